"""Where rollouts and π_old come from (rlblocks.run.source), for every RL recipe on the tiny
model: staleness 0 in the background thread is the synchronous run bit for bit, staleness 1
trains each batch on weights one update newer than those that sampled it, learns, resumes
exactly, and refuses an engine sharing the model; π_old follows ``RunOptions.old_logprobs``."""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from resume_helpers import assert_identical, untimed
from toy_tasks import count_prompts, digit_examples, digit_fraction, run_group_recipe

import rlblocks as rb
from rlblocks.run import Clock, RunOptions
from rlblocks.run.source import RolloutSource
from rlblocks.trainer.forward import score_responses

REWARD = rb.rewards.per_sample(digit_fraction, timeout=None)
MISMATCH = ("abs_mean", "abs_max", "kl", "ratio_mean", "outside")
SAMPLING = rb.SamplingParams(max_new_tokens=8)


def _blocks(engine_kind: str, lr: float = 1e-2, reference=None):
    torch.manual_seed(0)
    policy = tiny_trainer(lr=lr, reference=reference)
    # "copy": its own copy of the weights, synced by the resharder after every update
    return policy, tiny_engine(policy, shared=engine_kind == "shared")


def _run(engine_kind: str, steps: int, *, lr: float = 1e-2, run=None, **kw) -> dict:
    policy, engine = _blocks(engine_kind, lr)
    history = run_group_recipe(rb.recipes.grpo, policy, engine, steps=steps, run=run, **kw)
    return {"history": history, "policy": policy.model.state_dict()}


def _weights(policy_or_model):
    return {n: p.detach().clone() for n, p in policy_or_model.state_dict().items()}


@pytest.fixture(scope="module")
def teacher():
    """A teacher for distillation: the tiny model taught digits by a few SFT steps."""
    policy = tiny_trainer()
    train = digit_examples(policy.tokenizer, 0, 8)
    rb.recipes.sft(policy, [train] * 5, steps=5, run=RunOptions(progress=False))
    return rb.trainer.Teacher(policy.model, tokenizer=policy.tokenizer)


def _recipe(name: str, run: RunOptions, teacher=None, steps: int = 3) -> dict:
    """Every RL recipe on the tiny model and the digit task, its engine on its own copy of the
    weights; the history and the final weights."""
    policy, engine = _blocks("copy", reference="copy")
    batches = rb.data.PromptBatches(count_prompts(), prompts_per_step=4, seed=0)
    run = dataclasses.replace(run, progress=False)
    common = {"steps": steps, "sampling": SAMPLING, "run": run}
    if name == "ppo":
        critic = rb.critic.CriticTrainer(copy.deepcopy(engine.model), lr=1e-3)
        history = rb.recipes.ppo(policy, critic, engine, REWARD, batches, group_size=2, **common)
    elif name == "distill":
        history = rb.recipes.distill(policy, engine, teacher, batches, group_size=2, **common)
    elif name == "online_dpo":
        history = rb.recipes.online_dpo(policy, engine, REWARD, batches, **common)
    elif name == "dapo":
        history = rb.recipes.dapo(policy, engine, REWARD, batches, group_size=4, **common)
    else:
        recipe = {"grpo": rb.recipes.grpo, "remax": rb.recipes.remax}[name]
        history = recipe(policy, engine, REWARD, batches, group_size=2, **common)
    return {"history": history, "policy": policy.model.state_dict()}


RL_RECIPES = ["grpo", "ppo", "dapo", "remax", "distill", "online_dpo"]


# ---------------------------------------------------------------------- every RL recipe
@pytest.mark.parametrize("name", RL_RECIPES)
def test_every_recipe_at_staleness_zero_through_the_source_is_its_synchronous_run(name, teacher):
    # The same batches, sampled in the background thread but only after each sync: every
    # metric (timings aside) and every weight equal the synchronous run's.
    sync = _recipe(name, RunOptions(), teacher)
    background = _recipe(name, RunOptions(background=True), teacher)
    for h in background["history"]:
        assert h.pop("async/staleness") == h.pop("async/staleness_max") == 0.0
        assert h.pop("async/dropped_rows") == 0.0
        assert h.pop("async/sample_seconds") > 0
    assert_identical(background, sync, steps=3)


@pytest.mark.parametrize("name", RL_RECIPES)
def test_every_recipe_runs_one_step_off(name, teacher):
    history = _recipe(name, RunOptions(staleness=1), teacher)["history"]
    assert len(history) == 3
    assert history[0]["async/staleness"] == 0.0  # the first batch: nothing was sampled ahead
    if name == "dapo":  # a refill round is sampled in the step, by this update's weights
        assert all(0.0 <= h["async/staleness"] <= 1.0 for h in history)
        assert sum(h["async/staleness"] for h in history[1:]) > 0
    else:
        assert [h["async/staleness"] for h in history[1:]] == [1.0, 1.0]


