"""`env_reward`: the environment's own reward of each episode as a `RewardFn`, with the agent's
metrics (turns, tool calls, tool errors, how episodes ended) so that every recipe logs them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlblocks.envs.agent import ENDS
from rlblocks.interfaces import RewardOutput
from rlblocks.rollouts import Rollouts


def env_reward(rollouts: Rollouts) -> RewardOutput:
    """rᵢ = ``metadata[i]["agent"]["reward"]``, the reward `rlblocks.envs.AgentEngine` got from
    the environment for row i; (b) float32, no gradient. Metrics: ``reward/mean`` and
    :func:`agent_metrics`. Raises ``ValueError`` naming the first row that was not sampled by an
    ``AgentEngine``. Combine it with rule rewards on the completions as usual
    (``rb.rewards.combine``)."""
    infos = _infos(rollouts, "env_reward")
    rewards = torch.tensor([float(info["reward"]) for info in infos], dtype=torch.float32)
    mean = float(rewards.mean()) if len(rewards) else float("nan")
    return RewardOutput(rewards, {"reward/mean": mean, **agent_metrics(rollouts)})


def agent_metrics(rollouts: Rollouts) -> dict[str, float]:
    """Means over the episodes of a multi-turn batch: ``agent/turns``, ``agent/tool_calls``,
    ``agent/tool_errors``, ``agent/malformed`` (calls that could not be read: bad JSON, too
    deep a nesting, ...), ``agent/tool_call_rate`` (share of episodes with at least one call),
    ``agent/observation_tokens`` (response tokens not sampled by the model) and
    ``agent/end/<reason>`` for every reason in `rlblocks.envs.agent.ENDS`."""
    infos = _infos(rollouts, "agent_metrics")
    b = max(len(infos), 1)
    observation = rollouts.response_attention_mask & ~rollouts.response_mask
    metrics = {
        "agent/turns": sum(info["turns"] for info in infos) / b,
        "agent/tool_calls": sum(info["tool_calls"] for info in infos) / b,
        "agent/tool_errors": sum(info["tool_errors"] for info in infos) / b,
        "agent/malformed": sum(info["malformed"] for info in infos) / b,
        "agent/tool_call_rate": sum(info["tool_calls"] > 0 for info in infos) / b,
        "agent/observation_tokens": float(observation.sum()) / b,
    }
    for end in ENDS:
        metrics[f"agent/end/{end}"] = sum(info["end"] == end for info in infos) / b
    return metrics


def _infos(rollouts: Rollouts, owner: str) -> list[Mapping[str, Any]]:
    for i, row in enumerate(rollouts.metadata):
        if row.get("agent") is None:
            raise ValueError(
                f"{owner}: row {i} has no metadata['agent']; sample the rollouts with "
                "rb.envs.AgentEngine"
            )
    return [row["agent"] for row in rollouts.metadata]


__all__ = ["agent_metrics", "env_reward"]
