"""Reward functions written for TRL and verl, as rlblocks `RewardFn`\\ s.

- `from_trl(fn)`: a TRL ``GRPOTrainer`` reward function,
  ``fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]``. It gets what
  TRL gives it: ``prompts`` as the dataset holds them (text, or chat messages), ``completions``
  as text, or for a conversational prompt ``[{"role": "assistant", "content": text}]``,
  ``completion_ids`` the response's token ids, every other column of the row as a keyword list
  (one value per completion), and ``trainer_state``, ``log_extra``, ``log_metric``.
- `from_verl(compute_score)`: a verl ``compute_score(data_source, solution_str, ground_truth,
  extra_info)`` called once per row as verl's ``NaiveRewardManager`` calls it; a float, or a
  dict whose ``"score"`` is the reward and whose other numbers become metrics.

Where the rows come from: `rlblocks.data.load_prompts` with ``keep=True`` carries every column
of the dataset into ``rollouts.metadata``, the prompt column under its own name, as the dataset
holds it. Without it, TRL's ``prompts`` are the prompt texts the engine decoded
(``rollouts.prompts``) and only the columns rb.data kept are passed.

Choices made here (not TRL's or verl's, which leave a failing function to crash the run):

- **Guarded like `per_sample`.** A call past ``timeout`` seconds, one that raises, or a score
  that is not a finite number (or None, for TRL) gives the row the ``fallback`` score, counted
  in ``{key}/failures`` (``{key}/timeouts``) with one warning per batch naming the first failing
  row; ``raise_errors=True`` raises `RewardRowError` naming it. A TRL function scores the whole
  batch in one call; when that call raises, it is called again once per row, so that only the
  rows at fault fail and the warning names them. A batch call past its deadline fails all
  rows (which row hung is unknown, and b more deadlines would stall the step).
- **None** (TRL's "no reward for this row") scores ``none_score``, 0.0 by default: what TRL's
  sum over several reward functions gives such a row (``nansum``), counted in ``{key}/none``
  and left out of no mean. TRL (recent versions) also drops a row that *every* function left
  without a reward from its group's baseline and zeroes its advantage; rlblocks does not: give
  such rows a score, or filter them before the advantage.
- ``trainer_state`` is None (rlblocks has no ``transformers.TrainerState``); ``log_metric(name,
  value)`` adds ``{key}/{name}`` to the metrics; ``log_extra(column, values)`` is accepted and
  its values dropped (TRL shows them in its completions table; keep what you need in metadata).
- verl's ``extra_info`` is a copy of the row's (an empty dict where there is none) with
  ``num_turns`` and ``rollout_reward_scores`` set as verl sets them (None and ``{}`` unless the
  row has them): a function that writes into it changes no other row. ``ground_truth`` is
  ``metadata["reward_model"]["ground_truth"]`` (verl's layout), else ``metadata["ground_truth"]``
  (every rb.data dataset), so verl's scorers also run on rb.data's own tasks.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlblocks.interfaces import RewardFn, RewardOutput
from rlblocks.rewards.guard import _name_of, _run_with_deadlines, _summarize
from rlblocks.rewards.outcome import Failure, Outcome, checked_score

if TYPE_CHECKING:
    from rlblocks.rollouts import Rollouts

__all__ = ["from_trl", "from_verl", "trl_inputs", "verl_inputs"]

logger = logging.getLogger(__name__)

#: Keyword arguments TRL passes itself: a dataset column with one of these names is an error.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                 "log_metric")  # fmt: skip
#: Columns TRL does not pass on (it passes the prompt as ``prompts``).
TRL_DROPPED = ("prompt", "completion", "completion_ids")


# ---------------------------------------------------------------------- TRL
def trl_inputs(rollouts: Rollouts, *, prompt_key: str = "prompt") -> dict[str, list[Any]]:
    """The keyword lists a TRL reward function gets for these rows (no ``trainer_state`` &c.).

    ``prompts[i]``: ``metadata[i][prompt_key]`` if the row has it, else ``rollouts.prompts[i]``;
    ``completions[i]``: the text, wrapped as ``[{"role": "assistant", "content": text}]`` when
    the prompt is chat messages; ``completion_ids[i]``: the real response tokens (list of int);
    one list per other metadata key, None where a row lacks the key. Raises ``ValueError``
    naming a column that would hide one of TRL's own arguments.
    """
    metadata = rollouts.metadata
    prompts = [m.get(prompt_key, p) for m, p in zip(metadata, rollouts.prompts, strict=True)]
    completions = [
        [{"role": "assistant", "content": text}] if _is_messages(prompt) else text
        for prompt, text in zip(prompts, rollouts.completions, strict=True)
    ]
    real = rollouts.response_attention_mask
    ids = [row[mask].tolist() for row, mask in zip(rollouts.response_ids, real, strict=True)]
    inputs: dict[str, list[Any]] = {
        "prompts": prompts, "completions": completions, "completion_ids": ids,
    }  # fmt: skip
    keys = dict.fromkeys(k for m in metadata for k in m if k not in (prompt_key, *TRL_DROPPED))
    for key in keys:
        if key in TRL_ARGUMENTS:
            raise ValueError(
                f"from_trl: the rows have a column {key!r}, which would hide TRL's own "
                f"argument {key!r}; rename the column"
            )
        inputs[key] = [m.get(key) for m in metadata]
    return inputs


def from_trl(
    fn: Callable[..., Sequence[float | None]],
    *,
    timeout: float | None = 30.0,
    fallback: float = 0.0,
    none_score: float = 0.0,
    raise_errors: bool = False,
    key: str = "reward",
    name: str | None = None,
    prompt_key: str = "prompt",
) -> RewardFn:
    """A `RewardFn` calling the TRL reward function ``fn`` on the whole batch (module docstring).

        rᵢ = fn(**trl_inputs(rollouts))[i]     if a finite real number
        rᵢ = none_score                         if None (counted in ``{key}/none``)
        rᵢ = fallback                           if the call (or row) failed (``{key}/failures``)

    ``fn`` may be ``async def`` (run with ``asyncio.run``). ``timeout``: seconds for the batch
    call (each per-row retry gets as long); None calls in this thread, without a limit. Metrics:
    ``{key}/mean``, ``{key}/failures``, ``{key}/timeouts``, ``{key}/none`` and ``{key}/{name}``
    for each ``log_metric(name, value)``. ``name``: the function's ``__name__`` (for `combine`).
    """
    for value, what in ((fallback, "fallback"), (none_score, "none_score")):
        if not math.isfinite(value):
            raise ValueError(f"from_trl: {what} must be finite, got {value}; pass a finite score")
    label = name or _name_of(fn)

    def reward(rollouts: Rollouts, /) -> RewardOutput:
        inputs = trl_inputs(rollouts, prompt_key=prompt_key)
        logged: dict[str, float] = {}
        b = len(rollouts)

        def call(rows: Sequence[int]) -> list[Any]:
            kwargs = {k: [v[i] for i in rows] for k, v in inputs.items()}
            out = fn(**kwargs, trainer_state=None, log_extra=_drop, log_metric=_logger(logged))
            if inspect.isawaitable(out):
                out = asyncio.run(out)
            if isinstance(out, str | bytes | Mapping) or not isinstance(out, Sequence):
                raise TypeError(
                    f"from_trl: {label} returned {type(out).__name__}, expected a list of floats; "
                    "return one float (or None) per completion"
                )
            if len(out) != len(rows):
                raise ValueError(
                    f"from_trl: {label} returned {len(out)} scores for {len(rows)} rows; return "
                    "one score per completion"
                )
            return list(out)

        batch = _guarded(lambda _: call(range(b)), 1, timeout)[0] if b else []
        if isinstance(batch, Failure) and batch.kind == "error":
            logger.warning(
                "reward %r: the batch call failed (%s); calling it once per row", label,
                batch.message,
            )  # fmt: skip
            per_row = _guarded(lambda i: call([i]), b, timeout)
            values = [v[0] if isinstance(v, list) else v for v in per_row]
        else:
            values = [batch] * b if isinstance(batch, Failure) else batch
        none = [i for i, v in enumerate(values) if v is None]
        outcomes = [none_score if v is None else _outcome(v) for v in values]
        out = _summarize(
            outcomes, fallback=fallback, key=key, label=label, raise_errors=raise_errors
        )
        out.metrics[f"{key}/none"] = float(len(none))
        out.metrics.update({f"{key}/{k}": v for k, v in logged.items()})
        return out

    return _named(reward, label)


def _is_messages(prompt: Any) -> bool:
    """Chat messages: a non-empty list of mappings with a ``role`` (TRL's ``is_conversational``)."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in prompt)
    )


