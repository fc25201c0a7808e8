"""The training curves as one matplotlib figure: the live dashboard and ``plot`` both draw it.

The figure is a bare ``matplotlib.figure.Figure`` with an Agg canvas, never a pyplot figure:
pyplot would register it in its global figure manager (a leak unless closed) and, in a
notebook, the inline backend would display it a second time at the end of the cell.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlblocks.tracking.runlog import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The curves the dashboard draws, when present: (metric key, panel title). The recipes' names:
#: ``reward/mean`` from the reward function, ``entropy``, ``clip_frac``, ``approx_kl`` (KL to the
#: sampling policy π_old, from the clipped surrogate) and ``grad_norm`` from the trainer,
#: ``response_length`` from the recipe, ``kl/token`` (KL to the reference) from every recipe
#: that has one (rlblocks.run.clock), ``kl`` from a KL loss term in a hand-written loop,
#: ``accuracy`` from the demo.
CURVES: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward"),
    ("accuracy", "accuracy"),
    ("response_length", "response length (tokens)"),
    ("kl", "KL to reference"),
    ("approx_kl", "KL to π_old (approx.)"),
    ("kl/token", "KL to reference (per token)"),
    ("entropy", "entropy"),
    ("clip_frac", "clip fraction"),
    ("grad_norm", "gradient norm"),
)

#: Curves that repeat another under a name of their own: no panel when the other one is drawn.
#: A recipe copies a KL loss term's ``kl`` to ``kl/token`` (rlblocks.run.clock), so a run of
#: the demo has both; a hand-written loop with a KL loss term has only ``kl``.
REPEATS = {"kl": "kl/token"}

#: Panels per row of the figure.
COLUMNS = 3
#: Width and height of one panel, in inches.
PANEL_INCHES = (4.2, 3.0)
#: Beyond this many points a curve is drawn without markers.
MAX_MARKERS = 60


def present_curves(
    records: Sequence[Mapping[str, Any]], curves: Iterable[tuple[str, str]] = CURVES
) -> list[tuple[str, str]]:
    """The ``(key, title)`` pairs of ``curves`` that have at least one finite value in ``records``,
    less those that repeat another present curve (:data:`REPEATS`)."""
    curves = list(curves)
    present = [(k, t) for k, t in curves if any(_finite(r.get(k)) for r in records)]
    keys = {k for k, _ in present}
    return [(k, t) for k, t in present if REPEATS.get(k) not in keys]


def curves_figure(
    records: Sequence[Mapping[str, Any]],
    *,
    curves: Iterable[tuple[str, str]] = CURVES,
    columns: int = COLUMNS,
) -> Figure:
    """One panel per available curve, the metric against ``record["step"]``.

    ``records`` are ``{"step": int, key: float, ...}`` dicts (a ``RunLog``'s records, or the
    dashboard's history). Non-finite values (NaN from a step skipped by the NaN guard) are left
    out of their curve. Raises ``ValueError`` when none of ``curves`` appears.
    """
    from rlblocks.base.extras import require

    require("matplotlib", needed_by="curves_figure")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    present = present_curves(records, curves)
    if not present:
        raise ValueError(
            "curves_figure: none of the curves to plot appears in the metrics; pass records "
            "that hold at least one of them"
        )
    cols = min(columns, len(present))
    rows = math.ceil(len(present) / cols)
    width, height = PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    # Fixed margins in inches instead of tight_layout, which took ~0.5 s of a ~1 s redraw.
    spacing = {
        "left": 0.75 / width,
        "right": 1 - 0.15 / width,
        "bottom": 0.5 / height,
        "top": 1 - 0.35 / height,
        "wspace": 0.3,
        "hspace": 0.45,
    }
    axes = fig.subplots(rows, cols, squeeze=False, gridspec_kw=spacing)
    for ax, (key, title) in zip(axes.flat, present, strict=False):
        points = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
        marker = "o" if len(points) <= MAX_MARKERS else None
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present) :]:
        ax.axis("off")
    return fig


def png_bytes(fig: Figure, *, dpi: int = 90) -> bytes:
    """The figure rendered as PNG bytes; the figure is cleared afterwards (it is not reused)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    fig.clear()
    return buffer.getvalue()


def plot(
    records: str | Path | Sequence[Mapping[str, Any]],
    out: str | Path,
    *,
    curves: Iterable[tuple[str, str]] = CURVES,
    dpi: int = 100,
) -> Path:
    """Draw the dashboard's curves from a metrics JSONL file (or its records) into a PNG.

    ``plot("runs/demo/metrics.jsonl", "curves.png")``; returns the PNG's path. The same figure
    as the live :class:`~rlblocks.notebook.Dashboard`, so a finished run can be re-plotted.
    """
    if isinstance(records, (str, Path)):
        records = read_metrics(records)
    fig = curves_figure(records, curves=curves)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png_bytes(fig, dpi=dpi))
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
