"""What a :class:`~rlblocks.notebook.Dashboard` draws into: widgets in a notebook, text elsewhere.

Both views get the same calls from the dashboard, ``update(status, history, samples, redraw,
samples_step)`` and ``close(status, history, samples, samples_step)`` (``samples_step``: the step
the samples come from, the latest when None), and keep no training state of their own.
"""

from __future__ import annotations

import datetime
import html
import math
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, NamedTuple

from rlblocks.notebook.figure import curves_figure, png_bytes, present_curves
from rlblocks.notebook.samples import Sample, samples_html

Curves = tuple[tuple[str, str], ...]


class Status(NamedTuple):
    """Where training stands after an update."""

    step: int  # the step index the caller passed
    count: int  # type: ignore[assignment]  # shadows tuple.count; updates so far (the bar's value)
    total: int | None  # expected updates, or None when unknown
    seconds_per_step: float  # mean wall time per update
    elapsed: float  # sum of the step times

    @property
    def eta(self) -> float | None:
        """Seconds left: mean step time × steps left; None when the total is unknown."""
        if self.total is None:
            return None
        return self.seconds_per_step * max(self.total - self.count, 0)

    def describe(self) -> str:
        """``"4/30 · 1.20 s/step · ETA 0:00:31"`` (updates done / total, mean step time, ETA)."""
        of = "" if self.total is None else f"/{self.total}"
        text = f"{self.count}{of} · {self.seconds_per_step:.2f} s/step"
        eta = self.eta
        return text if eta is None else f"{text} · ETA {clock_time(eta)}"

    def summary(self) -> str:
        """``"done: 30 steps in 0:00:36 (1.20 s/step)"``."""
        steps = "step" if self.count == 1 else "steps"
        per_step = f"{self.seconds_per_step:.2f} s/step"
        return f"done: {self.count} {steps} in {clock_time(self.elapsed)} ({per_step})"


def clock_time(seconds: float) -> str:
    """``h:mm:ss``, rounded to the second: ``clock_time(3725.4) == "1:02:05"``."""
    if not math.isfinite(seconds):
        return "?"
    return str(datetime.timedelta(seconds=round(seconds)))


class _Frame(NamedTuple):
    """What a view draws: the status, the history, the samples and the step they come from."""

    status: Status
    history: Sequence[Mapping[str, float]]
    samples: Sequence[Sample]
    step: int  # the samples' step


class _View:
    """The two calls a `Dashboard` makes on its view (module docstring), passed on as one
    `_Frame`, the samples' step resolved, to the view's ``_draw`` and ``_finish``."""

    def update(
        self,
        status: Status,
        history: Sequence[Mapping[str, float]],
        samples: Sequence[Sample],
        redraw: bool,
        samples_step: int | None = None,
    ) -> None:
        """Show the latest step (the curves re-rendered only when ``redraw``)."""
        self._draw(_Frame(status, history, samples, _step(samples_step, status)), redraw)

    def close(
        self,
        status: Status,
        history: Sequence[Mapping[str, float]],
        samples: Sequence[Sample],
        samples_step: int | None = None,
    ) -> None:
        """Show the finished run."""
        self._finish(_Frame(status, history, samples, _step(samples_step, status)))

    def _draw(self, frame: _Frame, redraw: bool) -> None:
        raise NotImplementedError

    def _finish(self, frame: _Frame) -> None:
        raise NotImplementedError


class TerminalView(_View):
    """A tqdm bar and one concise ``key=value`` line per step, printed above the bar."""

    def __init__(self, *, total: int | None, curves: Curves, file: IO[str] | None = None) -> None:
        # tqdm.std: the text bar even inside a notebook, where tqdm.auto would pick widgets.
        from tqdm.std import tqdm

        self._tqdm = tqdm
        self.curves = curves
        self.file = file
        self.bar = tqdm(total=total, desc="train", unit="step", file=file, dynamic_ncols=True)

    def _draw(self, frame: _Frame, redraw: bool) -> None:
        """Print the latest step's curve values and the status, advance the bar."""
        status, latest = frame.status, frame.history[-1]
        values = [f"{k}={latest[k]:.4g}" for k, _ in self.curves if k in latest]
        line = "  ".join([f"step {status.step}", *values, f"[{status.describe()}]"])
        self._tqdm.write(line, file=self.file)
        self.bar.update(status.count - self.bar.n)

    def _finish(self, frame: _Frame) -> None:
        """Close the bar and print the summary line."""
        self.bar.close()
        if frame.status.count:
            self._tqdm.write(frame.status.summary(), file=self.file)


class WidgetView(_View):
    """``IntProgress`` + status line, the curves as an ``Image`` widget, the samples as ``HTML``.

    The curves are a PNG in an ``ipywidgets.Image``: setting its value is one comm message, which
    updates in place in Jupyter and needs no output capture. Widget state is often not saved with
    a notebook (nbclient stores it only when asked), so :meth:`close` keeps only the finished bar
    and displays the final figure as a static ``image/png`` output and the samples as
    ``text/html``, which every notebook saves.
    """

    def __init__(
        self, *, total: int | None, curves: Curves, display: Callable[..., Any] | None = None
    ) -> None:
        import ipywidgets as w

        if display is None:
            from IPython.display import display as ipython_display

            display = ipython_display
        self.display = display
        self.curves = curves
        self.total = total
        self.progress = w.IntProgress(value=0, min=0, max=max(total or 1, 1), description="0")
        self.status = w.HTML(value="waiting for the first step…")
        # Hidden until there is a figure: an empty Image shows a broken-image icon in some UIs.
        self.image = w.Image(format="png", layout=w.Layout(max_width="100%", display="none"))
        self.samples = w.HTML(value="")
        self.row = w.HBox([self.progress, self.status])
        self.box = w.VBox([self.row, self.image, self.samples])
        self.display(self.box)

    def _draw(self, frame: _Frame, redraw: bool) -> None:
        """Move the bar, rewrite the status and samples; re-render the curves if ``redraw``."""
        status = frame.status
        if status.total is None:
            self.progress.max = max(status.count, 1)
        self.progress.value = min(status.count, self.progress.max)
        self.progress.description = str(status.count)
        self.status.value = html.escape(status.describe())
        self.samples.value = samples_html(frame.samples, step=frame.step)
        if redraw and (png := self._png(frame.history)):
            self.image.value = png
            self.image.layout.display = None

    def _finish(self, frame: _Frame) -> None:
        """Keep the finished bar; display the final figure and samples as static outputs."""
        from IPython.display import HTML, Image

        png = self._png(frame.history)
        self.box.children = (self.row,)
        self.image.close()
        self.samples.close()
        self.progress.bar_style = "success"
        self.status.value = html.escape(frame.status.summary())
        if png:
            self.display(Image(data=png, format="png"))
        if frame.samples:
            self.display(HTML(samples_html(frame.samples, step=frame.step)))

    def _png(self, history: Sequence[Mapping[str, float]]) -> bytes | None:
        if not present_curves(history, self.curves):
            return None
        return png_bytes(curves_figure(history, curves=self.curves))


def _step(samples_step: int | None, status: Status) -> int:
    """The step the samples come from: the one given, else the latest."""
    return status.step if samples_step is None else samples_step
