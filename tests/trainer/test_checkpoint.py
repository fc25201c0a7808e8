"""A trainer's checkpoint (`rlblocks.trainer.checkpoint`) across data-parallel sizes.

A policy (float32, KL to its reference) and a critic are trained one step on 2 FSDP2 ranks
(gloo, spawned: tests/dp_cases.py) and checkpointed; the step after is taken straight on, and
again by fresh trainers that load the checkpoint on 2 ranks and in 1 process. A checkpoint
saved in 1 process is loaded on 2 ranks the same way. DCP reshards the optimizer state (keyed
by parameter name) from DTensor shards into whole tensors and back; the weights come from the
Hugging Face folder (the policy) or from DCP (the critic).

**Tolerance.** Loaded on the same number of ranks, the next step repeats every floating-point
operation: identical bits. Loaded on another number, the trainer starts from the same bits
(resharding is copying) and only the order of float32 additions changes: on 2 ranks each
gradient element is two partial sums added by FSDP's reduce-scatter, in 1 process one sum, which
differ by rounding, ~2⁻²⁴ ≈ 6e-8 relative to the magnitudes added. AdamW divides the first
moment by the root of the second, so its update does not depend on the gradient's scale: a
gradient element off by a relative r moves its update by about r·lr, ~1e-7·lr for most elements
(more only where the gradient nearly cancels, and those weigh little in a norm). Over the one
step (4 AdamW updates) the two trainers end ~1e-6 of the distance they travelled apart
(measured: 1.2e-6 to 2e-6), and the float32 metrics agree to ~1e-6 relative; both are asked to
1e-3, a thousandfold margin. A resume that lost AdamW's moments (its first update then moves
every weight by ±lr, as a first step does) ends about as far away as the travel itself
(measured: 0.9 to 1.2): the negative control below asks for more than 0.1.
"""

from __future__ import annotations

import pytest
import torch
from dp_cases import CHECKPOINTED, make_critic, make_trainer, run, train
from resume_helpers import assert_travelled_alike, gap_over_travel, untimed

REL = 1e-3  # the module docstring's tolerance
MAKE = {"policy": lambda: make_trainer(torch.float32, **CHECKPOINTED), "critic": make_critic}


def assert_same_step(got: dict, want: dict) -> None:
    assert untimed([got["metrics"]]) == untimed([want["metrics"]])
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), name


def assert_close_step(got: dict, want: dict, start: dict) -> None:
    assert_travelled_alike(got["weights"], want["weights"], start, rel=REL)
    got_metrics, want_metrics = untimed([got["metrics"]])[0], untimed([want["metrics"]])[0]
    assert got_metrics.keys() == want_metrics.keys()
    for key in want_metrics.keys() - {"ratio_max"}:  # a maximum per micro-batch: split-dependent
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=REL), key


@pytest.mark.parametrize("kind", ["policy", "critic"])
def test_a_checkpoint_moves_between_one_and_two_ranks(tmp_path, monkeypatch, kind):
    make = MAKE[kind]
    single = make()  # a checkpoint from one process, for the 2 ranks to load
    from_single = train(single, 1)["weights"]
    (tmp_path / "single").mkdir()
    single.save_checkpoint(tmp_path / "single")
    single_next = train(single, 2)
    monkeypatch.setenv("RLBLOCKS_CHECKPOINT_DIR", str(tmp_path))
    sharded = run(f"{kind}_checkpoint", str(tmp_path / "out.pt"))
    saved = sharded["saved"]["weights"]
    assert_same_step(sharded["resumed"], sharded["straight"])  # 2 -> 2
    one = make()
    one.load_checkpoint(tmp_path / "saved")
    assert_close_step(train(one, 2), sharded["straight"], saved)  # 2 -> 1
    assert_close_step(sharded["from_one"], single_next, from_single)  # 1 -> 2
    # The negative control: the weights restored but AdamW's moments lost.
    lost = make()
    lost.load_checkpoint(tmp_path / "saved")
    lost.rebuild_optimizer()
    lost_next = train(lost, 2)["weights"]
    assert gap_over_travel(lost_next, sharded["straight"]["weights"], saved) > 100 * REL
