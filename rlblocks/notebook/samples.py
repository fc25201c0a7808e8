"""A few sample completions of the latest step, with their rewards, as an escaped HTML table.

The rows and their rewards are picked by :mod:`rlblocks.tracking.samples` (re-exported here),
so the dashboard and the tracker's samples table show the same completions.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from rlblocks.tracking.samples import Sample, pick_samples, row_rewards

__all__ = [
    "COMPLETION_CHARS",
    "PROMPT_CHARS",
    "Sample",
    "pick_samples",
    "row_rewards",
    "samples_html",
]

#: Characters of a prompt / a completion kept in the table; the rest becomes "…".
PROMPT_CHARS = 200
COMPLETION_CHARS = 600


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
