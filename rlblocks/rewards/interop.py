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

- **Signatures are checked, not guarded.** A function that cannot take what the trainer passes
  would raise at every call, and the guard below would give every row of every step the
  fallback score: a run that learns nothing, with only warnings. So `from_trl` refuses (a
  ``TypeError`` naming the reward and the parameter) a function that cannot take TRL's own
  keywords (``prompts``, ``completions``, ``completion_ids``, ``trainer_state``,
  ``log_extra``, ``log_metric``: TRL passes all of them, so a TRL reward ends in ``**kwargs``)
  when it is built, and one whose parameters do not fit the rows' columns (a required column
  no row has, a column it cannot take) at the first call, before anything is scored;
  `from_verl` refuses a ``compute_score`` that cannot be called as verl calls it when it is
  built. (A callable whose signature Python cannot read, a C builtin, is not checked.)

- **Guarded like `per_sample`.** A call past ``timeout`` seconds, one that raises, or a score
  that is not a finite number (or None, for TRL) gives the row the ``fallback`` score, counted
  in ``{key}/failures`` (``{key}/timeouts``) with one warning per batch naming the first failing
  row; ``raise_errors=True`` raises `RewardRowError` naming it. A TRL function scores the whole
  batch in one call; when that call raises, it is called again once per row, so that only the
  rows at fault fail and the warning names them. A batch call past its deadline fails all
  rows (which row hung is unknown, and b more deadlines would stall the step). The thread
  of a call past its deadline keeps running (Python cannot stop it): as in `per_sample`, the
  first is reported by one warning per reward function, and from then on
  ``{key}/abandoned_threads`` counts those still running.
