"""rb.losses.nll: SFT's per-token cross-entropy, against hand-worked values."""

import math

import torch

import rlblocks as rb


def test_nll_is_minus_the_log_prob_on_valid_tokens_and_zero_elsewhere():
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.125, 0.3, 0.3]]))
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, metrics = rb.losses.nll(logprobs, torch.zeros(2, 3), torch.ones(2, 3), mask)
    expected = torch.tensor([[math.log(2), math.log(4), 0.0], [math.log(8), 0.0, 0.0]])
    torch.testing.assert_close(loss, expected)
    # mean over the 3 valid tokens: (ln 2 + ln 4 + ln 8) / 3 = 6 ln 2 / 3 = 2 ln 2
    torch.testing.assert_close(metrics["nll"], torch.tensor(2 * math.log(2)))


def test_nll_ignores_old_logprobs_and_advantages_and_keeps_float64():
    logprobs = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.rand(3, 4) > 0.3
    a, _ = rb.losses.nll(logprobs, torch.randn(3, 4), torch.randn(3, 4), mask)
    b, _ = rb.losses.nll(logprobs, torch.zeros(3, 4), torch.zeros(3, 4), mask)
    assert torch.equal(a, b) and a.dtype == torch.float64


def test_nll_gradient_is_minus_one_per_valid_token():
    logprobs = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    loss, _ = rb.losses.nll(logprobs, logprobs.detach(), logprobs.detach(), mask)
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, -mask.float())
