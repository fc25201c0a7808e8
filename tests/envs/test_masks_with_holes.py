"""Every advantage estimator, loss and aggregation treats a response mask with holes (the
observation tokens of a multi-turn row) as if the holes were not there.

Each case is computed twice: on rows with observation gaps (mask False inside the response,
garbage values there) and on the same rows with the gaps cut out (the model tokens packed to
the left). The results at the model tokens must be the same, and 0 in the gaps. An estimator
that used ``mask.sum(-1)`` as the index of the last token, or a loss that read a gap, fails.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import rlblocks as rb

# Row masks with gaps; each row's True count is what its packed row keeps.
HOLES = torch.tensor(
    [
        [1, 1, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 1, 1, 0],
        [0, 0, 1, 1, 1, 1, 1, 1, 0, 1],  # (a row may start with an observation)
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1],
    ],
    dtype=torch.bool,
)
GROUPS = torch.tensor([7, 7, 3, 3])


def pack(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The True entries of each row moved to the left; the rest 0 and masked."""
    out = torch.zeros_like(values)
    packed = torch.zeros_like(mask)
    for i in range(len(mask)):
        n = int(mask[i].sum())
        out[i, :n] = values[i][mask[i]]
        packed[i, :n] = True
    return out, packed


def with_garbage(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` with large numbers in the gaps: any read of a gap changes the result."""
    return torch.where(mask, values, 1e3)


def assert_same_at_model_tokens(holed: torch.Tensor, packed: torch.Tensor) -> None:
    assert (holed[~HOLES] == 0).all()
    torch.testing.assert_close(pack(holed, HOLES)[0], packed)


def data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = HOLES.shape
    return {
        "rewards": torch.tensor([1.0, 0.0, 0.5, 2.0]),
        "token_rewards": torch.randn(shape, generator=g),
        "values": torch.randn(shape, generator=g),
        "logprobs": -torch.rand(shape, generator=g) * 3,
        "old_logprobs": -torch.rand(shape, generator=g) * 3,
        "ref_logprobs": -torch.rand(shape, generator=g) * 3,
        "advantages": torch.randn(shape, generator=g),
        "baseline_rewards": torch.tensor([0.5, 0.5, 1.0, 1.0]),
    }


ESTIMATORS = {
    "grpo": rb.advantage.grpo,
    "dr_grpo": partial(rb.advantage.grpo, scale_by_std=False),
    "rloo": rb.advantage.rloo,
    "opo": rb.advantage.opo,
    "gpg": rb.advantage.gpg,
    "grpo_passk": rb.advantage.grpo_passk,
    "reinforce_pp": partial(rb.advantage.reinforce_pp, gamma=0.9),
    "reinforce_pp_baseline": rb.advantage.reinforce_pp_baseline,
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("per_token", [False, True], ids=["outcome", "per-token"])
def test_estimators(name, per_token):
    d = data()
    rewards = with_garbage(d["token_rewards"], HOLES) if per_token else d["rewards"]
    packed_rewards = pack(d["token_rewards"], HOLES)[0] if per_token else d["rewards"]
    _, packed_mask = pack(d["values"], HOLES)
    holed = ESTIMATORS[name](rewards, HOLES, GROUPS)
    packed = ESTIMATORS[name](packed_rewards, packed_mask, GROUPS)
    assert_same_at_model_tokens(holed.advantages, packed.advantages)
    assert_same_at_model_tokens(holed.returns, packed.returns)


@pytest.mark.parametrize("per_token", [False, True], ids=["outcome", "per-token"])
def test_gae_and_remax(per_token):
    d = data()
    rewards = with_garbage(d["token_rewards"], HOLES) if per_token else d["rewards"]
    packed_rewards = pack(d["token_rewards"], HOLES)[0] if per_token else d["rewards"]
    packed_values, packed_mask = pack(d["values"], HOLES)
    holed = rb.advantage.gae(
        rewards, HOLES, GROUPS, values=with_garbage(d["values"], HOLES), gamma=0.9, lam=0.8
    )
    packed = rb.advantage.gae(
        packed_rewards, packed_mask, GROUPS, values=packed_values, gamma=0.9, lam=0.8
    )
    assert_same_at_model_tokens(holed.advantages, packed.advantages)
    holed = rb.advantage.remax(rewards, HOLES, GROUPS, baseline_rewards=d["baseline_rewards"])
    packed = rb.advantage.remax(
        packed_rewards, packed_mask, GROUPS, baseline_rewards=d["baseline_rewards"]
    )
    assert_same_at_model_tokens(holed.advantages, packed.advantages)


LOSSES = {
    "clipped_surrogate": partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28)),
    "no_dual_clip": partial(rb.losses.clipped_surrogate, clip=(0.2, 0.2), dual_clip=None),
    "gspo": rb.losses.gspo,
    "cispo": rb.losses.cispo,
    "gpg_loss": rb.losses.gpg_loss,
    "kl_regularized": rb.losses.kl_regularized(rb.losses.clipped_surrogate, kl_coef=0.1),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_losses(name):
    d = data()
    fields = ("logprobs", "old_logprobs", "advantages", "ref_logprobs")
    holed_in = {k: with_garbage(d[k], HOLES) for k in fields}
    packed_in = {k: pack(d[k], HOLES)[0] for k in fields}
    _, packed_mask = pack(d["logprobs"], HOLES)
    loss_fn = LOSSES[name]
    kwargs = (
        (lambda x: {"ref_logprobs": x["ref_logprobs"]})
        if name == "kl_regularized"
        else (lambda x: {})
    )
    holed, holed_metrics = loss_fn(
        holed_in["logprobs"],
        holed_in["old_logprobs"],
        holed_in["advantages"],
        HOLES,
        **kwargs(holed_in),
    )
    packed, packed_metrics = loss_fn(
        packed_in["logprobs"],
        packed_in["old_logprobs"],
        packed_in["advantages"],
        packed_mask,
        **kwargs(packed_in),
    )
    assert_same_at_model_tokens(holed, packed)
    assert holed_metrics.keys() == packed_metrics.keys()
    for key in holed_metrics:
        torch.testing.assert_close(holed_metrics[key], packed_metrics[key], msg=key)
    for mode in (
        rb.losses.token_mean,
        rb.losses.seq_mean_token_mean,
        rb.losses.seq_mean_token_sum,
        rb.losses.SeqMeanTokenSumNorm(max_tokens=10),
    ):
        torch.testing.assert_close(
            rb.losses.aggregate(holed, HOLES, mode=mode),
            rb.losses.aggregate(packed, packed_mask, mode=mode),
        )


def test_kl_penalty_rewards_put_the_outcome_on_the_last_model_token():
    d = data()
    holed, _ = rb.losses.kl_penalty_rewards(
        d["rewards"],
        with_garbage(d["old_logprobs"], HOLES),
        with_garbage(d["ref_logprobs"], HOLES),
        HOLES,
        kl_coef=0.1,
    )
    packed_old, packed_mask = pack(d["old_logprobs"], HOLES)
    packed, _ = rb.losses.kl_penalty_rewards(
        d["rewards"], packed_old, pack(d["ref_logprobs"], HOLES)[0], packed_mask, kl_coef=0.1
    )
    assert_same_at_model_tokens(holed, packed)
