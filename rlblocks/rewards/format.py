"""Format reward: does the completion follow a required layout, e.g. ``<think>…</think><answer>…``.

DeepSeek-R1 (DeepSeek-AI 2025, arXiv 2501.12948, §2.2.2 "format rewards") pays the model for
putting its reasoning between ``<think>`` and ``</think>``; TRL's and open-r1's
``format_reward`` check it with one regular expression, as we do here.
"""

from __future__ import annotations

import re

from rlblocks.interfaces import RewardFn
from rlblocks.rewards.guard import per_sample
from rlblocks.rewards.names import REWARDS

THINK_ANSWER = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
"""Reasoning in ``<think>``, then the answer in ``<answer>``, nothing before or after."""


def format_reward(
    pattern: str = THINK_ANSWER,
    *,
    flags: re.RegexFlag | int = re.DOTALL,
    match_score: float = 1.0,
    miss_score: float = 0.0,
    strip: bool = True,
    timeout: float | None = 5.0,
) -> RewardFn:
    """Batch `RewardFn`: ``match_score`` when the whole completion matches ``pattern``.

        rᵢ = match_score   if re.fullmatch(pattern, completionᵢ, flags)
        rᵢ = miss_score    otherwise

    The pattern must match the **whole** completion (``re.fullmatch``; the default's ``^``/``$``
    only make that visible). With ``strip`` the completion's leading and trailing whitespace is
    removed first (a newline before the EOS token is tokenizer noise, not a format error).
    Rewards (b) float32, no gradient; runs through `per_sample` (metrics ``reward/mean``,
    ``reward/failures``, ``reward/timeouts``). The pattern is compiled once, here, so a typo
    fails at construction. Note that ``re`` holds the GIL, so ``timeout`` cannot stop a slow
    match (see `rlblocks.rewards.guard`); a pattern with several lazy ``.*?`` (the default
    included) can take time quadratic in the length of a degenerate completion that repeats
    the tags thousands of times (about a second for 60,000 characters).
    """
    compiled = re.compile(pattern, flags)

    def format_match(completion: str, **row: object) -> float:
        text = completion.strip() if strip else completion
        return match_score if compiled.fullmatch(text) else miss_score

    return per_sample(format_match, timeout=timeout, name="format")


think_answer_format: RewardFn = REWARDS.register("think_answer_format", format_reward())
"""The default format reward: ``<think>…</think>`` then ``<answer>…</answer>``, 1.0 or 0.0."""
