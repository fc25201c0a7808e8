"""A sync into an engine of narrower range (float16) names an overflowing cast as the cast, with
real engines: the tiny policy in float32 after a real update, HFEngines in float32, float16 and
bfloat16 around copies of it, and the real Resharder between them."""

from __future__ import annotations

import copy

import pytest
import torch
from builders import tiny_engine, tiny_trainer

import rlblocks as rb

SAMPLING = rb.SamplingParams(max_new_tokens=4)


def engine_copy(policy, dtype: torch.dtype) -> rb.rollout.HFEngine:
    """An HFEngine around the policy's model copied into ``dtype``."""
    return rb.rollout.HFEngine(
        copy.deepcopy(policy.model).to(dtype), policy.tokenizer, progress=False
    )


def test_a_sync_whose_float16_cast_overflows_is_refused_naming_the_cast():
    torch.manual_seed(0)
    policy = tiny_trainer(lr=1e5)
    engines = {dtype: engine_copy(policy, dtype) for dtype in (torch.float32, torch.bfloat16,
                                                              torch.float16)}  # fmt: skip
    resharder = rb.resharder.Resharder()
    resharder.sync(policy, engines[torch.float16])  # the initial weights fit: no false alarm
    ro = tiny_engine(policy).generate(["Count: 1"], group_size=4, sampling=SAMPLING)
    metrics = policy.step(ro, torch.tensor([1.0, -1.0, 1.0, -1.0]),
                          loss_fn=rb.recipes.defaults.PPO_CLIP)  # fmt: skip
    assert metrics["optimizer_steps"] == 1.0  # a finite update (Adam: each weight moves ~lr)
    peak = max(p.detach().abs().max().item() for p in policy.model.parameters())
    assert 65504 < peak < 2e5  # past float16's largest, finite in float32
    # The trainer's weights are fine: float32 and bfloat16 copies take them and sample.
    for dtype in (torch.float32, torch.bfloat16):
        resharder.sync(policy, engines[dtype])
        engines[dtype].generate(["Count: 1"], group_size=4, sampling=SAMPLING)
    # Before: this sync wrote inf into the float16 engine without a word, and its next
    # generate failed saying the scores were not finite, "lower lr".
    half = engines[torch.float16]
    before = {k: v.clone() for k, v in half.model.state_dict().items()}
    with pytest.raises(FloatingPointError, match=r"^HFEngine.update_weights: the trainer's "
                       r"weight 'model.embed_tokens.weight' holds values up to \|x\| = 1\d{5}(\.\d+)?, "
                       r"beyond float16's largest \(65504\): cast into the engine it would become "
                       r"inf.*nothing of this call was copied. Keep the engine in bfloat16 or "
                       r"float32"):  # fmt: skip
        resharder.sync(policy, half)
    after = half.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # untouched


def test_the_float16_boundary_hand_worked():
    from rlblocks.rollout.casting import check_cast, narrows  # new: the file runs on older code

    # float16's largest is 65504 = (2 − 2⁻¹⁰)·2¹⁵; its spacing there is 32, so a value rounds to
    # 65504 below the midpoint 65520 and to inf from it (round half to even: 65536 = inf).
    to_half = {"w": torch.float16}
    check_cast([("w", torch.tensor([65519.0, -3.0]))], to_half, owner="E")  # lands as 65504
    with pytest.raises(FloatingPointError, match=r"^E: the trainer's weight 'w' holds values up "
                       r"to \|x\| = 65520, beyond float16's largest \(65504\)"):  # fmt: skip
        check_cast([("w", torch.tensor([65520.0, 1.0]))], to_half, owner="E")
    with pytest.raises(FloatingPointError, match=r"up to \|x\| = 70000,"):  # the magnitude: −
        check_cast([("w", torch.tensor([[1.0, -70000.0]]))], to_half, owner="E")
    with pytest.raises(FloatingPointError, match=r"^E: the trainer's weight 'w' is not finite "
                       r"already \(max \|value\| = nan\), before any cast"):  # fmt: skip
        check_cast([("w", torch.tensor([1.0, float("nan")]))], to_half, owner="E")
    # The first offending tensor is named; names without an engine dtype are not checked.
    weights = [("a", torch.ones(2)), ("b", torch.full((2,), 1e6)), ("c", torch.full((2,), 1e9))]
    with pytest.raises(FloatingPointError, match=r"weight 'b' holds values up to \|x\| = 1e\+06"):
        check_cast(weights, dict.fromkeys("abc", torch.float16), owner="E")
    check_cast(weights, {"a": torch.float16}, owner="E")
    # Only a narrower exponent range is checked: bfloat16 has float32's (8 exponent bits).
    assert narrows(torch.float32, torch.float16) and narrows(torch.bfloat16, torch.float16)
    assert not narrows(torch.float32, torch.bfloat16) and not narrows(torch.float16, torch.float32)
    assert not narrows(torch.int64, torch.float16)
