"""Math answer reward: extraction, equality, the per-sample score and the batch reward."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from rlblocks.rewards.math import (
    answers_equal,
    extract_answer,
    math_answer,
    math_answer_reward,
    math_answer_score,
    truth_answer,
)

# (text, expected extraction): worked by reading the text with the documented order
# <answer> block > "####" > last complete \boxed/\fbox > last number.
EXTRACTION = [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),  # GSM8K marker wins over numbers
    ("#### 1,000\nsome trailing words 5", "1,000"),  # rest of the marker's line only
    ("first #### 3 then #### 4", "4"),  # the last marker
    ("####\nthe answer is 9", "9"),  # empty marker line: falls through to the last number
    (r"so x = \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),  # balanced braces kept whole
    (r"\boxed{a} then \boxed{\sqrt{2}}", r"\sqrt{2}"),  # the last box, nested braces
    (r"\fbox{7} is it", "7"),  # \fbox counts like \boxed
    (r"\boxed{3} and then \boxed{12", "3"),  # cut-off box ignored, last complete one used
    (r"\boxed{} and 8", "8"),  # empty box: falls through to the last number
    ("The total is $1,000.", "1,000"),  # thousands separator kept, sentence dot dropped
    ("It drops to -3.5 degrees", "-3.5"),  # negative decimal
    ("half is 1/2", "1/2"),  # a slash fraction is one number
    ("about 1.5e-3 m", "1.5e-3"),  # scientific notation
    (r"equals $\dfrac{3}{4}$ of it", r"\dfrac{3}{4}"),  # LaTeX fraction outside a box
    ("only .5 left", ".5"),  # leading-dot decimal
    ("no number at all", None),  # nothing to extract
    ("", None),
    ("<think>maybe 3</think><answer>the answer is 42</answer>", "42"),  # inside the tag
    ("<think>5</think><answer>(B)</answer>", "(B)"),  # tag text when it has no number
    ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last tag
]


@pytest.mark.parametrize(("text", "expected"), EXTRACTION)
def test_extract_answer_table(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


# (pred, truth, equal?) with the reason in the comment.
EQUALITY = [
    ("1,000", "1000", True),  # thousands separator removed
    ("1,000,000.5", "1000000.5", True),
    ("0.50", ".5", True),  # both are exactly 1/2
    ("1/2", "0.5", True),  # 1/2 = 0.5 exactly
    (r"\frac{1}{2}", "0.5", True),
    (r"\dfrac12", "1/2", True),  # single-digit \dfrac without braces
    (r"\tfrac{3}{4}", "0.75", True),
    (r"-\frac{3}{4}", "-0.75", True),  # sign outside the fraction
    (r"\frac{-3}{4}", "-0.75", True),  # sign inside the numerator
    ("$5$", "5", True),  # math-mode dollars
    (r"\$5.00", "5", True),  # escaped dollar sign, 5.00 = 5
    ("72.", "72", True),  # trailing sentence dot
    ("5 apples", "5", True),  # trailing unit word
    (r"5 \text{ apples}", "5", True),
    ("x = 5", "5", True),  # value after the last "="
    ("50%", "50", True),  # our choice: % dropped, 50% is 50 (GSM8K truths are bare numbers)
    (r"50\%", "50", True),
    ("50%", "0.5", False),  # ... and not 0.5
    ("-7", "-7", True),  # negative numbers
    ("\u22127", "-7", True),  # Unicode minus sign
    ("-7", "7", False),  # sign matters
    ("1e3", "1000", True),  # scientific notation
    ("1.5e-3", "0.0015", True),
    (r"1.5 \times 10^{3}", "1500", True),  # LaTeX scientific notation
    ("0.3333333", "1/3", True),  # |Δ| = 1/30000000 ≤ 1e-6 · 1/3 = 1/3000000
    ("0.33", "1/3", False),  # |Δ| = 1/300 > 1/3000000
    ("3.1415927", "3.14159265", True),  # |Δ| = 5e-8 ≤ 1e-6 · 3.14 ≈ 3.1e-6
    ("1000001", "1000000", False),  # integers compare exactly (rel. tol. alone would pass)
    ("10", "100", False),  # a prefix is not a match
    ("1/2", "1/3", False),  # 0.5 vs 0.333
    ("12", "1.2", False),
    ("0", "0", True),  # |Δ| = 0 ≤ 0
    ("0", "0.0000001", False),  # no absolute tolerance: 1e-7 > 1e-6 · 1e-7
    ("1/0", "1/0", True),  # not a number (division by zero): equal as strings
    (r"\text{(B)}", "(b)", True),  # non-numeric: \text{} removed, case folded
    ("Tuesday ", "tuesday", True),  # whitespace stripped
    ("x+1", "1+x", False),  # no symbolic algebra
    ("5", "five", False),  # numeric never equals non-numeric
    ("1,5", "1.5", False),  # "1,5" is not a thousands pattern: compared as text
    ("", "0", False),
]


@pytest.mark.parametrize(("pred", "truth", "equal"), EQUALITY)
def test_answers_equal_table(pred: str, truth: str, equal: bool) -> None:
    assert answers_equal(pred, truth) is equal
    assert answers_equal(truth, pred) is equal  # the relation is symmetric


def test_answers_equal_none_and_tolerance_limits() -> None:
    assert not answers_equal(None, "5")  # nothing extracted is never correct
    # rel_tol=0 makes non-integers exact: 0.3333333 ≠ 1/3.
    assert not answers_equal("0.3333333", "1/3", rel_tol=0.0)
    # A looser tolerance admits 0.33 vs 1/3: |Δ| = 1/300 ≤ 0.02 · 1/3 = 1/150.
    assert answers_equal("0.33", "1/3", rel_tol=0.02)


def test_huge_or_degenerate_numbers_do_not_blow_up() -> None:
    # Exponents are limited to three digits, so "1e999999999" is not parsed as a number
    # (it would build a billion-digit integer); it compares as text.
    assert not answers_equal("1e999999999", "1")
    assert answers_equal("1e999999999", "1E999999999")  # same text, case folded
    assert not answers_equal("9" * 5000, "1")  # too long to be a numeric answer


def test_truth_answer() -> None:
    assert truth_answer("48/2 = 24 clips in May.\n#### 72") == "72"  # GSM8K solution
    assert truth_answer(r"The answer is $\boxed{\frac{1}{4}}$.") == r"\frac{1}{4}"  # MATH
    assert truth_answer("72") == "72"  # bare answers are used whole
    assert truth_answer(r"\text{(B)}") == r"\text{(B)}"  # ... even when not a number


def test_math_answer_score() -> None:
    gsm8k_truth = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert math_answer_score("so she sold 72 clips.", gsm8k_truth) == 1.0
    assert math_answer_score(r"\boxed{72}", "72") == 1.0
    assert math_answer_score(r"\boxed{71}", gsm8k_truth) == 0.0
    assert math_answer_score("I do not know.", "72") == 0.0  # nothing extracted
    assert math_answer_score("#### 72", 72) == 1.0  # type: ignore[arg-type]  # int truths work


def test_math_answer_batch(make_rollouts, caplog) -> None:
    ro = make_rollouts(
        ["#### 72", r"\boxed{0.5}", "I give up", "#### 3"],
        [{"ground_truth": "x\n#### 72"}, {"ground_truth": "1/2"}, {"ground_truth": "4"}, {}],
    )
    with caplog.at_level(logging.WARNING, logger="rlblocks.rewards.guard"):
        rewards, metrics = math_answer(ro)
    # Rows: correct, correct (0.5 = 1/2), nothing extracted, no ground truth -> fallback 0.
    torch.testing.assert_close(rewards, torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert metrics["reward/mean"] == pytest.approx(0.5)  # (1 + 1 + 0 + 0) / 4
    assert metrics["reward/failures"] == 1.0  # only the row without "ground_truth" failed
    assert "row 3" in caplog.text and "KeyError" in caplog.text
    assert math_answer.__name__ == "math_answer"


def test_math_answer_reward_key_and_fallback(make_rollouts) -> None:
    reward = math_answer_reward(ground_truth_key="answer", fallback=-1.0)
    ro = make_rollouts(["#### 5", "#### 5"], [{"answer": "5"}, {"ground_truth": "5"}])
    rewards, metrics = reward(ro)
    torch.testing.assert_close(rewards, torch.tensor([1.0, -1.0]))  # row 1 lacks "answer"
    assert metrics["reward/failures"] == 1.0


def _random_case(rng: random.Random) -> tuple[str, str]:
    """A completion in one of several styles and a ground truth that may or may not match."""
    value = rng.choice([0, 3, 72, 1000, 1234567, -5])
    truth = str(value) if rng.random() < 0.7 else f"work...\n#### {value}"
    shown = value if rng.random() < 0.6 else value + rng.choice([1, 10, -1])
    style = rng.randrange(5)
    text = [
        f"so the answer is {shown}.",
        f"#### {shown:,}",
        rf"thus \boxed{{{shown}}}",
        f"<think>try {value + 7}</think><answer>{shown}</answer>",
        "no idea",
    ][style]
    return text, truth


@pytest.mark.parametrize("seed", range(4))
def test_math_answer_matches_a_loop_of_scores(make_rollouts, seed: int) -> None:
    rng = random.Random(seed)
    cases = [_random_case(rng) for _ in range(24)]
    ro = make_rollouts([c for c, _ in cases], [{"ground_truth": t} for _, t in cases])
    rewards, metrics = math_answer(ro)
    expected = torch.tensor([math_answer_score(c, t) for c, t in cases])
    torch.testing.assert_close(rewards, expected)
    assert metrics["reward/failures"] == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_boxed_score_matches_an_obvious_rule(seed: int) -> None:
    """Random boxed integers in several formats: correct exactly when the number is the value."""
    rng = random.Random(seed)
    for _ in range(50):
        value = rng.randrange(-10_000, 10_000)
        shown = value + rng.choice([0, 0, 1, -1, 100])
        form = rng.choice(["{:,}", "{}", "{}.00", "$ {} $"])
        text = rf"\boxed{{{form.format(shown)}}}"
        assert math_answer_score(text, f"solution\n#### {value}") == float(shown == value)


def test_degenerate_repetitions_are_handled_in_linear_time() -> None:
    # A policy stuck in a loop can repeat an opening thousands of times. Matching every
    # "\boxed{" or "<answer>" separately would be quadratic (minutes here); one pass is not.
    assert extract_answer(r"\boxed{" * 20_000 + "5") == "5"  # no box closes: last number
    assert extract_answer(r"\boxed{" * 20_000 + "6}") == "6"  # only the innermost closes
    assert extract_answer("<answer>" * 20_000 + "7") == "7"  # no tag closes: last number
    assert extract_answer("<answer>" * 20_000 + "8</answer>") == "8"
