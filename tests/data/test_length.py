"""Tests for rlblocks.data.length: counting prompt tokens and the three overlong modes."""

from __future__ import annotations

import warnings

import pytest

from rlblocks.data import limit_prompt_length, load_prompts, prompt_token_ids

FILLER = "The quick brown fox jumps over the lazy dog. "
QUESTION = "What is 12 + 7?"
# Row k repeats the filler k times before the question: lengths grow with k.
ROWS = [{"q": FILLER * k + QUESTION, "a": "19"} for k in range(5)]
SYSTEM = "You are a helpful assistant."


def _text_dataset():
    return load_prompts(ROWS, prompt="q", ground_truth="a")


def _chat_dataset():
    return load_prompts(ROWS, prompt="q", ground_truth="a", system=SYSTEM)


def _lengths(prompts, tokenizer):
    """Reference count, one prompt at a time, through the tokenizer's own entry points."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(len(tokenizer(p)["input_ids"]))
        else:
            encoded = tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
            out.append(len(encoded["input_ids"]))
    return out


# ---------------------------------------------------------------------- counting
def test_prompt_token_ids_matches_the_tokenizer(tokenizer):
    chat = [{"role": "user", "content": QUESTION}]
    prompts = [QUESTION, chat, FILLER, chat]  # mixed kinds: order must be kept
    ids = prompt_token_ids(prompts, tokenizer)
    assert ids[0] == tokenizer(QUESTION)["input_ids"]
    assert ids[2] == tokenizer(FILLER)["input_ids"]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert ids[1] == ids[3] == rendered["input_ids"]
    # ChatML adds "<|im_start|>user\n" before and "<|im_end|>\n<|im_start|>assistant\n" after.
    assert tokenizer.decode(ids[1]) == f"<|im_start|>user\n{QUESTION}<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_prompt_token_ids_of_nothing(tokenizer):
    assert prompt_token_ids([], tokenizer) == []


# ---------------------------------------------------------------------- limits
def test_short_prompts_pass_unchanged(tokenizer):
    ds = _text_dataset()
    longest = max(_lengths(ds.prompts, tokenizer))
    for mode in ("error", "truncate", "filter"):
        out = limit_prompt_length(ds, tokenizer, max_prompt_tokens=longest, overlong=mode)
        assert out.prompts == ds.prompts and out.num_dropped == 0


def test_error_names_row_length_and_limit(tokenizer):
    ds = _text_dataset()
    lengths = _lengths(ds.prompts, tokenizer)
    limit = lengths[2]  # rows 3 and 4 are longer; row 3 is the first
    message = rf"row 3: prompt is {lengths[3]} tokens, longer than max_prompt_tokens={limit}"
    with pytest.raises(ValueError, match=message + r" \(2 of 5 rows are too long"):
        limit_prompt_length(ds, tokenizer, max_prompt_tokens=limit, overlong="error")


def test_error_through_load_prompts_uses_source_rows(tokenizer):
    lengths = _lengths([row["q"] for row in ROWS], tokenizer)
    with pytest.raises(ValueError, match=rf"row 1: prompt is {lengths[1]} tokens"):
        load_prompts(ROWS, prompt="q", ground_truth="a", tokenizer=tokenizer, max_prompt_tokens=20)


def test_filter_drops_long_rows_and_reports_them(tokenizer):
    ds = _text_dataset()
    lengths = _lengths(ds.prompts, tokenizer)
    limit = lengths[2]
    with pytest.warns(UserWarning, match=rf"dropped 2 of 5 prompts longer than {limit} tokens"):
        out = limit_prompt_length(ds, tokenizer, max_prompt_tokens=limit, overlong="filter")
    # Loop reference: keep exactly the rows whose own length is within the limit.
    assert out.prompts == [p for p, n in zip(ds.prompts, lengths, strict=True) if n <= limit]
    assert out.num_dropped == 2 and out.dropped == [3, 4]
    assert [row.index for row in out] == [0, 1, 2]
    # Filtering again keeps the earlier record and adds to it.
    with pytest.warns(UserWarning, match="dropped 1 of 3"):
        again = limit_prompt_length(out, tokenizer, max_prompt_tokens=lengths[1], overlong="filter")
    assert again.dropped == [3, 4, 2]


def test_truncate_text_keeps_the_last_tokens(tokenizer):
    ds = _text_dataset()
    limit = 15
    with pytest.warns(UserWarning, match="truncated 4 of 5 prompts"):
        out = limit_prompt_length(ds, tokenizer, max_prompt_tokens=limit, overlong="truncate")
    assert out[0].prompt == ds[0].prompt  # 10 tokens: under the limit, untouched
    for before, after in zip(ds.prompts[1:], out.prompts[1:], strict=True):
        ids = tokenizer(before)["input_ids"]  # this tokenizer adds no BOS
        # Reference: the decoded last `limit` tokens. The filler splits on word boundaries, so
        # the tail re-encodes to the same tokens and nothing more has to be cut.
        assert after == tokenizer.decode(ids[-limit:])
        assert after.endswith(QUESTION) and before.endswith(after)
        assert _lengths([after], tokenizer) == [limit]
    assert [row.ground_truth for row in out] == ["19"] * 5


def test_truncate_chat_cuts_the_user_message_from_the_left(tokenizer):
    ds = _chat_dataset()
    limit = 40
    with pytest.warns(UserWarning, match="truncated"):
        out = limit_prompt_length(ds, tokenizer, max_prompt_tokens=limit, overlong="truncate")
    for before, after in zip(ds.prompts, out.prompts, strict=True):
        assert after[0] == {"role": "system", "content": SYSTEM}
        assert after[1]["role"] == "user"
        assert before[1]["content"].endswith(after[1]["content"])
        assert after[1]["content"].endswith(QUESTION)
        assert _lengths([after], tokenizer)[0] <= limit
    # Only the overlong rows changed; the input dataset is untouched.
    lengths = _lengths(ds.prompts, tokenizer)
    assert [a == b for a, b in zip(ds.prompts, out.prompts, strict=True)] == [
        n <= limit for n in lengths
    ]
    assert ds[4].prompt[1]["content"] == ROWS[4]["q"]


def test_truncate_chat_cannot_cut_the_template(tokenizer):
    ds = _chat_dataset()
    # The system message and the ChatML scaffolding alone are longer than 12 tokens.
    with pytest.raises(ValueError, match=r"row 0: cannot truncate the prompt to 12 tokens"):
        limit_prompt_length(ds, tokenizer, max_prompt_tokens=12, overlong="truncate")


def test_truncate_through_load_prompts_stays_within_every_limit(tokenizer):
    for limit in range(1, 40, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = load_prompts(
                ROWS,
                prompt="q",
                ground_truth="a",
                tokenizer=tokenizer,
                max_prompt_tokens=limit,
                overlong="truncate",
            )
        assert max(_lengths(out.prompts, tokenizer)) <= limit
        assert all(ROWS[row.index]["q"].endswith(row.prompt) for row in out)


def test_bad_arguments(tokenizer):
    ds = _text_dataset()
    with pytest.raises(ValueError, match="max_prompt_tokens must be >= 1"):
        limit_prompt_length(ds, tokenizer, max_prompt_tokens=0)
    with pytest.raises(ValueError, match="overlong must be"):
        limit_prompt_length(ds, tokenizer, max_prompt_tokens=5, overlong="drop")
