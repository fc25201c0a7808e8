"""A few sample completions of the latest step, with their rewards, as an escaped HTML table.

Which reward goes with each row, in order of preference:

1. the ``rewards`` passed to ``Dashboard.update`` (a ``(b)`` tensor or a list);
2. ``rollouts.rewards`` (the recipes put the ``(b)`` rewards there);
3. ``metrics["rewards"]`` when it is a per-row sequence of length ``b``;
4. none: the reward column shows "–".
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from rlblocks.rollouts import Rollouts

#: Characters of a prompt / a completion kept in the table; the rest becomes "…".
PROMPT_CHARS = 200
COMPLETION_CHARS = 600


class Sample(NamedTuple):
    """One row of the samples table."""

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
    firsts, others = [], []
    for row, gid in enumerate(rollouts.group_ids.tolist()):
        (others if gid in seen else firsts).append(row)
        seen.add(gid)
    rows = (firsts + others)[: max(k, 0)]
    return [
        Sample(rollouts.prompts[r], rollouts.completions[r], None if values is None else values[r])
        for r in rows
    ]


def samples_html(samples: Sequence[Sample], *, step: int | None = None) -> str:
    """An HTML table of ``samples``; every piece of model text is escaped (``<think>`` shows)."""
    if not samples:
        return ""
    caption = "samples" if step is None else f"samples at step {step}"
    cell = "padding:2px 8px;text-align:left;vertical-align:top;border-bottom:1px solid #ddd"
    pre = "white-space:pre-wrap;margin:0;font-size:85%"
    rows = [
        f"<tr><td style='{cell}'><pre style='{pre}'>{_text(s.prompt, PROMPT_CHARS)}</pre></td>"
        f"<td style='{cell}'><pre style='{pre}'>{_text(s.completion, COMPLETION_CHARS)}</pre></td>"
        f"<td style='{cell}'>{_reward(s.reward)}</td></tr>"
        for s in samples
    ]
    head = "".join(f"<th style='{cell}'>{h}</th>" for h in ("prompt", "completion", "reward"))
    return (
        f"<table style='border-collapse:collapse'><caption style='text-align:left'>{caption}"
        f"</caption><tr>{head}</tr>{''.join(rows)}</table>"
    )


def _text(text: str, limit: int) -> str:
    if len(text) > limit:
        text = text[:limit] + "…"
    return html.escape(text)


def _reward(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def _as_list(values: Any) -> list[Any] | None:
    if values is None or isinstance(values, (str, bytes, Mapping)):
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, Sequence):
        return list(values)
    return None
