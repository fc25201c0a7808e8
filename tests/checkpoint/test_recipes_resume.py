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


def _run(recipe, steps: int, folder, **kw) -> dict:
    torch.manual_seed(0)
    policy = tiny_trainer(reference="auto", mini_batch_size=16)
    engine = tiny_engine(policy)
    history = run_group_recipe(
        recipe,
        policy,
        engine,
        steps=steps,
        run=rb.run.RunOptions(checkpoint=folder, resume="auto"),
        **kw,
    )
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