- **None** (TRL's "no reward for this row") scores ``none_score``, 0.0 by default: what TRL's
  sum over several reward functions gives such a row (``nansum``), counted in ``{key}/none``
  and left out of no mean. TRL (recent versions) also drops a row that *every* function left
  without a reward from its group's baseline and zeroes its advantage; rlblocks does not: give
  such rows a score, or filter them before the advantage.
- ``trainer_state`` is a ``transformers.TrainerState`` with what TRL's carries and a reward
  reads: ``global_step`` (the steps the run loop has finished: its updates so far),
  ``max_steps`` (the run's steps) and ``epoch`` (epochs of the prompt data drawn so far,
  fractional), from `rlblocks.base.progress`. Called outside a run loop (by hand), it is a
  ``TrainerState()`` at step 0. ``log_metric(name, value)`` adds ``{key}/{name}`` to the
  metrics; ``log_extra(column, values)`` is accepted and
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
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from rlblocks.base.progress import current
from rlblocks.interfaces import RewardFn, RewardOutput
from rlblocks.rewards.guard import Abandoned, _name_of, _run_with_deadlines, _summarize
from rlblocks.rewards.outcome import Failure, Outcome, checked_score

if TYPE_CHECKING:
    from rlblocks.rollouts import Rollouts

__all__ = ["from_trl", "from_verl", "trainer_state", "trl_inputs", "verl_inputs"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: What `from_trl` and `from_verl` say to do about a thread left running past its deadline.
RETURN_FIX = (
    "make the function return (or raise) within timeout=; a per-row function run by "
    "rb.rewards.per_sample(fn, pool=rb.rewards.ProcessPool(workers=n)) is killed at its deadline"
)
#: TRL's keyword arguments that are not columns: passed besides `trl_inputs`.
TRL_CALLBACKS = ("trainer_state", "log_extra", "log_metric")
#: Keyword arguments TRL passes itself: a dataset column with one of these names is an error.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", *TRL_CALLBACKS)
#: Columns TRL does not pass on (it passes the prompt as ``prompts``).
TRL_DROPPED = ("prompt", "completion", "completion_ids")


# ---------------------------------------------------------------------- TRL
def trainer_state() -> Any:
    """The ``transformers.TrainerState`` TRL would pass a reward function now: ``global_step``,
    ``max_steps`` and ``epoch`` of the running loop (`rlblocks.base.progress`); a fresh
    ``TrainerState()`` (step 0) outside one."""
    from transformers import TrainerState

    progress = current()
    if progress is None:
        return TrainerState()
    return TrainerState(
        global_step=progress.step,
        max_steps=progress.steps or 0,
        epoch=progress.epoch,  # type: ignore[arg-type]  # None: the data cannot say (typed float)
    )


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

    ``fn`` may be ``async def``, or return any awaitable (run with ``asyncio.run``).
    ``timeout``: seconds for the batch call (each per-row retry gets as long); None calls in
    this thread, without a limit. Metrics:
    ``{key}/mean``, ``{key}/failures``, ``{key}/timeouts``, ``{key}/abandoned_threads`` (after
    a first timeout), ``{key}/none`` and ``{key}/{name}`` for each ``log_metric(name, value)``. ``name``: the function's ``__name__`` (for `combine`).
    """
    for value, what in ((fallback, "fallback"), (none_score, "none_score")):
        if not math.isfinite(value):
            raise ValueError(f"from_trl: {what} must be finite, got {value}; pass a finite score")
    label = name or _name_of(fn)
    signature = _signature(fn)
    _check_trl_signature(signature, label)
    abandoned = Abandoned(label, key, fix=RETURN_FIX)

    def reward(rollouts: Rollouts, /) -> RewardOutput:
        inputs = trl_inputs(rollouts, prompt_key=prompt_key)
        _check_trl_columns(signature, label, inputs)
        logged: dict[str, float] = {}
        b = len(rollouts)
        state = trainer_state()

        def call(rows: Sequence[int]) -> list[Any]:
            kwargs = {k: [v[i] for i in rows] for k, v in inputs.items()}
            out = fn(**kwargs, trainer_state=state, log_extra=_drop, log_metric=_logger(logged))
            if inspect.isawaitable(out):  # any awaitable: asyncio.run takes coroutines only
                out = asyncio.run(_awaited(out))
            if isinstance(out, str | bytes | Mapping) or not isinstance(out, Sequence):
                raise ContractError(
                    f"from_trl: {label} returned {type(out).__name__}, expected a list of floats; "
                    "return one float (or None) per completion"
                )
            if len(out) != len(rows):
                raise ValueError(
                    f"from_trl: {label} returned {len(out)} scores for {len(rows)} rows; return "
                    "one score per completion"
                )
            return list(out)

        batch = _guarded(lambda _: call(range(b)), 1, timeout, abandoned)[0] if b else []
        if isinstance(batch, Failure) and isinstance(batch.error, ContractError):
            # the function's own shape, not a row's failure: no row would score otherwise
            raise batch.error
        if isinstance(batch, Failure) and batch.kind == "error":
            logger.warning(
                "reward %r: the batch call failed (%s); calling it once per row", label,
                batch.message,
            )  # fmt: skip
            per_row = _guarded(lambda i: call([i]), b, timeout, abandoned)
            values = [v[0] if isinstance(v, list) else v for v in per_row]
        else:
            values = [batch] * b if isinstance(batch, Failure) else batch
        none = [i for i, v in enumerate(values) if v is None]
        outcomes = [none_score if v is None else _outcome(v) for v in values]
        out = _summarize(
            outcomes, fallback=fallback, key=key, label=label, raise_errors=raise_errors
        )
        out.metrics[f"{key}/none"] = float(len(none))
        abandoned.report(out.metrics)
        out.metrics.update({f"{key}/{k}": v for k, v in logged.items()})
        return out

    return _named(reward, label)


class ContractError(TypeError):
    """A reward function that returns what no row can be scored from (a float or a dict where
    TRL expects a list of scores): raised, not counted as failed rows, since every batch would
    fail the same way."""


async def _awaited(awaitable: Awaitable[_T]) -> _T:
    return await awaitable


#: The parameter kinds a keyword argument can fill.
_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    """``fn``'s signature, or None where Python cannot read one (a C builtin)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _misfit(signature: inspect.Signature, passed: Collection[str]) -> tuple[list[str], list[str]]:
    """What keeps ``fn(**{name: ... for name in passed})`` from binding: ``(names passed that
    it cannot take, parameters without a default that the call does not fill)``."""
    params = list(signature.parameters.values())
    by_name = {p.name for p in params if p.kind in _BY_KEYWORD}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    cannot = [] if takes_any else [n for n in passed if n not in by_name]
    unfilled = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and (p.kind is inspect.Parameter.POSITIONAL_ONLY or p.name not in passed)
    ]
    return cannot, unfilled


def _check_trl_signature(signature: inspect.Signature | None, label: str) -> None:
    """Refuse a TRL reward that cannot take TRL's own keywords, or that has a positional-only
    parameter without a default (TRL passes everything by keyword)."""
    if signature is None:
        return
    cannot, unfilled = _misfit(signature, TRL_ARGUMENTS)
    if cannot:
        raise TypeError(
            f"from_trl: reward {label}{signature} cannot take {', '.join(map(repr, cannot))}, "
            f"which TRL passes to every reward function (with {', '.join(TRL_ARGUMENTS)} and "
            "every dataset column, all by keyword); end its parameters with **kwargs, as TRL's "
            "reward functions do"
        )
    positional = [
        n for n in unfilled if signature.parameters[n].kind is inspect.Parameter.POSITIONAL_ONLY
    ]
    if positional:
        raise TypeError(
            f"from_trl: reward {label}{signature} has the positional-only parameter(s) "
            f"{', '.join(map(repr, positional))}, which TRL never fills (it passes everything by "
            "keyword); make them ordinary parameters"
        )


def _check_trl_columns(
    signature: inspect.Signature | None, label: str, inputs: Mapping[str, Any]
) -> None:
    """Refuse, before anything is scored, a TRL reward whose parameters do not fit the
    columns of these rows: one it requires that no row has, one it cannot take."""
    if signature is None:
        return
    passed = [*inputs, *TRL_CALLBACKS]
    cannot, unfilled = _misfit(signature, passed)
    columns = ", ".join(repr(k) for k in inputs if k not in TRL_ARGUMENTS) or "none"
    if unfilled:
        raise TypeError(
            f"from_trl: reward {label}{signature} needs {', '.join(map(repr, unfilled))}, "
            f"but no row has such a column (the rows' columns: {columns}), so every call would "
            "fail; keep that column in the rows (rb.data.load_prompts(..., keep=True) keeps "
            "every column of the dataset), or give the parameter a default"
        )
    if cannot:
        raise TypeError(
            f"from_trl: reward {label}{signature} cannot take the rows' column(s) "
            f"{', '.join(map(repr, cannot))}, which TRL passes as keywords, so every call "
            "would fail; end its parameters with **kwargs, as TRL's reward functions do"
        )


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


def _guarded(
    call: Callable[[int], Any], n: int, timeout: float | None, abandoned: Abandoned
) -> list[Any]:
    """``call(i)`` for ``i < n``: its value, or a `Failure` if it raised or ran past ``timeout``
    (its thread then handed to ``abandoned``)."""

    def attempt(i: int) -> Any:
        try:
            return call(i)
        except Exception as e:  # noqa: BLE001 -- whatever the function raises is that call's failure
            return Failure("error", f"{type(e).__name__}: {e}", e)

    if timeout is None:
        return [attempt(i) for i in range(n)]
    return _run_with_deadlines(attempt, n, timeout=timeout, max_workers=1, abandoned=abandoned)


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
    ``{key}/timeouts``, ``{key}/abandoned_threads`` (after a first timeout) and ``{key}/{k}``,
    the mean over the rows that returned a number for ``k``, for every other key of returned
    dicts (verl's ``reward_extra_info``).
    """
    if not math.isfinite(fallback):
        raise ValueError(f"from_verl: fallback must be finite, got {fallback}; pass a finite score")
    label = name or _name_of(compute_score)
    _check_verl_signature(_signature(compute_score), label)
    abandoned = Abandoned(label, key, fix=RETURN_FIX)

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

        outcomes = [_outcome(o) for o in _guarded(score, len(rollouts), timeout, abandoned)]
        out = _summarize(
            outcomes, fallback=fallback, key=key, label=label, raise_errors=raise_errors
        )
        out.metrics.update(_extra_means(list(extras.values()), key))
        abandoned.report(out.metrics)
        return out

    return _named(reward, label)


#: The keywords verl's ``NaiveRewardManager`` calls ``compute_score`` with.
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


def _check_verl_signature(signature: inspect.Signature | None, label: str) -> None:
    """Refuse a ``compute_score`` that cannot be called as verl calls it."""
    if signature is None:
        return
    cannot, unfilled = _misfit(signature, VERL_ARGUMENTS)
    if cannot or unfilled:
        problem = (
            f"it cannot take {', '.join(map(repr, cannot))}"
            if cannot
            else f"it also needs {', '.join(map(repr, unfilled))}, which verl never passes"
        )
        raise TypeError(
            f"from_verl: compute_score {label}{signature} cannot be called as verl calls it, "
            f"compute_score({'=, '.join(VERL_ARGUMENTS)}=): {problem}, so every row would score "
            "the fallback; give it those four parameters (extra_info=None), or bind the others "
            "with functools.partial"
        )


def _extra_means(dicts: list[Mapping[str, Any]], key: str) -> dict[str, float]:
    """``{key}/{k}``: the mean of each non-score key's finite real values over the rows."""
    values: dict[str, list[float]] = {}
    for d in dicts:
        for k, v in d.items():
            if k != "score" and isinstance(v, numbers.Real) and math.isfinite(v):
                values.setdefault(k, []).append(float(v))
    return {f"{key}/{k}": sum(vs) / len(vs) for k, vs in values.items()}