def test_dapo_refill_rounds_one_step_off_are_sampled_by_the_current_weights():
    # 4 groups wanted, 2 prompts a batch: every step needs at least two rounds. The first was
    # sampled during the last update (staleness 1), the refills in the step (staleness 0):
    # with equal rounds, the step's mean staleness is at most 1/2.
    policy, engine = _blocks("copy")
    history = rb.recipes.dapo(
        policy,
        engine,
        REWARD,
        rb.data.PromptBatches(count_prompts(), prompts_per_step=2, seed=0),
        steps=3,
        group_size=4,
        groups_per_step=4,
        sampling=SAMPLING,
        run=RunOptions(staleness=1, progress=False),
    )
    for h in history[1:]:
        rounds = h["sampling/rounds"]
        assert rounds >= 2
        assert h["async/staleness"] == pytest.approx(1 / rounds), h
    # the kept rows mix both: the trainer reports the mismatch of each staleness apart
    assert any({"mismatch/s0/kl", "mismatch/s1/kl"} <= h.keys() for h in history[1:])


# ---------------------------------------------------------------------- GRPO in detail
@pytest.mark.parametrize("engine_kind", ["shared", "copy"])
@pytest.mark.parametrize("old_logprobs", ["auto", "recompute", "rollout"])
def test_staleness_zero_is_the_synchronous_loop_bit_for_bit(engine_kind, old_logprobs):
    sync = _run(engine_kind, 3, run=RunOptions(old_logprobs=old_logprobs))
    run = RunOptions(background=True, old_logprobs=old_logprobs)
    background = _run(engine_kind, 3, run=run)
    for h in background["history"]:
        assert h.pop("async/staleness") == h.pop("async/staleness_max") == 0.0
        assert h.pop("async/dropped_rows") == 0.0
        assert h.pop("async/sample_seconds") > 0
    assert_identical(background, sync, steps=3)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_staleness_k_trains_each_batch_on_weights_k_updates_newer_than_its_sampler(k):
    # Record the weights before each update; the rollouts of step t must carry the log-probs
    # of the weights before update max(0, t - k) (the engine's, synced after step t - k - 1),
    # rather than those before update t, which the trainer holds when it trains on them, and
    # be stamped with that version and staleness.
    steps = k + 2
    snapshots, batches = [], []
    policy, engine = _blocks("copy")
    snapshots.append(_weights(policy.model))

    def keep(step, metrics, rollouts):
        snapshots.append(_weights(policy.model))  # after update `step`
        batches.append(rollouts)

    run = RunOptions(on_step=keep, staleness=k)
    history = run_group_recipe(rb.recipes.grpo, policy, engine, steps=steps, run=run)
    expected = [min(t, k) for t in range(steps)]
    assert [h["async/staleness"] for h in history] == expected
    assert [h["async/staleness_max"] for h in history] == expected
    assert [h["async/dropped_rows"] for h in history] == [0.0] * steps
    # the trainer's mismatch (π_old recomputed against the engine's log-probs) by staleness
    assert not any(key.startswith("mismatch/s") for key in history[0])  # nothing stale yet
    for t in range(1, steps):
        group = {k: v for k, v in history[t].items() if k.startswith("mismatch/s")}
        assert group.keys() == {f"mismatch/s{min(t, k)}/{m}" for m in MISMATCH}, t
        assert group[f"mismatch/s{min(t, k)}/kl"] == history[t]["mismatch/kl"] > 0
    for t, ro in enumerate(batches):
        assert ro.policy_version.tolist() == [max(0, t - k)] * len(ro), t
        assert ro.staleness.tolist() == [min(t, k)] * len(ro), t
    model = copy.deepcopy(policy.model)
    for t in (k, k + 1):  # the first steps past the start-up, where the two differ
        ro = batches[t]
        real = ro.response_attention_mask
        gaps = []
        for before in (t - k, t):  # sampled by θ before update t-k, trained from θ before t
            model.load_state_dict(snapshots[before])
            with torch.no_grad():
                lp, _ = score_responses(model, ro, chunk_size=64)
            gaps.append((lp[real] - ro.rollout_logprobs[real]).abs().max().item())
        # Cached against uncached attention rounds the log-probs by ~1e-6 in float32
        # (measured: 4.8e-7); one update at lr 1e-2 moves them by ~1 (measured: 0.79, 1.0).
        assert gaps[0] < 1e-5 and gaps[1] > 0.1, (t, gaps)


