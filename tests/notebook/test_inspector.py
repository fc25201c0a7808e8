"""rb.notebook.inspect: every column of a hand-worked batch, the clip decision at both bounds and
both advantage signs (and against the loss itself), the terminal table's shape, the HTML's
colours, the DataFrame and the widget, and the trainer column from a real policy."""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest
import torch

import rlblocks as rb
from rlblocks.notebook.inspector import COLUMNS
from rlblocks.rollouts import Rollouts

CLIP = (0.2, 0.28)  # the notebooks' DAPO clip-higher: the ratio band is [0.8, 1.28]
BOUNDS = (0.6, 2.0)


@pytest.fixture
def worked() -> Rollouts:
    """Three rows. Row 0 (A = +1): ratios 1.5 (above 1.28: clipped), 1.1, 0.5 (below 0.8 but
    A > 0: not clipped; below the 0.6 bound: masked). Row 1 (A = -1): 0.7 (below 0.8: clipped),
    two tool tokens, 4.0 (above the dual clip 3 and the 2.0 bound). Row 2 (A = -1): 1.5 (above
    1.28 but A < 0: not clipped). Ratios are exp(old_logprobs - rollout_logprobs)."""
    rollout = [[-1.0, -0.5, -2.0], [-1.0, 0.0, 0.0, -0.3], [-0.2]]
    ratios = [[1.5, 1.1, 0.5], [0.7, 1.0, 1.0, 4.0], [1.5]]
    trainer = [[lp + math.log(r) for lp, r in zip(a, b)] for a, b in zip(rollout, ratios)]
    trainer[1][1:3] = [-3.0, -4.0]  # the trainer's scores of the tool tokens
    ro = Rollouts.from_lists(
        [[11, 12], [13], [14, 15, 16]],
        [[21, 22, 23], [24, 25, 26, 27], [28]],
        response_masks=[[True] * 3, [True, False, False, True], [True]],
        rollout_logprobs=rollout,
    )
    old = torch.zeros(3, 4)
    for i, row in enumerate(trainer):
        old[i, : len(row)] = torch.tensor(row)
    return ro.replace(
        old_logprobs=old, advantages=torch.tensor([1.0, -1.0, -1.0])[:, None] * ro.response_mask
    )


def by_token(view, column):
    return dict(zip(view.columns["token_id"], view.columns[column]))


def test_one_row_per_real_token_with_positions_and_masks(worked):
    view = rb.notebook.inspect(worked, clip=CLIP)
    # Padding (row 0's 4th response column, rows 1-2's left prompt padding) is left out.
    assert view.columns["token_id"] == [11, 12, 21, 22, 23, 13, 24, 25, 26, 27, 14, 15, 16, 28]
    assert view.columns["row"] == [0] * 5 + [1] * 5 + [2] * 4
    assert view.columns["position"] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    prompt = {11, 12, 13, 14, 15, 16}
    assert [t for t, p in by_token(view, "prompt").items() if p] == sorted(prompt)
    assert {t for t, r in by_token(view, "response").items() if r} == {21, 22, 23, 24, 27, 28}
    assert {t for t, r in by_token(view, "tool").items() if r} == {25, 26}
    assert view.columns["text"][:3] == ["11", "12", "21"]  # no tokenizer: the ids
    assert "policy_version" not in view.columns
    optional = ("old_lp", "ppo_ratio", "is_ratio", "policy_version", "staleness")
    assert list(view.columns) == [c for c in COLUMNS if c not in optional]


def test_log_probs_difference_ratio_and_advantage(worked):
    view = rb.notebook.inspect(worked, clip=CLIP)
    rollout, trainer = by_token(view, "rollout_lp"), by_token(view, "trainer_lp")
    ratio, diff, adv = by_token(view, "ratio"), by_token(view, "diff"), by_token(view, "advantage")
    assert rollout[22] == pytest.approx(-0.5) and rollout[27] == pytest.approx(-0.3)
    assert trainer[21] == pytest.approx(-1.0 + math.log(1.5), abs=1e-6)
    expected = {21: 1.5, 22: 1.1, 23: 0.5, 24: 0.7, 27: 4.0, 28: 1.5}
    assert {t: round(ratio[t], 5) for t in expected} == expected
    assert diff[23] == pytest.approx(math.log(0.5), abs=1e-6)
    assert {t: adv[t] for t in expected} == {21: 1, 22: 1, 23: 1, 24: -1, 27: -1, 28: -1}
    # Tool tokens: the trainer's score is shown, the engine did not sample them (no ratio).
    assert trainer[25] == pytest.approx(-3.0) and math.isnan(rollout[25])
    assert all(math.isnan(by_token(view, c)[25]) for c in ("diff", "ratio", "advantage"))
    # Prompt tokens have no log-prob at all.
    assert all(math.isnan(by_token(view, c)[11]) for c in ("rollout_lp", "trainer_lp", "ratio"))


