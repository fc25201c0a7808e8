"""Watching a run: a live dashboard for notebooks (text in a terminal), its curves as a PNG, and
one batch token by token (`inspect`).

    dash = rb.notebook.Dashboard(total_steps=30)        # widgets in Jupyter, tqdm elsewhere
    rb.recipes.grpo(..., steps=30, run=rb.run.RunOptions(on_step=dash, progress=False))
    rb.notebook.plot("runs/demo/metrics.jsonl", "curves.png")
    rb.notebook.inspect(ro, policy=policy, advantages=adv).widget(color="ratio")

matplotlib, ipywidgets and IPython are imported only when a dashboard or a plot is made.
"""

from rlblocks.notebook.dashboard import Dashboard, in_notebook
from rlblocks.notebook.figure import CURVES, curves_figure, plot
from rlblocks.notebook.inspector import BatchView, inspect
from rlblocks.notebook.samples import Sample, pick_samples, row_rewards, samples_html
from rlblocks.notebook.views import Status

__all__ = [
    "CURVES",
    "BatchView",
    "Dashboard",
    "Sample",
    "Status",
    "curves_figure",
    "in_notebook",
    "inspect",
    "pick_samples",
    "plot",
    "row_rewards",
    "samples_html",
]
