"""``HFEngine``: a rollout engine on Hugging Face ``model.generate``, in the calling process.

The simplest engine: no server, the policy's own ``nn.Module`` (``engine.model`` may *be* the
trainer's model, so syncing weights costs nothing). Slow next to vLLM, but exact and debuggable.

Choices made here:

* **Token in, token out.** ``response_ids`` are the sampled ids; text is decoded for rewards only.
  A prompt given as token ids is sampled from as it is (a multi-turn rollout passes the
  conversation so far this way, see :mod:`rlblocks.rollout.prompts`).
* **Only ``SamplingParams`` decide sampling.** The checkpoint's ``generation_config.json``
  (Qwen's ``repetition_penalty``, ``top_k=20``, ...) is set aside during the call: a hidden
  logits processor would sample from a distribution the rollout log-probs do not describe.
* **Rollout log-probs** are ``log softmax(z / T)[y]`` of the model's raw logits ``z`` at the
  sampled token ``y`` (T = 1 when greedy), *before* top-k / top-p truncation: the quantity a
  trainer computes from a forward pass at the same temperature, so the two can be compared.
  With ``SamplingParams.replay`` they are those of the distribution sampled from (``generate``'s
  processed scores) and each row records its sampler (``Rollouts.sampler``), so that the
  trainer scores the same truncated distribution (`rlblocks.rollout.sampling`).
* **A response ends** at its first EOS token (kept, counted) or at the token completing a stop
  string (kept), neither before ``SamplingParams.min_new_tokens`` tokens. Later columns are
  padding: response and attention masks False, log-prob 0, id the padding token.
* Results are on the CPU. Generation runs in eval mode, without grad, with the KV cache; the
  model's train/eval mode and ``generation_config`` are restored afterwards. Not thread-safe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from rlblocks.interfaces import EngineMemory, SamplingParams, TensorSpec
from rlblocks.models import loading
from rlblocks.models.context import context_length
from rlblocks.rollout.base import EngineBase, Request, check_count, checked_prompts
from rlblocks.rollout.casting import check_cast
from rlblocks.rollout.names import ENGINES
from rlblocks.rollout.prompts import left_pad
from rlblocks.rollout.sampling import (
    generation_config,
    sampled_logprobs,
    sampler_record,
    seeded,
)
from rlblocks.rollout.stopping import FiniteLogits, ResponseEnds, valid_tokens
from rlblocks.rollouts import Rollouts

DEFAULT_SAMPLING = SamplingParams()


class LocalWeights(EngineBase):
    """An engine that samples with a model object in this process (``HFEngine``,
    ``CompiledEngine``, ``ContinuousBatchingEngine``): what it keeps from its constructor, and
    its weight side: copies into ``self.model``, its spec, no adapters (``serves_adapters``
    False), and nothing to free between calls (the cache lives inside a ``generate`` call)."""

    serves_adapters = False

    def __init__(
        self, model: nn.Module, tokenizer: Any, sampling: SamplingParams, chat: bool | None
    ) -> None:
        """Keep the constructor arguments every such engine has; ``weights_version`` 0."""
        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.chat = chat
        self.weights_version = 0

    def update_weights(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """Copy ``(name, tensor)`` pairs into the model, like ``load_state_dict``, then record
        ``weights_version = version``.

        Names are the model's ``state_dict`` names (Hugging Face names; tied weights answer to
        either name). A subset is fine (weights may arrive in several calls), but an unknown
        name or a shape mismatch raises ``ValueError`` naming it before anything of the call
        is copied. Values are cast to each parameter's dtype and device; a tensor that already
        is the parameter (a shared model) is skipped. A value that the cast would turn into
        ±inf (a float32 weight past float16's range) raises ``FloatingPointError`` naming it,
        before anything of the call is copied (`rlblocks.rollout.casting`).
        """
        load_weights(self.model, weights, owner=f"{type(self).__name__}.update_weights")
        self.weights_version = version

    def weight_spec(self) -> dict[str, TensorSpec]:
        """The model's ``state_dict`` names (tied weights under each), shapes and dtypes."""
        return {name: TensorSpec.of(t) for name, t in self.model.state_dict(keep_vars=True).items()}

    def load_adapter(self, path: Any, *, version: int) -> None:
        """Not served: the engine samples with plain weights (the resharder sends a LoRA
        policy's merged weights instead)."""
        name = type(self).__name__
        raise NotImplementedError(
            f"{name}.load_adapter: {name} does not serve LoRA adapters; sync a LoRA policy's "
            f"merged weights with rb.resharder.Resharder, or share the policy's model "
            f"({name}(policy.model, ...))"
        )

    def sleep(self) -> None:
        """Nothing to free: the KV cache lives only inside a ``generate`` call."""

    def wake_up(self) -> None:
        """Nothing to take back (see :meth:`sleep`)."""


@ENGINES.register("hf")
class HFEngine(LocalWeights):
    """Samples responses with ``model.generate``; implements ``RolloutEngine``.

    ``model``: a causal LM (any dtype, any device); ``tokenizer``: its tokenizer.
    ``sampling``: default ``SamplingParams`` (a ``generate`` call may pass others).
    ``chat``: how prompts become text, see :mod:`rlblocks.rollout.prompts` (None: strings
    verbatim, message lists through the chat template; True: strings wrapped as a user message;
    False: strings only). ``max_batch_size``: most rows (prompts × n) per ``model.generate`` call;
    None generates everything at once. ``progress``: a tqdm bar over decoding steps, shown once a
    call has run for more than a second.

    ``generate`` (contract: `rlblocks.interfaces.RolloutEngine.generate`): ``rollout_logprobs``
    at the raw logits, before top-k / top-p (with ``replay``: of the truncated distribution);
    nothing carries grad; with ``sampling.seed`` the global RNG is left untouched.

    The engine keeps no cache between calls, so :meth:`sleep` has nothing to free; it takes
    merged weights (``serves_adapters`` is False), also from a LoRA policy.
    """

    @classmethod
    def memory_model(cls) -> EngineMemory:
        """Keys and values of the rows it samples, freed after each call; the trainer's
        module, no copy of its own (the planner counts one when a run gives it a copy)."""
        return EngineMemory("hf", kv_cache="rows")

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        sampling: SamplingParams = DEFAULT_SAMPLING,
        chat: bool | None = None,
        max_batch_size: int | None = None,
        progress: bool = True,
    ) -> None:
        check_count(max_batch_size, "max_batch_size", owner="HFEngine", none="for one batch")
        if not hasattr(model, "generate"):
            raise TypeError(
                f"HFEngine: the model is a {type(model).__name__}, which has no .generate; pass "
                "a Hugging Face causal LM (e.g. policy.model)"
            )
        super().__init__(model, tokenizer, sampling, chat)
        self.max_batch_size = max_batch_size
        self.progress = progress

    # from_pretrained(name_or_path, *, dtype=float32, device=None, **kwargs): load (a built-in
    # such as "tiny" or a folder), then cls(model, tokenizer=tokenizer, **kwargs); device None:
    # CUDA when torch sees a GPU, else the CPU. HFEngine(policy.model) uses that model's device.
    from_pretrained: classmethod[HFEngine, ..., HFEngine] = classmethod(loading.from_pretrained)

    # ------------------------------------------------------------------ RolloutEngine
    def _generate(self, request: Request) -> Rollouts:
        """``generate`` (`EngineBase`): chunks of rows, one ``model.generate`` each."""
        return generate_in_chunks(
            self, request,
            lambda ids, rows, params, pad, eos, bar: self._generate_rows(
                ids, params, pad, eos, on_step=bar.update
            ),
        )  # fmt: skip

    # ------------------------------------------------------------------ one model.generate
    def _generate_rows(
        self,
        ids: list[list[int]],
        params: SamplingParams,
        pad: int,
        eos: list[int],
        *,
        on_step: Any,
    ) -> dict[str, Tensor]:
        """Run ``model.generate`` on one chunk; tensors on the model's device."""
        device = _device(self.model)
        input_ids, prompt_mask = (x.to(device) for x in left_pad(ids, pad_token_id=pad))
        ends = ResponseEnds(
            batch_size=len(ids),
            prompt_width=input_ids.shape[1],
            eos_token_ids=eos,
            stop=params.stop,
            tokenizer=self.tokenizer,
            on_step=on_step,
            min_new_tokens=params.min_new_tokens,
        )
        out = self.model.generate(  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
            input_ids=input_ids,
            attention_mask=prompt_mask.long(),
            generation_config=generation_config(params, pad_token_id=pad, eos_token_ids=eos),
            stopping_criteria=StoppingCriteriaList([ends]),
            logits_processor=LogitsProcessorList([FiniteLogits()]),  # a broken model says so
        )
        response = out.sequences[:, input_ids.shape[1] :]
        # replay: the processed scores (tempered, −inf outside the kept set) are what was sampled
        logits = list(out.scores if params.replay else out.logits)
        del out  # the KV cache and the logits tuple: let sampled_logprobs free steps as it goes
        valid = valid_tokens(ends.end.to(device), response.shape[1])  # (b t) bool
        temperature = 1.0 if params.replay else params.temperature or 1.0  # greedy: T = 1
        logprobs = sampled_logprobs(logits, response, temperature=temperature)
        return {
            "prompt_ids": input_ids,
            "prompt_mask": prompt_mask,
            "response_ids": torch.where(valid, response, pad),
            "valid": valid,
            "logprobs": torch.where(valid, logprobs, 0.0),
            **({"sampler": sampler_record(params, len(ids))} if params.replay else {}),
        }