def _drop(column: str, values: list[Any]) -> None:
    """TRL's ``log_extra``: accepted, values dropped (module docstring)."""


def _logger(logged: dict[str, float]) -> Callable[[str, float], None]:
    def log_metric(name: str, value: float) -> None:
        logged[name] = float(value)

    return log_metric


def _outcome(value: Any) -> Outcome:
    """A finished row's score, or the `Failure` it already is."""
    return value if isinstance(value, Failure) else checked_score(value)


def _guarded(call: Callable[[int], Any], n: int, timeout: float | None) -> list[Any]:
    """``call(i)`` for ``i < n``: its value, or a `Failure` if it raised or ran past ``timeout``."""

    def attempt(i: int) -> Any:
        try:
            return call(i)
        except Exception as e:  # noqa: BLE001 -- whatever the function raises is that call's failure
            return Failure("error", f"{type(e).__name__}: {e}", e)

    if timeout is None:
        return [attempt(i) for i in range(n)]
    return _run_with_deadlines(attempt, n, timeout=timeout, max_workers=1)


def _named(reward: Callable[..., RewardOutput], label: str) -> RewardFn:
    reward.__name__ = reward.__qualname__ = label
    reward.__doc__ = f"Guarded batch reward around {label}."
    return reward


# ---------------------------------------------------------------------- verl
def verl_inputs(
    rollouts: Rollouts, i: int, *, data_source_key: str = "data_source"
) -> dict[str, Any]:
    """The keyword arguments verl's ``NaiveRewardManager`` gives ``compute_score`` for row ``i``.

    ``data_source``: ``metadata[data_source_key]``; ``solution_str``: the completion text;
    ``ground_truth``: ``metadata["reward_model"]["ground_truth"]``, else
    ``metadata["ground_truth"]``; ``extra_info``: a copy of ``metadata["extra_info"]`` (or
    ``{}``) with ``num_turns`` and ``rollout_reward_scores`` set as verl sets them. Raises
    ``KeyError`` naming the row and the missing column.
    """
    row = rollouts.metadata[i]
    if data_source_key not in row:
        raise KeyError(
            f"from_verl: row {i} has no column {data_source_key!r} (has {list(row)}); keep it in "
            "the metadata (rb.data.load_prompts(..., keep=True)), or pass data_source_key="
        )
    model = row.get("reward_model")
    if isinstance(model, Mapping) and "ground_truth" in model:
        truth = model["ground_truth"]
    elif "ground_truth" in row:
        truth = row["ground_truth"]
    else:
        raise KeyError(
            f"from_verl: row {i} has neither reward_model.ground_truth nor ground_truth (has "
            f"{list(row)}); keep one of them in the metadata (rb.data.load_prompts(..., keep=True))"
        )
    extra = dict(row.get("extra_info") or {})
    extra["num_turns"] = row.get("__num_turns__")
    extra["rollout_reward_scores"] = row.get("reward_scores", {})
    return {
        "data_source": row[data_source_key],
        "solution_str": rollouts.completions[i],
        "ground_truth": truth,
        "extra_info": extra,
    }


