"""Sampling replay through a run (rlblocks.run.source): a GRPO step on an engine that records
its sampler trains on π_old of the distribution it sampled from (the ``mismatch/*`` metrics
drop to rounding), and an engine that cannot record it is refused at the first step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import count_prompts, digit_fraction

import rlblocks as rb
from rlblocks.rollout import HFEngine


def grpo_step(engine_of, *, replay: bool) -> dict:
    """One GRPO step, top-p 0.8, on an engine with its own copy of the weights (π_old is then
    scored by the trainer, not taken from the engine): its metrics."""
    torch.manual_seed(0)
    policy = tiny_trainer(model_config={"initializer_range": 0.3})  # peaked: top-p cuts a lot
    engine = engine_of(policy)
    (metrics,) = rb.recipes.grpo(
        policy,
        engine,
        rb.rewards.per_sample(digit_fraction, timeout=None),
        rb.data.PromptBatches(count_prompts(), prompts_per_step=4, seed=0),
        steps=1,
        group_size=4,
        sampling=rb.SamplingParams(max_new_tokens=8, top_p=0.8, seed=0, replay=replay),
        run=rb.run.RunOptions(progress=False, old_logprobs="recompute"),
    )
    return metrics


def own_copy(policy) -> HFEngine:
    engine = tiny_engine(policy, shared=False)
    engine.model.load_state_dict(policy.model.state_dict())
    return engine


@dataclasses.dataclass
class ProcessedLogprobsEngine:
    """An engine that reports log-probs of the distribution it sampled from but records no
    sampler: `VLLMEngine` (``processed_logprobs``) before sampling replay, or a user's engine
    written before it. Samples with an `HFEngine`."""

    inner: HFEngine

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompts, *, sampling, **kw):
        processed = dataclasses.replace(sampling, replay=True)
        return self.inner.generate(prompts, sampling=processed, **kw).replace(sampler=None)


def test_replay_brings_the_mismatch_of_a_top_p_run_down_to_rounding():
    """Before: the engine's log-probs are of the truncated distribution, the trainer's of the
    untruncated one (off by the log of the kept mass); after: both of the truncated one."""
    before = grpo_step(lambda policy: ProcessedLogprobsEngine(own_copy(policy)), replay=False)
    after = grpo_step(own_copy, replay=True)
    assert before["mismatch/abs_mean"] > 0.1
    assert after["mismatch/abs_max"] < 1e-4  # float32, cached vs uncached attention


def test_replay_asked_of_an_engine_that_cannot_record_it_is_refused_at_the_first_step():
    with pytest.raises(ValueError, match=r"RolloutSource: SamplingParams\(replay=True\) asked "
                                         r"of a ProcessedLogprobsEngine"):  # fmt: skip
        grpo_step(lambda policy: ProcessedLogprobsEngine(own_copy(policy)), replay=True)