# ---------------------------------------------------------------------- helpers
class _Engine(Protocol):
    model: nn.Module
    tokenizer: Any
    chat: bool | None
    max_batch_size: int | None
    progress: bool


#: ``(ids of each row, prompt index of each row, params, pad id, EOS ids, progress bar)`` to
#: one chunk's decoded batch (what `batch_rollouts` takes).
DecodeChunk = Callable[[list[list[int]], Tensor, SamplingParams, int, list[int], Any], dict]


def generate_in_chunks(engine: _Engine, request: Request, decode: DecodeChunk) -> Rollouts:
    """What `HFEngine.generate` and `CompiledEngine.generate` share: the checks made before any
    compute (`checked_prompts`; errors name the engine's class), rows ``i·g … i·g+g−1`` for prompt
    ``i`` cut in chunks of ``engine.max_batch_size``, each decoded by ``decode`` in eval mode,
    without grad, under ``params.seed``, with a progress bar over decoding steps."""
    params = request.sampling
    texts, ids, meta = checked_prompts(engine, request, limit=context_length(engine.model))
    rows = torch.arange(len(ids)).repeat_interleave(
        request.group_size
    )  # (b) prompt index of each row
    size = engine.max_batch_size or len(rows)
    chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
    pad, eos = _special_ids(engine.model, engine.tokenizer)  # before generation_config is swapped
    bar = tqdm(total=len(chunks) * params.max_new_tokens, desc=f"generate {len(rows)} rows",
               unit="step", delay=1.0, leave=False, disable=not engine.progress)  # fmt: skip
    with bar, _generating(engine.model), seeded(params.seed, _device(engine.model)):
        parts = []
        for k, chunk in enumerate(chunks):
            batch = decode([ids[i] for i in chunk], chunk, params, pad, eos, bar)
            bar.update((k + 1) * params.max_new_tokens - bar.n)  # a chunk may end early
            parts.append(batch_rollouts(engine.tokenizer, chunk, batch, texts, meta, pad))
    return parts[0] if len(parts) == 1 else Rollouts.concat(parts)


