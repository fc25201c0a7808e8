"""The dashboard: terminal fallback, the widget view driven without a kernel, the recipe hook."""

import base64
import io
from pathlib import Path

import IPython
import ipywidgets
import matplotlib.pyplot as plt
import pytest
import torch
from builders import tiny_engine, tiny_trainer
from IPython.display import HTML, Image
from toy_tasks import digit_fraction

import rlblocks as rb
from rlblocks.data import PromptBatches, load_prompts
from rlblocks.notebook import Dashboard, in_notebook
from rlblocks.notebook.figure import curves_figure, png_bytes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METRICS = {"reward/mean": 0.25, "approx_kl": 0.01, "grad_norm": 1.5, "loss": -0.1}


def widget_dashboard(total, clock, **kw):
    shown = []
    kw.setdefault("refresh_seconds", 0)
    dash = Dashboard(total, mode="widgets", display=shown.append, clock=clock, **kw)
    return dash, shown


# ----------------------------------------------------------------------------- terminal view
def test_terminal_prints_a_line_per_step_and_advances_the_bar(clock):
    out = io.StringIO()
    # Built at t = 0; updates at t = 2 and t = 6: step times 2 s and 4 s, mean 3 s.
    dash = Dashboard(5, mode="terminal", file=out, clock=clock(0.0, 2.0, 6.0))
    assert dash.mode == "terminal"
    dash.update(0, METRICS)
    assert dash.view.bar.n == 1
    dash.update(1, {**METRICS, "reward/mean": torch.tensor(0.5)})
    assert dash.view.bar.n == 2
    lines = [x for x in out.getvalue().splitlines() if x.startswith("step")]
    assert lines[0].startswith("step 0  reward/mean=0.25  approx_kl=0.01  grad_norm=1.5")
    # 2 of 5 done at 3 s/step: 3 left × 3 s = 9 s.
    assert lines[1] == (
        "step 1  reward/mean=0.5  approx_kl=0.01  grad_norm=1.5  [2/5 · 3.00 s/step · ETA 0:00:09]"
    )
    dash.close()
    assert dash.closed and dash.view.bar.disable  # tqdm marks a closed bar disabled
    assert "done: 2 steps in 0:00:06 (3.00 s/step)" in out.getvalue()
    dash.close()  # closing twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        dash.update(2, METRICS)


def test_first_step_is_timed_by_the_recipe_when_it_says(clock):
    # Built at t = 0 in an earlier cell; the first step ends at t = 100 but took 2 s.
    dash = Dashboard(4, mode="terminal", file=io.StringIO(), clock=clock(0.0, 100.0, 103.0))
    dash.update(0, {"step_seconds": 2.0})
    assert dash.status.seconds_per_step == 2.0
    dash.update(1, {"step_seconds": 2.0})  # then wall time between updates: 3 s
    assert dash.status.seconds_per_step == 2.5  # (2 + 3) / 2
    assert dash.status.eta == 5.0  # 2 left × 2.5 s
    dash.close()


def test_closes_itself_after_total_steps_and_as_a_context_manager():
    dash = Dashboard(2, mode="terminal", file=io.StringIO())
    dash.update(0, METRICS)
    assert not dash.closed
    dash.update(1, METRICS)
    assert dash.closed
    with Dashboard(mode="terminal", file=io.StringIO()) as dash:
        dash.update(0, METRICS)
    assert dash.closed


def test_history_keeps_only_scalars():
    dash = Dashboard(mode="terminal", file=io.StringIO())
    metrics = {"a": torch.tensor(0.5), "b": torch.ones(3), "c": [1, 2], "d": "x", "e": True, "f": 2}
    dash.update(7, metrics)
    assert dash.history == [{"step": 7, "a": 0.5, "f": 2.0}]
    dash.close()


def test_auto_mode_is_terminal_without_a_kernel():
    assert IPython.get_ipython() is None  # pytest is not a kernel
    assert not in_notebook()
    dash = Dashboard(mode="auto", file=io.StringIO())
    assert dash.mode == "terminal"
    dash.close()
    with pytest.raises(ValueError, match="mode"):
        Dashboard(mode="html")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_steps": -1}, r"total_steps=-1; pass the run's steps, an int >= 1"),
        ({"total_steps": 0}, "total_steps=0"),
        ({"total_steps": 2.5}, "total_steps=2.5"),
        ({"samples": -3}, "samples=-3"),
        ({"refresh_seconds": -1.0}, "refresh_seconds=-1.0"),
        ({"refresh_seconds": float("inf")}, "refresh_seconds=inf"),
        ({"refresh_seconds": float("nan")}, "refresh_seconds=nan"),
    ],
)
def test_settings_that_cannot_take_effect_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=rf"^Dashboard: {message}"):
        Dashboard(file=io.StringIO(), **kwargs)


