"""After an update and a sync, the engine samples with exactly the trainer's weights."""

import torch
from builders import tiny_engine, tiny_trainer

import rlblocks as rb
from rlblocks.losses import clipped_surrogate
from rlblocks.resharder import Resharder

PROMPTS = ["What is 2 + 3?", "Say hi", "7 times 8"]


def make_pair(shared: bool):
    policy = tiny_trainer()
    return policy, tiny_engine(policy, shared=shared)  # or its own copy of the weights


def train_one_step(policy, engine):
    sampling = rb.SamplingParams(max_new_tokens=6, seed=1)
    ro = engine.generate(PROMPTS, group_size=2, sampling=sampling)
    advantages = torch.linspace(-1, 1, ro.batch_size)  # (b): any non-zero signal moves the weights
    policy.step(ro, advantages, loss_fn=clipped_surrogate)


def engine_vs_trainer(policy, engine):
    """The engine's log-probs (cached decoding) and the trainer's (one uncached pass).

    They differ by float32 rounding only: 4.8e-7 to 9.5e-7 measured (seeds 2-7, 1 and 2
    threads; the logits stay below 2, where a float32 step is 1.2e-7), the same for the shared
    module and a synced copy, so assert_close's defaults (atol 1e-5) hold with 10x to spare. A
    stale copy is 0.45 to 0.57 away.
    """
    ro = engine.generate(
        PROMPTS, group_size=2, sampling=rb.SamplingParams(max_new_tokens=6, seed=2)
    )
    return ro.rollout_logprobs, policy.logprobs(ro), ro.response_mask


def test_shared_module_sync_copies_nothing_and_matches():
    policy, engine = make_pair(shared=True)
    resharder = Resharder()
    train_one_step(policy, engine)
    metrics = resharder.sync(policy, engine)
    assert metrics["sync/bytes"] == 0.0
    assert engine.weights_version == 1 == metrics["sync/version"]
    engine_lp, trainer_lp, mask = engine_vs_trainer(policy, engine)
    torch.testing.assert_close(engine_lp[mask], trainer_lp[mask])


def test_separate_copy_is_synced_and_matches():
    policy, engine = make_pair(shared=False)
    resharder = Resharder()
    train_one_step(policy, engine)
    metrics = resharder.sync(policy, engine)
    n_bytes = sum(p.numel() * p.element_size() for p in policy.model.state_dict().values())
    assert metrics["sync/bytes"] == n_bytes
    # Complete: the step moved every tensor, and every one of the engine's is the trainer's.
    trained = policy.model.state_dict()
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    engine_lp, trainer_lp, mask = engine_vs_trainer(policy, engine)
    torch.testing.assert_close(engine_lp[mask], trainer_lp[mask])
    assert resharder.state_dict() == {"version": 1}


def test_without_sync_the_separate_engine_is_stale():
    # The negative control: the same setup without sync must fail the comparison above.
    policy, engine = make_pair(shared=False)
    train_one_step(policy, engine)
    engine_lp, trainer_lp, mask = engine_vs_trainer(policy, engine)
    assert (engine_lp[mask] - trainer_lp[mask]).abs().max() > 1e-3


def test_buckets_keep_order_and_respect_the_budget():
    # 4-byte float32 scalars of sizes 3, 3, 5, 1 elements with a 32-byte budget:
    # 12 + 12 = 24 <= 32, + 20 = 44 > 32 -> cut; 20 + 4 = 24 -> one more bucket.
    weights = [(name, torch.zeros(n)) for name, n in [("a", 3), ("b", 3), ("c", 5), ("d", 1)]]
    got = [[name for name, _ in bucket] for bucket in rb.resharder.buckets(weights, 32)]
    assert got == [["a", "b"], ["c", "d"]]
    # A tensor over the budget is a bucket of its own.
    got = [[name for name, _ in b] for b in rb.resharder.buckets(weights, 8)]
    assert got == [["a"], ["b"], ["c"], ["d"]]


def test_small_buckets_give_the_same_engine_weights():
    policy, engine = make_pair(shared=False)
    train_one_step(policy, engine)
    metrics = Resharder(bucket_mb=0.01).sync(policy, engine)  # ~10 KB: many buckets
    # embedding, layer 0, layer 1 (each over the ~10 KB budget, layers kept whole), the final
    # norm, the tied lm_head under its own name: 5 buckets.
    assert metrics["sync/buckets"] == 5
    for name, value in policy.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value), name


def test_buckets_never_split_a_layer():
    # Layer 0 is 3 tensors of 4 bytes, layer 1 likewise, then a norm: with a 16-byte budget
    # layer 0 (12 bytes) fits, layer 1 would make 24 -> a new bucket; the norm joins it (16).
    names = [f"model.layers.{i}.{p}" for i in (0, 1) for p in ("q.weight", "k.weight", "v.weight")]
    weights = [(n, torch.zeros(1)) for n in [*names, "model.norm.weight"]]
    got = [[n for n, _ in bucket] for bucket in rb.resharder.buckets(weights, 16)]
    assert got == [names[:3], [*names[3:], "model.norm.weight"]]
    # A layer above the budget stays whole, in a bucket of its own.
    got = [[n for n, _ in bucket] for bucket in rb.resharder.buckets(weights, 4)]
    assert got == [names[:3], names[3:], ["model.norm.weight"]]
