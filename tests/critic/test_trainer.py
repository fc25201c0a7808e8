"""CriticTrainer: the first loss by hand, one update against a slow loop, micro-batch invariance,
the NaN guard, the sources of old values, state round trip.

Updates that are compared use float64 models (see tests/critic/test_value_model.py for why).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.testing import assert_close

from rlblocks.critic import CriticTrainer
from rlblocks.interfaces import Advantages, Stateful
from rlblocks.losses import aggregate, seq_mean_token_mean, token_mean, value_loss
from rlblocks.models import tiny
from rlblocks.trainer import TrainConfig


def _weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _targets(ro, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(ro.response_ids.shape, generator=g)


def test_first_loss_hand_worked(make_rollouts):
    ro = make_rollouts(seed=0)
    # Zero-initialised head: V = V_old = 0, so the clip changes nothing and every valid token
    # has L = ½ (0 − 2)² = 2; the token mean is 2. V_old = 0 explains nothing of R: but R is
    # constant (all 2), so the explained variance is undefined: NaN.
    out = CriticTrainer(tiny()[0], lr=1e-3).step(ro, torch.where(ro.response_mask, 2.0, 0.0))
    assert_close(out["vf_loss"], 2.0)
    assert out["vf_clip_frac"] == 0.0 and out["values_mean"] == 0.0
    assert math.isnan(out["vf_explained_var"])
    # A (b) tensor is broadcast over each row's valid tokens: the same targets, the same loss.
    out = CriticTrainer(tiny()[0], lr=1e-3).step(ro, torch.full((len(ro),), 2.0))
    assert_close(out["vf_loss"], 2.0)
    assert out["vf_optimizer_steps"] == 1.0 and out["vf_skipped_steps"] == 0.0


def test_old_values_sources_and_clipping_hand_worked(make_rollouts):
    ro = make_rollouts(seed=1)
    mask = ro.response_mask
    critic = CriticTrainer(tiny()[0], lr=0.0)  # V = 0 stays 0
    returns = torch.where(mask, 1.0, 0.0)
    far = torch.where(mask, -1.0, 0.0)
    # V_old = −1, ε = 0.2: V_clip = clamp(0, −1.2, −0.8) = −0.8; (V_clip − R)² = 1.8² = 3.24 >
    # (V − R)² = 1, so the clipped term wins on every token: L = ½·3.24 = 1.62, clip frac 1.
    # Old values from the extras:
    out = critic.step(ro.replace(old_values=far), returns)
    assert_close(out["vf_loss"], 1.62)
    assert out["vf_clip_frac"] == 1.0
    # The argument wins over the extras: V_old = 0 = V, no clipping: L = ½·1 = 0.5.
    out = critic.step(ro.replace(old_values=far), returns, old_values=torch.zeros_like(far))
    assert_close(out["vf_loss"], 0.5)
    assert out["vf_clip_frac"] == 0.0
    # clip=None: plain ½ (V − R)² = 0.5 whatever V_old.
    out = critic.step(ro, returns, old_values=far, clip=None)
    assert_close(out["vf_loss"], 0.5)
    # An Advantages tuple: its returns are the targets (not its advantages).
    out = critic.step(ro, Advantages(torch.zeros_like(far), returns), clip=None)
    assert_close(out["vf_loss"], 0.5)


def test_explained_variance_limits(make_rollouts):
    ro = make_rollouts(seed=2)
    returns = _targets(ro, seed=2)
    critic = CriticTrainer(tiny()[0], lr=0.0)
    # V_old = 0: Var(R − 0) = Var(R), EV = 1 − 1 = 0. V_old = R: Var(0) = 0, EV = 1.
    assert_close(critic.step(ro, returns)["vf_explained_var"], 0.0)
    assert_close(critic.step(ro, returns, old_values=returns)["vf_explained_var"], 1.0)


def test_first_loss_matches_value_loss_computed_directly(value_model64, make_rollouts):
    ro = make_rollouts(seed=3)
    vm = value_model64()
    critic = CriticTrainer(vm, lr=1e-3)
    returns = _targets(ro, seed=3)
    old = critic.values(ro) + 0.3 * _targets(ro, seed=4)  # V ≠ V_old: some tokens clip
    with torch.no_grad():
        per_token, metrics = value_loss(vm(ro), old, returns, ro.response_mask, clip=0.2)
    expected = aggregate(per_token, ro.response_mask, mode=token_mean)
    out = critic.step(ro, returns, old_values=old, clip=0.2)
    assert 0 < out["vf_clip_frac"] < 1
    assert_close(out["vf_loss"], float(expected))
    assert_close(out["vf_clip_frac"], float(metrics["vf_clip_frac"]))
    assert_close(out["values_mean"], float(metrics["values_mean"]))


def test_a_few_steps_reduce_the_value_loss(make_rollouts):
    ro = make_rollouts(seed=5)
    returns = _targets(ro, seed=5, scale=0.5)
    critic = CriticTrainer(tiny()[0], lr=3e-3)
    losses = [critic.step(ro, returns)["vf_loss"] for _ in range(15)]
    # Measured: 0.144 at the start (V = 0: ½·mean R²), 0.0048 after 15 steps.
    assert losses[-1] < 0.25 * losses[0], losses


def _slow_update(vm, ro, returns, old, *, lr: float, max_grad_norm: float) -> torch.Tensor:
    """One AdamW step on Σ_tokens clipped value loss / N_tokens, one unpadded row at a time."""
    opt = torch.optim.AdamW(vm.parameters(), lr=lr, weight_decay=0.0)
    n_tokens = ro.response_mask.sum()
    for i in range(len(ro)):
        prompt = ro.prompt_ids[i][ro.prompt_mask[i]]
        length = int(ro.response_lengths[i])
        ids = torch.cat([prompt, ro.response_ids[i, :length]])
        hidden = vm.backbone(ids[None]).last_hidden_state[0]
        v = vm.head(hidden[len(prompt) - 1 : len(prompt) - 1 + length]).squeeze(-1)
        row = slice(i, i + 1), slice(0, length)
        loss, _ = value_loss(v[None], old[row], returns[row], ro.response_mask[row], clip=0.2)
        (loss.sum() / n_tokens).backward()
    norm = torch.nn.utils.clip_grad_norm_(vm.parameters(), max_grad_norm)
    opt.step()
    return norm


def test_step_matches_slow_loop_reference(value_model64, make_rollouts):
    ro = make_rollouts(seed=6)
    returns = _targets(ro, seed=6).double()
    critic = CriticTrainer(value_model64(), lr=1e-3, max_grad_norm=0.5)
    old = critic.values(ro).double() + 0.3 * _targets(ro, seed=7).double()
    out = critic.step(ro, returns, old_values=old)
    assert out["vf_grad_norm"] > 0.5 and out["vf_clip_frac"] > 0  # clipping of both kinds active
    reference = value_model64()
    norm = _slow_update(reference, ro, returns, old, lr=1e-3, max_grad_norm=0.5)
    # The trainer stores the returns as float32 (masked, detached): the reference sees the same.
    assert_close(_weights(critic.model), _weights(reference))
    assert_close(out["vf_grad_norm"], float(norm))


SPLITS = [{"micro_batch_size": 1}, {"micro_batch_size": 4}, {"micro_batch_tokens": 20}]


@pytest.mark.parametrize("aggregation", [token_mean, seq_mean_token_mean])
@pytest.mark.parametrize("batching", [{}, {"mini_batch_size": 4, "epochs": 2}])
def test_micro_batching_does_not_change_the_update(
    value_model64, make_rollouts, aggregation, batching
):
    ro = make_rollouts(seed=8)
    returns = _targets(ro, seed=8)
    old = CriticTrainer(value_model64()).values(ro) + 0.3 * _targets(ro, seed=9)
    results = []
    for split in [{"micro_batch_size": 8}, *SPLITS]:
        config = TrainConfig(lr=1e-2, aggregation=aggregation, **batching, **split)
        critic = CriticTrainer(value_model64(), config=config)
        out = critic.step(ro, returns, old_values=old)
        results.append((_weights(critic.model), out))
    (weights, out), initial = results[0], _weights(value_model64())
    assert all(not torch.equal(initial[n], w) for n, w in weights.items())  # backbone and head
    for other_weights, other_out in results[1:]:
        assert_close(other_weights, weights)
        for key in ("vf_loss", "vf_clip_frac", "values_mean", "vf_grad_norm"):
            assert_close(other_out[key], out[key])


@pytest.mark.parametrize(("mini", "epochs", "expected"), [(None, 2, 2), (3, 2, 6)])
def test_optimizer_steps_and_zero_lr(make_rollouts, mini, epochs, expected):
    ro = make_rollouts(seed=10)  # 8 rows: epochs · ⌈8 / mini⌉ optimizer steps
    critic = CriticTrainer(tiny()[0], lr=0.0, mini_batch_size=mini, epochs=epochs)
    before = _weights(critic.model)
    out = critic.step(ro, _targets(ro))
    assert out["vf_optimizer_steps"] == expected == critic.optimizer_steps
    assert all(torch.equal(before[n], w) for n, w in _weights(critic.model).items())


def _snapshot(critic):
    return _weights(critic.model), copy.deepcopy(critic.optimizer.state_dict())


def _assert_same(critic, snapshot):
    weights, optimizer = snapshot
    for name, p in critic.model.named_parameters():
        assert torch.equal(p, weights[name]), name  # bit-identical
    now = critic.optimizer.state_dict()["state"]
    for key, state in optimizer["state"].items():
        for field, value in state.items():
            assert torch.equal(now[key][field], value), (key, field)
    assert all(p.grad is None for p in critic.model.parameters())


def test_nan_guard_skips_the_update_and_touches_nothing(make_rollouts):
    ro = make_rollouts(seed=11)
    critic = CriticTrainer(tiny()[0], lr=1e-2)
    critic.step(ro, _targets(ro))  # Adam state exists
    before = _snapshot(critic)
    poisoned = _targets(ro).clone()
    poisoned[3, 0] = float("nan")  # a counted token (column 0 always counts)
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"):
        out = critic.step(ro, poisoned)
    _assert_same(critic, before)
    assert out["vf_optimizer_steps"] == 0 and out["vf_skipped_steps"] == 1
    assert math.isnan(out["vf_loss"]) and critic.skipped_steps == 1
    assert critic.scheduler.last_epoch == 1  # the schedule did not advance
    # NaN on a token that does not count is never read: the update goes through.
    masked = _targets(ro).clone()
    masked[~ro.response_mask] = float("nan")
    out = critic.step(ro, masked)
    assert out["vf_optimizer_steps"] == 1 and math.isfinite(out["vf_loss"])


def test_nan_guard_skips_only_the_bad_minibatch(make_rollouts):
    ro = make_rollouts(seed=12)
    critic = CriticTrainer(tiny()[0], lr=1e-2, mini_batch_size=4)
    poisoned = _targets(ro).clone()
    poisoned[5, 0] = float("inf")  # in one of the two mini-batches
    with pytest.warns(RuntimeWarning):
        out = critic.step(ro, poisoned)
    assert out["vf_optimizer_steps"] == 1 and out["vf_skipped_steps"] == 1
    assert math.isfinite(out["vf_loss"]) and math.isfinite(out["vf_grad_norm"])


def test_state_dict_round_trip(make_rollouts):
    first, second = make_rollouts(seed=13), make_rollouts(seed=14)
    critic = CriticTrainer(tiny()[0], lr=1e-2, mini_batch_size=3)
    critic.step(first, _targets(first))
    state = copy.deepcopy(critic.state_dict())
    out = critic.step(second, _targets(second, seed=1))
    restored = CriticTrainer(tiny(seed=7)[0], lr=1e-2, mini_batch_size=3)
    assert isinstance(restored, Stateful)
    restored.load_state_dict(state)
    assert restored.steps == 1 and restored.optimizer_steps == 3
    again = restored.step(second, _targets(second, seed=1))
    assert_close(_weights(restored.model), _weights(critic.model))
    assert_close(again["vf_loss"], out["vf_loss"])
