"""Format reward: whole-completion regular-expression match."""

from __future__ import annotations

import random
import re

import pytest
import torch

from rlblocks.rewards.format import THINK_ANSWER, format_reward, think_answer_format

# (completion, score under the default <think>…</think><answer>…</answer> pattern)
CASES = [
    ("<think>2 + 2</think><answer>4</answer>", 1.0),  # the layout, nothing else
    ("<think>line 1\nline 2</think>\n\n<answer>4</answer>", 1.0),  # DOTALL + whitespace between
    ("  <think>a</think><answer>4</answer>\n", 1.0),  # surrounding whitespace stripped
    ("<answer>4</answer>", 0.0),  # no reasoning block
    ("<think>a</think>", 0.0),  # no answer block
    ("<answer>4</answer><think>a</think>", 0.0),  # wrong order
    ("Sure! <think>a</think><answer>4</answer>", 0.0),  # text before
    ("<think>a</think><answer>4</answer> Hope this helps", 0.0),  # text after
    ("", 0.0),
]


@pytest.mark.parametrize(("completion", "score"), CASES)
def test_default_pattern_table(make_rollouts, completion: str, score: float) -> None:
    rewards, metrics = think_answer_format(make_rollouts([completion]))
    torch.testing.assert_close(rewards, torch.tensor([score]))
    assert metrics["reward/failures"] == 0.0


def test_scores_strip_and_flags(make_rollouts) -> None:
    ro = make_rollouts(["<think>a</think><answer>4</answer>\n", "nope"])
    rewards, metrics = format_reward(match_score=0.5, miss_score=-1.0)(ro)
    torch.testing.assert_close(rewards, torch.tensor([0.5, -1.0]))
    assert metrics["reward/mean"] == pytest.approx(-0.25)  # (0.5 − 1) / 2
    # Without strip the trailing newline is outside the pattern: no match.
    rewards, _ = format_reward(strip=False)(ro)
    torch.testing.assert_close(rewards, torch.tensor([0.0, 0.0]))
    # Without DOTALL "." stops at newlines, so multi-line reasoning does not match.
    multi = make_rollouts(["<think>a\nb</think><answer>4</answer>"])
    torch.testing.assert_close(format_reward(flags=0)(multi).rewards, torch.tensor([0.0]))
    torch.testing.assert_close(format_reward()(multi).rewards, torch.tensor([1.0]))


def test_bad_pattern_fails_at_construction() -> None:
    with pytest.raises(re.error):
        format_reward("(<think>")


@pytest.mark.parametrize("seed", range(3))
def test_matches_a_loop_of_fullmatch(make_rollouts, seed: int) -> None:
    rng = random.Random(seed)
    pieces = ["<think>", "</think>", "<answer>", "</answer>", "x", " ", "\n"]
    completions = ["".join(rng.choices(pieces, k=rng.randrange(8))) for _ in range(40)]
    completions += ["<think>x</think><answer>x</answer>"]  # at least one match
    rewards, _ = think_answer_format(make_rollouts(completions))
    pattern = re.compile(THINK_ANSWER, re.DOTALL)
    expected = [float(pattern.fullmatch(c.strip()) is not None) for c in completions]
    torch.testing.assert_close(rewards, torch.tensor(expected))
