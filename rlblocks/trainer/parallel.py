"""Data parallelism for the trainers: the group a trainer is in, and its share of a batch.

Every trainer has a ``dp``: a :class:`SingleProcess` (the default: a group of one, every
collective the identity) or, once sharded over several processes, a :class:`DataParallel`.
Code that must agree over ranks goes through it unconditionally:

- **The whole batch on every rank, a share to train on.** Every rank of a group receives the
  same batch and draws the same mini-batch plan; :meth:`DataParallel.share` splits each
  mini-batch over the ranks, balanced by tokens (``Rollouts.balanced_shares``), so the split is
  the trainer's own and no caller has to know it.
- **One normalizer for the whole mini-batch.** It is computed from the whole mini-batch, which
  every rank holds, and the gradients are *summed* (not averaged) over the ranks by FSDP's
  reduce-scatter. Rank r's loss is Σ_{its tokens} ℓ / n(M) with the global n(M), so the sum
  over ranks is the single-process loss of M and the gradient does not depend on the
  data-parallel size.
- **The same number of forward passes on every rank.** FSDP all-gathers each layer during the
  forward and reduce-scatters its gradient during the backward: a rank that ran one micro-batch
  less would leave the others waiting forever. :meth:`DataParallel.aligned` pads a rank's list
  of micro-batches to the largest count with zero-weight copies of its first row.
- **One decision for the NaN guard**, and metrics reduced over the ranks.

Every collective has the process group's timeout, so a dead peer ends in an error, not a hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from rlblocks.rollouts import Rollouts, balanced_partition


@dataclass(frozen=True)
class Share:
    """One rank's part of an update: which rows it trains on, and how."""

    rows: list[int]
    """The batch rows this rank trains on (sorted): its part of every mini-batch."""
    plan: list[Tensor]
    """Each mini-batch's rows on this rank, as indices into ``rows``."""
    owned: Tensor
    """(len(rows)) bool: the rows this rank counts in batch-wide metrics (each row on one rank:
    the one it first trains on)."""


class SingleProcess:
    """The data-parallel group of one process: collectives are identities, the share is all."""

    rank = 0
    size = 1
    sharded: Literal[False] = False  # the model is whole: its own tensors are its weights
    everyone = None  # the group of every process of the trainer: none
    process = 0  # this process's rank in it
    sequence = None  # the sequence-parallel group: none

    def all_sum(self, x: Tensor) -> Tensor:
        """``x`` itself: one process is the whole group."""
        return x

    def all_max(self, value: float) -> float:
        """``value`` itself: one process is the whole group."""
        return float(value)

    def all_true(self, flag: Tensor) -> Tensor:
        """``flag`` itself: one process is the whole group."""
        return flag

    def aligned(self, parts: Sequence[Any], *, filler: Any) -> list[tuple[Any, bool]]:
        """Every part as a real one: no rank to keep in step with."""
        return [(p, True) for p in parts]

    def share(self, batch: Rollouts, plan: Sequence[Tensor]) -> Share:
        """The whole batch and plan: this process trains on every row."""
        return share(batch, plan, rank=0, size=1)

    def __repr__(self) -> str:
        return "SingleProcess()"