def test_a_kernel_shell_is_detected(monkeypatch):
    class Shell:
        def __init__(self, config):
            self.config = config

    kernel = Shell({"IPKernelApp": {"connection_file": "kernel.json"}})
    monkeypatch.setattr(IPython, "get_ipython", lambda: kernel)
    assert in_notebook()
    terminal = Shell({"TerminalIPythonApp": {}})
    monkeypatch.setattr(IPython, "get_ipython", lambda: terminal)
    assert not in_notebook()  # plain `ipython` in a terminal: no widgets there


# ----------------------------------------------------------------------------- widget view
def test_widgets_update_in_place(clock, batch):
    # Built at 0, updates at 1 and 3: 1 s then 2 s, mean 1.5 s; 4 - 2 = 2 left -> ETA 3 s.
    dash, shown = widget_dashboard(4, clock(0.0, 1.0, 3.0))
    view = dash.view
    assert shown == [view.box] and isinstance(view.box, ipywidgets.VBox)
    assert isinstance(view.progress, ipywidgets.IntProgress) and view.progress.max == 4
    assert view.image.value == b"" and view.image.layout.display == "none"
    dash.update(0, METRICS, batch)
    assert view.image.layout.display is None  # shown once there is a figure
    assert (view.progress.value, view.progress.description) == (1, "1")
    first_png = view.image.value
    assert first_png[:8] == PNG_MAGIC
    dash.update(1, {**METRICS, "reward/mean": 0.75}, batch, [0.0, 1.0, 0.5, 0.25])
    assert (view.progress.value, view.progress.description) == (2, "2")
    assert view.status.value == "2/4 · 1.50 s/step · ETA 0:00:03"
    assert view.image.value[:8] == PNG_MAGIC and view.image.value != first_png
    assert "&lt;think&gt;easy&lt;/think&gt; 2" in view.samples.value
    assert "<think>" not in view.samples.value
    assert "samples at step 1" in view.samples.value and ">0.5</td>" in view.samples.value
    assert shown == [view.box]  # updates change widgets; nothing new is displayed
    fig = dash.figure()
    assert [ax.get_title() for ax in fig.axes] == [
        "reward",
        "KL to π_old (approx.)",
        "gradient norm",
    ]
    assert list(fig.axes[0].lines[0].get_ydata()) == [0.25, 0.75]


def test_close_leaves_a_static_figure_and_closes_the_widgets(clock, batch):
    dash, shown = widget_dashboard(2, clock(0.0, 1.0, 2.0))
    view = dash.view
    dash.update(0, METRICS, batch)
    dash.update(1, {**METRICS, "reward/mean": 0.5}, batch)  # the 2nd of 2 steps closes it
    assert dash.closed
    # Only the finished bar stays; the figure and sample widgets are closed (no comm in ipywidgets 8).
    assert view.box.children == (view.row,)
    assert view.image.comm is None and view.samples.comm is None
    assert view.progress.bar_style == "success"
    # 2 steps of 1 s each.
    assert view.status.value == "done: 2 steps in 0:00:02 (1.00 s/step)"
    box, image, table = shown
    assert box is view.box
    assert isinstance(image, Image) and image.data[:8] == PNG_MAGIC
    assert image.format == "png" and image._repr_png_()  # saved as an image/png output
    # The static PNG is the figure of the whole history.
    assert image.data == png_bytes(curves_figure(dash.history, curves=dash.curves))
    assert isinstance(table, HTML) and "&lt;think&gt;" in table.data


def test_redraws_are_throttled_but_the_final_figure_is_complete(clock):
    # refresh every 10 s; updates at t = 1, 2, 3: only the first redraws the image.
    dash, shown = widget_dashboard(3, clock(0.0, 1.0, 2.0, 3.0), refresh_seconds=10)
    dash.update(0, METRICS)
    first = dash.view.image.value
    dash.update(1, {**METRICS, "reward/mean": 0.5})
    assert dash.view.image.value == first
    dash.update(2, {**METRICS, "reward/mean": 1.0})
    final = shown[1].data
    assert final != first
    assert final == png_bytes(curves_figure(dash.history, curves=dash.curves))


