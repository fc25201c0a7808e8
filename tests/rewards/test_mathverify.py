"""The math-verify backend of math_answer: LaTeX answers the default comparison gets wrong."""

from __future__ import annotations

import sys

import pytest

import rlblocks as rb
from rlblocks.rewards import math_answer_score, math_verify_reward, math_verify_score

pytest.importorskip("math_verify")

# (completion, ground truth): equal answers that differ as text and are not plain numbers.
EQUAL = [
    (r"so \boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),
    (r"The answer is \boxed{\sqrt{12}}.", r"2\sqrt{3}"),
    (r"<answer>\boxed{\frac{\pi}{2}}</answer>", r"\pi/2"),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}"),
]


@pytest.mark.parametrize(("completion", "truth"), EQUAL)
def test_latex_the_default_gets_wrong_and_math_verify_right(completion, truth):
    assert math_answer_score(completion, truth) == 0.0
    assert math_verify_score(completion, truth) == 1.0


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        ("#### 1,000", "1000", 1.0),  # answers_equal's thousands separator (math-verify: a tuple)
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{2}}{2}", 0.0),
        ("no number here", r"\frac{1}{2}", 0.0),
        ("… #### 72", "Natalia sold 48 clips … #### 72", 1.0),  # a GSM8K solution as the truth
    ],
)
def test_math_verify_score_hand_worked(completion, truth, expected):
    assert math_verify_score(completion, truth) == expected


def test_reward_on_worker_threads_and_unparseable_truth(make_rollouts):
    completions = [completion for completion, _ in EQUAL] + [r"\boxed{1}"]
    metadata = [{"ground_truth": truth} for _, truth in EQUAL] + [{"ground_truth": "\\"}]
    ro = make_rollouts(completions, metadata)
    # timeout=5.0 (the default): rows run on a worker thread, where math-verify's signal-based
    # limits are off; the last row's truth cannot be parsed: a counted failure.
    rewards, metrics = math_verify_reward()(ro)
    assert rewards.tolist() == [1.0] * 5 + [0.0]
    assert metrics["reward/failures"] == 1.0
    default, _ = rb.rewards.math_answer(ro)
    assert default.tolist() == [0.0] * 6
    same, _ = rb.rewards.math_answer_reward(score=math_verify_score, timeout=None)(ro)
    assert same.tolist() == rewards.tolist()  # in the main thread, with its own limits


def test_import_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now fails
    with pytest.raises(ImportError, match=r"pip install 'rlblocks\[math\]'"):
        math_verify_reward()
    with pytest.raises(ImportError, match=r"math-verify>=0.8"):
        math_verify_score("1", "1")
