"""Off-policy corrections (rlblocks.losses.offpolicy): hand-worked weights at every level, a
slow loop reference, and the trainer's refusal of a correction without rollout log-probs."""

import math
from functools import partial

import pytest
import torch
from builders import ragged_rollouts, tiny_trainer

from rlblocks.losses import MaskedIS, TruncatedIS, clipped_surrogate, importance_ratios
from rlblocks.losses.inputs import loss_inputs

E = math.e
# Row 0: d = log π_old − log π_rollout = (1, −0.1, 0) on three valid tokens (the fourth is
# padding holding a wild value that must not count); row 1: d = (0, 1).
OLD = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -1.0, 0.0, 0.0]], dtype=torch.float64)
ROLLOUT = torch.tensor([[-2.0, -1.9, -3.0, -9.0], [-0.5, -2.0, 7.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])
ADV = torch.tensor([[1.0, -1.0, 2.0, 5.0], [-3.0, 4.0, 5.0, 5.0]])

# The ratios by hand: row 0 Σd = 0.9, mean 0.3; row 1 Σd = 1, mean 0.5.
TOKEN = [[E, math.exp(-0.1), 1.0], [1.0, E]]
SEQUENCE = [[math.exp(0.9)] * 3, [E] * 2]
GEOMETRIC = [[math.exp(0.3)] * 3, [math.exp(0.5)] * 2]


def _valid(x: torch.Tensor) -> list[list[float]]:
    return [x[0, :3].tolist(), x[1, :2].tolist()]


@pytest.mark.parametrize(
    ("level", "expected"), [("token", TOKEN), ("sequence", SEQUENCE), ("geometric", GEOMETRIC)]
)
def test_importance_ratios_by_hand(level, expected):
    ratio = importance_ratios(OLD, ROLLOUT, MASK, level=level)
    for got, want in zip(_valid(ratio), expected, strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    assert ratio[~MASK].eq(1).all()  # padding: ratio 1, whatever it holds


# weights on the valid tokens, by hand, and the share of tokens capped / masked
CASES = [
    (TruncatedIS, {"cap": 2.0}, [[2.0, math.exp(-0.1), 1.0], [1.0, 2.0]], 2 / 5),
    (TruncatedIS, {"cap": 2.0, "level": "sequence"}, [[2.0] * 3, [2.0] * 2], 1.0),
    (TruncatedIS, {"cap": 2.0, "level": "geometric"}, GEOMETRIC, 0.0),
    (MaskedIS, {}, [[0.0, math.exp(-0.1), 1.0], [1.0, 0.0]], 2 / 5),  # IcePop's [1/2, 2]
    (MaskedIS, {"level": "sequence"}, [[0.0] * 3, [0.0] * 2], 1.0),
    (MaskedIS, {"level": "geometric"}, GEOMETRIC, 0.0),
    (MaskedIS, {"low": 0.0, "high": 2.0, "reweight": False}, [[0.0, 1.0, 1.0], [1.0, 0.0]], 0.4),
    (MaskedIS, {"low": 0.95, "high": 1.5}, [[0.0, 0.0, 1.0], [1.0, 0.0]], 3 / 5),
]


@pytest.mark.parametrize(("cls", "kw", "weights", "flagged"), CASES)
def test_each_correction_weights_the_inner_loss_by_hand(cls, kw, weights, flagged):
    # At the first update π_θ = π_old: the clipped surrogate is −A per token, so the loss is
    # −A · w on valid tokens and 0 elsewhere.
    logprobs = OLD.float().clone().requires_grad_(True)
    correction = cls(partial(clipped_surrogate, clip=(0.2, 0.2)), **kw)
    loss, metrics = correction(logprobs, OLD.float(), ADV, MASK, rollout_logprobs=ROLLOUT.float())
    expected = torch.zeros(2, 4)
    for row, w in enumerate(weights):
        expected[row, : len(w)] = -ADV[row, : len(w)] * torch.tensor(w)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    name = "tis" if cls is TruncatedIS else "mis"
    flag = "capped_frac" if cls is TruncatedIS else "masked_frac"
    mean = sum(sum(w) for w in weights) / 5
    assert metrics[f"{name}/weight_mean"].item() == pytest.approx(mean, rel=1e-6)
    assert metrics[f"{name}/{flag}"].item() == pytest.approx(flagged)
    assert loss_inputs(correction).required == {"rollout_logprobs"}


def _loop_weights(old, rollout, mask, *, level, kind, cap=2.0, low=0.5, high=2.0):
    """The weights one token at a time, from the definitions."""
    b, t = old.shape
    out = torch.ones(b, t, dtype=torch.float64)
    for i in range(b):
        valid = [j for j in range(t) if mask[i, j]]
        logs = {j: float(old[i, j]) - float(rollout[i, j]) for j in valid}
        for j in valid:
            if level == "token":
                log_r = logs[j]
            elif level == "sequence":
                log_r = sum(logs.values())
            else:
                log_r = sum(logs.values()) / len(valid)
            r = math.exp(log_r)
            if kind == "truncate":
                out[i, j] = min(r, cap)
            else:
                out[i, j] = r if low <= r <= high else 0.0
    return out


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("kind", ["truncate", "mask"])
def test_the_weights_match_a_loop_over_tokens(level, kind):
    g = torch.Generator().manual_seed(7)
    b, t = 16, 9
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    # log-ratios up to ±0.8 per token: some tokens and rows inside the band, some outside
    rollout = old + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 1.6
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0] = False  # a row with no valid token
    # a wider band for whole sequences, whose ratios spread wider
    low, high = (0.3, 3.0) if level == "sequence" else (0.8, 1.25)
    if kind == "truncate":
        correction = TruncatedIS(_passthrough, cap=high, level=level)
        want = _loop_weights(old, rollout, mask, level=level, kind=kind, cap=high)
    else:
        correction = MaskedIS(_passthrough, low=low, high=high, level=level)
        want = _loop_weights(old, rollout, mask, level=level, kind=kind, low=low, high=high)
    _, metrics = correction(old, old, old, mask, rollout_logprobs=rollout)
    torch.testing.assert_close(metrics["weights"].double(), want, rtol=1e-6, atol=0)
    ratios = _loop_weights(old, rollout, mask, level=level, kind="truncate", cap=math.inf)
    # capped or masked: the weight is not the ratio
    flagged = ~torch.isclose(metrics["weights"].double(), ratios, rtol=1e-6, atol=0)[mask]
    assert 0 < flagged.sum() < mask.sum()  # the case exercises both sides


def _passthrough(logprobs, old_logprobs, advantages, mask, /, *, is_weights):
    """An inner loss that hands its weights back as a metric."""
    return torch.zeros_like(logprobs), {"weights": is_weights}


def test_bad_bounds_are_refused_by_name():
    with pytest.raises(ValueError, match=r"MaskedIS: the band \[1.2, 2.0\] must hold 1"):
        MaskedIS(clipped_surrogate, low=1.2)
    with pytest.raises(ValueError, match=r"TruncatedIS: cap must be > 0"):
        TruncatedIS(clipped_surrogate, cap=0.0)
    with pytest.raises(ValueError, match=r"MaskedIS: level='row' is not a level"):
        MaskedIS(clipped_surrogate, level="row")


@pytest.mark.parametrize("correction", [MaskedIS, TruncatedIS])
def test_the_trainer_refuses_a_correction_without_rollout_logprobs_naming_it(correction):
    policy = tiny_trainer()
    ro = ragged_rollouts(4, seed=0).replace(rollout_logprobs=None)
    loss = correction(partial(clipped_surrogate, clip=(0.2, 0.28)))
    pattern = rf"PolicyTrainer.step: the loss {correction.__name__}\(clipped_surrogate\) needs"
    with pytest.raises(ValueError, match=pattern):
        policy.step(ro, torch.zeros(ro.batch_size), loss_fn=loss)
