"""A live training dashboard: a progress bar with ETA, the curves, a few sample completions.

    dash = rb.notebook.Dashboard(total_steps=30)
    history = rb.recipes.grpo(policy, engine, reward, batches, steps=30,
                              run=rb.run.RunOptions(on_step=dash, progress=False))

In a Jupyter kernel with ipywidgets it shows widgets that update in place; elsewhere a tqdm bar
and one printed line per step. The dashboard closes itself after ``total_steps`` updates (call
:meth:`Dashboard.close` when stopping early, or use it as a context manager); closing leaves the
final figure and samples as static outputs, so an executed notebook keeps them even where widget
state is not saved. An update after closing raises ``RuntimeError``.

With a dashboard, pass ``RunOptions(progress=False)`` to the recipe: its own tqdm bar would
show twice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, Literal

from rlblocks.notebook.figure import CURVES
from rlblocks.notebook.samples import Sample, pick_samples
from rlblocks.notebook.views import Curves, Status, TerminalView, WidgetView
from rlblocks.rollouts import Rollouts

if TYPE_CHECKING:
    from typing_extensions import Self

Mode = Literal["auto", "widgets", "terminal"]


def in_notebook() -> bool:
    """True inside a running IPython kernel (Jupyter, VS Code, Colab) with ipywidgets importable."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    kernel = "IPKernelApp" in shell.config or type(shell).__name__ == "ZMQInteractiveShell"
    if not kernel:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class Dashboard:
    """Shows training progress live; pass it (or its :meth:`update`) as ``on_step`` of a
    recipe's ``run=rb.run.RunOptions(...)``, or put it in a tracker's ``report_to``: it then follows the tracking backend contract
    (:meth:`start`, :meth:`log_metrics`, :meth:`log_samples`, :meth:`close`) and shows exactly
    what the tracker logs, samples at the tracker's samples steps.

    ``total_steps``: updates expected (the recipe's ``steps``), for the bar and the ETA; None
    when unknown. ``metrics``: the curves, ``(key, title)`` pairs or bare keys, drawn when present
    (default :data:`~rlblocks.notebook.figure.CURVES`). ``samples``: completions shown from the
    latest step. ``mode``: ``"auto"`` picks ``"widgets"`` in a notebook kernel, else
    ``"terminal"``. ``display``: the function widgets and the final static outputs are shown with
    (default ``IPython.display.display``); ``file``: where the terminal view writes (default
    stdout for lines, stderr for the bar). ``refresh_seconds``: the figure is redrawn at most this
    often (the bar and samples at every update; the final figure always). ``clock``: for tests.

    Memory stays bounded: the history keeps only the scalar metrics of each step, the samples
    only the latest step's; figures are rendered to PNG bytes and never kept.
    """

    def __init__(
        self,
        total_steps: int | None = None,
        *,
        metrics: Iterable[tuple[str, str] | str] = CURVES,
        samples: int = 3,
        mode: Mode = "auto",
        display: Callable[..., Any] | None = None,
        file: IO[str] | None = None,
        refresh_seconds: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if mode not in ("auto", "widgets", "terminal"):
            raise ValueError(
                f"Dashboard: mode must be 'auto', 'widgets' or 'terminal', not {mode!r}; pass "
                "one of them"
            )
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1
        ):
            raise ValueError(
                f"Dashboard: total_steps={total_steps!r}; pass the run's steps, an int >= 1 "
                "(None: unknown, no ETA)"
            )
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"Dashboard: samples={samples!r}; pass the rows to show, an int >= 0")
        if not 0 <= refresh_seconds < math.inf:
            raise ValueError(
                f"Dashboard: refresh_seconds={refresh_seconds!r}; pass a finite number of seconds "
                ">= 0 (0: redraw at every step)"
            )
        if mode == "auto":
            mode = "widgets" if in_notebook() else "terminal"
        self.mode = mode
        self.total_steps = total_steps
        self.curves: Curves = tuple((m, m) if isinstance(m, str) else tuple(m) for m in metrics)  # type: ignore[misc]  # tuple() forgets a pair's length
        self.num_samples = samples
        self.refresh_seconds = refresh_seconds
        self.clock = clock
        self.history: list[dict[str, float]] = []
        self.samples: list[Sample] = []
        self.closed = False
        self._count = 0
        self._elapsed = 0.0
        self._step = -1
        self._samples_step: int | None = None
        self._last = clock()
        self._drawn_at = -math.inf
        if mode == "widgets":
            self.view: WidgetView | TerminalView = WidgetView(
                total=total_steps, curves=self.curves, display=display
            )
        else:
            self.view = TerminalView(total=total_steps, curves=self.curves, file=file)

    def update(
        self,
        step: int,
        metrics: Mapping[str, Any],
        rollouts: Rollouts | None = None,
        rewards: Any = None,
    ) -> None:
        """Record one step and redraw; the signature of ``RunOptions.on_step``.

        ``metrics``: the step's metrics; scalars (numbers, one-element tensors) enter the
        history, anything else is ignored. ``rollouts``: the step's batch, for sample
        completions. ``rewards``: ``(b)`` per-row rewards; when None they are taken from
        ``rollouts.rewards``, then ``metrics["rewards"]`` (see
        :mod:`rlblocks.notebook.samples`).
        """
        if rollouts is not None:
            self.log_samples(step, pick_samples(rollouts, metrics, rewards, k=self.num_samples))
        self.log_metrics(step, metrics)

    def start(self, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        """As a tracker's backend: the run starts (the dashboard shows no configuration)."""
        self._check_open()

    def log_metrics(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Record one step's metrics and redraw: as a tracker's backend, once per step."""
        self._check_open()
        now = self.clock()
        duration = now - self._last
        if self._count == 0 and _finite(scalars.get("step_seconds")):
            # The dashboard may have been built in an earlier cell: time the first step by the
            # recipe's own measurement rather than since construction.
            duration = float(scalars["step_seconds"])
        self._last = now
        self._count += 1
        self._elapsed += duration
        self._step = step
        self.history.append({"step": step, **_scalars(scalars)})
        redraw = now - self._drawn_at >= self.refresh_seconds
        if redraw:
            self._drawn_at = now
        self.view.update(self.status, self.history, self.samples, redraw, self._samples_step)
        if self.total_steps is not None and self._count >= self.total_steps:
            self.close()

    def log_samples(self, step: int, rows: Sequence[Sample]) -> None:
        """Show ``rows`` (the first ``samples`` of them) from now on, captioned with ``step``;
        drawn with the next :meth:`log_metrics`."""
        self._check_open()
        self.samples = list(rows)[: self.num_samples]
        self._samples_step = step

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                "Dashboard.update: this Dashboard is closed; create a new one for another run"
            )

    __call__ = update

    @property
    def status(self) -> Status:
        """Step, progress count, total, mean seconds per step and ETA."""
        per_step = self._elapsed / self._count if self._count else math.nan
        return Status(self._step, self._count, self.total_steps, per_step, self._elapsed)

    def figure(self) -> Any:
        """The curves of the history so far as a ``matplotlib.figure.Figure`` (to save or show)."""
        from rlblocks.notebook.figure import curves_figure

        return curves_figure(self.history, curves=self.curves)

    def close(self) -> None:
        """Finish the bar; in a notebook, replace the widgets by the final static figure."""
        if self.closed:
            return
        self.closed = True
        self.view.close(self.status, self.history, self.samples, self._samples_step)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "numel") and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
