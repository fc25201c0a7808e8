"""Tinker's primitives: ``forward_backward`` × k, then ``optim_step``, is ``step`` on the batch.

float64 models (see tests/trainer/test_policy.py): the chunked and the whole-batch runs differ
only in the order of the gradient's additions (~1e-16 relative), far inside the default float64
tolerance, while a normalizer per chunk instead of the batch's changes the gradient by ~10%.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from builders import tiny_trainer
from torch.testing import assert_close

from rlblocks.losses import clipped_surrogate, kl_regularized

# PPO's clipped surrogate plus a k3 KL penalty: the reference path runs as in ``step``.
LOSS = kl_regularized(partial(clipped_surrogate, clip=(0.2, 0.28)), kl_coef=0.1)
CHUNKS = [[0, 1, 2], [3, 4], [5, 6, 7]]  # of a batch of 8 rows


SETTINGS = {"reference": "copy", "log_entropy": True, "micro_batch_size": 2}


def _trainers():
    """Two trainers with the same weights: one takes ``step``, one Tinker's primitives."""
    return tiny_trainer(torch.float64, **SETTINGS), tiny_trainer(torch.float64, **SETTINGS)


def _advantages(ro, seed):
    return torch.randn(len(ro), generator=torch.Generator().manual_seed(seed))


def _tinker_round(policy, ro, advantages, *, normalizer="batch"):
    n = policy.normalizer(ro) if normalizer == "batch" else None
    calls = [
        policy.forward_backward(ro.select(rows), advantages[rows], loss_fn=LOSS, normalizer=n)
        for rows in CHUNKS
    ]
    return calls, policy.optim_step()


