"""Held-out evaluation: greedy (or sampled) answers to a fixed prompt set, scored by a reward."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlblocks.interfaces import Prompt, RewardFn, RolloutEngine, Rollouts, SamplingParams

GREEDY = SamplingParams(max_new_tokens=128, temperature=0.0)


@dataclass
class Evaluation:
    """Mean reward over the prompts, with every row kept for inspection."""

    score: float
    rewards: list[float]
    rollouts: Rollouts

    def samples(self, k: int = 3) -> list[tuple[str, str, float]]:
        """The first ``k`` (prompt, completion, reward) triples."""
        ro = self.rollouts
        return list(zip(ro.prompts[:k], ro.completions[:k], self.rewards[:k], strict=True))


def evaluate(
    engine: RolloutEngine,
    prompts: Sequence[Prompt],
    reward_fn: RewardFn,
    *,
    metadata: Sequence[Mapping[str, Any]] | None = None,
    sampling: SamplingParams = GREEDY,
) -> Evaluation:
    """Answer each prompt once (greedy by default) and score it: accuracy for 0/1 rewards."""
    if not prompts:
        raise ValueError("evaluate: no prompts; pass at least one prompt to score")
    rollouts = engine.generate(list(prompts), group_size=1, sampling=sampling, metadata=metadata)
    rewards, _ = reward_fn(rollouts)
    values = rewards.tolist()
    return Evaluation(score=sum(values) / len(values), rewards=values, rollouts=rollouts)