def batch_rollouts(
    tokenizer: Any,
    rows: Tensor,
    batch: dict[str, Tensor],
    texts: list[str],
    meta: list[Mapping],
    pad: int,
) -> Rollouts:
    """Rows ``rows`` (prompt index of each) of a decoded batch as a CPU ``Rollouts``: ``batch``
    holds ``prompt_ids``, ``prompt_mask`` (left-padded), ``response_ids``, ``valid``,
    ``logprobs`` and, with replay, ``sampler`` (what `HFEngine` and `CompiledEngine` decode)."""
    batch = {k: v.cpu() for k, v in batch.items()}
    lengths = batch["valid"].sum(-1).tolist()
    responses = [r[:n] for r, n in zip(batch["response_ids"].tolist(), lengths, strict=True)]
    index = rows.tolist()
    return Rollouts(
        prompt_ids=batch["prompt_ids"],
        response_ids=batch["response_ids"],
        attention_mask=torch.cat([batch["prompt_mask"], batch["valid"]], dim=1),
        response_mask=batch["valid"],
        group_ids=rows.clone(),
        rollout_logprobs=batch["logprobs"],
        sampler=batch.get("sampler"),
        prompts=[texts[i] for i in index],
        completions=tokenizer.batch_decode(responses, skip_special_tokens=True),
        metadata=[dict(meta[i]) for i in index],
        pad_token_id=pad,
    )


def _special_ids(model: nn.Module, tokenizer: Any) -> tuple[int, list[int]]:
    """``(pad_token_id, eos_token_ids)``: EOS ids from the tokenizer and the model's generation
    config (chat models often list several); padding falls back to the first EOS."""
    eos: list[int] = []
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for ids in (tokenizer.eos_token_id, config_eos):
        for i in [ids] if isinstance(ids, int) else list(ids or []):
            if i not in eos:
                eos.append(int(i))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0] if eos else None
    if pad is None:
        raise ValueError(
            "HFEngine: the tokenizer has neither a padding token nor an EOS token; set "
            "tokenizer.pad_token"
        )

    return int(pad), eos


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Tensor]], *, owner: str) -> None:
    """Copy ``(name, tensor)`` pairs into ``model`` (``HFEngine.update_weights`` says how); every
    name, shape and cast is checked before the first copy, errors name ``owner``."""
    targets = model.state_dict(keep_vars=True)
    pairs = list(weights)  # references: all are checked before the first copy
    for name, value in pairs:
        target = targets.get(name)
        if target is None:
            known = ", ".join(list(targets)[:3])
            raise ValueError(
                f"{owner}: the model has no weight named {name!r} "
                f"(its names look like {known}, ...); send the weights of the engine's model"
            )
        if target.shape != value.shape:
            raise ValueError(
                f"{owner}: {name!r} has shape {tuple(value.shape)}, "
                f"the model's is {tuple(target.shape)}; send the weights of the engine's model"
            )
    check_cast(pairs, {n: targets[n].dtype for n, _ in pairs}, owner=owner)
    with torch.no_grad():
        for name, value in pairs:
            if value is not targets[name]:
                targets[name].copy_(value)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def _generating(model: nn.Module) -> Iterator[None]:
    """Eval mode and a blank ``generation_config`` (our config is then the whole truth:
    ``generate`` fills unset fields from ``model.generation_config``), restored afterwards."""
    was_training, saved = model.training, model.generation_config
    model.eval()
    model.generation_config = GenerationConfig()  # type: ignore[assignment]  # Module.__setattr__ is typed Tensor | Module
    try:
        with torch.no_grad():
            yield
    finally:
        model.generation_config = saved
        model.train(was_training)
