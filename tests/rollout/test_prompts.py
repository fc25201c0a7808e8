"""Prompt rendering (raw text, chat messages, chat=True/False), left padding, and input errors."""

from __future__ import annotations

import pytest
import torch

from rlblocks.interfaces import SamplingParams
from rlblocks.models import tiny_tokenizer
from rlblocks.rollout import HFEngine, left_pad, render_prompts

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_raw_text_is_verbatim_and_messages_use_the_template(tokenizer):
    texts, ids = render_prompts(["What is 2+2?", MESSAGES], tokenizer)
    rendered = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"  # ChatML
    assert texts == ["What is 2+2?", rendered]
    assert ids[0] == tokenizer("What is 2+2?")["input_ids"]
    # The template text is tokenized without adding special tokens (no double BOS).
    assert ids[1] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids[1][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_chat_true_wraps_raw_text_as_a_user_message(tokenizer):
    wrapped = render_prompts(["What is 2+2?"], tokenizer, chat=True)
    assert wrapped == render_prompts([MESSAGES], tokenizer)


def test_chat_prompts_through_the_engine(peaky):
    sampling = SamplingParams(max_new_tokens=5, seed=0)
    a = HFEngine(*peaky, progress=False).generate([MESSAGES], sampling=sampling)
    b = HFEngine(*peaky, chat=True, progress=False).generate(["What is 2+2?"], sampling=sampling)
    c = HFEngine(*peaky, progress=False).generate(["What is 2+2?"], sampling=sampling)
    assert a.prompts == b.prompts and a.prompts[0].startswith("<|im_start|>user")
    assert torch.equal(a.response_ids, b.response_ids)
    assert c.prompts == ["What is 2+2?"] and c.prompt_ids.shape[1] < a.prompt_ids.shape[1]


def test_token_ids_are_used_as_they_are(tokenizer):
    # Ids that are NOT what their text tokenizes to ("a", "b" as two tokens where "ab" may be
    # one): they must reach the model unchanged, whatever chat says.
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b"))
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = [im_start, a, b]
    for chat in (None, True, False):
        texts, out = render_prompts([ids, (a,)], tokenizer, chat=chat)
        assert out == [ids, [a]]
        assert texts == ["<|im_start|>ab", "a"]  # decoded with special tokens kept
    with pytest.raises(ValueError, match="prompt 1 is a list of token ids but holds 999999"):
        render_prompts([ids, [a, 999999]], tokenizer)
    with pytest.raises(
        TypeError, match=r"^render_prompts: prompt 0 is list \[True, False\]; pass a string"
    ):
        render_prompts([[True, False]], tokenizer)  # bools are not ids


def test_token_id_prompts_through_the_engine(peaky):
    sampling = SamplingParams(max_new_tokens=5, seed=0)
    engine = HFEngine(*peaky, chat=True, progress=False)
    by_text = engine.generate(["What is 2+2?"], sampling=sampling)
    ids = by_text.prompt_ids[0].tolist()
    by_ids = engine.generate([ids], sampling=sampling)
    assert torch.equal(by_ids.prompt_ids, by_text.prompt_ids)
    assert torch.equal(by_ids.response_ids, by_text.response_ids)


def test_left_pad_by_hand():
    # [[5, 6, 7], [8]] with padding 0 -> rows end in the same column.
    ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    assert ids.dtype == torch.long and mask.dtype == torch.bool


def test_left_padding_whatever_the_tokenizer_says(peaky):
    model, tokenizer = peaky
    tokenizer.padding_side = "right"  # a caller's setting must not matter
    try:
        ro = HFEngine(model, tokenizer, progress=False).generate(
            ["x", "Hello there"], sampling=SamplingParams(max_new_tokens=2, temperature=0)
        )
    finally:
        tokenizer.padding_side = "left"
    assert ro.prompt_mask.tolist()[0][-1] and not ro.prompt_mask.tolist()[0][0]


def test_prompt_errors(tokenizer):
    with pytest.raises(ValueError, match="^render_prompts: prompts is empty; "):
        render_prompts([], tokenizer)
    with pytest.raises(TypeError, match="wrap a single prompt in a list"):
        render_prompts("hello", tokenizer)
    with pytest.raises(TypeError, match="prompt 0 .* wrap it in a list"):
        render_prompts(MESSAGES, tokenizer)  # one conversation passed without the outer list
    with pytest.raises(
        TypeError, match="^render_prompts: prompt 1 is int 42; pass a string, a non-empty list"
    ):
        render_prompts(["ok", 42], tokenizer)
    with pytest.raises(ValueError, match="prompt 0 is empty after tokenization"):
        render_prompts([""], tokenizer)
    with pytest.raises(ValueError, match="chat=False"):
        render_prompts([MESSAGES], tokenizer, chat=False)


def test_messages_without_a_chat_template_raise():
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(
        ValueError, match="prompt 0 is a chat conversation but the tokenizer has no"
    ):
        render_prompts([MESSAGES], bare)
    with pytest.raises(ValueError, match="no chat template"):
        render_prompts(["hi"], bare, chat=True)
    assert render_prompts(["hi"], bare)[0] == ["hi"]  # raw text needs no template


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_with_a_lone_surrogate_is_refused_by_its_number(tokenizer, chat):
    # What bytes.decode(errors="surrogateescape") leaves for a byte that is not UTF-8: the
    # tokenizer failed on it with "TypeError: TextEncodeInput must be Union[...]", no prompt named.
    bad = b"x = \xff here".decode("utf-8", errors="surrogateescape")
    with pytest.raises(
        ValueError, match=r"^render_prompts: prompt 1 holds a lone surrogate \('\\udcff' at"
    ):
        render_prompts(["fine", bad], tokenizer, chat=chat)
    with pytest.raises(ValueError, match="prompt 0 holds a lone surrogate"):
        render_prompts([[{"role": "user", "content": bad}]], tokenizer)
