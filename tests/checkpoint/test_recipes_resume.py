"""ReMax and a one-keyword variant (RLOO) resume like GRPO: a run stopped after a checkpoint
and resumed by new blocks ends as the run that went straight through (in one process here;
tests/checkpoint/test_resume.py kills real processes for GRPO, PPO and DAPO)."""

from __future__ import annotations

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from resume_helpers import assert_identical
from toy_tasks import run_group_recipe

import rlblocks as rb


def _run(recipe, steps: int, folder, on_step=None, **kw) -> dict:
    torch.manual_seed(0)
    policy = tiny_trainer(reference="auto", mini_batch_size=16)
    engine = tiny_engine(policy)
    run = rb.run.RunOptions(checkpoint=folder, resume="auto", on_step=on_step) if folder else None
    history = run_group_recipe(recipe, policy, engine, steps=steps, run=run, **kw)
    return {"history": history, "policy": policy.model.state_dict()}


@pytest.mark.parametrize(
    ("recipe", "kw"),
    [(rb.recipes.remax, {}), (rb.recipes.grpo, {"advantage": rb.advantage.rloo})],
    ids=["remax", "rloo"],
)
def test_a_stopped_run_resumed_by_new_blocks_ends_the_same(recipe, kw, tmp_path):
    straight = _run(recipe, 4, tmp_path / "straight", **kw)
    _run(recipe, 2, tmp_path / "stopped", **kw)  # stops after 2 steps, checkpoint of step 2
    torch.manual_seed(123)  # whatever the process did meanwhile: the checkpoint restores it
    resumed = _run(recipe, 4, tmp_path / "stopped", **kw)
    assert_identical(resumed, straight, steps=4)


class BlowUp(Exception):
    """What a run that fails in its first step raises."""


def _blow_up(index, metrics, rollouts):
    raise BlowUp(f"step {index}")


def test_a_run_resumed_from_its_step_0_checkpoint_ends_the_same(tmp_path):
    """The initial weights are checkpointed (step 0): a run that failed in its first step,
    before the checkpoint of step 1, resumes from there bit for bit; and checkpointing changes
    nothing (an optimizer that took no step is saved as none: reading its state would run a
    zero step on it)."""
    unsaved = _run(rb.recipes.grpo, 3, None)
    straight = _run(rb.recipes.grpo, 3, tmp_path / "straight")
    assert_identical(straight, unsaved, steps=3)
    with pytest.raises(BlowUp, match="step 0"):
        _run(rb.recipes.grpo, 3, tmp_path / "failed", on_step=_blow_up)
    assert rb.checkpoint.Checkpointer(tmp_path / "failed").steps() == [0]
    torch.manual_seed(123)  # whatever the process did meanwhile: the checkpoint restores it
    resumed = _run(rb.recipes.grpo, 3, tmp_path / "failed")
    assert_identical(resumed, unsaved, steps=3)
