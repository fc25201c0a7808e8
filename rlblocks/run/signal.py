"""Whether a run's steps carry a learning signal: two metrics, and a warning when they do not.

A run can go on for hours with nothing to learn from, and its curves only say so to whoever
reads them closely. :class:`SignalWatch` looks at the rows each step trained on
(`rlblocks.run.Run.record` hands them over) and adds two metrics:

- ``signal/informative_groups``: the share of groups whose rewards are not all equal. A group
  whose samples all got the same reward has a group-relative advantage of 0 on every row
  (GRPO, RLOO, Dr. GRPO): it contributes no gradient. Needs ``rewards`` on the rows.
- ``signal/cut_off``: the share of rows whose response ran to the token budget
  (``max_new_tokens`` of the source's sampling) without ending. A task whose answers never fit
  the budget scores every sample as unfinished.

After `PATIENCE` steps in a row with no informative group, or with every row cut off, it
warns once (``UserWarning``) with what it saw and what to check.
"""

from __future__ import annotations

import warnings

import torch

from rlblocks.advantage.groups import group_index, group_max, group_min
from rlblocks.advantage.returns import outcome_scores
from rlblocks.rollouts import Rollouts

PATIENCE = 3
"""Steps in a row without a learning signal before :class:`SignalWatch` warns."""


class SignalWatch:
    """The signal metrics of each step and the two warnings (module docstring) of one run,
    named ``owner`` in the messages."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.flat: list[int] = []  # steps in a row with no informative group
        self.cut: list[int] = []  # steps in a row with every row cut off
        self.values: set[float] = set()  # the rewards seen over self.flat's steps
        self.warned: set[str] = set()

    def observe(self, step: int, rollouts: Rollouts, budget: int | None) -> dict[str, float]:
        """The metrics of ``step``'s rows; warns when a run of `PATIENCE` steps is reached.
        ``budget``: the source's ``max_new_tokens`` (None: unknown, no ``signal/cut_off``)."""
        metrics: dict[str, float] = {}
        if rollouts.rewards is not None and len(rollouts):
            scores = outcome_scores(rollouts.rewards.detach(), rollouts.response_mask)  # (b)
            share = informative_share(scores, rollouts.group_ids)
            metrics["signal/informative_groups"] = share
            if share == 0.0:
                self.flat.append(step)
                self.values |= set(scores.tolist())
            else:
                self.flat, self.values = [], set()
        if budget is not None and len(rollouts):
            cut = (rollouts.response_lengths >= budget).double().mean().item()
            metrics["signal/cut_off"] = cut
            self.cut = [*self.cut, step] if cut == 1.0 else []
        self._warn()
        return metrics

    def _warn(self) -> None:
        if len(self.flat) >= PATIENCE and "flat" not in self.warned:
            self.warned.add("flat")
            seen = sorted(self.values)
            what = (f"every reward was {seen[0]:g}" if len(seen) == 1 else
                    f"the rewards took {len(seen)} values, but never two within one group")  # fmt: skip
            warnings.warn(
                f"{self.owner}: steps {self.flat[0]}-{self.flat[-1]} had no learning signal: "
                f"in every group all samples got the same reward ({what}), so every "
                "group-relative advantage is 0 (signal/informative_groups). Check the reward "
                "function on a few completions, the answer format the prompts ask for, and "
                "whether the answers fit the token budget (signal/cut_off); more samples per "
                "group or easier prompts give more mixed groups",
                UserWarning,
                stacklevel=4,
            )
        if len(self.cut) >= PATIENCE and "cut" not in self.warned:
            self.warned.add("cut")
            warnings.warn(
                f"{self.owner}: in steps {self.cut[0]}-{self.cut[-1]} every response ran to the "
                "token budget without ending (signal/cut_off = 1), so no answer was finished "
                "where the reward looks for it; raise the sampling's max_new_tokens, or ask "
                "for a shorter answer in the prompts",
                UserWarning,
                stacklevel=4,
            )


def informative_share(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """The share of groups (rows with one ``group_ids`` value) whose ``rewards`` ``(b)`` are
    not all equal; 0 for groups of one."""
    index, n = group_index(group_ids)
    mixed = group_max(rewards, group_ids) > group_min(rewards, group_ids)  # (b), per row
    return (
        torch.zeros(n, dtype=torch.bool, device=mixed.device)
        .scatter_(0, index, mixed)
        .double()
        .mean()
        .item()
    )


__all__ = ["PATIENCE", "SignalWatch", "informative_share"]
