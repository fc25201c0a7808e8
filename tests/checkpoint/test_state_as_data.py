"""Every `Stateful` block's ``state_dict`` is data: written by `rlblocks.base.statefile` (JSON and
safetensors), read back without unpickling, loaded into a fresh block, it gives the same
``state_dict`` again. The blocks a run checkpoints: the data position, the KL controllers, the
resharder's version, the rollout source's batch sampled ahead, the trainers (the critic; the
policy with its scheduler and random state) and the random generators."""

from __future__ import annotations

import copy

import pytest
import torch
from builders import ragged_rollouts, tiny_engine, tiny_trainer
from resume_helpers import assert_same_state
from toy_tasks import count_prompts

import rlblocks as rb
from rlblocks.base.statefile import read_state, write_state
from rlblocks.run import Drawn
from rlblocks.run.source import RolloutSource


def _drawn(stateful: bool):
    def build():
        batches = rb.data.PromptBatches(count_prompts(), prompts_per_step=3, seed=1, epochs=3)
        return Drawn(batches if stateful else list(batches))

    block = build()
    for _ in range(7):  # into the second epoch
        next(block)
    return block, build


def _kl(adaptive: bool):
    def build():
        if adaptive:
            return rb.losses.AdaptiveKLController(0.05, target=0.01, horizon=100)
        return rb.losses.FixedKLController(0.05)

    block = build()
    block.update(0.3, 16)
    return block, build


def _resharder():
    policy = tiny_trainer()
    engine = tiny_engine(policy, shared=False)
    block = rb.resharder.Resharder()
    block.sync(policy, engine)
    return block, rb.resharder.Resharder


def _source():
    def build():
        policy = tiny_trainer()
        sampling = rb.SamplingParams(max_new_tokens=6)
        batches = rb.data.PromptBatches(count_prompts(), prompts_per_step=2, seed=0)
        engine = tiny_engine(policy, shared=False)
        return RolloutSource(engine, policy, batches, group_size=2, sampling=sampling, staleness=1)

    block = build()
    block.begin(0, remaining=1)
    block.draw()  # batch 1 is sampled ahead, in the background
    assert len(block.state_dict()["ahead"]) == 1
    block.close()
    return block, build


def _critic():
    def build():
        return rb.critic.CriticTrainer(rb.models.tiny(seed=0)[0], lr=1e-2)

    block = build()
    ro = ragged_rollouts(8, seed=2)
    block.step(ro, torch.randn(ro.response_mask.shape), old_values=block.values(ro))
    return block, build


def _policy():
    def build():
        return tiny_trainer(schedule=rb.trainer.schedules.cosine(warmup=2, total=10))

    block = build()
    ro = ragged_rollouts(8, seed=2)
    block.step(ro, torch.randn(8), loss_fn=rb.recipes.defaults.PPO_CLIP)
    return block, build


BLOCKS = {
    "data position (PromptBatches)": lambda: _drawn(True),
    "data position (a list)": lambda: _drawn(False),
    "fixed KL controller": lambda: _kl(False),
    "adaptive KL controller": lambda: _kl(True),
    "resharder version": _resharder,
    "the batch sampled ahead": _source,
    "critic": _critic,
    "policy, scheduler and random state": _policy,
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_a_stateful_blocks_state_round_trips_as_data(tmp_path, name):
    block, build = BLOCKS[name]()
    saved = block.state_dict()
    expected = copy.deepcopy(saved)
    write_state(tmp_path / "state.json", saved)
    fresh = build()
    fresh.load_state_dict(read_state(tmp_path / "state.json"))
    assert_same_state(fresh.state_dict(), expected)
    if hasattr(fresh, "close"):
        fresh.close()


def test_the_random_state_round_trips_as_data(tmp_path):
    torch.manual_seed(5)
    saved = rb.checkpoint.rng_state()
    write_state(tmp_path / "rng.json", saved)
    assert_same_state(read_state(tmp_path / "rng.json"), saved)
