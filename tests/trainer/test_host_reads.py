"""Host reads of one ``PolicyTrainer.step``: a constant per step and per optimizer step, none
per micro-batch (tests/host_reads.py says what is counted and why it stands for the syncs
of a step on a GPU).

Measured on this batch (16 ragged rows, packed): 10 reads for a step of one optimizer step, in
any number of micro-batches: the rows' lengths (1, read once and handed to every derived
batch), the metrics (1 transfer), the NaN guard's decision (1), the batch's own mask check
(1) and six reads of row indices (host index tensors, which live on the host on a GPU too);
each further optimizer step adds about 3 (23 for 4). The bound tested is 12 + 4 per further
optimizer step, with room for neither a read per micro-batch (2 → 8 micro-batches adds 6)
nor per row.
"""

from __future__ import annotations

import torch
from builders import ragged_rollouts, tiny_trainer
from host_reads import HostReads

import rlblocks as rb

LOSS = rb.losses.clipped_surrogate


def _reads(**settings) -> HostReads:
    trainer = tiny_trainer(lr=1e-3, **settings)
    ro = ragged_rollouts(16, seed=1, max_response=12)
    advantages = torch.randn(16, generator=torch.Generator().manual_seed(0))
    trainer.step(ro, advantages, loss_fn=LOSS)  # the first step checks the model's packing
    with HostReads() as reads:
        trainer.step(ro, advantages, loss_fn=LOSS)
    return reads


def test_host_reads_do_not_grow_with_micro_batches():
    two = _reads(micro_batch_size=8)
    eight = _reads(micro_batch_size=2)
    by_tokens = _reads(micro_batch_tokens=24)
    assert two.total == eight.total == by_tokens.total, (two.counts, eight.counts)
    assert two.total <= 12, two.counts


def test_host_reads_grow_only_with_optimizer_steps():
    one = _reads(micro_batch_size=2)
    four = _reads(micro_batch_size=2, mini_batch_size=8, epochs=2)  # 4 optimizer steps
    assert four.total <= 12 + 4 * 3, four.counts
    assert four.total > one.total  # a read per optimizer step remains: the NaN guard


def test_the_proxy_sees_a_read_per_micro_batch_when_there_is_one():
    # The counting is live: a read in the micro-batch loop (here, the mask checks of
    # Rollouts.trim without the kept lengths) shows up once per micro-batch.
    ro = ragged_rollouts(16, seed=1)
    with HostReads() as reads:
        for part in ro.split(rows=2):
            fresh = rb.Rollouts(
                **{
                    f: getattr(part, f)
                    for f in (
                        "prompt_ids",
                        "response_ids",
                        "attention_mask",
                        "response_mask",
                        "group_ids",
                    )
                }
            )
            fresh.trim()
    assert reads.total >= 8 * 2
