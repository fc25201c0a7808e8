"""PolicyTrainer: scoring, one update against a slow loop, micro-batch invariance, batching.

Models are ``tiny(dtype=torch.float64)`` wherever two updates are compared: a forward over 8 rows
and over 1 row may block the matmuls differently, so they agree only up to rounding; in float64
that noise (~1e-16) is far below the default float64 tolerance (rtol 1e-7), while in float32 it
would sit near the default float32 tolerance and make the comparisons flaky.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from builders import tiny_trainer
from torch.testing import assert_close

from rlblocks.interfaces import PolicyTrainer as PolicyTrainerProtocol
from rlblocks.interfaces import Stateful
from rlblocks.losses import (
    clipped_surrogate,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    token_mean,
)
from rlblocks.models import tiny
from rlblocks.trainer import TrainConfig, warmup_constant


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _inputs(ro, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (b t) advantages and old log-probs off the current policy (so some tokens clip)."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(ro.response_ids.shape, generator=g)
    shift = 0.3 * torch.randn(ro.response_ids.shape, generator=g)
    lp = tiny_trainer(torch.float64, lr=1e-6).logprobs(ro)
    return adv, lp.double() + shift


def test_satisfies_the_protocols():
    trainer = tiny_trainer(lr=1e-6)
    assert isinstance(trainer, PolicyTrainerProtocol) and isinstance(trainer, Stateful)


@pytest.mark.parametrize("split", [{}, {"micro_batch_size": 3}, {"micro_batch_tokens": 12}])
def test_logprobs_match_slow_reference(model32, make_rollouts, slow_logprobs, split):
    ro = make_rollouts(seed=1)
    trainer = tiny_trainer(module=model32, lr=1e-6, temperature=0.8, **split)
    lp, ent = trainer.logprobs(ro, entropy=True)
    assert lp.dtype == ent.dtype == torch.float32 and not lp.requires_grad
    assert_close(lp, slow_logprobs(model32, ro, temperature=0.8).float())
    assert_close(trainer.logprobs(ro), lp)


def _slow_update(model, ro, adv, old, *, lr: float, max_grad_norm: float) -> torch.Tensor:
    """One AdamW step on Σ_rows Σ_tokens clipped_surrogate / N_tokens, one unpadded row at a time.

    Returns the gradient norm before clipping.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    n_tokens = ro.response_mask.sum()
    for i in range(len(ro)):
        prompt = ro.prompt_ids[i][ro.prompt_mask[i]]
        length = int(ro.response_lengths[i])
        response = ro.response_ids[i, :length]
        logits = model(torch.cat([prompt, response])[None]).logits[0]
        picked = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + length], -1)
        lp = picked.gather(-1, response[:, None])[:, 0]
        row = slice(i, i + 1), slice(0, length)
        loss, _ = clipped_surrogate(lp[None], old[row], adv[row], ro.response_mask[row])
        (loss.sum() / n_tokens).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    return norm


def test_step_matches_slow_loop_reference(model64, make_rollouts):
    ro = make_rollouts(seed=2)
    adv, old = _inputs(ro, seed=2)
    trainer = tiny_trainer(module=model64, lr=1e-3, max_grad_norm=1.0)
    before = _weights(model64)
    out = trainer.step(ro.replace(old_logprobs=old), adv, loss_fn=clipped_surrogate)
    assert out["grad_norm"] > 1.0  # the clip was active, so clipping is checked too
    assert out["clip_frac"] > 0  # and some tokens were clipped
    reference = tiny(dtype=torch.float64)[0]
    norm = _slow_update(reference, ro, adv, old, lr=1e-3, max_grad_norm=1.0)
    assert_close(_weights(model64), _weights(reference))
    # Adam's first step is nearly invariant to the gradient's scale: the norm checks the scale.
    assert_close(out["grad_norm"], float(norm))
    assert any(not torch.equal(before[n], p) for n, p in _weights(model64).items())


SPLITS = [{"micro_batch_size": 1}, {"micro_batch_size": 4}, {"micro_batch_tokens": 20}]