class DataParallel:
    """This process's place in the data-parallel group, and the few collectives a step needs."""

    sharded: Literal[True] = (
        True  # FSDP2 units: weights are gathered, state is collected (rlblocks.trainer.fsdp)
    )

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        everyone: dist.ProcessGroup | None = None,
        *,
        sequence: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        # Sequence parallelism: groups of sp consecutive ranks train on the same rows, each
        # rank on its slice of the tokens; ``rank`` and ``size`` count the row groups.
        self.sequence = sequence
        self.sp = 1 if sequence is None else dist.get_world_size(sequence)
        self.rank = dist.get_rank(group) // self.sp
        self.size = dist.get_world_size(group) // self.sp
        # Every process of the trainer: the data-parallel group itself, or with tensor
        # parallelism all of the mesh (each rank holds its own shards: checkpoints, exports).
        self.everyone = everyone if everyone is not None else group
        self.process = dist.get_rank(self.everyone)
        # NCCL reduces only CUDA tensors, gloo (here) CPU ones.
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def all_sum(self, x: Tensor) -> Tensor:
        """Σ over the row groups of ``x``: a new tensor on ``x``'s device, in ``x``'s dtype.
        Under sequence parallelism the ranks of a group hold the same value (the metrics of
        their shared rows): the sum over every rank, divided by ``sp``."""
        out = x.detach().to(self.device or x.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        if self.sp > 1:
            out = out / self.sp
        return out.to(x.device)

    def all_max(self, value: float) -> float:
        """The largest ``value`` over the ranks (float64 holds every count exactly)."""
        x = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return float(x)

    def all_true(self, flag: Tensor) -> Tensor:
        """True on every rank iff ``flag`` is True on every rank (the NaN guard's decision)."""
        bad = self.all_sum((~flag).to(torch.int64).reshape(1))
        return (bad == 0).reshape(()).to(flag.device)

    def aligned(self, parts: Sequence[Any], *, filler: Any) -> list[tuple[Any, bool]]:
        """``parts`` padded to the longest list over the ranks with ``(filler, False)`` entries.

        Returns ``(part, real)`` pairs; a padded entry must be run (so that FSDP's collectives
        match) with its result thrown away and a loss weight of zero.
        """
        count = int(self.all_max(len(parts)))
        return [(p, True) for p in parts] + [(filler, False)] * (count - len(parts))

    def share(self, batch: Rollouts, plan: Sequence[Tensor]) -> Share:
        """This rank's :class:`Share` of an update of ``batch`` by ``plan`` (global rows)."""
        return share(batch, plan, rank=self.rank, size=self.size)

    def copies(self, x: Tensor) -> int:
        """How many processes of :attr:`everyone` hold the same part of ``x`` (a DTensor's
        shard, or a whole tensor): a sum over every process divided by it counts each once."""
        from torch.distributed.tensor import DTensor, Shard

        processes = dist.get_world_size(self.everyone)
        if not isinstance(x, DTensor):
            return processes
        mesh = x.device_mesh
        shards = 1
        for dim, placement in enumerate(x.placements):
            if isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard":
                shards *= mesh.size(dim)
        return processes // shards

    def __repr__(self) -> str:
        sp = f", sp {self.sp}" if self.sp > 1 else ""
        return f"DataParallel(rank {self.rank} of {self.size}{sp})"


def share(batch: Rollouts, plan: Sequence[Tensor], *, rank: int, size: int) -> Share:
    """Rank ``rank``'s rows of every mini-batch of ``plan`` in a group of ``size``.

    Each mini-batch (global row indices) is split over the ranks by
    :func:`~rlblocks.rollouts.balanced_partition` of its rows' real tokens; rank r's piece is
    its r-th local mini-batch. Every rank needs a row of every mini-batch (FSDP's collectives).
    """
    lengths = batch.row_tokens()
    pieces: list[list[int]] = []
    owner: dict[int, int] = {}
    for minibatch in plan:
        rows = [int(r) for r in minibatch.tolist()]  # a host index
        if size == 1:
            split = [list(range(len(rows)))]
        else:
            split = balanced_partition([lengths[r] for r in rows], size)
        if size > 1 and any(not part for part in split):
            raise ValueError(
                f"PolicyTrainer.step: a mini-batch of {len(rows)} rows cannot feed {size} "
                "data-parallel ranks (each needs at least one row); use bigger mini-batches or "
                "fewer workers"
            )
        for r, part in enumerate(split):
            for k in part:
                owner.setdefault(rows[k], r)
        pieces.append([rows[k] for k in split[rank]])
    mine = sorted({r for piece in pieces for r in piece})
    position = {r: i for i, r in enumerate(mine)}
    return Share(
        rows=mine,
        plan=[torch.tensor([position[r] for r in piece], dtype=torch.long) for piece in pieces],
        owned=torch.tensor([owner[r] == rank for r in mine], dtype=torch.bool),
    )
