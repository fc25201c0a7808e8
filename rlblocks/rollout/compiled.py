"""``CompiledEngine``: a decode loop of its own over the model's forward, one graph per step.

``model.generate`` (`HFEngine`) dispatches every operator of every layer of every step from
Python, grows its KV cache by concatenation, and keeps computing rows that have ended until the
longest one is done. On a GPU a small model's decode step is then bound by kernel launches, not
by the chip. This engine decodes with the pieces that remove that bound
(:mod:`rlblocks.rollout.decode`):

* **A static KV cache sized from the request**: one ``(rows, heads, columns, d)`` tensor per
  layer, columns = the longest prompt plus ``max_new_tokens`` rounded up to a bucket, written
  in place. The engine keeps it between calls (so a captured graph's addresses stay put);
  :meth:`sleep` frees it.
* **The whole step as one function of tensors** (`rlblocks.rollout.decode.decode_step`: the
  forward from embedding to logits, temperature, top-k / top-p, ``min_new_tokens``, the sampled
  token and its log-prob, EOS bookkeeping), compiled with ``torch.compile(fullgraph=True)``
  and, on a GPU, replayed as CUDA graphs (``mode="reduce-overhead"``). The row and column
  dimensions are marked dynamic, so one compile serves every bucket; CUDA graphs are recorded
  once per bucket shape.
* **Rows that have ended stop costing**: every few steps the engine reads how many rows are
  still going, and when they fit a smaller bucket it moves them (their cache rows too) to the
  front and decodes only those. Buckets are powers of two and their halves between (2, 3, 4, 6,
  8, 12, ...), so a rollout visits a handful of shapes.
* **A prompt is prefilled once per group**: the ``group_size`` samples of a prompt copy its
  cache rows instead of each running the prompt through the model (on a CPU this is most of
  the gain over HF ``generate``, docs/speed.md).

``compile``: None (default) compiles on CUDA and runs the same step eagerly elsewhere: on a
2-core CPU inductor's first call took about a minute for SmolLM2-135M's step, which a short run
does not win back (docs/speed.md has the measurement); True compiles anywhere (inductor's
default mode off CUDA); False never compiles.

What it returns is what `HFEngine` returns (token ids in and out, left-padded prompts,
responses ending at their first EOS (kept) or at the token completing a stop string (kept),
float32 rollout log-probs on the CPU, rows ``i·g … i·g+g−1`` for prompt ``i``); the log-probs
are those of `HFEngine` (untruncated tempered distribution, or with ``replay`` the truncated
one); sampling draws from the same distribution with another random stream, so a seed gives
other tokens than `HFEngine`'s. Stop strings are matched after decoding (a row decodes on to EOS
or ``max_new_tokens``; the tokens after its stop string cost compute and are dropped).

Served: Hugging Face decoders whose attention is ``sdpa`` or ``eager`` and whose layers all
attend fully (Llama, Qwen2/3, Mistral without a sliding window, SmolLM, ...); anything else is
refused when the engine is built, naming `HFEngine` for it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from rlblocks.interfaces import SamplingParams
from rlblocks.models import loading
from rlblocks.rollout.base import Request, check_count
from rlblocks.rollout.decode import Sampler, StaticKV, additive_mask, choose, decode_step
from rlblocks.rollout.hf import LocalWeights, _device, generate_in_chunks
from rlblocks.rollout.prompts import left_pad
from rlblocks.rollout.sampling import sampler_record
from rlblocks.rollout.stopping import stop_ends, valid_tokens
from rlblocks.rollouts import Rollouts

DEFAULT_SAMPLING = SamplingParams()
#: Attention implementations that take the engine's additive 4D mask as it is.
STATIC_ATTENTION = ("sdpa", "eager")
#: Steps between two reads of how many rows are still going (each read waits for the device).
SYNC_EVERY = 4
#: Most prompt tokens in one prefill forward (rows are prefilled in chunks of at most this).
PREFILL_TOKENS = 16384
#: Cache columns are a multiple of this (compiled: fewer shapes to record; eager: less waste).
COLUMNS_COMPILED, COLUMNS_EAGER = 128, 16


def row_bucket(rows: int) -> int:
    """The smallest bucket of at least ``rows`` (≥ 2: dynamo specializes a dimension of 1)."""
    bucket = 2
    while bucket < rows:
        if rows <= bucket + bucket // 2:
            return bucket + bucket // 2
        bucket *= 2
    return bucket


class CompiledEngine(LocalWeights):
    """Samples with a static KV cache and a compiled decode step; implements ``RolloutEngine``.

    ``model``: a Hugging Face causal LM (any dtype, any device; sdpa or eager attention, full
    attention in every layer); ``tokenizer``: its tokenizer. ``sampling``: default
    ``SamplingParams`` (every field is served). ``chat``: how prompts become text, as for
    `HFEngine`. ``max_batch_size``: most rows decoded at once (None: every row of a call).
    ``compile``: None compiles on CUDA only (module docstring), True always, False never.
    ``progress``: a tqdm bar over decoding steps, shown once a call has run for a second.

    Weights: ``update_weights`` copies in place (a compiled graph reads the parameters it was
    given, so it sees the new values), ``weight_spec`` as `HFEngine`; merged weights only
    (``serves_adapters`` False). :meth:`sleep` frees the KV cache it keeps between calls.

    ``generate`` (contract: `rlblocks.interfaces.RolloutEngine.generate`) returns what
    `HFEngine.generate` does, log-probs included (module docstring: the random stream differs).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        sampling: SamplingParams = DEFAULT_SAMPLING,
        chat: bool | None = None,
        max_batch_size: int | None = None,
        compile: bool | None = None,
        progress: bool = True,
    ) -> None:
        check_count(max_batch_size, "max_batch_size", owner="CompiledEngine", none="for one batch")
        check_static(model)
        super().__init__(model, tokenizer, sampling, chat)
        self.max_batch_size = max_batch_size
        self.compiled = _device(model).type == "cuda" if compile is None else compile
        self.progress = progress
        self._step = _compiled_step(_device(model)) if self.compiled else decode_step
        self._cache: _Cache | None = None

    # from_pretrained(name_or_path, *, dtype=float32, device=None, **kwargs): as HFEngine's.
    from_pretrained: classmethod[CompiledEngine, ..., CompiledEngine] = classmethod(
        loading.from_pretrained
    )

    def sleep(self) -> None:
        """Free the KV cache kept between calls (the next ``generate`` allocates it again)."""
        self._cache = None
        if _device(self.model).type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ RolloutEngine
    def _generate(self, request: Request) -> Rollouts:
        """``generate`` (`EngineBase`): chunks of rows, each decoded by :meth:`_decode`."""
        return generate_in_chunks(
            self, request,
            lambda ids, rows, params, pad, eos, bar: self._decode(
                ids, rows, params, pad, eos, bar.update
            ),
        )  # fmt: skip

    # ------------------------------------------------------------------ one batch of rows
    def _decode(
        self,
        ids: list[list[int]],
        rows: Tensor,
        params: SamplingParams,
        pad: int,
        eos_ids: list[int],
        on_step: Any,
    ) -> dict[str, Tensor]:
        """Decode rows ``ids`` (one per row; rows of one prompt are adjacent and equal in
        ``rows``) to the end; tensors on the model's device."""
        device = _device(self.model)
        first = torch.ones(len(rows), dtype=torch.bool)
        first[1:] = rows[1:] != rows[:-1]
        unique = first.nonzero()[:, 0]  # (p) the first row of each prompt
        of_row = (first.cumsum(0) - 1).to(device)  # (b) which of the p prompts each row is
        prompt_ids, prompt_mask = (
            x.to(device) for x in left_pad([ids[i] for i in unique], pad_token_id=pad)
        )
        width, steps = prompt_ids.shape[1], params.max_new_tokens
        columns = -(-(width + steps) // self._column_multiple()) * self._column_multiple()
        slots = row_bucket(len(rows)) if self.compiled else len(rows)
        cache = self._static_cache(slots, columns, device)
        logits = self._prefill(prompt_ids, prompt_mask, cache)  # (p v)
        index = torch.cat([of_row, of_row[:1].expand(slots - len(rows))])  # fillers copy row 0
        cache.select_rows(index, slots, source_rows=len(unique))
        loop = _Loop(self, cache, params, eos_ids, len(rows), slots, on_step)
        loop.start(logits[index], (~prompt_mask).sum(-1)[index], width)
        loop.run()
        response, logprobs, end = loop.result()
        if params.stop:
            end = stop_ends(prompt_ids[of_row], response, end, stop=params.stop, eos=eos_ids,
                            tokenizer=self.tokenizer, min_new_tokens=params.min_new_tokens)  # fmt: skip
        valid = valid_tokens(end, response.shape[1])
        return {
            "prompt_ids": prompt_ids[of_row],
            "prompt_mask": prompt_mask[of_row],
            "response_ids": torch.where(valid, response, pad),
            "valid": valid,
            "logprobs": torch.where(valid, logprobs, 0.0),
            **({"sampler": sampler_record(params, len(rows))} if params.replay else {}),
        }

    def _column_multiple(self) -> int:
        return COLUMNS_COMPILED if self.compiled else COLUMNS_EAGER

    def _static_cache(self, slots: int, columns: int, device: torch.device) -> _Cache:
        """The kept cache when it has room for ``slots`` rows of ``columns``, else a new one."""
        dtype = next(self.model.parameters()).dtype
        kept = self._cache
        if kept is None or not kept.fits(slots, columns, dtype, device):
            self._cache = None  # free the old one before allocating
            kept = self._cache = _Cache(self.model, slots, columns, dtype, device)
        return kept

    def _prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, cache: _Cache) -> Tensor:
        """Run the prompts (p P) through the model into cache rows 0..p−1; the last
        position's logits (p v)."""
        p, width = prompt_ids.shape
        pad = (~prompt_mask).sum(-1)
        query = torch.arange(width, device=prompt_ids.device)
        allowed = (query[None, None, :] >= pad[:, None, None]) & (
            query[None, None, :] <= query[None, :, None]
        )  # (p P P): key j of row r is visible to query q when it is real and not after q
        chunk = max(1, PREFILL_TOKENS // width)
        out = []
        for start in range(0, p, chunk):
            part = slice(start, min(start + chunk, p))
            kv = cache.view(part, visible=width)
            kv.column.zero_()
            logits = self.model(
                input_ids=prompt_ids[part],
                attention_mask=additive_mask(allowed[part], cache.dtype)[:, None],
                position_ids=(query[None, :] - pad[part, None]).clamp(min=0),
                past_key_values=kv,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            out.append(logits)
        return torch.cat(out)


class _Cache:
    """The engine's static KV cache: per layer, ``(slots, kv heads, columns, d)`` keys and
    values, and per bucket of rows a `StaticKV` of views on the first rows (made once, marked as
    static addresses so that CUDA graphs replay on them in place)."""

    def __init__(self, model: nn.Module, slots: int, columns: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        config = model.config.get_text_config()  # type: ignore[union-attr, operator]  # Module.__getattr__ is typed Tensor | Module
        heads = config.num_key_value_heads or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (slots, heads, columns, dim)
        self.keys = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)
        ]
        self.values = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)
        ]
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.slots, self.columns, self.dtype, self.device = slots, columns, dtype, device
        self._views: dict[int, StaticKV] = {}

    def fits(self, slots: int, columns: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (self.slots >= slots and self.columns == columns and self.dtype == dtype
                and self.device == device)  # fmt: skip

    def view(self, rows: slice | int, *, visible: int | None = None) -> StaticKV:
        """A `StaticKV` on rows ``rows`` (a slice, or the first ``rows``)."""
        if isinstance(rows, int):
            if rows not in self._views:
                kv = StaticKV([k[:rows] for k in self.keys], [v[:rows] for v in self.values],
                              self.column)  # fmt: skip
                for t in [*kv.keys, *kv.values, self.column]:
                    torch._dynamo.mark_static_address(t)
                self._views[rows] = kv
            return self._views[rows]
        kv = StaticKV([k[rows] for k in self.keys], [v[rows] for v in self.values], self.column)
        kv.visible = visible
        return kv

    def select_rows(self, index: Tensor, slots: int, *, source_rows: int) -> None:
        """Rows ``0..slots−1`` become copies of rows ``index`` (slots) of the first
        ``source_rows`` rows (a copy is made first: the two ranges overlap)."""
        for t in (*self.keys, *self.values):
            t[:slots].copy_(t[:source_rows].index_select(0, index))


class _Loop:
    """The decode loop of one batch: the state of each slot, compaction, the step outputs."""

    def __init__(self, engine: CompiledEngine, cache: _Cache, params: SamplingParams,
                 eos_ids: list[int], rows: int, slots: int, on_step: Any) -> None:  # fmt: skip
        device = cache.device
        self.engine, self.cache, self.on_step = engine, cache, on_step
        self.sampler = Sampler(
            greedy=params.temperature == 0, top_k=params.top_k, top_p=params.top_p,
            holds_eos=params.min_new_tokens > 0, replay=params.replay,
        )  # fmt: skip
        self.temperature = torch.tensor(params.temperature or 1.0, device=device)
        self.min_new = torch.tensor(params.min_new_tokens, device=device)
        self.eos = torch.tensor(eos_ids or [-1], dtype=torch.long, device=device)
        self.steps = params.max_new_tokens
        # step k's index and column as device scalars made once: a Python int turned into a
        # device tensor at every step would be a copy from the host each time
        self.step_index = torch.arange(self.steps, device=device)
        self.slots = slots
        self.row_of_slot = torch.cat([torch.arange(rows), torch.full((slots - rows,), -1)])
        self.tokens_out = torch.zeros((rows, self.steps), dtype=torch.long, device=device)
        self.logprobs_out = torch.zeros((rows, self.steps), dtype=torch.float32, device=device)
        self.end_out = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.phase: list[tuple[Tensor, Tensor]] = []
        self.phase_start = 0
        self.done = 0  # steps decoded

    def start(self, logits: Tensor, pad: Tensor, width: int) -> None:
        """Step 0: the first token of every slot from the prefill's logits."""
        device = logits.device
        tokens, logprobs, broken = choose(logits, temperature=self.temperature,
                                          step=self.step_index[0],
                                          min_new_tokens=self.min_new, eos=self.eos,
                                          sampler=self.sampler)  # fmt: skip
        filler = (self.row_of_slot < 0).to(device)
        self.end = torch.where(torch.isin(tokens, self.eos) | filler, 0, -1)
        self.tokens, self.pad = tokens, pad
        self.columns = self.step_index + (width - 1)  # step k feeds column width + k − 1
        self.broken = broken.any()
        self._record(tokens, logprobs)

    def run(self) -> None:
        """Steps 1 … max_new_tokens − 1, compacting the slots as rows end."""
        with _compiling(self.engine.compiled):
            self._steps()
        if bool(self.broken):
            _raise_broken(self.done)

    def _steps(self) -> None:
        for k in range(1, self.steps):
            if k % SYNC_EVERY == 0:
                live, broken = torch.stack([(self.end < 0).sum(), self.broken.long()]).tolist()
                if broken:
                    _raise_broken(k)
                if live == 0:
                    break
                self._compact(live)
            if self.engine.compiled and self.cache.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            tokens, logprobs, end, broken = self.engine._step(
                self.engine.model, self.cache.view(self.slots), self.tokens, self.pad,
                self.columns[k], self.step_index[k], self.end, self.broken,
                self.temperature, self.min_new, self.eos, self.sampler,
            )  # fmt: skip
            # a CUDA graph's outputs are overwritten by its next replay: keep copies
            self.tokens, self.end, self.broken = tokens.clone(), end.clone(), broken.clone()
            self._record(self.tokens, logprobs.clone())
            self.on_step()

    def result(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(response (b t), logprobs (b t), end (b))``, t the steps decoded."""
        self._flush()
        return (self.tokens_out[:, : self.done], self.logprobs_out[:, : self.done],
                self.end_out)  # fmt: skip

    def _record(self, tokens: Tensor, logprobs: Tensor) -> None:
        self.phase.append((tokens, logprobs))
        self.done += 1

    def _flush(self) -> None:
        """Write the steps since the last compaction into the rows' outputs."""
        if not self.phase:
            return
        real = (self.row_of_slot >= 0).nonzero()[:, 0]  # the slots that hold a row
        rows = self.row_of_slot[real].to(self.end.device)
        real = real.to(self.end.device)
        span = slice(self.phase_start, self.phase_start + len(self.phase))
        self.tokens_out[rows, span] = torch.stack([t for t, _ in self.phase], 1)[real]
        self.logprobs_out[rows, span] = torch.stack([lp for _, lp in self.phase], 1)[real]
        self.end_out[rows] = self.end[real]
        self.phase_start += len(self.phase)
        self.phase = []

    def _compact(self, live: int) -> None:
        """Move the live slots to the front when they fit a smaller bucket (compiled) or three
        quarters of the slots (eager: a copy of the cache is worth it only then)."""
        smaller = row_bucket(live) if self.engine.compiled else live
        if smaller >= self.slots or (not self.engine.compiled and live > 0.75 * self.slots):
            return
        self._flush()
        going = (self.end < 0).nonzero()[:, 0]
        index = torch.cat([going, going[:1].expand(smaller - live)])
        self.cache.select_rows(index, smaller, source_rows=self.slots)
        filler = torch.arange(smaller, device=index.device) >= live
        self.tokens, self.pad = self.tokens[index], self.pad[index]
        self.end = torch.where(filler, 0, self.end[index])
        self.row_of_slot = torch.where(filler.cpu(), -1, self.row_of_slot[index.cpu()])
        self.slots = smaller


def _raise_broken(step: int) -> None:
    """The error of a decode whose scores turned non-finite (`HFEngine`'s, with the step)."""
    raise FloatingPointError(
        f"CompiledEngine.generate: the model's next-token scores are not finite (by decoding "
        f"step {step}): its weights are broken, usually by an update too large for them (a "
        "learning rate too high, no max_grad_norm: the trainer's grad_norm and lr metrics of "
        "the last steps show it); lower lr, set max_grad_norm, or resume from an earlier "
        "checkpoint"
    )


def _compiling(compiled: bool) -> contextlib.AbstractContextManager[Any]:
    """Settings of a compiled step's call (read when dynamo traces it): no duck sizing, so that
    two dimensions of equal size (a row bucket and a head width, a view and its base) are not
    taken for one symbol, which would recompile as soon as they differ; room for more than the
    default 8 compiled variants of `decode_step` in one process (every engine shares them)."""
    if not compiled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.fx.experimental._config.patch(use_duck_shape=False))  # type: ignore[attr-defined]  # a config module, patched by attribute
    stack.enter_context(torch._dynamo.config.patch(recompile_limit=64))
    return stack


def _compiled_step(device: torch.device) -> Any:
    """`decode_step` compiled whole: CUDA graphs on CUDA (``reduce-overhead``), inductor's
    default mode elsewhere; the row and column dimensions are marked dynamic by the caller."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return torch.compile(decode_step, fullgraph=True, mode=mode, dynamic=True)


# ---------------------------------------------------------------------- checks
def check_static(model: nn.Module) -> None:
    """Raise unless the engine can decode ``model``: a Hugging Face causal LM whose attention
    takes a ready 4D mask (sdpa, eager) and whose layers all attend fully. Checked when the
    engine is built, before any compute."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        raise TypeError(
            f"CompiledEngine: the model is a {name}, not a Hugging Face causal LM; pass one "
            "(e.g. policy.model)"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    attention = str(getattr(text, "_attn_implementation", None))
    if attention not in STATIC_ATTENTION:
        raise ValueError(
            f"CompiledEngine: the model {name} runs attention_implementation={attention!r}, "
            f"which does not take the engine's static-cache mask (it serves "
            f"{list(STATIC_ATTENTION)}); load it with attn_implementation='sdpa', or use "
            "rb.rollout.HFEngine (any attention) or rb.rollout.ContinuousBatchingEngine "
            "(flash attention)"
        )
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    if (types and set(types) != {"full_attention"}) or (not types and window):
        raise ValueError(
            f"CompiledEngine: the model {name} has sliding-window attention (layer types "
            f"{sorted(set(types or []))}, window {window}); the engine's static cache serves "
            "full attention only; use rb.rollout.HFEngine for this model"
        )


__all__ = ["CompiledEngine", "check_static", "row_bucket"]