def test_clip_decision_at_both_bounds_and_both_signs(worked):
    view = rb.notebook.inspect(worked, clip=CLIP)
    clipped, why = by_token(view, "clipped"), by_token(view, "why")
    # Upper bound 1.28: ratio 1.5 is clipped with A > 0 (token 21), not with A < 0 (28).
    # Lower bound 0.8: ratio 0.7 is clipped with A < 0 (24), 0.5 not with A > 0 (23).
    assert {t for t, c in clipped.items() if c} == {21, 24}
    assert (why[21], why[24], why[28], why[23], why[22]) == ("clip high", "clip low", "", "", "")
    assert by_token(view, "dual_clipped") == {t: t == 27 for t in clipped}  # A < 0, ratio 4 > 3
    assert why[27] == "dual clip" and (why[11], why[25]) == ("prompt", "tool")
    # A wider band clips nothing; dual_clip=None never dual-clips.
    wide = rb.notebook.inspect(worked, clip=(0.4, 0.6), dual_clip=None)
    assert not any(wide.columns["clipped"]) and not any(wide.columns["dual_clipped"])


def test_clip_decision_is_the_losses_own(worked):
    view = rb.notebook.inspect(worked, clip=CLIP)
    mask = worked.response_mask
    _, metrics = rb.losses.clipped_surrogate(
        worked.old_logprobs, worked.rollout_logprobs, worked.advantages, mask, clip=CLIP
    )
    policy = [i for i, r in enumerate(view.columns["response"]) if r]
    for column, metric in (("clipped", "clip_frac"), ("dual_clipped", "dual_clip_frac")):
        share = sum(view.columns[column][i] for i in policy) / len(policy)
        assert share == pytest.approx(metrics[metric].item()), column
        assert share > 0


class Scores:
    """A policy's ``logprobs``: the batch's π_old times the given per-token PPO ratios."""

    def __init__(self, ratios: list[list[float]]) -> None:
        self.ratios = ratios

    def logprobs(self, rollouts: Rollouts) -> torch.Tensor:
        lp = rollouts.old_logprobs.clone()
        for i, row in enumerate(self.ratios):
            lp[i, : len(row)] += torch.tensor(row).log()
        return lp


def test_with_pi_old_and_a_policy_the_clip_and_the_mask_take_their_own_ratios(worked):
    # An asynchronous step with π_old recomputed: PPO clips π_θ / π_old, the token mask drops
    # π_old / π_rollout (the fixture's ratios). π_θ / π_old is 1.5 at token 22 (A > 0) and 0.7
    # at 24 (A < 0), 1 elsewhere: those two are clipped, not 21 whose π_θ / π_rollout is 1.5.
    policy = Scores([[1.0, 1.5, 1.0], [0.7, 1.0, 1.0, 1.0], [1.0]])
    view = rb.notebook.inspect(worked, policy=policy, clip=CLIP, bounds=BOUNDS)
    ppo = {t: round(r, 5) for t, r in by_token(view, "ppo_ratio").items() if not math.isnan(r)}
    assert ppo == {21: 1.0, 22: 1.5, 23: 1.0, 24: 0.7, 27: 1.0, 28: 1.0}
    assert round(by_token(view, "is_ratio")[27], 5) == 4.0
    assert round(by_token(view, "ratio")[22], 5) == round(1.1 * 1.5, 5)  # π_θ / π_rollout
    assert {t for t, c in by_token(view, "clipped").items() if c} == {22, 24}
    assert not any(view.columns["dual_clipped"])  # π_θ / π_old of token 27 is 1
    masked = {t for t, m in by_token(view, "masked").items() if m}
    assert masked - {11, 12, 13, 14, 15, 16, 25, 26} == {23, 27}
    # The losses decide the same: IcePop's mask around the clipped surrogate.
    from rlblocks.losses.offpolicy import MaskedIS

    loss = MaskedIS(partial(rb.losses.clipped_surrogate, clip=CLIP), low=BOUNDS[0], high=BOUNDS[1])
    mask = worked.response_mask
    lp, old, adv = policy.logprobs(worked), worked.old_logprobs, worked.advantages
    _, metrics = loss(lp, old, adv, mask, rollout_logprobs=worked.rollout_logprobs)
    policy_rows = [i for i, r in enumerate(view.columns["response"]) if r]
    share = {c: sum(view.columns[c][i] for i in policy_rows) / 6 for c in ("clipped", "masked")}
    assert share["clipped"] == pytest.approx(metrics["clip_frac"].item()) == 2 / 6
    assert share["masked"] == pytest.approx(metrics["mis/masked_frac"].item()) == 2 / 6