@pytest.mark.parametrize("aggregation", [token_mean, seq_mean_token_mean, seq_mean_token_sum_norm])
@pytest.mark.parametrize("batching", [{}, {"mini_batch_size": 4, "epochs": 2}])
def test_micro_batching_does_not_change_the_update(make_rollouts, aggregation, batching):
    ro = make_rollouts(seed=3)
    adv, old = _inputs(ro, seed=3)
    loss = partial(clipped_surrogate, clip=(0.2, 0.28))
    results = []
    for split in [{"micro_batch_size": 8}, *SPLITS]:
        cfg = TrainConfig(lr=1e-2, aggregation=aggregation, log_entropy=True, **batching, **split)
        trainer = tiny_trainer(torch.float64, config=cfg)
        out = trainer.step(ro.replace(old_logprobs=old), adv, loss_fn=loss)
        results.append((_weights(trainer.model), out))
    (weights, out), initial = results[0], _weights(tiny(dtype=torch.float64)[0])
    assert any(not torch.equal(initial[n], w) for n, w in weights.items())
    for other_weights, other_out in results[1:]:
        assert_close(other_weights, weights)
        for key in ("loss", "clip_frac", "approx_kl", "entropy", "grad_norm"):
            assert_close(other_out[key], out[key])


@pytest.mark.parametrize(
    ("mini", "epochs", "expected"), [(None, 3, 3), (8, 1, 1), (5, 1, 2), (3, 2, 6)]
)
def test_optimizer_steps_and_zero_lr(model32, make_rollouts, mini, epochs, expected):
    ro = make_rollouts(seed=4)  # 8 rows: epochs · ⌈8 / mini⌉ optimizer steps
    trainer = tiny_trainer(module=model32, lr=0.0, mini_batch_size=mini, epochs=epochs)
    before = _weights(model32)
    out = trainer.step(ro, torch.randn(8), loss_fn=clipped_surrogate)
    assert out["optimizer_steps"] == expected == trainer.optimizer_steps
    assert trainer.scheduler.last_epoch == expected
    state = trainer.optimizer.state_dict()["state"]
    assert all(float(s["step"]) == expected for s in state.values())
    after = _weights(model32)
    assert all(torch.equal(before[n], after[n]) for n in before)  # lr 0: nothing moves


def test_lr_metric_follows_the_schedule(make_rollouts):
    ro = make_rollouts(seed=5)
    trainer = tiny_trainer(lr=0.1, schedule=warmup_constant(warmup=4), mini_batch_size=4)
    # 2 updates per call; multipliers (k + 1) / 4: call 1 uses 0.25, 0.5; call 2 uses 0.75, 1.
    # The metric is the lr of the last update of the call: 0.1 · 0.5, then 0.1 · 1.
    lrs = [trainer.step(ro, torch.randn(8), loss_fn=clipped_surrogate)["lr"] for _ in range(2)]
    assert_close(lrs, [0.05, 0.1])


def test_old_logprobs_sources(make_rollouts):
    ro = make_rollouts(seed=6)
    lp = tiny_trainer(lr=1e-6).logprobs(ro)
    trainer = tiny_trainer(lr=0.0)
    adv = torch.randn(8)
    # Computed in the step: π_old = π_θ, so log r = 0 and approx_kl = mean(−log r) = 0.
    out = trainer.step(ro, adv, loss_fn=clipped_surrogate)
    assert_close(out["approx_kl"], 0.0)
    assert_close(out["ratio_mean"], 1.0)
    # From extras: old = lp − 1, so log r = 1 on every token: approx_kl = −1, ratio = e.
    # (lp − (lp − 1)) in float32 is 1 up to one ulp of lp (~5e-7): hence atol/rtol 1e-5.
    shifted = ro.replace(old_logprobs=lp - 1.0)
    out = trainer.step(shifted, adv, loss_fn=clipped_surrogate)
    assert_close(out["approx_kl"], -1.0, rtol=0, atol=1e-5)
    assert_close(out["ratio_mean"], math.e, rtol=1e-5, atol=0)
    # The argument wins over the extras: old = lp − 0.5 gives approx_kl = −0.5.
    out = trainer.step(shifted.replace(old_logprobs=lp - 0.5), adv, loss_fn=clipped_surrogate)
    assert_close(out["approx_kl"], -0.5, rtol=0, atol=1e-5)


def test_entropy_is_computed_only_when_asked(make_rollouts):
    # The entropy metric costs a pass over the vocabulary per token: off unless the loss takes
    # it or config.log_entropy asks. Asking changes nothing else in the update.
    ro = make_rollouts(seed=5)
    adv, old = _inputs(ro, seed=5)
    loss = partial(clipped_surrogate, clip=(0.2, 0.28))
    outs, weights = [], []
    for log_entropy in (False, True):
        trainer = tiny_trainer(torch.float64, lr=1e-2, log_entropy=log_entropy)
        outs.append(trainer.step(ro.replace(old_logprobs=old), adv, loss_fn=loss))
        weights.append(_weights(trainer.model))
    assert "entropy" not in outs[0]
    assert outs[1]["entropy"] > 0
    assert_close(weights[0], weights[1], rtol=0, atol=0)
    assert outs[0]["loss"] == outs[1]["loss"]
