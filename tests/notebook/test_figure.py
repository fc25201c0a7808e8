"""The curves figure and ``plot``: which panels are drawn, with what data, into a real PNG."""

import math

import matplotlib.pyplot as plt
import pytest

from rlblocks.notebook import CURVES, curves_figure, plot
from rlblocks.notebook.figure import png_bytes, present_curves
from rlblocks.tracking.runlog import RunLog

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def titles(fig):
    return [ax.get_title() for ax in fig.axes if ax.get_title()]


def test_one_panel_per_present_curve_in_curve_order():
    records = [
        {"step": s, "grad_norm": 1.0, "reward/mean": s / 4, "approx_kl": 0.01} for s in (0, 1)
    ]
    fig = curves_figure(records)
    # CURVES order: reward, ..., approx_kl, ..., grad_norm; absent keys get no panel.
    assert titles(fig) == ["reward", "KL to π_old (approx.)", "gradient norm"]
    assert len(fig.axes) == 3  # one row of three, no blank panel
    reward_line = fig.axes[0].lines[0]
    assert list(reward_line.get_xdata()) == [0, 1]
    assert list(reward_line.get_ydata()) == [0.0, 0.25]


def test_nan_values_are_left_out_and_blank_panels_hidden():
    records = [
        {"step": 0, "reward/mean": 0.1, "kl": math.nan},
        {"step": 1, "reward/mean": math.nan, "kl": 0.2},
        {"step": 2, "reward/mean": 0.3, "kl": 0.4, "entropy": 2.0, "clip_frac": 0.0},
        {"step": 3, "grad_norm": 1.0},
    ]
    fig = curves_figure(records)
    assert titles(fig) == ["reward", "KL to reference", "entropy", "clip fraction", "gradient norm"]
    assert list(fig.axes[0].lines[0].get_xdata()) == [0, 2]  # step 1's NaN reward is skipped
    assert list(fig.axes[1].lines[0].get_xdata()) == [1, 2]
    # 5 panels on a 2 x 3 grid: the sixth is switched off.
    assert len(fig.axes) == 6 and not fig.axes[5].axison


def test_a_repeated_curve_gets_no_panel_of_its_own():
    # A recipe reports a KL loss term's "kl" also as "kl/token": one KL panel, not two. Alone
    # (a hand-written loop), "kl" keeps its panel.
    both = [{"step": 0, "kl": 0.1, "kl/token": 0.1}]
    assert present_curves(both) == [("kl/token", "KL to reference (per token)")]
    assert present_curves([{"step": 0, "kl": 0.1}]) == [("kl", "KL to reference")]
    only_kl = [{"step": 0, "kl": 0.1, "kl/token": math.nan}]  # no finite kl/token: not drawn
    assert present_curves(only_kl) == [("kl", "KL to reference")]


def test_present_curves_ignores_non_numbers():
    records = [{"step": 0, "reward/mean": "0.5", "kl": True, "entropy": math.inf}]
    assert present_curves(records) == []
    with pytest.raises(ValueError, match="none of the curves"):
        curves_figure(records)


def test_plot_writes_a_png_from_records_and_from_jsonl(tmp_path):
    log = RunLog(tmp_path / "metrics.jsonl")
    for step in range(4):
        log.log(step, {"reward/mean": step / 4, "response_length": 10.0 + step})
    from_records = plot(log.records, tmp_path / "a" / "curves.png")
    from_file = plot(tmp_path / "metrics.jsonl", tmp_path / "b.png")
    assert from_records.read_bytes()[:8] == PNG_MAGIC
    # Same records, same drawing code: byte-identical PNGs.
    assert from_file.read_bytes() == from_records.read_bytes()
    assert from_file.stat().st_size > 5000  # two drawn panels, not an empty canvas


def test_plot_with_custom_curves(tmp_path):
    records = [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}]
    with pytest.raises(ValueError, match="none of the curves"):
        plot(records, tmp_path / "none.png")
    assert plot(records, tmp_path / "loss.png", curves=[("loss", "loss")]).exists()
    assert CURVES[0] == ("reward/mean", "reward")


def test_rb_plot_is_the_notebook_plot():
    import rlblocks as rb

    assert rb.plot is plot  # the demo's curves.png and the docs' rb.plot(...) draw this figure


def test_no_pyplot_figures_are_created():
    before = plt.get_fignums()
    data = png_bytes(curves_figure([{"step": 0, "reward/mean": 1.0}]))
    assert data[:8] == PNG_MAGIC
    # The figure is a bare Figure: pyplot's figure manager never sees it, so nothing leaks.
    assert plt.get_fignums() == before
