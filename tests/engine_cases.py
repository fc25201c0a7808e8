"""What the rollout engine tests share: a tiny model whose greedy rows end at different steps,
the float32 bound of two evaluations of a log-prob, and equality of two ``Rollouts``.

A plain module (``tests`` is on ``sys.path``): the engine test files import it.
"""

from __future__ import annotations

import torch
from torch import nn

from rlblocks.models import tiny

PROMPTS = ["What is 2+2?", "Hello there, how are you today?", "x", "a b c d e f g"]
U32 = torch.finfo(torch.float32).eps / 2  # unit roundoff of float32, 2^-24


def with_eos_bias(model: nn.Module, tokenizer, bias: float) -> nn.Module:
    """``model`` (a tiny model with untied embeddings) with its head turned into an
    ``nn.Linear`` with a bias of ``bias`` on the EOS logit and 0 elsewhere."""
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = bias
    model.lm_head = head
    return model


def peaky_eos(bias: float = 2.0, dtype: torch.dtype = torch.float64):
    """The peaky tiny model (std 0.3: peaked next-token distributions) with an untied head and a
    bias on the EOS logit: under greedy decoding PROMPTS end after 3, 12, 6 and 5 tokens (some
    at EOS, one at the length limit), so a comparison covers rows finishing at different
    steps."""
    model, tokenizer = tiny(initializer_range=0.3, tie_word_embeddings=False)
    return with_eos_bias(model, tokenizer, bias).to(dtype), tokenizer


def logprob_bound(model: nn.Module, ro, temperature: float) -> float:
    """How far two float32 evaluations of log softmax(s)[y] can be apart when the scores s (=
    logits / T) agree before their cast to float32 (a float64 model: cached, static and padded
    passes differ by ~1e-13 there). One side computes log(softmax(s)[y]), the other
    s_y − max − log Σ exp(s − max): the float32 sum of V positive terms has relative error at
    most V·u (u = 2^-24), which the log turns into an absolute error of V·u; each side rounds
    s and its result once more, at most u·max|s| and u·|log p| each. The bound is the sum, for
    both sides: 2·u·(V + max|s| + max|log p|)."""
    mask = ro.attention_mask.long()
    with torch.no_grad():
        logits = model(ro.input_ids, attention_mask=mask).logits
    scores = logits.abs().max().item() / temperature
    worst = ro.rollout_logprobs.abs().max().item()
    return 2 * U32 * (model.config.vocab_size + scores + worst)


def same_rollouts(a, b) -> None:
    for name in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "group_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.prompts == b.prompts and a.completions == b.completions and a.metadata == b.metadata


def count_forwards(model: nn.Module) -> list[int]:
    """A forward pre-hook that counts the model's forward passes (the real module's calls)."""
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def greedy_margin(model: nn.Module, ro) -> tuple[float, float]:
    """``(smallest margin, largest |logit|)``: over the response tokens of ``ro``, the gap
    between the best and second-best logit each token was picked from, in one uncached
    forward pass of ``model``."""
    with torch.no_grad():
        logits = model(ro.input_ids, attention_mask=ro.attention_mask.long()).logits
    tp = ro.prompt_ids.shape[1]
    top2 = logits[:, tp - 1 : -1].topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1])[ro.response_mask]
    return margin.min().item(), logits.abs().max().item()
