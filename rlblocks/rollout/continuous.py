"""``ContinuousBatchingEngine``: transformers' continuous batching with a paged KV cache, no vLLM.

``model.generate_batch`` (transformers' ``generation.continuous_batching``) keeps a pool of
requests in flight: each forward packs the new tokens of every running sequence into one row
(no padding), reads and writes keys and values in a paged cache, and a finished sequence's
place goes to the next waiting one at once. Padded ``generate`` (`HFEngine`) instead keeps
every row of a batch until the longest one ends. The engine samples with the module it is given,
so ``ContinuousBatchingEngine(policy.model, policy.tokenizer)`` sees every update of the trainer
without a copy, as `HFEngine` does; the resharder's bucketed sync writes into it otherwise.

What it returns is what `HFEngine` returns (:mod:`rlblocks.rollout.hf`): token ids in and out,
left-padded prompts, responses ending at their first EOS (kept) or at the token completing a
stop string (kept), later columns padding, float32 rollout log-probs on the CPU, rows
``i·g … i·g+g−1`` for prompt ``i``.

Choices made here:

* **Rollout log-probs come from the engine's own sampling step.** ``generate_batch`` with
  ``return_logprobs`` reports ``log softmax(s)[y]`` of the scores ``s`` it sampled ``y`` from
  (float32). With temperature only, ``s = z / T`` (greedy: ``s = z``), which is exactly the
  quantity `HFEngine` reports and a trainer computes: no second pass over the tokens is needed.
  Top-k and top-p change ``s`` (the log-probs are then those of the truncated distribution):
  they are taken with sampling replay (``SamplingParams.replay``, the engine then records its
  sampler in ``Rollouts.sampler`` and the trainer scores the same truncated distribution) and
  refused without it. transformers 5.19 drops ``min_new_tokens``' processor in continuous
  batching without an error: it is refused. Refusals come before any compute. (Its top-p
  compares the running sum with 1 − p in float32 where ``generate`` computes 1 − p in float64
  first: the two kept sets can differ only where the running sum falls within ~2e-8 of it.)
* **Stop strings** are not known to ``generate_batch``: a sequence decodes on to EOS or
  ``max_new_tokens`` and is cut afterwards at the token completing the first stop string, with
  the same matcher as `HFEngine` (:class:`rlblocks.rollout.stopping.ResponseEnds`). The kept
  tokens are what `HFEngine` returns; the tokens after the stop cost compute and are dropped.
* **The paged cache is sized per call from the request**, never from free memory (transformers'
  default takes 90 % of what is free: on the CPU that is the machine's RAM, which it tried and
  was killed for, measured here). ``max_concurrent`` sequences (default: every row, at most
  1024), each given the pages its prompt plus ``max_new_tokens`` needs; ``cache_tokens`` caps it.
  A row that could not fit in the cache alone is refused before any compute.
* ``group_size`` samples share their prompt's prefill where transformers returns the forks
  (5.18 on): the request is forked after the prompt (``num_return_sequences``), each copy
  samples its own tokens. transformers 5.16 and 5.17 decode the forks too but leave them out of
  what ``generate_batch`` returns (its re-ordering keeps each input's own request only: 192 of
  256 rows of 64 prompts × 4 came back, on a GPU with 5.17), so there each row is a request of
  its own and a prompt is prefilled ``g`` times (the cost of it, measured on this project's CPU
  with two small random models, 64 prompts of 50–102 tokens × 4 samples × 32 new tokens: 1.6×
  to 1.9× the time of forks).
* **Seeds** as `HFEngine`: with ``sampling.seed`` the call runs in a forked RNG seeded with it
  (continuous batching seeds torch's global generator itself, so the fork also keeps the
  caller's generator as it was); without, the global RNG advances.
* Continuous batching runs in a background thread of this process; ``generate`` blocks until
  every row is done. The model's train/eval mode, ``generation_config`` and attention
  implementation (transformers may switch sdpa to flash attention for the call) are restored.
  Not thread-safe.

Runs on the CPU too (transformers 5.19 uses its sdpa/eager paged path there); fast only on a GPU,
where flash attention and CUDA graphs apply (docs/rollout.md has the numbers measured).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from torch.torch_version import TorchVersion
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from rlblocks.interfaces import SamplingParams
from rlblocks.models import loading
from rlblocks.models.context import context_length
from rlblocks.rollout.base import Request, check_count, checked_prompts
from rlblocks.rollout.hf import LocalWeights, _device, _generating, _special_ids
from rlblocks.rollout.prompts import left_pad
from rlblocks.rollout.sampling import generation_config, sampler_record, seeded
from rlblocks.rollout.stopping import stop_ends, valid_tokens
from rlblocks.rollouts import Rollouts

PAGE_FIELD = (
    "page_size"
    if "page_size" in {field.name for field in dataclasses.fields(ContinuousBatchingConfig)}
    else "block_size"
)
"""The paged cache's tokens-per-page field: ``page_size`` in transformers 5.19, ``block_size``
in 5.17 (which refuses ``page_size``: found on the GPU machine's image)."""
FORKS_RETURNED = TorchVersion(transformers.__version__) >= "5.18"
"""Whether ``generate_batch`` returns the forks of a request (``num_return_sequences > 1``,
``req_i__child#k``). transformers 5.16 and 5.17 wait for them, then re-order their results by
the ids of the inputs alone and drop them (``generate_batch``'s "Re-order requests" loop); 5.18
returns them after their parent. Without it each of a prompt's ``g`` rows is its own request.
(``TorchVersion`` compares any PEP 440 version string; a 5.18 pre-release counts as 5.17.)"""

DEFAULT_SAMPLING = SamplingParams()
#: Tokens of one page of the paged cache (transformers' default). Every sequence holds whole
#: pages: a 40-token row takes one page of 256 tokens.
PAGE_SIZE = 256
#: Most sequences in flight when ``max_concurrent`` is None (transformers' own fallback).
MAX_CONCURRENT = 1024
#: Most tokens in one forward when prompts are prefilled (bounds the sdpa/eager attention mask,
#: tokens x cached tokens, on the CPU).
MAX_BATCH_TOKENS = 2048
#: Attention implementations transformers 5.19 can page (``switch_to_cb_friendly_attn``).
PAGED_ATTENTION = ("sdpa", "eager", "paged|eager")
#: Layer types its paged cache knows (``cache.ATTN_TYPE_TO_ALLOCATOR``).
PAGED_LAYER_TYPES = ("full_attention", "sliding_attention")


class ContinuousBatchingEngine(LocalWeights):
    """Samples responses with transformers' continuous batching; implements ``RolloutEngine``.

    ``model``: a Hugging Face causal LM with paged-attention support (a decoder whose attention is
    sdpa, eager or flash attention: Llama, Qwen2/3, Mistral, SmolLM, ...); ``tokenizer``: its
    tokenizer. ``sampling``: default ``SamplingParams`` (min_new_tokens 0; top_k and top_p only
    with ``replay``: the module docstring says why). ``chat``: how prompts become text, as for `HFEngine`.
    ``max_concurrent``: most sequences decoding at once (None: every row of a call, at most
    1024). ``cache_tokens``: most tokens the paged KV cache holds, over all sequences (None: what
    ``max_concurrent`` sequences of the call's longest prompt plus ``max_new_tokens`` need, in
    whole pages of 256 tokens). ``progress``: transformers' bar over finished requests.

    Weights: ``update_weights``, ``weight_spec`` as `HFEngine` (the module is the engine's
    model); merged weights only (``serves_adapters`` False); the paged cache lives only inside a
    ``generate`` call, so :meth:`sleep` has nothing to free.

    ``generate`` (contract: `rlblocks.interfaces.RolloutEngine.generate`) returns what
    `HFEngine.generate` does; everything it can refuse is refused before any compute: sampling
    fields it cannot honour, a prompt past the model's context, a row the paged cache cannot
    hold alone.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        sampling: SamplingParams = DEFAULT_SAMPLING,
        chat: bool | None = None,
        max_concurrent: int | None = None,
        cache_tokens: int | None = None,
        progress: bool = True,
    ) -> None:
        for name, value in (("max_concurrent", max_concurrent), ("cache_tokens", cache_tokens)):
            check_count(value, name, owner="ContinuousBatchingEngine",
                        none="to size it from each call's rows")  # fmt: skip
        check_paged(model)
        check_sampling(sampling)
        super().__init__(model, tokenizer, sampling, chat)
        self.max_concurrent = max_concurrent
        self.cache_tokens = cache_tokens
        self.progress = progress

    # from_pretrained(name_or_path, *, dtype=float32, device=None, **kwargs): as HFEngine's
    # (device None: CUDA when torch sees a GPU, else the CPU).
    from_pretrained: classmethod[ContinuousBatchingEngine, ..., ContinuousBatchingEngine] = (
        classmethod(loading.from_pretrained)
    )

    # ------------------------------------------------------------------ RolloutEngine
    def _generate(self, request: Request) -> Rollouts:
        """``generate`` (`EngineBase`): one ``generate_batch`` over every row."""
        params, group_size = request.sampling, request.group_size
        check_sampling(params)
        texts, ids, meta = checked_prompts(self, request, limit=context_length(self.model))
        cache = self._cache_config([len(p) for p in ids], group_size, params)
        pad, eos = _special_ids(self.model, self.tokenizer)
        config = generation_config(params, pad_token_id=pad, eos_token_ids=eos)
        # One request per prompt, forked g times after its prefill, where transformers returns
        # the forks; else one request per row (FORKS_RETURNED says why).
        forked = FORKS_RETURNED
        config.num_return_sequences = group_size if forked else 1
        inputs = ids if forked else [p for p in ids for _ in range(group_size)]
        with _generating(self.model), seeded(params.seed, _device(self.model)):
            cache.seed = params.seed
            outputs = self.model.generate_batch(  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
                inputs,
                generation_config=config,
                continuous_batching_config=cache,
                progress_bar=self.progress,
            )
        rows = _ordered(outputs, len(ids), group_size, forked=forked)
        return self._rollouts(ids, rows, group_size, params, texts, meta, pad, eos)

    # ------------------------------------------------------------------ helpers
    def _cache_config(
        self, lengths: list[int], group_size: int, params: SamplingParams
    ) -> ContinuousBatchingConfig:
        """The paged cache for this call (module docstring); a row it cannot hold is refused."""
        rows = len(lengths) * group_size
        concurrent = min(self.max_concurrent or min(rows, MAX_CONCURRENT), rows)
        pages = [math.ceil((n + params.max_new_tokens) / PAGE_SIZE) for n in lengths]
        blocks = concurrent * max(pages)
        if self.cache_tokens is not None:
            blocks = min(blocks, self.cache_tokens // PAGE_SIZE)
        row = max(range(len(pages)), key=pages.__getitem__)
        if pages[row] > blocks:
            raise ValueError(
                f"ContinuousBatchingEngine.generate: prompt {row} has {lengths[row]} tokens; "
                f"with max_new_tokens={params.max_new_tokens} it needs {pages[row] * PAGE_SIZE} "
                f"tokens of paged cache ({pages[row]} pages of {PAGE_SIZE}), more than "
                f"cache_tokens={self.cache_tokens} holds; raise cache_tokens to at least "
                f"{pages[row] * PAGE_SIZE}, or shorten the prompt or max_new_tokens"
            )
        total = sum(lengths) * group_size
        return ContinuousBatchingConfig(
            **{PAGE_FIELD: PAGE_SIZE},  # type: ignore[arg-type]  # the field's name varies by version
            num_blocks=blocks,
            max_batch_tokens=max(concurrent, min(total, MAX_BATCH_TOKENS)),
            max_requests_per_batch=concurrent,
            return_logprobs=True,
        )

    def _rollouts(
        self,
        ids: list[list[int]],
        rows: list[Any],
        group_size: int,
        params: SamplingParams,
        texts: list[str],
        meta: list[Mapping],
        pad: int,
        eos: list[int],
    ) -> Rollouts:
        """The finished requests (in row order) as a CPU ``Rollouts``, cut at stop strings."""
        index = [i for i in range(len(ids)) for _ in range(group_size)]
        width = max(1, max(len(r.generated_tokens) for r in rows))
        response = torch.full((len(rows), width), pad, dtype=torch.long)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for k, r in enumerate(rows):
            n = len(r.generated_tokens)
            response[k, :n] = torch.tensor(r.generated_tokens, dtype=torch.long)
            logprobs[k, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
        prompt_ids, prompt_mask = left_pad([ids[i] for i in index], pad_token_id=pad)
        generated = torch.tensor([len(r.generated_tokens) for r in rows])
        valid = _ends(prompt_ids, response, generated, params, eos, self.tokenizer)
        response = torch.where(valid, response, pad)
        lengths = valid.sum(-1).tolist()
        decoded = [r[:n] for r, n in zip(response.tolist(), lengths, strict=True)]
        return Rollouts(
            prompt_ids=prompt_ids,
            response_ids=response,
            attention_mask=torch.cat([prompt_mask, valid], dim=1),
            response_mask=valid,
            group_ids=torch.tensor(index, dtype=torch.long),
            rollout_logprobs=torch.where(valid, logprobs, 0.0),
            sampler=sampler_record(params, len(rows)) if params.replay else None,
            prompts=[texts[i] for i in index],
            completions=self.tokenizer.batch_decode(decoded, skip_special_tokens=True),
            metadata=[dict(meta[i]) for i in index],
            pad_token_id=pad,
        )


# ---------------------------------------------------------------------- checks
def check_paged(model: nn.Module) -> None:
    """Raise unless transformers can run ``model`` with continuous batching: a ``generate_batch``
    method, an attention implementation it can page, layer types its paged cache knows. Checked
    when the engine is built, before any compute."""
    name = type(model).__name__
    if not hasattr(model, "generate_batch"):
        raise TypeError(
            f"ContinuousBatchingEngine: the model is a {name}, which has no .generate_batch "
            "(transformers' continuous batching); pass a Hugging Face causal LM (e.g. "
            "policy.model), or use rb.rollout.HFEngine"
        )
    config = model.config.get_text_config()  # type: ignore[union-attr, operator]  # Module.__getattr__ is typed Tensor | Module
    attention = str(getattr(config, "_attn_implementation", None))
    if attention not in PAGED_ATTENTION and "flash" not in attention:
        raise ValueError(
            f"ContinuousBatchingEngine: the model {name} runs attention_implementation="
            f"{attention!r}, which transformers cannot page; load it with "
            "attn_implementation='sdpa' (or 'eager', or a flash attention one), or use "
            "rb.rollout.HFEngine"
        )
    if getattr(model, "_supports_attention_backend", True) is False:
        raise ValueError(
            f"ContinuousBatchingEngine: the model {name} does not take transformers' attention "
            "backends, so it cannot read a paged cache; use rb.rollout.HFEngine for this model"
        )
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(PAGED_LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"ContinuousBatchingEngine: the model {name} has layers of type {unknown}, which "
            f"transformers' paged cache does not hold (it knows {list(PAGED_LAYER_TYPES)}); use "
            "rb.rollout.HFEngine for this model"
        )


def check_sampling(params: SamplingParams) -> None:
    """Refuse the ``SamplingParams`` the engine cannot honour (module docstring)."""
    if params.min_new_tokens != 0:
        raise ValueError(
            f"ContinuousBatchingEngine: SamplingParams.min_new_tokens={params.min_new_tokens} "
            "is not supported (transformers' continuous batching drops it without an error); "
            "use min_new_tokens=0, or rb.rollout.HFEngine for this sampling"
        )
    for field, (value, ok) in {"top_k": (params.top_k, 0), "top_p": (params.top_p, 1.0)}.items():
        if value != ok and not params.replay:
            raise ValueError(
                f"ContinuousBatchingEngine: SamplingParams.{field}={value} is not supported "
                f"without replay (its rollout log-probs are those of the truncated distribution "
                f"it samples from); pass SamplingParams(replay=True) so that the trainer scores that "
                f"distribution too, use {field}={ok}, or rb.rollout.HFEngine"
            )


# ---------------------------------------------------------------------- results
def _ordered(
    outputs: Mapping[str, Any], prompts: int, group_size: int, *, forked: bool
) -> list[Any]:
    """The finished requests in row order, or an error naming the rows that failed:
    ``generate_batch`` logs a failure and returns what it has. Its ids count the inputs from
    ``req_0``: ``forked``, row ``i·g`` is prompt ``i``'s request ``req_i`` and rows
    ``i·g+1 … i·g+g−1`` its forks ``req_i__child#0 …``; else row ``k`` is ``req_k``."""
    rows, failed = [], []
    for i in range(prompts):
        if forked:
            requests = [f"req_{i}"] + [f"req_{i}__child#{k}" for k in range(group_size - 1)]
        else:
            requests = [f"req_{i * group_size + k}" for k in range(group_size)]
        for request in requests:
            out = outputs.get(request)
            if (
                out is None
                or out.error is not None
                or len(out.logprobs) != len(out.generated_tokens)
            ):
                failed.append((i, request, None if out is None else out.error))
            rows.append(out)
    if failed:
        i, request, error = failed[0]
        raise RuntimeError(
            f"ContinuousBatchingEngine.generate: request {request} (prompt {i}) did not finish "
            f"({len(failed)} of {len(rows)} rows failed), error: {error or 'no result returned'}; "
            "transformers' log above has the traceback. Try a smaller max_concurrent or "
            "cache_tokens, or rb.rollout.HFEngine"
        )
    return rows


def _ends(
    prompt_ids: Tensor,
    response: Tensor,
    generated: Tensor,
    params: SamplingParams,
    eos: list[int],
    tokenizer: Any,
) -> Tensor:
    """(b t) bool, True up to each row's end: its last generated token (continuous batching
    stopped it at EOS or ``max_new_tokens``), or earlier the token completing a stop string
    (replayed with `HFEngine`'s matcher, one column at a time)."""
    end = generated - 1  # continuous batching stops a request at its first EOS (kept)
    if params.stop:
        end = stop_ends(prompt_ids, response, end, stop=params.stop, eos=eos, tokenizer=tokenizer)
    return valid_tokens(end, response.shape[1])


__all__ = ["ContinuousBatchingEngine", "check_paged", "check_sampling"]