def test_nothing_is_sampled_that_no_step_trains_on():
    # Three steps at staleness 5: three batches drawn from the data, no more; the data
    # position after the run is where a synchronous run of three steps leaves it.
    policy, engine = _blocks("copy")
    batches = rb.data.PromptBatches(count_prompts(), prompts_per_step=4, seed=0)
    drawn = []
    source = RolloutSource(
        engine,
        policy,
        (drawn.append(b) or b for b in batches),
        RunOptions(staleness=5),
        group_size=2,
        sampling=SAMPLING,
    )
    for index in range(3):
        source.begin(index, remaining=2 - index)
        source.draw(Clock())
        source.sync(Clock())
    source.close()
    assert len(drawn) == 3


def test_rows_older_than_the_bound_are_dropped_counted_and_never_trained_on(tmp_path):
    # A run at staleness 3 is stopped after step 2 with batches 3, 4, 5 sampled ahead (by the
    # weights of steps 0, 1, 2); resumed at staleness 1, batches 3 and 4 are 3 and 2 updates
    # old: dropped (counted, warned), and step 3 trains on batch 5 (1 update old).
    def stop(step, metrics, rollouts):
        if step == 2:
            raise StopIteration

    folder = tmp_path / "run"
    _run("copy", 6, run=RunOptions(staleness=3, checkpoint=folder, on_step=stop))
    seen = []

    def keep(step, metrics, rollouts):
        seen.append((step, rollouts.policy_version.tolist(), rollouts.staleness.tolist()))

    with pytest.warns(UserWarning, match=r"RolloutSource: dropped 32 rows sampled by weight"):
        resumed = _run(
            "copy", 4, run=RunOptions(staleness=1, checkpoint=folder, resume=True, on_step=keep)
        )["history"]
    rows = len(seen[0][1])
    assert seen == [(3, [2] * rows, [1] * rows)]
    assert resumed[3]["async/dropped_rows"] == 64.0  # two batches of 4 prompts x 8 samples
    assert resumed[3]["async/staleness"] == 1.0


def test_staleness_one_learns_the_toy_task():
    # The task of tests/recipes/test_grpo.py (a random tiny model writes ~2% digits); one
    # update stale, π_old recomputed, the reward still climbs far past where lr 0 stays (< 0.1).
    history = _run("copy", 30, run=RunOptions(staleness=1))["history"]
    rewards = [h["reward/mean"] for h in history]
    assert sum(rewards[-3:]) / 3 > 0.8, rewards


def test_an_engine_sharing_the_model_is_refused_one_step_off():
    with pytest.raises(ValueError, match="needs an engine with its own copy|own copy of the"):
        _run("shared", 1, run=RunOptions(staleness=1))


def test_bad_settings_are_refused_naming_the_block_and_the_way_out():
    with pytest.raises(ValueError, match=r"RunOptions.staleness: -1 is negative; pass 0"):
        RunOptions(staleness=-1)
    with pytest.raises(TypeError, match=r"RunOptions.staleness: 1.5 is not a whole number"):
        RunOptions(staleness=1.5)
    with pytest.raises(ValueError, match=r"RunOptions.old_logprobs: 'engine' is not"):
        RunOptions(old_logprobs="engine")
    with pytest.raises(ValueError, match=r"RunOptions.resume: resume=True has no folder"):
        RunOptions(resume=True)


@pytest.mark.parametrize(
    ("keyword", "value", "where"),
    [
        ("progress", False, r"run=rb.run.RunOptions\(progress=...\)"),
        ("async_rollout", None, r"run=rb.run.RunOptions\(staleness=1"),
        ("reuse_rollout_logprobs", True, r"run=rb.run.RunOptions\(old_logprobs='rollout' or"),
        ("resharder", None, r"run=rb.run.RunOptions\(resharder=...\)"),
    ],
)
def test_the_old_keywords_fail_naming_their_new_place(keyword, value, where):
    policy, engine = _blocks("shared")
    with pytest.raises(TypeError, match=rf"grpo: {keyword}= is no longer a keyword; use {where}"):
        rb.recipes.grpo(policy, engine, REWARD, [], steps=1, **{keyword: value})
    with pytest.raises(AttributeError, match=r"OneStepOff: moved; use rb.run.RunOptions"):
        rb.recipes.OneStepOff  # noqa: B018


def test_the_resharder_of_run_options_moves_the_weights_and_none_means_a_new_one():
    # How the new weights reach the engine is the run's choice: RunOptions(resharder=...). A
    # resharder with 1 KiB buckets splits the tiny model's tensors into many buckets (one per
    # tensor at most, never splitting one); the default's 256 MiB hold them all in one.
    small = rb.resharder.Resharder(bucket_mb=1 / 1024)
    synced = {}
    for name, resharder in (("small", small), ("default", None)):
        run = RunOptions(progress=False, resharder=resharder)
        synced[name] = _run("copy", 2, run=run)["history"]
    tensors = len(tiny_trainer().model.state_dict())
    assert [m["sync/buckets"] for m in synced["default"]] == [1.0, 1.0]
    assert all(1 < m["sync/buckets"] <= tensors for m in synced["small"])
    assert small.version == 2  # the run's own object did the two syncs
    assert [m["sync/bytes"] for m in synced["small"]] == [
        m["sync/bytes"] for m in synced["default"]
    ]


