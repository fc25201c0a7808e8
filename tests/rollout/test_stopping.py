"""Where responses end: ResponseEnds / valid_tokens by hand, then EOS and stop strings through
HFEngine against slow per-row references."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlblocks.interfaces import SamplingParams
from rlblocks.rollout import HFEngine, ResponseEnds, valid_tokens

PROMPTS = ["What is 2+2?", "Hello there, how are you today?", "x"]


# ---------------------------------------------------------------------- hand-worked
def test_valid_tokens_by_hand():
    # end = [1, -1, 0], t = 3: row 0 keeps steps 0..1, row 1 (no end: cut at the limit) all,
    # row 2 only step 0 (it ended on its first token).
    valid = valid_tokens(torch.tensor([1, -1, 0]), 3)
    assert valid.tolist() == [[True, True, False], [True, True, True], [True, False, False]]


def test_response_ends_keeps_the_first_end_by_hand():
    # Prompt width 2, EOS id 2, padding also 2 (pad == eos, as in SmolLM2). Steps:
    #   step 0: rows emit [2, 5, 7] -> row 0 ends at step 0
    #   step 1: rows emit [2, 2, 7] -> row 0's padding (=EOS) is not a new end; row 1 ends at 1
    #   step 2: rows emit [2, 2, 7] -> nothing new; row 2 never ends (-1)
    ticks = []
    ends = ResponseEnds(
        batch_size=3, prompt_width=2, eos_token_ids=[2], on_step=lambda: ticks.append(1)
    )
    ids = torch.tensor([[9, 9], [9, 9], [0, 9]])
    for column, expected_stop in (
        ([2, 5, 7], [1, 0, 0]),
        ([2, 2, 7], [1, 1, 0]),
        ([2, 2, 7], None),
    ):
        ids = torch.cat([ids, torch.tensor(column)[:, None]], dim=1)
        stopped = ends(ids, None)
        if expected_stop is not None:
            assert stopped.tolist() == [bool(s) for s in expected_stop]
    assert ends.end.tolist() == [0, 1, -1] and len(ticks) == 3


# ---------------------------------------------------------------------- EOS through the engine
def first_eos_reference(ids: list[int], eos: int) -> int:
    """Slow reference: number of valid tokens = index of the first EOS + 1, else all."""
    for k, token in enumerate(ids):
        if token == eos:
            return k + 1
    return len(ids)


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_eos_ends_a_row_and_later_tokens_are_padding(eos_biased, pad_is_eos):
    model, tokenizer = eos_biased(4.0)
    if pad_is_eos:  # SmolLM2-style: padding and EOS are one token
        tokenizer.pad_token = tokenizer.eos_token
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sampling = SamplingParams(max_new_tokens=10, seed=0)
    ro = HFEngine(model, tokenizer, progress=False).generate(
        PROMPTS, group_size=4, sampling=sampling
    )
    t = ro.response_ids.shape[1]
    lengths = ro.response_mask.sum(-1).tolist()
    assert min(lengths) < t and max(lengths) == t  # rows that ended and rows cut at the limit
    for i in range(ro.batch_size):
        n = first_eos_reference(ro.response_ids[i].tolist(), eos)
        assert lengths[i] == n
        assert ro.response_mask[i].tolist() == [True] * n + [False] * (t - n)  # EOS counts
        assert (ro.response_ids[i, n:] == pad).all()
        assert (ro.rollout_logprobs[i, n:] == 0).all() and (ro.rollout_logprobs[i, :n] < 0).all()
        assert tokenizer.eos_token not in ro.completions[i]  # special tokens skipped
    assert torch.equal(ro.response_attention_mask, ro.response_mask)


def test_pad_token_value_does_not_change_the_samples(eos_biased):
    # Padding positions are masked, so the padding id cannot change what is sampled.
    sampling = SamplingParams(max_new_tokens=10, seed=0)
    runs = []
    for pad_is_eos in (False, True):
        model, tokenizer = eos_biased(4.0)
        if pad_is_eos:
            tokenizer.pad_token = tokenizer.eos_token
        runs.append(
            HFEngine(model, tokenizer, progress=False).generate(
                PROMPTS, group_size=4, sampling=sampling
            )
        )
    a, b = runs
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.response_ids[a.response_mask], b.response_ids[b.response_mask])
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)


@pytest.mark.parametrize("min_new_tokens", [10, 5])
def test_min_new_tokens_holds_eos_back(eos_biased, forward_logprobs, min_new_tokens):
    # p(EOS) ≈ 0.13 a step (conftest): without the floor most of the 12 rows end within 10
    # steps (the test above). EOS is sampled from step min_new_tokens on, never before, so a row
    # is exactly 10 tokens (min = max: equal shapes) or ends with EOS at step >= min.
    model, tokenizer = eos_biased(4.0)
    eos = tokenizer.eos_token_id
    sampling = SamplingParams(max_new_tokens=10, min_new_tokens=min_new_tokens, seed=0)
    ro = HFEngine(model, tokenizer, progress=False).generate(
        PROMPTS, group_size=4, sampling=sampling
    )
    lengths = ro.response_mask.sum(-1)
    assert ro.response_ids.shape == (12, 10) and (lengths >= min(min_new_tokens + 1, 10)).all()
    assert not (ro.response_ids[:, :min_new_tokens] == eos).any()
    if min_new_tokens == 10:
        assert (lengths == 10).all()
    else:
        assert (lengths < 10).any()  # EOS is back after the floor
    # Rollout log-probs score the untruncated distribution (EOS's mass included), as the
    # trainer's forward pass does; tolerances as in test_hf.py.
    torch.testing.assert_close(ro.rollout_logprobs, forward_logprobs(model, ro, 1.0))


# ---------------------------------------------------------------------- stop strings
def pick_stop_string(tokenizer, rows: list[list[int]]) -> tuple[int, str]:
    """``(row, text)``: two consecutive sampled tokens, before the last column, whose text is
    plain ASCII letters and spaces: a multi-token stop string the model does emit."""
    for row, ids in enumerate(rows):
        for k in range(len(ids) - 2):
            text = tokenizer.decode(ids[k : k + 2])
            if len(text.strip()) >= 3 and all(
                c.isascii() and (c.isalpha() or c == " ") for c in text
            ):
                return row, text
    raise AssertionError("no plain-text token pair in the sample; change the seed")


def stop_reference(tokenizer, prompt_ids: list[int], ids: list[int], stops: list[str]) -> int:
    """Slow reference: the shortest prefix whose decoded text (after the prompt) contains a stop
    string; all tokens when none does."""
    prompt_text = tokenizer.decode(prompt_ids)
    assert not any(s in prompt_text for s in stops)
    for n in range(1, len(ids) + 1):
        if any(s in tokenizer.decode(prompt_ids + ids[:n]) for s in stops):
            return n
    return len(ids)


def test_stop_string_ends_the_row_right_after_it(peaky, forward_logprobs):
    model, tokenizer = peaky
    eng = HFEngine(model, tokenizer, progress=False)
    free = eng.generate(PROMPTS, group_size=2, sampling=SamplingParams(max_new_tokens=12, seed=4))
    row, stop = pick_stop_string(tokenizer, free.response_ids.tolist())
    sampling = SamplingParams(max_new_tokens=12, seed=4, stop=(stop, "zzzz"))
    ro = eng.generate(PROMPTS, group_size=2, sampling=sampling)
    t = ro.response_ids.shape[1]
    for i in range(ro.batch_size):
        prompt = ro.prompt_ids[i][ro.prompt_mask[i]].tolist()
        n = stop_reference(tokenizer, prompt, free.response_ids[i].tolist(), [stop, "zzzz"])
        # Same seed, same draws: the row is the free sample cut right after the stop string.
        assert ro.response_ids[i, :n].tolist() == free.response_ids[i, :n].tolist()
        assert ro.response_mask[i].tolist() == [True] * n + [False] * (t - n)
        assert (ro.rollout_logprobs[i, n:] == 0).all()
    assert ro.response_mask[row].sum() < 12 and stop in ro.completions[row]  # kept
    torch.testing.assert_close(ro.rollout_logprobs, forward_logprobs(model, ro, 1.0))


def test_a_stop_string_the_model_never_emits_changes_nothing(peaky):
    eng = HFEngine(*peaky, progress=False)
    a = eng.generate(PROMPTS, sampling=SamplingParams(max_new_tokens=6, seed=3))
    b = eng.generate(PROMPTS, sampling=SamplingParams(max_new_tokens=6, seed=3, stop=("\x00\x00",)))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(
        a.response_mask, b.response_mask
    )


def test_stop_strings_wait_for_min_new_tokens(peaky):
    model, tokenizer = peaky
    eng = HFEngine(model, tokenizer, progress=False)
    fixed = SamplingParams(max_new_tokens=12, min_new_tokens=12, seed=4)
    free = eng.generate(PROMPTS, group_size=2, sampling=fixed)
    _, stop = pick_stop_string(tokenizer, free.response_ids.tolist())
    ro = eng.generate(PROMPTS, group_size=2, sampling=dataclasses.replace(fixed, stop=(stop,)))
    # A stop string before the floor ends nothing (vLLM's min_tokens): the rows without it.
    assert ro.response_mask.all() and torch.equal(ro.response_ids, free.response_ids)