def _assert_same_state(a, b):
    for (name, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert_close(x, y, msg=name)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and sa  # AdamW's moments and step count, per parameter
    for key in sa:
        for field in sa[key]:
            assert_close(sa[key][field], sb[key][field], msg=f"{key}.{field}")


def test_forward_backward_over_chunks_then_optim_step_is_one_step(make_rollouts):
    # Two rounds: the second starts from moved weights (a non-zero KL to the reference) and
    # from AdamW moments, so the optimizer state is compared after a step that used it.
    stepped, tinker = _trainers()
    for round_ in range(2):
        ro = make_rollouts(seed=round_)
        advantages = _advantages(ro, round_)
        logs = stepped.step(ro, advantages, loss_fn=LOSS)
        calls, applied = _tinker_round(tinker, ro, advantages)
        assert logs["optimizer_steps"] == applied["optimizer_steps"] == 1.0
        assert applied["skipped_steps"] == 0.0
        assert_close(applied["grad_norm"], logs["grad_norm"])
        assert applied["lr"] == logs["lr"]
        # Each call's loss is its share of the batch loss: they add up to step's.
        assert_close(sum(c["loss"] for c in calls), logs["loss"])
        _assert_same_state(stepped, tinker)
    assert tinker.optimizer_steps == stepped.optimizer_steps == 2


def test_given_old_logprobs_are_used_as_in_step(make_rollouts):
    # π_old off the current weights (ratios ≠ 1, some tokens clipped), given per chunk.
    stepped, tinker = _trainers()
    ro = make_rollouts(seed=3)
    advantages = _advantages(ro, 3)
    old = stepped.logprobs(ro).double() + 0.3 * torch.randn(
        ro.response_ids.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    logs = stepped.step(ro.replace(old_logprobs=old), advantages, loss_fn=LOSS)
    n = tinker.normalizer(ro)
    for rows in CHUNKS:
        tinker.forward_backward(
            ro.replace(old_logprobs=old).select(rows), advantages[rows], loss_fn=LOSS, normalizer=n
        )
    applied = tinker.optim_step()
    assert_close(applied["grad_norm"], logs["grad_norm"])
    assert logs["clip_frac"] > 0  # the given π_old was really used
    _assert_same_state(stepped, tinker)


def test_each_chunk_normalized_by_itself_is_another_gradient(make_rollouts):
    # Why the batch's normalizer must be passed: the default is each call's own token count.
    stepped, tinker = _trainers()
    ro = make_rollouts(seed=0)
    advantages = _advantages(ro, 0)
    logs = stepped.step(ro, advantages, loss_fn=LOSS)
    _, applied = _tinker_round(tinker, ro, advantages, normalizer=None)
    assert abs(applied["grad_norm"] - logs["grad_norm"]) > 0.05 * logs["grad_norm"]


def test_one_call_over_the_whole_batch_reports_what_step_reports(make_rollouts):
    stepped, tinker = _trainers()
    ro = make_rollouts(seed=1)
    advantages = _advantages(ro, 1)
    logs = stepped.step(ro, advantages, loss_fn=LOSS)
    metrics = tinker.forward_backward(ro, advantages, loss_fn=LOSS)  # its own normalizer
    applied = tinker.optim_step()
    step_keys = set(logs) - {"grad_norm", "lr", "optimizer_steps", "skipped_steps"}
    step_keys -= {"seconds", "logprob_seconds", "tokens_per_second"}
    assert set(metrics) == step_keys
    for key in metrics:
        assert_close(metrics[key], logs[key], msg=key)
    assert_close(applied["grad_norm"], logs["grad_norm"])
    _assert_same_state(stepped, tinker)


def test_optim_step_with_nothing_accumulated_is_an_error(make_rollouts):
    _, policy = _trainers()
    with pytest.raises(RuntimeError, match="optim_step: no gradient to apply; call forward_b"):
        policy.optim_step()
    ro = make_rollouts()
    policy.forward_backward(ro, _advantages(ro, 0), loss_fn=LOSS)
    policy.optim_step()
    with pytest.raises(RuntimeError, match="no gradient to apply"):  # the first one consumed it
        policy.optim_step()
    assert policy.optimizer_steps == 1 and policy.steps == 0


def test_a_nan_loss_in_one_call_skips_the_whole_update(make_rollouts):
    _, policy = _trainers()
    ro = make_rollouts(seed=2)
    advantages = _advantages(ro, 2)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    policy.forward_backward(ro.select(CHUNKS[0]), advantages[CHUNKS[0]], loss_fn=LOSS)

    def nan_valued(lp, old, adv, mask, /, *, ref_logprobs):
        # A NaN value with a finite gradient: only the loss check can catch it, not the norm.
        loss, metrics = LOSS(lp, old, adv, mask, ref_logprobs=ref_logprobs)
        return loss + torch.full_like(loss, float("nan")).detach(), metrics

    rows = CHUNKS[1]
    metrics = policy.forward_backward(ro.select(rows), advantages[rows], loss_fn=nan_valued)
    assert metrics["loss"] != metrics["loss"]  # NaN: reported, not hidden
    policy.forward_backward(ro.select(CHUNKS[2]), advantages[CHUNKS[2]], loss_fn=LOSS)
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"):
        applied = policy.optim_step()
    assert applied["skipped_steps"] == 1.0 and applied["optimizer_steps"] == 0.0
    assert applied["grad_norm"] != applied["grad_norm"]  # NaN, as step reports a skipped one
    for name, p in policy.model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None, name
    assert policy.optimizer.state_dict()["state"] == {}  # AdamW never stepped
    assert (policy.optimizer_steps, policy.skipped_steps) == (0, 1)
    # The next round starts clean: the NaN is not carried over.
    policy.forward_backward(ro, advantages, loss_fn=LOSS)
    assert policy.optim_step()["optimizer_steps"] == 1.0


def test_a_failing_call_drops_every_pending_gradient(make_rollouts):
    _, policy = _trainers()
    ro = make_rollouts()
    advantages = _advantages(ro, 0)
    policy.forward_backward(ro.select(CHUNKS[0]), advantages[CHUNKS[0]], loss_fn=LOSS)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError):
        policy.forward_backward(ro.select(CHUNKS[1]), advantages[CHUNKS[1]], loss_fn=broken)
    assert all(p.grad is None for p in policy.model.parameters())
    assert not policy.model.training  # back in eval mode
    with pytest.raises(RuntimeError, match="no gradient to apply"):
        policy.optim_step()


def test_pending_gradients_are_not_checkpointed_or_mixed_into_a_step(make_rollouts, tmp_path):
    _, policy = _trainers()
    ro = make_rollouts()
    advantages = _advantages(ro, 0)
    saved = copy.deepcopy(policy.state_dict())
    policy.forward_backward(ro, advantages, loss_fn=LOSS)
    for call in (
        policy.state_dict,
        partial(policy.save_checkpoint, tmp_path / "ckpt"),
        partial(policy.step, ro, advantages, loss_fn=LOSS),
    ):
        with pytest.raises(RuntimeError, match="forward_backward are pending.*call optim_step"):
            call()
    assert not (tmp_path / "ckpt").exists()
    assert any(p.grad is not None for p in policy.model.parameters())  # still pending
    policy.load_state_dict(saved)  # restoring drops them: they belong to other weights
    assert all(p.grad is None for p in policy.model.parameters())
    with pytest.raises(RuntimeError, match="no gradient to apply"):
        policy.optim_step()


def test_a_normalizer_must_be_a_scalar_and_an_empty_call_is_refused(make_rollouts):
    _, policy = _trainers()
    ro = make_rollouts()
    advantages = _advantages(ro, 0)
    with pytest.raises(ValueError, match="normalizer must be a scalar, got shape \\(2,\\)"):
        policy.forward_backward(ro, advantages, loss_fn=LOSS, normalizer=torch.ones(2))
    with pytest.raises(ValueError, match="PolicyTrainer.forward_backward: empty batch"):
        policy.forward_backward(ro.select([]), advantages[:0], loss_fn=LOSS)
