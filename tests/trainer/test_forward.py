"""Scoring response tokens: position ids, log-probs and entropies against slow references."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from rlblocks.models import tiny as rb_tiny
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.forward import position_ids, response_logits, score_responses


def test_position_ids_hand_worked():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    # row 0: cumsum = [0, 0, 1, 2, 3, 3], minus 1 = [-1, -1, 0, 1, 2, 2], clamped at 0.
    # row 1: cumsum = [1, 2, 3, 4, 4, 4], minus 1 = [0, 1, 2, 3, 3, 3].
    expected = torch.tensor([[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 3, 3]])
    assert torch.equal(position_ids(mask), expected)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("seed", [0, 1])
def test_logprobs_match_unpadded_rows(model32, make_rollouts, slow_logprobs, temperature, seed):
    ro = make_rollouts(seed=seed)  # left-padded prompts of 1..6 tokens, responses of 1..8
    lp, ent = score_responses(model32, ro, temperature=temperature, chunk_size=5, entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    expected = slow_logprobs(model32, ro, temperature=temperature)
    # Padded batch vs unpadded single rows in float32: rounding only (default tolerances).
    assert_close(lp, expected.float())
    assert torch.all(lp[~ro.response_attention_mask] == 0)
    assert torch.all(ent[~ro.response_attention_mask] == 0)


def test_entropy_matches_full_softmax(model32, make_rollouts):
    ro = make_rollouts(seed=2)
    _, ent = score_responses(model32, ro, temperature=0.5, chunk_size=3, entropy=True)
    with torch.no_grad():
        z = response_logits(model32, ro, temperature=0.5).double()
    p = torch.softmax(z, -1)
    expected = -(p * torch.log(p)).sum(-1)  # H = −Σ p log p over the whole vocabulary
    real = ro.response_attention_mask
    assert_close(ent[real], expected[real].float())


def test_temperature_changes_logprobs(model32, make_rollouts):
    # Limit check that the temperature is not ignored: T = 1 and T = 2 must differ.
    ro = make_rollouts(seed=3)
    lp1, _ = score_responses(model32, ro, temperature=1.0, chunk_size=64)
    lp2, _ = score_responses(model32, ro, temperature=2.0, chunk_size=64)
    real = ro.response_attention_mask
    assert (lp1[real] - lp2[real]).abs().min() > 1e-4


class _NoLogitsToKeep(nn.Module):
    """A causal LM whose forward has no ``logits_to_keep``: full logits come back."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.calls: list[int] = []

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        )
        self.calls.append(out.logits.shape[1])
        return out


def test_only_response_positions_reach_the_head(model64, make_rollouts):
    ro = make_rollouts(seed=4)
    tp, t = ro.prompt_ids.shape[1], ro.response_ids.shape[1]
    head_widths = []
    hook = model64.lm_head.register_forward_hook(lambda m, i, o: head_widths.append(i[0].shape[1]))
    kept = response_logits(model64, ro)
    hook.remove()
    assert head_widths == [t] and kept.is_contiguous()  # the t scoring columns, nothing else
    plain = _NoLogitsToKeep(model64)
    full = response_logits(plain, ro)
    assert plain.calls == [tp + t]  # the fallback scored every column...
    assert kept.shape == full.shape == (len(ro), t, model64.config.vocab_size)
    assert_close(kept, full)  # ...and gives the same logits


def test_gradient_flows_and_no_prompt_column_is_refused(model32, make_rollouts):
    ro = make_rollouts(seed=5)
    lp, ent = score_responses(model32, ro, chunk_size=4, entropy=True)
    assert lp.requires_grad and ent.requires_grad
    empty_prompt = Rollouts.from_lists([[], []], [[5, 6], [7]])
    with pytest.raises(ValueError, match="no prompt column"):
        response_logits(model32, empty_prompt)


def test_bf16_autocast_keeps_float32_logprobs(model32, make_rollouts):
    ro = make_rollouts(seed=6)
    lp, ent = score_responses(model32, ro, chunk_size=8, bf16=True, entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    exact, _ = score_responses(model32, ro, chunk_size=8)
    # bf16 keeps 8 mantissa bits (relative error ~4e-3 per op; the log-probs move by ~1e-3
    # here): an absolute 0.02 shows the autocast forward still scores the same tokens.
    assert_close(lp, exact, atol=0.02, rtol=0.0)


def _head_calls(model):
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


def test_the_head_is_swapped_only_during_the_forward_and_restored_after_an_error(
    model32, make_rollouts
):
    ro = make_rollouts(seed=4)
    head = model32.lm_head
    calls, handle = _head_calls(model32)
    lp, _ = score_responses(model32, ro, chunk_size=4)
    assert calls == [] and model32.lm_head is head  # scored without calling the real head
    bad = ro.replace(response_ids=ro.response_ids + model32.config.vocab_size)  # ids past v
    with pytest.raises(IndexError):  # raised inside the forward, with the head swapped
        score_responses(model32, bad, chunk_size=4)
    assert model32.lm_head is head
    handle.remove()
    with torch.no_grad():
        expected = torch.log_softmax(response_logits(model32, ro).double(), -1)
    expected = expected.gather(-1, ro.response_ids[..., None])[..., 0]
    real = ro.response_attention_mask
    assert_close(lp[real], expected[real].float())


def test_a_model_that_changes_its_logits_after_the_head_gets_full_logits(make_rollouts):
    # Soft-capped logits (Gemma-2's final_logit_softcapping): the swap would skip the cap, so
    # the real head runs and the capped logits are scored.
    from transformers import Qwen2ForCausalLM

    class Capped(Qwen2ForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = torch.tanh(out.logits / 0.5) * 0.5
            return out

    model, _ = rb_tiny(seed=2)
    capped = Capped(model.config)
    capped.load_state_dict(model.state_dict())
    capped.eval()
    ro = make_rollouts(seed=5)
    lp, _ = score_responses(capped, ro, chunk_size=4)
    with torch.no_grad():
        z = capped(
            input_ids=ro.input_ids,
            attention_mask=ro.attention_mask.long(),
            position_ids=position_ids(ro.attention_mask),
        ).logits
    t = ro.response_ids.shape[1]
    z = z[:, -t - 1 : -1].double()
    expected = torch.log_softmax(z, -1).gather(-1, ro.response_ids[..., None])[..., 0]
    real = ro.response_attention_mask
    assert_close(lp[real], expected[real].float())
