"""``Ray(...)`` against ``Local()``: the same GRPO steps give the same numbers on 2 FSDP2 workers.

One local Ray instance and one pool of two workers serve the module (starting them costs
~10 s on 2 cores); tests that break a pool or need another layout build their own.
"""

import copy
import os
import re
from functools import partial
from pathlib import Path

import pytest
import torch
from builders import tiny_trainer
from ray_helpers import LOSS, PROMPTS, grpo_batch, local_blocks, policy_factory
from toy_tasks import run_group_recipe

import rlblocks as rb
from rlblocks.placement import WorkerError

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def placement():
    placement = rb.placement.Ray(workers=2)
    yield placement
    placement.shutdown()


@pytest.fixture(scope="module")
def ray_blocks(placement):
    policy = placement.build("actor", policy_factory())
    engine = placement.build("rollout", rb.rollout.HFEngine.from_pretrained, "tiny", progress=False)
    return policy, engine


def test_grpo_steps_match_local_and_the_engine_gets_identical_weights(ray_blocks):
    # The model is float64 on both sides; the only difference is the order of additions (two
    # partial sums all-reduced instead of one sum), ~1e-16 relative per operation, so the
    # gradient norm and the weights after three AdamW steps agree to 1e-9, while a real error
    # (a normalizer per rank instead of one for the group, averaged instead of summed
    # gradients) moves the gradient norm by >10%. The PPO loss and its metrics are computed in
    # float32 by design (rlblocks.losses.ppo): they agree to float32 rounding, which the
    # cancelling ± advantage terms of a near-zero loss amplify to ~1e-5 relative, hence an
    # absolute 1e-7 on the loss. ratio_max is a per-micro-batch maximum averaged over
    # micro-batches, which depend on the split, so it is not compared.
    ray_policy, ray_engine = ray_blocks
    policy, engine = local_blocks()
    resharder, ray_resharder = rb.resharder.Resharder(), rb.resharder.Resharder(bucket_mb=0.05)
    for step in range(3):
        ro, advantages = grpo_batch(engine, step)  # the local policy samples both batches
        local = policy.step(ro, advantages, loss_fn=LOSS)
        remote = ray_policy.step(ro, advantages, loss_fn=LOSS)
        assert local["optimizer_steps"] == remote["optimizer_steps"] == 3  # 12 rows / 4
        assert remote["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-9)
        assert remote["mismatch/abs_max"] == pytest.approx(local["mismatch/abs_max"], rel=1e-9)
        assert remote["loss"] == pytest.approx(local["loss"], abs=1e-7)
        for key in ("clip_frac", "entropy", "ratio_mean", "approx_kl", "mismatch/abs_mean"):
            assert remote[key] == pytest.approx(local[key], rel=1e-5, abs=1e-7), key
        resharder.sync(policy, engine)
        metrics = ray_resharder.sync(ray_policy, ray_engine)
        assert metrics["sync/version"] == step + 1
    remote_weights = dict(ray_policy.named_weights())
    for name, value in policy.named_weights():
        torch.testing.assert_close(remote_weights[name], value, rtol=1e-9, atol=1e-12)
    engine_weights = ray_engine.model.state_dict()  # rank 0's engine, float32
    for name, value in remote_weights.items():
        assert torch.equal(engine_weights[name], value.float()), name
    # Each of the 2 workers is handed every float64 tensor (8 bytes an element) of the model.
    assert metrics["sync/bytes"] == 2 * 8 * sum(v.numel() for v in engine_weights.values())


def test_engine_and_trainer_agree_after_sync_and_not_before(placement):
    policy = placement.build("actor", policy_factory(torch.float32))
    engine = placement.build("rollout", rb.rollout.HFEngine.from_pretrained, "tiny", progress=False)
    sampling = rb.SamplingParams(max_new_tokens=8, seed=3)
    ro = engine.generate(PROMPTS, group_size=2, sampling=sampling)
    policy.step(ro, torch.linspace(-1, 1, len(ro)), loss_fn=LOSS)
    stale = engine.generate(PROMPTS, group_size=2, sampling=sampling)
    gap = (stale.rollout_logprobs - policy.logprobs(stale))[stale.response_mask].abs().max()
    assert gap > 1e-3  # the negative control: without a sync the engine is behind
    rb.resharder.Resharder().sync(policy, engine)
    engine_weights = engine.model.state_dict()  # rank 0's copy: every tensor, to the bit
    assert all(torch.equal(engine_weights[n], v) for n, v in policy.named_weights())
    fresh = engine.generate(PROMPTS, group_size=2, sampling=sampling)
    gap = (fresh.rollout_logprobs - policy.logprobs(fresh))[fresh.response_mask].abs().max()
    # Identical weights; what is left is float32 rounding between the engine's cached
    # (incremental) attention and the trainer's one uncached forward: 4.8e-7 to 9.5e-7
    # measured here, logits below 2 where a float32 step is 1.2e-7. A stale engine: 0.5-0.8.
    assert gap < 1e-5


def test_a_sync_into_an_engine_of_another_shape_is_refused_untouched(
    placement, ray_blocks, tmp_path
):
    # A 3-layer engine colocated with the 2-layer policy: the driver compares the specs that
    # rank 0 of each side declares before run_with carries any copy; the error is a ValueError
    # here, not a worker's, and the engine keeps its weights. (Built as the free "reward" role:
    # the module's "rollout" engine stays as the other tests expect it.)
    policy, _ = ray_blocks
    folder = rb.models.save_tiny(tmp_path / "three", seed=1, num_hidden_layers=3)
    engine = placement.build("reward", rb.rollout.HFEngine.from_pretrained, str(folder))
    before = engine.model.state_dict()
    with pytest.raises(ValueError, match=r"\(12 missing from the trainer\)"):
        rb.resharder.Resharder().sync(policy, engine)
    after = engine.model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert engine.weights_version == 0


def test_generate_keeps_prompt_order_groups_and_metadata(ray_blocks):
    _, engine = ray_blocks
    metadata = [{"i": i} for i in range(len(PROMPTS))]
    ro = engine.generate(
        PROMPTS, group_size=3, metadata=metadata, sampling=rb.SamplingParams(max_new_tokens=4)
    )
    assert ro.prompts == [p for p in PROMPTS for _ in range(3)]  # 3 prompts on rank 0, 2 on rank 1
    assert ro.group_ids.tolist() == [i for i in range(5) for _ in range(3)]
    assert [m["i"] for m in ro.metadata] == ro.group_ids.tolist()


def test_logprobs_come_back_in_row_order(ray_blocks):
    policy, engine = ray_blocks
    ro = engine.generate(
        PROMPTS, group_size=2, sampling=rb.SamplingParams(max_new_tokens=8, seed=5)
    )
    lengths = ro.attention_mask.sum(-1).tolist()
    assert len(set(lengths)) > 2  # rows of different lengths: the balanced split reorders them
    local = tiny_trainer(torch.float64)
    local.model.load_state_dict(dict(policy.named_weights()))  # the same weights, in this process
    # Public log-probs are float32: both sides round the same float64 numbers (up to padding
    # width), so they agree to an ulp; a row out of place would be off by ~1.
    torch.testing.assert_close(policy.logprobs(ro), local.logprobs(ro), rtol=1e-6, atol=1e-6)
    one_row = ro.select([3])  # fewer rows than workers: rank 1 scores a padding copy
    torch.testing.assert_close(
        policy.logprobs(one_row), local.logprobs(one_row), rtol=1e-6, atol=1e-6
    )


def test_an_error_in_a_worker_names_role_rank_and_traceback(ray_blocks):
    _, engine = ray_blocks
    with pytest.raises(WorkerError) as info:
        engine.generate(["only one prompt: rank 0 gets it"], group_size=0)
    error = info.value
    assert (error.role, error.rank) == ("rollout", 0)
    assert "group_size=0; use group_size >= 1" in str(error)
    assert re.search(r"File \".*rollout/base.py\", line \d+, in generate", error.remote_traceback)
    assert engine.generate(
        ["still usable"], group_size=1, sampling=rb.SamplingParams(max_new_tokens=2)
    )


def test_state_dict_restores_the_next_step_exactly(ray_blocks):
    policy, _ = ray_blocks
    ro, advantages = grpo_batch(rb.rollout.HFEngine.from_pretrained("tiny", progress=False), 7)
    saved = policy.state_dict()
    assert set(saved["model"]) == {n for n, _ in policy.named_weights()} - {"lm_head.weight"}
    first = policy.step(ro, advantages, loss_fn=LOSS)
    after_first = dict(policy.named_weights())
    policy.load_state_dict(saved)
    again = policy.step(ro, advantages, loss_fn=LOSS)
    assert again["loss"] == first["loss"] and again["grad_norm"] == first["grad_norm"]
    for name, value in policy.named_weights():
        assert torch.equal(value, after_first[name]), name


def test_a_state_dict_moves_from_this_process_to_the_workers_and_back(placement):
    # The live swap of notebook 05: a trainer trained here hands its state (weights, AdamW
    # moments keyed by index, schedule, counters) to the same trainer on 2 FSDP2 workers, whose
    # next step is the one this process would take (float64: to 1e-9, as the first test); and
    # the workers' state (keyed by name) comes back into a fresh trainer here.
    policy, engine = local_blocks()
    ro, advantages = grpo_batch(engine, 11)
    policy.step(ro, advantages, loss_fn=LOSS)
    ray_policy = placement.build("actor", policy_factory())
    ray_policy.load_state_dict(copy.deepcopy(policy.state_dict()))
    ro, advantages = grpo_batch(engine, 12)
    here, there = (p.step(ro, advantages, loss_fn=LOSS) for p in (policy, ray_policy))
    assert there["grad_norm"] == pytest.approx(here["grad_norm"], rel=1e-9)
    assert ray_policy.steps == policy.steps == 2
    weights = dict(ray_policy.named_weights())
    for name, value in policy.named_weights():
        torch.testing.assert_close(weights[name], value, rtol=1e-9, atol=1e-9)
    back = policy_factory()()
    back.load_state_dict(ray_policy.state_dict())
    ro, advantages = grpo_batch(engine, 13)
    here, again = (p.step(ro, advantages, loss_fn=LOSS) for p in (policy, back))
    assert again["grad_norm"] == pytest.approx(here["grad_norm"], rel=1e-9)


def test_a_loop_of_forward_backward_and_optim_step_matches_step_locally(placement):
    # Tinker's primitives through the handle: every worker gets each call and takes its share
    # of the chunk; two chunks of 6 rows with the batch's normalizer, then optim_step, twice,
    # against a local step on the whole batch as one mini-batch. Same float64 reasoning as the
    # first test (1e-9 on the gradient norm and the weights, 1e-7 absolute on the loss); the
    # second round's AdamW step uses the first one's moments, so they match too.
    ray_policy = placement.build("actor", policy_factory())  # fresh float64, as `policy`
    policy, engine = local_blocks()
    for step in (20, 21):
        ro, advantages = grpo_batch(engine, step)
        local = policy.step(ro, advantages, loss_fn=LOSS, minibatches=[torch.arange(len(ro))])
        n = ray_policy.normalizer(ro)
        calls = [
            ray_policy.forward_backward(
                ro.select(rows), advantages[rows], loss_fn=LOSS, normalizer=n
            )
            for rows in ([0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11])
        ]
        remote = ray_policy.optim_step()
        assert remote["optimizer_steps"] == local["optimizer_steps"] == 1.0
        assert remote["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-9)
        assert sum(c["loss"] for c in calls) == pytest.approx(local["loss"], abs=1e-7)
    remote_weights = dict(ray_policy.named_weights())
    for name, value in policy.named_weights():
        torch.testing.assert_close(remote_weights[name], value, rtol=1e-9, atol=1e-12)
    with pytest.raises(WorkerError, match="no gradient to apply"):
        ray_policy.optim_step()


def test_a_sharded_critic_fits_like_one_process(placement):
    # PPO's critic on the same two workers as the policy (the "critic" role shares the pool).
    factory = partial(
        rb.critic.CriticTrainer.from_pretrained,
        "tiny",
        dtype=torch.float64,
        lr=1e-3,
        mini_batch_size=4,
        micro_batch_size=3,
    )
    critic, local = placement.build("critic", factory), factory()
    ro, _ = grpo_batch(local_blocks()[1], 11)
    returns = torch.linspace(-1, 1, len(ro))
    torch.testing.assert_close(critic.values(ro), local.values(ro), rtol=1e-6, atol=1e-6)
    for _ in range(2):
        remote, here = critic.step(ro, returns), local.step(ro, returns)
        assert remote["vf_grad_norm"] == pytest.approx(here["vf_grad_norm"], rel=1e-9)
        assert remote["vf_explained_var"] == pytest.approx(here["vf_explained_var"], rel=1e-9)
        assert remote["vf_loss"] == pytest.approx(here["vf_loss"], rel=1e-5)
    torch.testing.assert_close(critic.values(ro), local.values(ro), rtol=1e-6, atol=1e-6)


def test_the_grpo_recipe_learns_on_two_workers(placement):
    # The toy task of tests/recipes/test_grpo.py (share of digits), the recipe unchanged: only
    # the blocks come from the Ray placement. Same bar as in one process.
    policy = placement.build("actor", policy_factory(torch.float32, lr=1e-2, mini_batch_size=None))
    engine = placement.build("rollout", rb.rollout.HFEngine.from_pretrained, "tiny", progress=False)
    history = run_group_recipe(rb.recipes.grpo, policy, engine, steps=30)
    rewards = [h["reward/mean"] for h in history]
    assert sum(rewards[:3]) / 3 < 0.1
    assert sum(rewards[-3:]) / 3 > 0.8, rewards
    assert history[-1]["sync/version"] == 30


def test_one_grpo_step_is_three_round_trips(placement):
    # generate (prompts split over the workers), step (the whole batch to every worker: the
    # trainer takes its share and answers for the group), sync (the resharder's copy, carried
    # into each worker next to its colocated engine). No attribute reads, no sleep/wake calls,
    # no second trip for the metrics: the recipe makes three remote calls a step, plus five per
    # run: reading policy.config (lr, batch sizes) for the run configuration, and the check of
    # the first sync of its resharder (both tokenizers, both weight specs).
    policy = placement.build("actor", policy_factory(torch.float32, mini_batch_size=None))
    engine = placement.build("rollout", rb.rollout.HFEngine.from_pretrained, "tiny", progress=False)
    for steps in (1, 2):
        before = placement.round_trips
        history = run_group_recipe(rb.recipes.grpo, policy, engine, steps=steps)
        assert len(history) == steps
        assert placement.round_trips - before == 3 * steps + 5
    assert history[-1]["optimizer_steps"] == 1.0 and history[-1]["sync/buckets"] >= 1


def test_colocated_workers_sync_through_memory_they_share(ray_blocks):
    # Each worker writes its rows of a bucket into memory both workers map (an in-memory file
    # of rank 0's, rlblocks.trainer.shared_gather) and copies from there into its own engine:
    # no weight crosses gloo's TCP, and a later sync writes into the slabs of the one before
    # (fresh pages fault one by one: that cost is the reason to keep them).
    def slabs(policy, engine) -> list[str]:  # in a worker: the slabs it maps, by inode
        maps = Path("/proc/self/maps").read_text().splitlines()
        return sorted({line.split()[4] for line in maps if "memfd:rlblocks-gather" in line})

    policy, engine = ray_blocks
    resharder = rb.resharder.Resharder(bucket_mb=1)  # whole layers: the default's shape
    resharder.sync(policy, engine)  # maps what the next syncs need (earlier tests' are freed)
    resharder.sync(policy, engine)
    first = policy.run_with(slabs, engine)
    resharder.sync(policy, engine)
    assert first[0], "no shared-memory slab in the worker: the gather went through gloo"
    assert first[0] == first[1]  # both workers map the same files
    assert policy.run_with(slabs, engine) == first
    engine_weights = engine.model.state_dict()  # rank 0's engine, float32
    for name, value in policy.named_weights():
        assert torch.equal(engine_weights[name], value.float()), name


def test_a_missing_attribute_is_an_attribute_error_as_in_one_process(ray_blocks):
    policy, engine = ray_blocks
    assert getattr(engine, "no_such_method", None) is None  # a getattr default works
    with pytest.raises(AttributeError, match="HFEngine"):
        engine.no_such_thing  # noqa: B018
    assert policy.config.lr > 0  # plain attributes still come from rank 0


def test_save_pretrained_through_the_handle_writes_the_gathered_weights(ray_blocks, tmp_path):
    # Dispatch.ALL: both workers call (the weights are all-gathered), rank 0 alone writes, and
    # the folder holds the full weights of the group, those its state_dict gathers too.
    from safetensors.torch import load_file

    ray_policy, _ = ray_blocks
    folder = ray_policy.save_pretrained(tmp_path / "policy")
    assert folder == tmp_path / "policy"
    saved = load_file(folder / "model.safetensors")
    full = ray_policy.state_dict()["model"]
    assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved  # tied
    assert saved.keys() <= full.keys() and len(saved) == 26
    assert all(torch.equal(saved[k], full[k]) for k in saved)


def test_a_teacher_on_its_own_role_scores_rows_in_order_and_drives_distill(placement):
    # On-policy distillation with every block on the placement: the teacher's rows are split
    # over the two workers and come back in order, equal to the same teacher in this process.
    teacher = placement.build("teacher", rb.trainer.Teacher.from_pretrained, "tiny")
    policy = placement.build("actor", policy_factory(torch.float32, mini_batch_size=None))
    engine = placement.build("rollout", rb.rollout.HFEngine.from_pretrained, "tiny", progress=False)
    ro = engine.generate(
        PROMPTS, group_size=2, sampling=rb.SamplingParams(max_new_tokens=8, seed=5)
    )
    local = rb.trainer.Teacher.from_pretrained("tiny")
    torch.testing.assert_close(teacher.logprobs(ro), local.logprobs(ro), rtol=1e-6, atol=1e-6)
    history = rb.recipes.distill(
        policy,
        engine,
        teacher,
        rb.data.PromptBatches(
            rb.data.load_prompts([{"prompt": p} for p in PROMPTS], ground_truth=None),
            prompts_per_step=2,
            seed=0,
        ),
        steps=2,
        group_size=2,
        sampling=rb.SamplingParams(max_new_tokens=6),
        run=rb.run.RunOptions(progress=False),
    )
    # The student starts as the teacher's own weights: the reverse KL is 0 up to the
    # rounding of cached (engine) against uncached (trainer) attention, until the update moves it.
    assert abs(history[0]["distill/reverse_kl"]) < 1e-4
    assert history[-1]["sync/version"] == 2


def test_a_pool_without_gpus_shows_its_workers_none(placement):
    # Ray leaves CUDA_VISIBLE_DEVICES alone in a worker given no GPU: the pool hides the GPUs,
    # so that from_pretrained's default (CUDA when torch sees a GPU) is the CPU there.
    probe = placement.build("ref", rb.models.default_device)  # built in each worker

    def seen(device, _):
        return os.environ.get("CUDA_VISIBLE_DEVICES"), str(device)

    assert probe.run_with(seen, probe) == [("", "cpu"), ("", "cpu")]  # by rank