def from_verl(
    compute_score: Callable[..., float | Mapping[str, Any]],
    *,
    timeout: float | None = 5.0,
    fallback: float = 0.0,
    raise_errors: bool = False,
    key: str = "reward",
    name: str | None = None,
    data_source_key: str = "data_source",
) -> RewardFn:
    """A `RewardFn` calling verl's ``compute_score(**verl_inputs(rollouts, i))`` per row.

        rᵢ = s            if compute_score returns a finite real s
        rᵢ = d["score"]   if it returns a dict d (d's other numeric keys: metrics)
        rᵢ = fallback     if it raises, runs past ``timeout`` s, or returns anything else

    verl puts the score on the last response token; an outcome reward (b) is the same for
    every advantage estimator here. Metrics: ``{key}/mean``, ``{key}/failures``,
    ``{key}/timeouts`` and ``{key}/{k}``, the mean over the rows that returned a number for
    ``k``, for every other key of returned dicts (verl's ``reward_extra_info``).
    """
    if not math.isfinite(fallback):
        raise ValueError(f"from_verl: fallback must be finite, got {fallback}; pass a finite score")
    label = name or _name_of(compute_score)

    def reward(rollouts: Rollouts, /) -> RewardOutput:
        extras: dict[int, Mapping[str, Any]] = {}

        def score(i: int) -> Outcome:
            value = compute_score(**verl_inputs(rollouts, i, data_source_key=data_source_key))
            if isinstance(value, Mapping):
                if "score" not in value:
                    return Failure("error", f"returned a dict without 'score': {list(value)}")
                extras[i] = value
                value = value["score"]
            return checked_score(value)

        outcomes = [_outcome(o) for o in _guarded(score, len(rollouts), timeout)]
        out = _summarize(
            outcomes, fallback=fallback, key=key, label=label, raise_errors=raise_errors
        )
        out.metrics.update(_extra_means(list(extras.values()), key))
        return out

    return _named(reward, label)


def _extra_means(dicts: list[Mapping[str, Any]], key: str) -> dict[str, float]:
    """``{key}/{k}``: the mean of each non-score key's finite real values over the rows."""
    values: dict[str, list[float]] = {}
    for d in dicts:
        for k, v in d.items():
            if k != "score" and isinstance(v, numbers.Real) and math.isfinite(v):
                values.setdefault(k, []).append(float(v))
    return {f"{key}/{k}": sum(vs) / len(vs) for k, vs in values.items()}