def test_masked_outside_the_response_mask_and_the_bounds(worked):
    plain = rb.notebook.inspect(worked, clip=CLIP)
    assert {t for t, m in by_token(plain, "masked").items() if not m} == {21, 22, 23, 24, 27, 28}
    bounded = rb.notebook.inspect(worked, clip=CLIP, bounds=BOUNDS)
    masked, why = by_token(bounded, "masked"), by_token(bounded, "why")
    assert {t for t, m in masked.items() if not m} == {21, 22, 24, 28}  # 0.5 < 0.6, 4.0 > 2.0
    assert (why[23], why[27]) == ("ratio < low", "ratio > high")  # before any clip reason


def test_policy_version_advantages_per_row_and_settings(worked):
    # Stamped by a staleness-k source: the versions that sampled the rows, and their staleness.
    stamped = worked.replace(
        policy_version=torch.tensor([7, 8, 9]), staleness=torch.tensor([2, 1, 0])
    )
    view = rb.notebook.inspect(stamped, advantages=torch.tensor([2.0, 0.0, -3.0]))
    rows = by_token(view, "row")
    assert by_token(view, "policy_version") == {t: 7 + r for t, r in rows.items()}
    assert by_token(view, "staleness") == {t: 2 - r for t, r in rows.items()}
    assert list(view.columns)[-2:] == ["policy_version", "staleness"]
    adv = by_token(view, "advantage")
    assert (adv[21], adv[24], adv[28]) == (2.0, 0.0, -3.0) and math.isnan(adv[25])
    with pytest.raises(ValueError, match=r"^inspect: advantages has shape \(2,\)"):
        rb.notebook.inspect(worked, advantages=torch.ones(2))
    with pytest.raises(ValueError, match=r"^inspect: bounds=\(2.0, 0.5\)"):
        rb.notebook.inspect(worked, bounds=(2.0, 0.5))
    with pytest.raises(ValueError, match=r"^inspect: clip=\(1.0, 0.2\)"):
        rb.notebook.inspect(worked, clip=(1.0, 0.2))
    with pytest.raises(ValueError, match=r"^inspect: dual_clip=1.0"):
        rb.notebook.inspect(worked, dual_clip=1.0)


def test_without_log_probs_or_advantages_the_columns_are_nan(worked):
    bare = worked.replace(rollout_logprobs=None, old_logprobs=None, advantages=None)
    view = rb.notebook.inspect(bare)
    for column in ("rollout_lp", "trainer_lp", "diff", "ratio", "advantage"):
        assert all(math.isnan(v) for v in view.columns[column]), column
    assert not any(view.columns["clipped"]) and view.columns["masked"] == [
        not r for r in view.columns["response"]
    ]


def test_text_table_fits_100_columns_and_elides_long_batches(worked):
    view = rb.notebook.inspect(worked.replace(policy_version=torch.tensor([7, 8, 9])), clip=CLIP)
    lines = str(view).splitlines()
    assert len(lines) == 1 + len(view) == 15
    assert max(len(line) for line in lines) <= 100
    assert lines[0].split() == [
        "row", "pos", "id", "text", "kind", "rollout", "trainer", "ratio", "adv", "c", "d",
        "m", "why", "ver",
    ]  # fmt: skip
    row_21 = lines[3].split()  # token 21: policy, ratio 1.5, A = 1, clipped
    assert row_21 == ["0", "2", "21", "21", "policy", "-1.000", "-0.595", "1.500", "1.000",
                      "c", ".", ".", "clip", "high", "7"]  # fmt: skip
    assert lines[8].split()[4] == "tool" and lines[1].split()[4] == "prompt"
    short = view.text(max_lines=4).splitlines()
    assert short[3] == "... 10 tokens not shown ..."
    assert len(short) == 6 and short[1].split()[2] == "11" and short[-1].split()[2] == "28"


