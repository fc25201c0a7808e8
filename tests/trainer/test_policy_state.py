"""Checkpointing the trainer, numerics options (gradient checkpointing, bf16), construction."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from builders import tiny_trainer
from torch.testing import assert_close

from rlblocks.losses import clipped_surrogate
from rlblocks.trainer import PolicyTrainer, TrainConfig, cosine
from rlblocks.trainer.weights import optimizer_state_by_name

CONFIG = TrainConfig(lr=1e-2, mini_batch_size=3, epochs=2, schedule=cosine(warmup=2, total=20))


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_state_dict_round_trip(make_rollouts):
    ro1, ro2 = make_rollouts(seed=0), make_rollouts(seed=1)
    adv1, adv2 = torch.randn(8), torch.randn(8)
    original = tiny_trainer(config=CONFIG)
    original.step(ro1, adv1, loss_fn=clipped_surrogate)
    state = copy.deepcopy(original.state_dict())

    restored = tiny_trainer(config=CONFIG)
    restored.load_state_dict(state)
    fresh = tiny_trainer(config=CONFIG)  # negative control
    out_a = original.step(ro2, adv2, loss_fn=clipped_surrogate)
    out_b = restored.step(ro2, adv2, loss_fn=clipped_surrogate)
    fresh.step(ro2, adv2, loss_fn=clipped_surrogate)
    assert_close(_weights(restored.model), _weights(original.model))
    assert out_a["lr"] == out_b["lr"] and out_a["loss"] == out_b["loss"]
    assert (original.steps, original.optimizer_steps) == (restored.steps, restored.optimizer_steps)
    diff = [(_weights(fresh.model)[n] - w).abs().max() for n, w in _weights(original.model).items()]
    assert max(diff) > 1e-3  # without the state the next step really differs


def test_state_dict_rejects_other_parameters():
    trainer = tiny_trainer(lr=1e-6)
    state = trainer.state_dict()
    state["model"] = {"not.a.parameter": torch.zeros(1)}
    with pytest.raises(KeyError, match="state dict mismatch"):
        trainer.load_state_dict(state)


def _by_name(trainer) -> dict:
    """The trainer's optimizer state keyed by parameter name: what a sharded group (Ray
    workers) returns in ``state_dict()["optimizer"]`` and loads (DCP's full state dict; it
    reads a one-process model too)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    return get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options)


def test_an_index_keyed_state_is_renamed_as_a_sharded_group_loads_it(make_rollouts):
    # This kernel -> Ray workers: the one-process state, keyed by index, in the keying of DCP's
    # set_optimizer_state_dict (checked by tests/placement/test_ray.py on real workers).
    trainer = tiny_trainer(config=CONFIG)
    trainer.step(make_rollouts(seed=0), torch.randn(8), loss_fn=clipped_surrogate)
    renamed = optimizer_state_by_name(
        trainer.optimizer, trainer.model, trainer.optimizer.state_dict()
    )
    expected = _by_name(trainer)
    assert renamed["param_groups"] == expected["param_groups"]
    assert renamed["state"].keys() == expected["state"].keys()
    for name, values in expected["state"].items():
        assert_close(renamed["state"][name], values, rtol=0, atol=0)
    other = {**renamed, "param_groups": renamed["param_groups"] * 2}
    with pytest.raises(ValueError, match=r"^PolicyTrainer.load_state_dict: the optimizer state"):
        optimizer_state_by_name(trainer.optimizer, trainer.model, other)
    assert optimizer_state_by_name(trainer.optimizer, trainer.model, expected) is expected


def _count_forwards(module: torch.nn.Module) -> list[int]:
    """Count calls of ``module.forward`` (module hooks do not fire on recomputation)."""
    calls, forward = [], module.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    module.forward = counted
    return calls


def test_gradient_checkpointing_gives_the_same_update(make_rollouts):
    ro = make_rollouts(seed=2)
    adv = torch.randn(8)
    results = []
    for checkpointing in (False, True):
        trainer = tiny_trainer(torch.float64, lr=1e-2, gradient_checkpointing=checkpointing)
        model = trainer.model
        calls = _count_forwards(model.model.layers[0].mlp)
        trainer.step(ro, adv, loss_fn=clipped_surrogate)
        # Forwards of a layer: the training forward (one optimizer step: it gives π_old too),
        # + the recomputation in backward.
        assert len(calls) == (2 if checkpointing else 1)
        assert not model.training  # back in eval mode after the step
        results.append(_weights(model))
    assert_close(results[1], results[0])  # float64: recomputation is exact up to ~1e-16


def test_bf16_step_runs_and_logprobs_stay_float32(make_rollouts):
    ro = make_rollouts(seed=3)
    trainer = tiny_trainer(lr=1e-3, bf16=True, micro_batch_size=3)
    assert trainer.logprobs(ro).dtype == torch.float32
    out = trainer.step(ro, torch.randn(8), loss_fn=clipped_surrogate)
    assert all(math.isfinite(v) for v in out.values())
    assert out["optimizer_steps"] == 1 and out["skipped_steps"] == 0
    assert next(trainer.model.parameters()).dtype == torch.float32  # master weights untouched