def test_unknown_total_and_custom_curves(clock):
    dash, _shown = widget_dashboard(None, clock(0.0, 1.0, 2.0), metrics=["loss"])
    assert dash.curves == (("loss", "loss"),)
    dash.update(0, METRICS)
    dash.update(1, METRICS)
    assert (dash.view.progress.value, dash.view.progress.max) == (2, 2)
    assert "ETA" not in dash.view.status.value
    assert [ax.get_title() for ax in dash.figure().axes] == ["loss"]
    dash.close()


def test_no_curves_yet_shows_no_image_and_no_pyplot_figures_leak(clock):
    before = plt.get_fignums()
    dash, shown = widget_dashboard(None, clock(0.0, 1.0))
    dash.update(0, {"other": 1.0})
    assert dash.view.image.value == b"" and dash.view.image.layout.display == "none"
    dash.close()
    assert not any(isinstance(x, Image) for x in shown)
    assert plt.get_fignums() == before


# ----------------------------------------------------------------------------- recipe hook


@pytest.mark.parametrize("mode", ["terminal", "widgets"])
def test_dashboard_as_the_grpo_on_step_callback(mode):
    torch.manual_seed(0)
    policy = tiny_trainer(lr=1e-3, log_entropy=True)
    engine = tiny_engine(policy)
    data = load_prompts([{"prompt": f"Count: {i}", "ground_truth": "0"} for i in range(4)])
    out, shown = io.StringIO(), []
    dash = Dashboard(2, mode=mode, file=out, display=shown.append, refresh_seconds=0)
    history = rb.recipes.grpo(
        policy,
        engine,
        rb.rewards.per_sample(digit_fraction, timeout=None),
        PromptBatches(data, prompts_per_step=2, seed=0),
        steps=2,
        group_size=3,
        sampling=rb.SamplingParams(max_new_tokens=4),
        run=rb.run.RunOptions(on_step=dash.update, progress=False),
    )
    assert dash.closed  # 2 of 2 steps: closed by the last update
    assert [h["step"] for h in dash.history] == [0, 1]
    assert [h["reward/mean"] for h in dash.history] == [h["reward/mean"] for h in history]
    assert len(dash.samples) == 3 and all(s.prompt.startswith("Count") for s in dash.samples)
    titles = {ax.get_title() for ax in dash.figure().axes}
    assert {"reward", "response length (tokens)", "entropy", "gradient norm"} <= titles
    if mode == "terminal":
        assert "step 1  reward/mean=" in out.getvalue()
    else:
        assert any(isinstance(x, Image) and x.data[:8] == PNG_MAGIC for x in shown)


# ----------------------------------------------------------------------------- a real kernel
KERNEL_CELL = """
from rlblocks.notebook import Dashboard, in_notebook
from rlblocks.rollouts import Rollouts
assert in_notebook()
ro = Rollouts.from_lists([[1], [1]], [[2], [3]], completions=["<think>", "4"])
dash = Dashboard(total_steps=3)
for step in range(3):
    dash.update(step, {"reward/mean": step / 2, "entropy": 1.0}, ro, rewards=[0.0, 1.0])
"""


@pytest.mark.slow
def test_an_executed_notebook_keeps_the_figure(tmp_path):
    """Headless nbclient execution (as CI runs the tutorials): the saved outputs hold the widget
    view, then the final figure as image/png and the escaped samples table as text/html."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    root = str(Path(__file__).resolve().parents[2])
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(f"import sys; sys.path.insert(0, {root!r})\n{KERNEL_CELL}")
    ]
    client = nbclient.NotebookClient(nb, timeout=120, resources={"metadata": {"path": tmp_path}})
    client.execute()
    outputs = [o for o in nb.cells[0].outputs if o["output_type"] == "display_data"]
    kinds = [sorted(o["data"]) for o in outputs]
    assert kinds == [
        ["application/vnd.jupyter.widget-view+json", "text/plain"],
        ["image/png", "text/plain"],
        ["text/html", "text/plain"],
    ]
    assert base64.b64decode(outputs[1]["data"]["image/png"])[:8] == PNG_MAGIC
    assert "&lt;think&gt;" in outputs[2]["data"]["text/html"]