def test_a_stopped_async_run_resumes_on_the_batch_it_had_sampled_ahead(tmp_path):
    # The checkpoint after step 2 holds batch 3, sampled during step 2 by the weights before
    # update 2; the resumed run trains on it and ends as the run that went straight through.
    def stop_after_two(step, metrics, rollouts):
        if step == 1:  # killed after step 2's checkpoint, batch 3 sampled ahead
            raise StopIteration

    def options(folder, **kw):
        return RunOptions(staleness=1, checkpoint=tmp_path / folder, **kw)

    straight = _run("copy", 4, run=options("a", resume="auto"))
    _run("copy", 4, run=options("b", on_step=stop_after_two))
    torch.manual_seed(123)  # whatever happened meanwhile: the checkpoint restores it
    resumed = _run("copy", 4, run=options("b", resume="auto"))
    assert_identical(resumed, straight, steps=4)
    assert untimed(resumed["history"])[2]["async/staleness"] == 1.0


# ---------------------------------------------------------------------- PPO and π_old
def _ppo(steps: int, run: RunOptions) -> dict:
    return _recipe("ppo", run, steps=steps)


def test_ppo_one_step_off_takes_pi_old_from_the_engine_or_recomputes_it():
    ahead = _ppo(3, RunOptions(staleness=1, old_logprobs="rollout"))["history"]
    assert [h["async/staleness"] for h in ahead] == [0.0, 1.0, 1.0]
    # π_old is the engine's log-probs (nothing scored): no gap between the two; recomputed
    # on a batch sampled by the older weights, it shows one.
    assert all(h["mismatch/abs_max"] == 0.0 for h in ahead)
    recomputed = _ppo(2, RunOptions(staleness=1))["history"]
    assert recomputed[1]["mismatch/abs_max"] > 0.1


# ---------------------------------------------------------------------- the correction
def _correction_run(run: RunOptions, **kw) -> list[dict]:
    return _run("copy", 2, run=run, **kw)["history"]


def test_auto_masks_stale_tokens_only_when_pi_old_is_recomputed_k_steps_off():
    # staleness 1, π_old recomputed: the loss is wrapped in IcePop's mask (mis/*)
    assert all("mis/masked_frac" in h for h in _correction_run(RunOptions(staleness=1)))
    # synchronous, or π_old the engine's, or correction=None: the loss as given
    for run in (
        RunOptions(),
        RunOptions(staleness=1, old_logprobs="rollout"),
        RunOptions(staleness=1, correction=None),
    ):
        assert not any(k.startswith("mis/") for h in _correction_run(run) for k in h), run
    # a loss that already is a correction is not wrapped again
    tis = rb.losses.TruncatedIS(rb.recipes.defaults.PPO_CLIP, cap=2.0)
    history = _correction_run(RunOptions(staleness=1), loss_fn=tis)
    assert all("tis/weight_mean" in h and "mis/weight_mean" not in h for h in history)


def test_a_given_correction_applies_at_every_staleness():
    run = RunOptions(correction=partial(rb.losses.TruncatedIS, cap=1.5))
    history = _correction_run(run)
    assert all(h["tis/capped_frac"] >= 0 for h in history)


def _no_weights(logprobs, old_logprobs, advantages, mask, /):
    """A policy loss that takes no importance weights."""
    return -(logprobs - old_logprobs).exp() * advantages * mask, {}


def test_a_loss_without_is_weights_is_refused_or_warned_about_by_name():
    with pytest.warns(UserWarning, match=r"the loss _no_weights takes no is_weights"):
        history = _correction_run(RunOptions(staleness=1), loss_fn=_no_weights)
    assert len(history) == 2  # trained, uncorrected, as the warning says
    given = RunOptions(staleness=1, correction=partial(rb.losses.MaskedIS))
    with pytest.raises(ValueError, match=r"RolloutSource: .* but _no_weights takes no is_weights"):
        _correction_run(given, loss_fn=_no_weights)


def test_bad_corrections_are_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"RunOptions.correction: 'icepop' is not a correction"):
        RunOptions(correction="icepop")
    with pytest.raises(ValueError, match=r"RunOptions.correction: .* old_logprobs='rollout'"):
        RunOptions(correction=partial(rb.losses.TruncatedIS), old_logprobs="rollout")
