"""Random batches shaped like real rollouts, shared by the advantage tests.

Every batch has: groups of several sizes with at least one group of one; arbitrary, shuffled,
non-contiguous int64 group ids; rows with exactly one valid token; "observation" gaps (mask
False) inside responses; groups whose rewards are all equal, groups of 0/1 rewards (ties) and
groups of continuous rewards. Masked-out entries of the per-token rewards and the values are
NaN, so any leak of a masked position into a result shows up as a NaN mismatch.

Helpers reach the tests as fixtures (``batch``, ``make_batch``, ``ref``, ``check_equivariance``)
rather than imports, so they work under any pytest import mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

SEEDS = range(6)


@dataclass
class Batch:
    rewards: Tensor  # (b) float32 outcome rewards
    token_rewards: Tensor  # (b t) float32, NaN where mask is False
    mask: Tensor  # (b t) bool
    group_ids: Tensor  # (b) int64, shuffled, non-contiguous
    values: Tensor  # (b t) float32 critic values, NaN where mask is False


def _group_rewards(size: int, gen: torch.Generator) -> Tensor:
    kind = int(torch.randint(0, 3, (1,), generator=gen))
    if kind == 0:  # continuous
        return torch.randn(size, generator=gen)
    if kind == 1:  # pass/fail: ties
        return torch.randint(0, 2, (size,), generator=gen).float()
    return torch.full((size,), float(torch.randn(1, generator=gen)))  # all equal


def _mask(b: int, t: int, gen: torch.Generator) -> Tensor:
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    gaps = torch.rand(b, t, generator=gen) < 0.25  # observation tokens inside responses
    gaps[:, 0] = False  # keeps at least one valid token per row
    mask = mask & ~gaps
    for row in range(0, b, 4):  # every fourth row has exactly one valid token, anywhere
        mask[row] = False
        mask[row, int(torch.randint(0, t, (1,), generator=gen))] = True
    return mask


def make_batch(seed: int, *, t: int = 9) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    n_groups = int(torch.randint(4, 8, (1,), generator=gen))
    sizes = torch.randint(1, 6, (n_groups,), generator=gen)
    sizes[0] = 1  # at least one group of one
    ids = torch.randperm(10_000, generator=gen)[:n_groups] * 1_000_003 - 5_000_000_000
    rewards = torch.cat([_group_rewards(int(s), gen) for s in sizes])
    group_ids = ids.repeat_interleave(sizes)
    order = torch.randperm(int(sizes.sum()), generator=gen)  # shuffle the rows
    rewards, group_ids = rewards[order], group_ids[order]
    b = rewards.numel()
    mask = _mask(b, t, gen)
    nan = torch.full((b, t), float("nan"))
    token_rewards = torch.where(mask, torch.randn(b, t, generator=gen), nan)
    values = torch.where(mask, torch.randn(b, t, generator=gen), nan)
    return Batch(rewards, token_rewards, mask, group_ids, values)


def relabel_sorted(batch: Batch) -> tuple[Batch, Tensor]:
    """The same batch with rows sorted by group and ids 0..n-1, and the row permutation used."""
    order = torch.argsort(batch.group_ids, stable=True)
    dense = torch.unique(batch.group_ids, return_inverse=True)[1]
    sorted_batch = Batch(
        batch.rewards[order],
        batch.token_rewards[order],
        batch.mask[order],
        dense[order],
        batch.values[order],
    )
    return sorted_batch, order


@pytest.fixture(params=SEEDS)
def batch(request: pytest.FixtureRequest) -> Batch:
    return make_batch(request.param)


@pytest.fixture
def check_equivariance():
    """Assert estimator(shuffled ids) and estimator(sorted contiguous ids) agree row by row."""

    def check(estimator, batch: Batch) -> None:
        sorted_batch, order = relabel_sorted(batch)
        for rewards, sorted_rewards in (
            (batch.rewards, sorted_batch.rewards),
            (batch.token_rewards, sorted_batch.token_rewards),
        ):
            shuffled = estimator(rewards, batch.mask, batch.group_ids)
            ordered = estimator(sorted_rewards, sorted_batch.mask, sorted_batch.group_ids)
            torch.testing.assert_close(ordered.advantages, shuffled.advantages[order])
            torch.testing.assert_close(ordered.returns, shuffled.returns[order])

    return check


def groups_of(group_ids: list[int]) -> dict[int, list[int]]:
    """Row indices of each group, in a plain dict: the loop references' grouping."""
    groups: dict[int, list[int]] = {}
    for row, gid in enumerate(group_ids):
        groups.setdefault(gid, []).append(row)
    return groups


def broadcast_rows(per_row: list[float], mask: Tensor) -> Tensor:
    """Loop reference for broadcasting: row value on every valid token, 0 elsewhere."""
    out = [[per_row[i] if m else 0.0 for m in row] for i, row in enumerate(mask.tolist())]
    return torch.tensor(out, dtype=torch.float32)


def outcome_list(batch: Batch, per_token: bool) -> list[float]:
    """Outcome score per row with a loop: the (b) reward, or the sum of valid token rewards."""
    if not per_token:
        return batch.rewards.tolist()
    scores = []
    for rewards_row, mask_row in zip(batch.token_rewards.tolist(), batch.mask.tolist()):
        scores.append(sum(r for r, m in zip(rewards_row, mask_row) if m))
    return scores


def reward_to_go_list(rewards: list[float], mask: list[bool], gamma: float) -> list[float]:
    """Loop reference for one row: discounted reward-to-go over its valid tokens, 0 elsewhere."""
    valid = [i for i, m in enumerate(mask) if m]
    out = [0.0] * len(mask)
    running = 0.0
    for i in reversed(valid):
        running = rewards[i] + gamma * running
        out[i] = running
    return out


def row_token_rewards(batch: Batch, per_token: bool) -> list[list[float]]:
    """Per-token rewards per row as lists: the (b) reward on the last valid token, or as given."""
    rows = []
    for i, mask_row in enumerate(batch.mask.tolist()):
        if per_token:
            rows.append(batch.token_rewards[i].tolist())
            continue
        row = [0.0] * len(mask_row)
        valid = [j for j, m in enumerate(mask_row) if m]
        if valid:
            row[valid[-1]] = float(batch.rewards[i])
        rows.append(row)
    return rows


def returns_reference(batch: Batch, per_token: bool, gamma: float = 1.0) -> Tensor:
    """Loop reference for every estimator's ``returns`` (reward-to-go), ``(b t)``."""
    rows = row_token_rewards(batch, per_token)
    out = [reward_to_go_list(r, m, gamma) for r, m in zip(rows, batch.mask.tolist())]
    return torch.tensor(out, dtype=torch.float32)


@pytest.fixture
def ref() -> SimpleNamespace:
    """The plain-Python loop helpers the references are built from."""
    return SimpleNamespace(
        groups_of=groups_of,
        broadcast_rows=broadcast_rows,
        outcome_list=outcome_list,
        reward_to_go_list=reward_to_go_list,
        row_token_rewards=row_token_rewards,
        returns_reference=returns_reference,
    )


@pytest.fixture
def batch_factory():
    """``make_batch(seed, t=...)`` for tests that need a batch of their own."""
    return make_batch