def test_config_overrides_and_validation():
    trainer = tiny_trainer(config=TrainConfig(epochs=2), lr=0.5)
    assert trainer.config.lr == 0.5 and trainer.config.epochs == 2
    assert trainer.optimizer.param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig(epochs=0)
    with pytest.raises(ValueError, match="temperature"):
        TrainConfig(temperature=0.0)
    with pytest.raises(ValueError, match="reference"):
        tiny_trainer(reference="frozen", lr=1e-6)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", NAN), ("lr", INF), ("lr", -1e-5),
        ("max_grad_norm", NAN), ("max_grad_norm", INF), ("max_grad_norm", 0.0),
        ("weight_decay", NAN), ("weight_decay", -0.1),
        ("eps", NAN), ("eps", 0.0),
        ("temperature", NAN), ("temperature", INF),
        ("betas", (0.9, NAN)), ("betas", (1.0, 0.999)), ("betas", (-0.1, 0.999)),
    ],
)  # fmt: skip
def test_a_setting_that_is_not_a_finite_number_in_range_is_refused_by_name(field, value):
    # A NaN passes every < comparison: max_grad_norm=nan was accepted and one step then
    # turned every weight NaN; lr=inf and betas of 1 were taken as they were.
    name = field if field != "betas" else r"betas\[[01]\]"
    with pytest.raises(ValueError, match=rf"^TrainConfig\.{name}: must be a finite number"):
        TrainConfig(**{field: value})


def test_settings_at_the_edge_of_their_range_are_kept():
    config = TrainConfig(lr=0, weight_decay=0.0, betas=(0.0, 0.0), max_grad_norm=None)
    assert (config.lr, config.betas, config.max_grad_norm) == (0, (0.0, 0.0), None)


def test_from_pretrained_builtin(tmp_path, monkeypatch, make_rollouts):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path))
    trainer = PolicyTrainer.from_pretrained("tiny", lr=1e-3, reference=None)
    assert trainer.tokenizer is not None and trainer.config.lr == 1e-3
    out = trainer.step(make_rollouts(seed=4), torch.randn(8), loss_fn=clipped_surrogate)
    assert out["optimizer_steps"] == 1


def test_one_optimizer_step_takes_pi_old_from_its_own_forward(make_rollouts):
    # One epoch, one mini-batch: the weights do not move before any row's forward, so the
    # update's forward gives π_old. The same update with π_old scored beforehand (two
    # mini-batches force it; the first mini-batch's update is then compared) must agree: in
    # float64 the two forwards of the same weights differ by rounding only (~1e-16), so the
    # weights after the step agree to assert_close's float64 default (rtol 1e-7).
    ro = make_rollouts(seed=3)
    adv = torch.randn(8)
    fused = tiny_trainer(torch.float64, lr=1e-2)
    fused_model = fused.model
    calls = _count_forwards(fused_model.model.layers[0].mlp)
    metrics = fused.step(ro, adv, loss_fn=clipped_surrogate)
    assert len(calls) == 1  # no scoring pass before the update
    assert metrics["clip_frac"] == 0.0 and metrics["ratio_max"] == 1.0  # ratio exactly 1
    scored = tiny_trainer(torch.float64, lr=1e-2)
    scored_model = scored.model
    old = scored.logprobs(ro)
    scored.step(ro.replace(old_logprobs=old), adv, loss_fn=clipped_surrogate)
    assert_close(_weights(fused_model), _weights(scored_model))
    # The mismatch metric still compares π_old (now from the update's forward) with the
    # engine's log-probs, row by row in place: the same as with π_old scored beforehand.
    with_rollout = ro.replace(rollout_logprobs=old.float() - 0.5 * ro.response_mask)
    a = tiny_trainer(torch.float64, lr=1e-2)
    b = tiny_trainer(torch.float64, lr=1e-2)
    fused_metrics = a.step(with_rollout, adv, loss_fn=clipped_surrogate)
    scored_metrics = b.step(with_rollout.replace(old_logprobs=old), adv, loss_fn=clipped_surrogate)
    # π_old is float64 inside the fused step and the float32 public log-probs in the scored
    # one; |log p| < 30 here, which float32 holds to 30·2⁻²⁴ ≈ 2e-6, so every metric of the
    # two agrees to that (kl = mean(e^d − 1 − d) moves by at most |e^d − 1|·2e-6 < 2e-6).
    for key in ("mismatch/abs_mean", "mismatch/abs_max", "mismatch/kl"):
        assert_close(fused_metrics[key], scored_metrics[key], rtol=0, atol=2e-6, msg=key)
    assert_close(fused_metrics["mismatch/abs_max"], 0.5, rtol=0, atol=2e-6)


@pytest.mark.parametrize(("kind", "size"), [("tp", 2), ("sp", 2)])
def test_tensor_or_sequence_parallel_settings_in_one_process_are_refused_not_dropped(
    kind, size, make_rollouts
):
    # A trainer built in this process with tp or sp > 1 and never sharded used to score and
    # train on the whole model, the setting dropped without a word.
    trainer = tiny_trainer(config=TrainConfig(**{kind: size}), lr=1e-3)
    rollouts = make_rollouts(seed=0)
    message = (
        rf"^PolicyTrainer.{{}}: TrainConfig.{kind} = {size} splits the policy over {size} processes"
    )
    with pytest.raises(RuntimeError, match=message.format("logprobs")):
        trainer.logprobs(rollouts)
    with pytest.raises(RuntimeError, match=message.format("step")):
        trainer.step(rollouts, torch.randn(len(rollouts)), loss_fn=clipped_surrogate)
    assert trainer.steps == 0  # nothing was trained
