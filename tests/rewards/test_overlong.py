"""DAPO soft overlong punishment (arXiv 2503.14476, eq. 13)."""

from __future__ import annotations

import pytest
import torch

from rlblocks.rewards.overlong import overlong, overlong_penalty


def reference(length: int, max_length: int, cache_length: int, factor: float) -> float:
    """Eq. 13 written case by case, as in the paper."""
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return factor * (expected - length) / cache_length
    return -factor


def test_hand_worked_boundaries() -> None:
    # L_max = 10, L_cache = 4, so L_max − L_cache = 6.
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 11, 100])
    expected = torch.tensor(
        [
            0.0,  # 0 ≤ 6: no penalty
            0.0,  # 5 ≤ 6
            0.0,  # 6 ≤ 6: the last free length
            -0.25,  # (6 − 7) / 4
            -0.5,  # (6 − 8) / 4
            -0.75,  # (6 − 9) / 4
            -1.0,  # (6 − 10) / 4 = −1 exactly at L_max
            -1.0,  # 11 > 10: held at −1
            -1.0,  # 100 > 10
        ]
    )
    out = overlong_penalty(lengths, max_length=10, cache_length=4)
    assert out.dtype == torch.float32 and out.shape == (9,)
    torch.testing.assert_close(out, expected)
    # factor 0.5 halves every value: (6 − 7) / 4 · 0.5 = −0.125, ..., −1 · 0.5 = −0.5.
    torch.testing.assert_close(
        overlong_penalty(lengths, max_length=10, cache_length=4, factor=0.5), 0.5 * expected
    )


@pytest.mark.parametrize("seed", range(5))
def test_matches_the_case_by_case_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    max_length = int(torch.randint(2, 50, (1,), generator=gen))
    cache_length = int(torch.randint(1, max_length + 1, (1,), generator=gen))
    factor = float(torch.rand(1, generator=gen)) * 2
    lengths = torch.randint(0, 2 * max_length, (64,), generator=gen)
    lengths[:3] = torch.tensor([max_length - cache_length, max_length, max_length + 1])
    expected = torch.tensor([reference(int(n), max_length, cache_length, factor) for n in lengths])
    out = overlong_penalty(lengths, max_length=max_length, cache_length=cache_length, factor=factor)
    torch.testing.assert_close(out, expected)


def test_limits() -> None:
    lengths = torch.arange(0, 30)
    # Every length within L_max − L_cache = 30: no penalty at all.
    torch.testing.assert_close(
        overlong_penalty(lengths, max_length=40, cache_length=10), torch.zeros(30)
    )
    # factor 0 switches the shaping off.
    torch.testing.assert_close(
        overlong_penalty(lengths, max_length=20, cache_length=10, factor=0.0), torch.zeros(30)
    )
    # L_cache = L_max: the ramp starts at 0 and every token costs 1/L_max: −n/20 up to −1.
    torch.testing.assert_close(
        overlong_penalty(lengths, max_length=20, cache_length=20),
        (-lengths.float() / 20).clamp(min=-1.0),
    )
    # The penalty never increases with length.
    out = overlong_penalty(lengths, max_length=20, cache_length=7)
    assert bool((out[1:] <= out[:-1]).all())


@pytest.mark.parametrize(("max_length", "cache_length"), [(10, 0), (10, 11), (10, -1)])
def test_bad_arguments(max_length: int, cache_length: int) -> None:
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(torch.tensor([1]), max_length=max_length, cache_length=cache_length)
    with pytest.raises(ValueError, match="cache_length"):
        overlong(max_length=max_length, cache_length=cache_length)


def test_reward_fn_reads_response_lengths(make_rollouts) -> None:
    # L_max = 8, L_cache = 4: free up to 4 tokens.
    ro = make_rollouts(["a", "b", "c", "d"], lengths=[3, 4, 6, 8])
    rewards, metrics = overlong(max_length=8, cache_length=4)(ro)
    # 3, 4 ≤ 4: 0; (4 − 6) / 4 = −0.5; (4 − 8) / 4 = −1.
    torch.testing.assert_close(rewards, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    assert metrics == {
        "reward/mean": pytest.approx(-0.375),  # (0 + 0 − 0.5 − 1) / 4
        "reward/penalized_fraction": 0.5,  # rows with 6 and 8 tokens
        "reward/max_length_fraction": 0.25,  # the row with 8 tokens
    }
    assert overlong(max_length=8, cache_length=4).__name__ == "overlong"
