"""What a resumed run may change (`rlblocks.run.resume`): honoured from its first step, or
refused by name before it; and a folder whose run never checkpointed a step can be run again.

The lr test derives its expectation from AdamW itself: from one restored state and one batch,
AdamW's update −lr·m̂/(√v̂ + ε) is linear in lr, so the third step of a run resumed with lr/10
must move every weight by a tenth of what the same step moves it in a run resumed with the
saved lr (float64: equal but for rounding, ~1e-16 relative; assert_close's float64 default).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from counting_run import Counter, count
from toy_tasks import count_prompts, digit_fraction, run_group_recipe

import rlblocks as rb
from rlblocks.run.resume import ResumeRefused
from rlblocks.tracking.runlog import read_metrics

LR = 1e-2


def grpo(folder, steps: int, **settings) -> tuple[rb.trainer.PolicyTrainer, list[dict]]:
    """GRPO on the toy task in float64, checkpointing into ``folder`` (resume="auto") and
    tracking into it."""
    torch.manual_seed(0)
    policy = tiny_trainer(torch.float64, **settings)
    with rb.tracking.Tracker(folder) as tracker:
        run = rb.run.RunOptions(checkpoint=folder / "ckpt", resume="auto", tracker=tracker)
        history = run_group_recipe(
            rb.recipes.grpo, policy, tiny_engine(policy), steps=steps, run=run
        )
    return policy, history


def weights(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters()}


def test_a_run_resumed_with_a_lower_lr_trains_at_it_from_its_first_step(tmp_path):
    saved, _ = grpo(tmp_path / "low", 2, lr=LR)
    start = weights(saved)
    shutil.copytree(tmp_path / "low", tmp_path / "same")  # two resumes of one checkpoint
    same, same_history = grpo(tmp_path / "same", 3, lr=LR)  # the control: the saved lr
    with pytest.warns(UserWarning, match=r"in effect from step 2 on: policy_config\.lr 0\.01 ->"):
        low, low_history = grpo(tmp_path / "low", 3, lr=LR / 10)
    assert low.optimizer.param_groups[0]["lr"] == LR / 10  # in effect, not the saved 1e-2
    assert [h["lr"] for h in low_history] == [LR, LR, LR / 10]
    assert same_history[2]["lr"] == LR
    moved, moved_low = weights(same), weights(low)
    assert any((moved[n] - start[n]).abs().max() > 0 for n in start)  # step 3 did something
    for name, w in start.items():
        torch.testing.assert_close(moved_low[name] - w, (moved[name] - w) / 10, msg=name)
    # what the run records is what was in effect: the checkpoint's and the tracker's config
    meta = json.loads((tmp_path / "low" / "ckpt" / "step-00000003" / "meta.json").read_text())
    tracked = json.loads((tmp_path / "low" / "config.json").read_text())
    assert meta["config"]["policy_config"]["lr"] == tracked["policy_config"]["lr"] == LR / 10


def test_a_resumed_ppo_trains_with_the_new_fixed_kl_coef(tmp_path):
    def ppo(steps: int, kl_coef: float) -> list[dict]:
        torch.manual_seed(0)
        policy = tiny_trainer(reference="copy")
        return rb.recipes.ppo(
            policy,
            rb.critic.CriticTrainer(policy.model, lr=1e-3),
            tiny_engine(policy),
            rb.rewards.per_sample(digit_fraction, timeout=None),
            rb.data.PromptBatches(count_prompts(), prompts_per_step=2, seed=0),
            steps=steps,
            group_size=2,
            kl_coef=kl_coef,
            sampling=rb.SamplingParams(max_new_tokens=4),
            run=rb.run.RunOptions(checkpoint=tmp_path, resume="auto", progress=False),
        )

    assert ppo(1, 0.05)[0]["kl/coef"] == 0.05
    with pytest.warns(UserWarning, match=r"kl_coef 0\.05 -> 0\.2"):
        history = ppo(2, 0.2)
    assert [h["kl/coef"] for h in history] == [0.05, 0.2]  # not the saved 0.05 again


def test_what_cannot_be_honoured_is_refused_before_the_first_step(tmp_path):
    count(tmp_path, steps=3, config={"recipe": "grpo"})
    stepped = []

    def resumed(**kw) -> None:
        count(tmp_path, on_step=lambda i, m, r: stepped.append(i), **kw)

    with pytest.raises(ResumeRefused, match=r"of a 'grpo' run, this run is 'remax'; resume it"):
        resumed(steps=5, config={"recipe": "remax"})
    with pytest.raises(ResumeRefused, match=r"after 3 steps, and steps=2 asks for fewer; pass"):
        resumed(steps=2, config={"recipe": "grpo"})
    assert stepped == []
    resumed(steps=4, config={"recipe": "grpo"})  # steps may grow
    assert stepped == [3]


# ---------------------------------------------------------------------- dead folders
def failed_in_first_step(folder) -> None:
    """What a run that raised in its first step leaves in ``folder``: the checkpoint of step 0
    (its initial state), no other."""
    with pytest.raises(RuntimeError, match="step 0 fails"):
        count(folder, steps=3, fail_at=0)
    assert rb.checkpoint.Checkpointer(folder / "checkpoints").steps() == [0]


def test_a_folder_left_by_a_run_that_failed_in_its_first_step_is_run_again(tmp_path):
    for resume in (False, "auto"):
        failed_in_first_step(tmp_path / str(resume))
        assert count(tmp_path / str(resume), steps=3, resume=resume) == [1, 2, 3]
        steps = [r["step"] for r in read_metrics(tmp_path / str(resume) / "metrics.jsonl")]
        assert steps == [0, 1, 2]
    failed_in_first_step(tmp_path / "true")  # resume=True goes on from its step 0
    assert count(tmp_path / "true", steps=3, resume=True) == [1, 2, 3]
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint: nothing to resume"):
        count(tmp_path / "never", steps=3, resume=True)  # no checkpoint at all
    assert count(tmp_path / "never", steps=3, resume=False) == [1, 2, 3]  # as the message says


def test_a_rerun_drops_the_records_of_the_steps_that_were_never_checkpointed(tmp_path):
    with pytest.raises(RuntimeError, match="step 2 fails"):
        count(tmp_path, steps=6, every=5, fail_at=2)  # steps 0 and 1 logged, none saved
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    assert count(tmp_path, steps=3, every=5, resume=False) == [1, 2, 3]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_a_folder_holding_only_the_initial_checkpoint_starts_over(tmp_path):
    # A run that saved its initial state as step 0 and failed in its first step.
    failed_in_first_step(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000000")  # replaced by one that shows:
    initial = Counter()
    initial.n = 100  # not what a new run starts from: a resume would show it
    rb.checkpoint.Checkpointer(tmp_path / "checkpoints").save(0, {"c": initial})
    assert count(tmp_path, steps=2, resume=False) == [1, 2]  # started over, from 0
    assert rb.checkpoint.Checkpointer(tmp_path / "checkpoints").steps() == [1, 2]
