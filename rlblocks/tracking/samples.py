"""Which completions a samples table shows, and which reward goes with each row.

The tracker's samples table (every ``samples_every`` steps) and the notebook dashboard pick their
rows here, so both show the same completions. Which reward goes with each row, in order of
preference:

1. the ``rewards`` passed in (a ``(b)`` tensor or a list);
2. ``rollouts.rewards`` (the recipes put the ``(b)`` rewards there);
3. ``metrics["rewards"]`` when it is a per-row sequence of length ``b``;
4. none: the row's reward is None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from rlblocks.rollouts import Rollouts


class Sample(NamedTuple):
    """One row of a samples table."""

    prompt: str
    completion: str
    reward: float | None


def row_rewards(
    rollouts: Rollouts, metrics: Mapping[str, Any], rewards: Any = None
) -> list[float] | None:
    """The ``b`` per-row rewards from the first source that has them (see the module docstring)."""
    b = rollouts.batch_size
    for candidate in (rewards, rollouts.rewards, metrics.get("rewards")):
        values = _as_list(candidate)
        if values is None or len(values) != b:
            continue
        try:
            return [float(v) for v in values]
        except (TypeError, ValueError):  # not one number per row, e.g. (b t) per-token rewards
            continue
    return None


def pick_samples(
    rollouts: Rollouts,
    metrics: Mapping[str, Any],
    rewards: Any = None,
    *,
    k: int = 3,
) -> list[Sample]:
    """``k`` rows, one per group first (so different prompts show), then the remaining rows."""
    values = row_rewards(rollouts, metrics, rewards)
    seen: set[int] = set()
    firsts: list[int] = []
    others: list[int] = []
    for row, gid in enumerate(rollouts.group_ids.tolist()):
        (others if gid in seen else firsts).append(row)
        seen.add(gid)
    rows = (firsts + others)[: max(k, 0)]
    return [
        Sample(rollouts.prompts[r], rollouts.completions[r], None if values is None else values[r])
        for r in rows
    ]


def _as_list(values: Any) -> list[Any] | None:
    if values is None or isinstance(values, (str, bytes, Mapping)):
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, Sequence):
        return list(values)
    return None