def test_html_colours_by_any_numeric_or_boolean_column(worked):
    view = rb.notebook.inspect(worked, clip=CLIP)

    def backgrounds(color):
        page = view.html(color=color)
        return [s.split("background:")[1].split(";")[0] for s in page.split("<span")[1:]]

    adv = dict(zip(view.columns["token_id"], backgrounds("advantage")))
    assert adv[21] == "rgba(220, 50, 47, 1.00)" and adv[24] == "rgba(38, 139, 210, 1.00)"
    assert adv[11] == "transparent" and adv[25] == "transparent"  # prompt and tool: NaN
    # The ratio around 1 on a log scale: 4.0 is the largest |log r|, 0.5 is half of it.
    ratio = dict(zip(view.columns["token_id"], backgrounds("ratio")))
    assert ratio[27] == "rgba(220, 50, 47, 1.00)" and ratio[23] == "rgba(38, 139, 210, 0.50)"
    assert ratio[21] == f"rgba(220, 50, 47, {math.log(1.5) / math.log(4):.2f})"
    clipped = dict(zip(view.columns["token_id"], backgrounds("clipped")))
    assert {t for t, c in clipped.items() if c != "transparent"} == {21, 24}
    assert clipped[21] == "rgba(230, 126, 34, 0.60)"
    page = view._repr_html_()
    assert "coloured by <b>ratio</b>" in page and page.count("<b>row ") == 3
    assert "clipped=True" in page and "why=clip high" in page  # the hover title
    with pytest.raises(ValueError, match=r"^BatchView.html: cannot colour by 'why'"):
        view.html(color="why")


def test_html_escapes_token_text_and_elides(worked):
    class Vocab:  # a tokenizer whose tokens hold markup and a newline
        def decode(self, ids):
            return {21: "<b>", 22: "a\nb"}.get(ids[0], "&")

    view = rb.notebook.inspect(worked, tokenizer=Vocab())
    page = view.html(color="advantage", max_tokens=5)
    assert "&lt;b&gt;" in page and "<b><" not in page and "a\u21b5\nb" in page
    assert page.count("<span") == 5 and "9 tokens not shown" in page


def test_frame_and_widget(worked):
    view = rb.notebook.inspect(worked, clip=CLIP)
    frame = view.frame
    assert list(frame.columns) == list(view.columns) and len(frame) == 14
    assert frame.loc[frame.clipped, "token_id"].tolist() == [21, 24]
    assert frame.loc[frame.tool, "token_id"].tolist() == [25, 26]
    widget = view.widget(color="advantage")
    picker, out = widget.children
    assert "why" not in picker.options and "ratio" in picker.options
    assert out.value == view.html(color="advantage")
    picker.value = "masked"
    assert out.value == view.html(color="masked")


def test_trainer_column_from_a_policy_and_its_tokenizer():
    from builders import tiny_engine, tiny_trainer

    policy = tiny_trainer()
    ro = tiny_engine(policy).generate(["2 + 3 =", "hi"], group_size=2)
    view = rb.notebook.inspect(ro, policy=policy)
    lp = policy.logprobs(ro)
    real = ro.response_attention_mask
    response = [v for v, p in zip(view.columns["trainer_lp"], view.columns["prompt"]) if not p]
    assert response == pytest.approx(lp[real].tolist())
    ids = ro.input_ids[ro.attention_mask].tolist()
    assert view.columns["text"] == [policy.tokenizer.decode([i]) for i in ids]
    # The engine sampled with the same weights: ratio 1 up to float rounding, nothing clipped.
    ratios = [r for r in view.columns["ratio"] if not math.isnan(r)]
    assert ratios and max(abs(r - 1) for r in ratios) < 1e-3
    assert not any(view.columns["clipped"])


def test_only_keeps_the_tokens_of_a_flag(worked):
    view = rb.notebook.inspect(worked, clip=CLIP)
    assert view.only("clipped").columns["token_id"] == [21, 24]
    assert view.only("tool").columns["why"] == ["tool", "tool"]
    assert view.only("prompt", False).columns["token_id"] == [21, 22, 23, 24, 25, 26, 27, 28]
    assert len(view.only("clipped").only("tool")) == 0
    assert len(view.only("dual_clipped").text().splitlines()) == 2
    with pytest.raises(ValueError, match=r"^BatchView.only: 'ratio' is not a boolean column"):
        view.only("ratio")


def test_html_shows_in_jupyter_and_the_widget_falls_back_to_it(worked, monkeypatch):
    view = rb.notebook.inspect(worked, clip=CLIP)
    page = view.html(color="tool")
    assert isinstance(page, str) and page._repr_html_() == str(page)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets raises ImportError
    fallback = view.widget(color="tool")
    assert fallback == page and fallback._repr_html_() == str(page)
