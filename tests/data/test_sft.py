"""Tests for rlblocks.data.sft and SFTBatches: ids and masks built by hand, the RL prompt ids,
the batch layout, exact resume, and every error naming its row."""

from __future__ import annotations

import itertools
import json
import warnings

import datasets
import numpy as np
import pytest
import torch
from tokenizers.processors import TemplateProcessing

from rlblocks.data import SFTBatches, SFTData, SFTExample, prompt_token_ids, sft_data
from rlblocks.models import tiny_tokenizer
from rlblocks.run import Drawn

# The brief's ChatML template, written out here so that the expected ids below do not depend
# on the tiny tokenizer's own template.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SYSTEM = {"role": "system", "content": "Be brief."}
Q1 = {"role": "user", "content": "What is 2 + 3?"}
A1 = {"role": "assistant", "content": "The answer is 5."}
Q2 = {"role": "user", "content": "And 4 + 4?"}
A2 = {"role": "assistant", "content": "8"}


@pytest.fixture(scope="module")
def tok():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHATML
    return tokenizer


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def turn(tok, role: str, content: str) -> list[int]:
    """``<|im_start|>role\\ncontent<|im_end|>\\n`` by hand: the special tokens are single ids
    and split the text, so the text between them is tokenized on its own."""
    return [
        _id(tok, "<|im_start|>"),
        *enc(tok, f"{role}\n{content}"),
        tok.eos_token_id,
        *enc(tok, "\n"),
    ]


def header(tok) -> list[int]:
    return [_id(tok, "<|im_start|>"), *enc(tok, "assistant\n")]


def answer(tok, content: str) -> list[int]:
    """A trained assistant turn after its header: content, ``<|im_end|>``, ``\\n``."""
    return [*enc(tok, content), tok.eos_token_id, *enc(tok, "\n")]


def _id(tok, token: str) -> int:
    return tok.convert_tokens_to_ids(token)


def test_the_tiny_tokenizer_knows_the_chatml_tokens(tok):
    # The expected ids below rely on these being single special tokens, EOS = <|im_end|>.
    for token in ("<|im_start|>", "<|im_end|>"):
        assert enc(tok, token) == [_id(tok, token)]
        assert tok.added_tokens_decoder[_id(tok, token)].special
    assert tok.eos_token == "<|im_end|>" and tok.bos_token is None


# ---------------------------------------------------------------------- conversational
def test_single_turn_ids_and_mask_by_hand(tok):
    [ex] = sft_data([{"messages": [SYSTEM, Q1, A1]}], tok)
    assert ex.prompt_ids == [
        *turn(tok, "system", "Be brief."),
        *turn(tok, "user", Q1["content"]),
        *header(tok),
    ]
    assert ex.response_ids == answer(tok, A1["content"])
    assert ex.response_mask == [True] * len(ex.response_ids)
    assert ex.index == 0


def test_multi_turn_trains_both_assistant_turns_and_masks_user_turn_2(tok):
    # A trailing user turn trains nothing and is left out of the response.
    [ex] = sft_data([{"messages": [Q1, A1, Q2, A2, {"role": "user", "content": "Thanks"}]}], tok)
    pieces = [  # (ids, trained), in order after the prompt
        (answer(tok, A1["content"]), True),
        ([*turn(tok, "user", Q2["content"]), *header(tok)], False),
        (answer(tok, A2["content"]), True),
    ]
    assert ex.prompt_ids == [*turn(tok, "user", Q1["content"]), *header(tok)]
    assert ex.response_ids == [i for ids, _ in pieces for i in ids]
    assert ex.response_mask == [t for ids, t in pieces for _ in ids]
    trained = [i for i, m in zip(ex.response_ids, ex.response_mask, strict=True) if m]
    assert tok.decode(trained) == "The answer is 5.<|im_end|>\n8<|im_end|>\n"


@pytest.mark.parametrize(
    "chat", [[Q1, A1], [SYSTEM, Q1, A1], [Q1, A1, Q2, A2], [SYSTEM, Q1, A1, Q2, A2]]
)
def test_prompt_ids_are_the_rl_prompt_ids(tok, chat):
    first = next(k for k, m in enumerate(chat) if m["role"] == "assistant")
    [ex] = sft_data([{"messages": chat}], tok)
    assert ex.prompt_ids == prompt_token_ids([chat[:first]], tok)[0]
    # and the whole example is the full conversation's rendering, token by token here
    full = enc(tok, tok.apply_chat_template(chat, tokenize=False))
    assert ex.prompt_ids + ex.response_ids == full


def test_the_tiny_tokenizers_own_template_gives_the_same(tok, tokenizer):
    rows = [{"messages": [SYSTEM, Q1, A1, Q2, A2]}]
    assert list(sft_data(rows, tokenizer)) == list(sft_data(rows, tok))


def test_none_keys_of_a_dataset_are_dropped_and_sources_agree(tok, tmp_path):
    named = {**Q1, "name": "ann"}  # a Dataset gives every other message "name": None
    rows = [{"messages": [named, A1]}, {"messages": [Q2, A2]}]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "chats.parquet")
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = list(sft_data(rows, tok))
    for source in (
        datasets.Dataset.from_list(rows),
        tmp_path / "chats.parquet",
        tmp_path / "chats.jsonl",
    ):
        assert list(sft_data(source, tok)) == expected


# ---------------------------------------------------------------------- prompt / completion
def test_text_prompt_and_completion_end_with_eos(tok):
    data = sft_data(
        [{"prompt": "What is 2 + 3?", "completion": " 5"}, {"prompt": "Hi", "completion": 7}], tok
    )
    assert (
        data[0].prompt_ids
        == prompt_token_ids(["What is 2 + 3?"], tok)[0]
        == enc(tok, "What is 2 + 3?")
    )
    assert data[0].response_ids == [*enc(tok, " 5"), tok.eos_token_id]
    assert data[1].response_ids == [*enc(tok, "7"), tok.eos_token_id]  # a number, as text
    assert all(
        all(ex.response_mask) and len(ex.response_mask) == len(ex.response_ids) for ex in data
    )


def test_a_bos_tokenizer_puts_bos_on_the_prompt_only():
    tok = tiny_tokenizer()
    bos = _id(tok, "<|im_start|>")  # any special token will do as a BOS here
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    [ex] = sft_data([{"prompt": "Hi", "completion": " there"}], tok)
    assert ex.prompt_ids == [bos, *enc(tok, "Hi")] == prompt_token_ids(["Hi"], tok)[0]
    assert ex.response_ids == [*enc(tok, " there"), tok.eos_token_id]


def test_message_prompt_and_completion(tok):
    # A few-shot assistant turn inside the prompt is context, not trained.
    rows = [
        {"prompt": [Q1, A1, Q2], "completion": [A2]},
        {"prompt": [Q1, A1, Q2], "completion": "8"},  # text: one assistant message
    ]
    a, b = sft_data(rows, tok)
    assert a.prompt_ids == prompt_token_ids([[Q1, A1, Q2]], tok)[0]
    assert a.prompt_ids == [
        *turn(tok, "user", Q1["content"]),
        *turn(tok, "assistant", A1["content"]),
        *turn(tok, "user", Q2["content"]),
        *header(tok),
    ]
    assert a.response_ids == answer(tok, "8") and all(a.response_mask)
    assert (b.prompt_ids, b.response_ids, b.response_mask) == (
        a.prompt_ids,
        a.response_ids,
        a.response_mask,
    )
    # a tool call and its result inside the completion: only the assistant turns train
    tool = {"role": "tool", "content": "8"}
    [c] = sft_data([{"prompt": [Q2], "completion": [A1, tool, A2]}], tok)
    assert c.response_mask == [True] * len(answer(tok, A1["content"])) + [False] * len(
        [*turn(tok, "tool", "8"), *header(tok)]
    ) + [True] * len(answer(tok, "8"))


def test_messages_win_when_both_layouts_are_there(tok):
    rows = [{"messages": [Q1, A1], "prompt": "ignored", "completion": "ignored"}]
    assert list(sft_data(rows, tok)) == list(sft_data([{"messages": [Q1, A1]}], tok))
    renamed = [{"chat": [Q1, A1]}]
    assert list(sft_data(renamed, tok, messages="chat")) == list(sft_data(rows, tok))


# ---------------------------------------------------------------------- rollouts
def _three(tok) -> SFTData:
    return sft_data(
        [
            {"messages": [Q1, A1]},
            {"messages": [SYSTEM, Q2, A2]},
            {"messages": [Q1, A1, Q2, A2]},
        ],
        tok,
    )


def test_rollouts_pads_prompts_left_and_responses_right(tok):
    data = _three(tok)
    ro = data.rollouts([2, 0])
    ro.validate()
    pad = tok.pad_token_id
    picked = [data[2], data[0]]
    tp = max(len(ex.prompt_ids) for ex in picked)
    t = max(len(ex.response_ids) for ex in picked)
    assert ro.prompt_ids.shape == (2, tp) and ro.response_ids.shape == (2, t)
    assert ro.attention_mask.shape == (2, tp + t) and ro.response_mask.shape == (2, t)
    for row, ex in enumerate(picked):
        np_, nr = len(ex.prompt_ids), len(ex.response_ids)
        assert ro.prompt_ids[row].tolist() == [pad] * (tp - np_) + ex.prompt_ids
        assert ro.response_ids[row].tolist() == ex.response_ids + [pad] * (t - nr)
        assert ro.response_mask[row].tolist() == ex.response_mask + [False] * (t - nr)
        assert ro.attention_mask[row].tolist() == (
            [False] * (tp - np_) + [True] * (np_ + nr) + [False] * (t - nr)
        )
        assert ro.prompts[row] == tok.decode(ex.prompt_ids)
        assert ro.completions[row] == tok.decode(ex.response_ids, skip_special_tokens=True)
    assert ro.group_ids.tolist() == [0, 1] and ro.metadata == [{"index": 2}, {"index": 0}]
    assert ro.pad_token_id == pad and ro.prompt_ids.dtype == torch.long
    # the padded batch is already tight, and all of it in order by default
    assert ro.trim().prompt_ids.shape == ro.prompt_ids.shape
    assert data.rollouts().metadata == [{"index": i} for i in range(3)]


def test_rollouts_pads_with_eos_when_there_is_no_pad_token(tok):
    no_pad = tiny_tokenizer()
    no_pad.pad_token = None
    data = SFTData(list(_three(tok)), no_pad)
    ro = data.rollouts([0, 1])
    assert ro.pad_token_id == no_pad.eos_token_id
    assert ro.prompt_ids[0, 0] == no_pad.eos_token_id  # row 0's prompt has no system turn
    with pytest.raises(ValueError, match="no examples"):
        data.rollouts([])


def test_slices_keep_the_tokenizer_and_dropped(tok):
    data = SFTData(list(_three(tok)), tok, dropped=[7])
    part = data[1:]
    assert isinstance(part, SFTData) and len(part) == 2 and part.dropped == (7,)
    assert part.rollouts().metadata == [{"index": 1}, {"index": 2}]
    assert repr(data) == "SFTData(3 examples, 1 dropped)"


# ---------------------------------------------------------------------- batches
def _numbered(tok, n: int) -> SFTData:
    """``n`` examples whose response is the number of their row, for telling batches apart."""
    return sft_data([{"prompt": f"p{i}", "completion": str(i)} for i in range(n)], tok)


def _rows(batches, steps: int) -> list[list[int]]:
    return [[m["index"] for m in b.metadata] for b in itertools.islice(batches, steps)]


def test_batches_follow_the_seeded_permutation_and_keep_the_last_batch(tok):
    n, b, seed = 7, 3, 5
    batches = SFTBatches(_numbered(tok, n), batch_size=b, seed=seed)
    # Reference: epoch e visits permutation(7) of a generator seeded with (seed, e), in batches
    # of 3, 3 and the 1 left over.
    expected = []
    for epoch in range(3):
        order = np.random.default_rng([seed, epoch]).permutation(n).tolist()
        expected += [order[0:3], order[3:6], order[6:7]]
    assert _rows(batches, 9) == expected and batches.steps_per_epoch == 3
    dropping = SFTBatches(_numbered(tok, n), batch_size=b, seed=seed, drop_last=True)
    assert _rows(dropping, 4) == [expected[0], expected[1], expected[3], expected[4]]


def test_a_batch_is_the_rollouts_of_its_examples(tok):
    data = _numbered(tok, 5)
    batch = next(SFTBatches(data, batch_size=2, shuffle=False))
    expected = data.rollouts([0, 1])
    for name in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "group_ids"):
        torch.testing.assert_close(getattr(batch, name), getattr(expected, name))


def test_same_seed_same_batches(tok):
    data = _numbered(tok, 10)
    a = _rows(SFTBatches(data, batch_size=4, seed=1), 8)
    assert a == _rows(SFTBatches(data, batch_size=4, seed=1), 8)
    assert a != _rows(SFTBatches(data, batch_size=4, seed=2), 8)


@pytest.mark.parametrize("stop_after", [1, 2, 3, 4])
def test_resume_mid_epoch_gives_the_same_next_batches(tok, stop_after):
    # 7 examples in batches of 3: an epoch is 3 batches, so 1, 2 and 4 stop mid-epoch, 3 at
    # the boundary.
    data = _numbered(tok, 7)
    uninterrupted = list(itertools.islice(SFTBatches(data, batch_size=3, seed=4), stop_after + 5))
    first = SFTBatches(data, batch_size=3, seed=4)
    list(itertools.islice(first, stop_after))
    resumed = SFTBatches(data, batch_size=3, seed=4)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for want, got in zip(uninterrupted[stop_after:], itertools.islice(resumed, 5), strict=True):
        torch.testing.assert_close(got.input_ids, want.input_ids)
        torch.testing.assert_close(got.response_mask, want.response_mask)
        assert got.metadata == want.metadata


def test_resume_through_the_recipes_drawn(tok):
    data = _numbered(tok, 5)
    drawn = Drawn(SFTBatches(data, batch_size=2, seed=0))
    straight = _rows(SFTBatches(data, batch_size=2, seed=0), 7)
    assert _rows(drawn, 4) == straight[:4]  # epoch 0: 2 + 2 + 1, then a batch of epoch 1
    state = json.loads(json.dumps(drawn.state_dict()))
    assert state["source"]["epoch"] == 1 and state["source"]["position"] == 2
    again = Drawn(SFTBatches(data, batch_size=2, seed=0))
    again.load_state_dict(state)
    assert _rows(again, 3) == straight[4:]


def test_epochs_limit_and_refused_resumes(tok):
    batches = SFTBatches(_numbered(tok, 5), batch_size=2, epochs=2)
    assert len(batches) == 6 and len(list(batches)) == 6 and list(batches) == []
    with pytest.raises(TypeError, match="endless"):
        len(SFTBatches(_numbered(tok, 5), batch_size=2))
    state = SFTBatches(_numbered(tok, 5), batch_size=2).state_dict()
    with pytest.raises(ValueError, match="saved batch_size=2, this one has 3"):
        SFTBatches(_numbered(tok, 5), batch_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="saved num_rows=5, this one has 6"):
        SFTBatches(_numbered(tok, 6), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        SFTBatches(_numbered(tok, 5), batch_size=0)
    with pytest.raises(ValueError, match="fewer than batch_size=6"):
        SFTBatches(_numbered(tok, 5), batch_size=6, drop_last=True)
    with pytest.raises(ValueError, match="empty"):
        SFTBatches(SFTData([], tok), batch_size=1)


# ---------------------------------------------------------------------- errors
def _jsonl(tmp_path, rows) -> str:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GOOD = {"messages": [Q1, A1]}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            {"messages": [Q1, Q2]},
            r"column 'messages': no assistant turn to train on \(roles \['user', 'user'\]\)",
        ),
        ({"messages": [A1, Q1, A2]}, "starts with an assistant turn"),
        (
            {"messages": [Q1, {"role": "assistant", "content": "  "}]},
            "message 1: the assistant turn is empty",
        ),
        ({"messages": [Q1, {"role": "assistant"}]}, "message 1: expected a dict with str 'role'"),
        ({"messages": [Q1, {"role": "assistant", "content": 5}]}, "message 1: expected a dict"),
        ({"messages": []}, "expected a non-empty list of chat messages"),
        ({"messages": "Hi"}, "expected a non-empty list of chat messages"),
        ({"messages": None}, "column 'messages': value is missing"),
        ({"prompt": "x"}, "column 'messages' is missing"),
    ],
)
def test_a_bad_conversation_names_file_line_and_row(tmp_path, tok, bad, message):
    path = _jsonl(tmp_path, [GOOD, GOOD, bad])
    with pytest.raises(ValueError, match=rf"sft.jsonl, line 3 \(row 2\).*{message}"):
        sft_data(path, tok)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt": "Hi", "completion": " "}, "column 'completion': text is empty"),
        ({"prompt": "Hi", "completion": None}, "column 'completion': value is missing"),
        ({"prompt": "", "completion": "x"}, "column 'prompt': text is empty"),
        (
            {"prompt": "Hi", "completion": [A1]},
            "'prompt' is text but 'completion' holds chat messages",
        ),
        (
            {"prompt": [Q1], "completion": [Q2, A2]},
            "must start with an assistant message, got role 'user'",
        ),
        ({"prompt": [Q1], "completion": [A1, Q2]}, None),  # fine: a trailing user turn is dropped
    ],
)
def test_a_bad_prompt_completion_row_names_its_row(tok, bad, message):
    rows = [{"prompt": "Hi", "completion": "x"}, bad]
    if message is None:
        assert len(sft_data(rows, tok)) == 2
        return
    with pytest.raises(ValueError, match=rf"^(rb\.data|sft_data): row 1.*{message}"):
        sft_data(rows, tok)


def test_a_template_that_is_not_prefix_stable(tok):
    # The generation prompt says "assistant", a rendered assistant turn "model".
    odd = tiny_tokenizer()
    odd.chat_template = CHATML.replace(
        "{{ m['role'] }}", "{{ 'model' if m['role'] == 'assistant' else m['role'] }}"
    )
    with pytest.raises(
        ValueError,
        match=r"^sft_data: row 0: the chat template is not prefix-stable: the rendering of "
        r"messages\[:2\] "
        r"does not start with that of messages\[:1\] with the generation prompt",
    ):
        sft_data([GOOD], odd)
    # One that marks the last assistant turn (as Qwen3 drops the thinking of earlier turns)
    # is stable for one turn, not between turns: "(final)" vanishes from turn 1 once turn 2 is
    # there.
    marked = tiny_tokenizer()
    marked.chat_template = CHATML.replace(
        "{{ m['content'] }}",
        "{{ m['content'] }}{% if loop.last and m['role'] == 'assistant' %} (final){% endif %}",
    )
    [ex] = sft_data([GOOD], marked)
    assert tok.decode(ex.response_ids) == "The answer is 5. (final)<|im_end|>\n"
    with pytest.raises(
        ValueError,
        match=r"^sft_data: row 0: the chat template is not prefix-stable: the rendering of "
        r"messages\[:3\] "
        r"with the generation prompt does not start with that of messages\[:2\] \(they differ at "
        r"character \d+: ' \(final\)<\|im_end",
    ):
        sft_data([{"messages": [Q1, A1, Q2, A2]}], marked)


def test_missing_columns_template_or_eos(tok):
    with pytest.raises(
        ValueError,
        match=r"^sft_data: no SFT columns: expected 'messages' .* or 'prompt' and 'completion', "
        r"available columns: \['text'\]; name yours with messages=",
    ):
        sft_data([{"text": "hi"}], tok)
    plain = tiny_tokenizer()
    plain.chat_template = None
    with pytest.raises(
        ValueError, match="row 0, column 'messages': chat messages need a chat template"
    ):
        sft_data([GOOD], plain)
    no_eos = tiny_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="row 0: a text completion needs an EOS token"):
        sft_data([{"prompt": "Hi", "completion": "x"}], no_eos)
    with pytest.raises(ValueError, match="overlong must be"):
        sft_data([GOOD], tok, overlong="cut")
    with pytest.raises(ValueError, match="max_tokens must be >= 2"):
        sft_data([GOOD], tok, max_tokens=1)


# ---------------------------------------------------------------------- overlong
def _lengths(tok):
    """Two rows, the first short: (row, prompt length, response length) by hand."""
    rows = [{"messages": [Q1, A1]}, {"messages": [Q1, A1, Q2, A2]}]
    prompt = len(turn(tok, "user", Q1["content"]) + header(tok))
    first = len(answer(tok, A1["content"]))
    between = len(turn(tok, "user", Q2["content"]) + header(tok))
    return rows, prompt, first, between, len(answer(tok, A2["content"]))


def test_overlong_error_names_the_first_long_row(tok):
    rows, prompt, first, between, second = _lengths(tok)
    total = prompt + first + between + second
    with pytest.raises(
        ValueError,
        match=rf"^sft_data: row 1: prompt \+ response is {total} tokens \({prompt} \+ "
        rf"{first + between + second}\), longer than max_tokens={total - 1} \(1 of 2 rows",
    ):
        sft_data(rows, tok, max_tokens=total - 1)
    assert len(sft_data(rows, tok, max_tokens=total)) == 2  # the limit itself is allowed


def test_overlong_filter_drops_and_records(tok):
    rows, prompt, first, _, _ = _lengths(tok)
    with pytest.warns(UserWarning, match=r"dropped 1 of 2 SFT examples .* \(source rows \[0\]\)"):
        data = sft_data([rows[1], rows[0]], tok, max_tokens=prompt + first, overlong="filter")
    assert data.dropped == (0,) and data.num_dropped == 1
    assert [ex.index for ex in data] == [1] and data.rollouts().metadata == [{"index": 1}]


def test_overlong_truncate_cuts_the_response_end(tok):
    rows, prompt, first, between, _ = _lengths(tok)
    full = sft_data(rows, tok)[1]
    with pytest.warns(UserWarning, match="truncated the responses of 1 of 2"):
        data = sft_data(rows, tok, max_tokens=prompt + first + between + 1, overlong="truncate")
    assert data[0] == sft_data(rows, tok)[0]  # short rows untouched
    cut = data[1]  # one token into the second answer
    assert cut.prompt_ids == full.prompt_ids
    assert cut.response_ids == full.response_ids[: first + between + 1]
    assert cut.response_mask == full.response_mask[: first + between + 1]
    # A cut inside user turn 2 leaves untrained tokens at the end: they are cut too.
    with pytest.warns(UserWarning, match="truncated"):
        inside = sft_data(rows, tok, max_tokens=prompt + first + 3, overlong="truncate")[1]
    assert inside.response_ids == full.response_ids[:first] and all(inside.response_mask)
    with pytest.raises(ValueError, match=rf"row 0: the prompt is {prompt} tokens, and no trained"):
        sft_data(rows, tok, max_tokens=prompt, overlong="truncate")


def test_no_warning_when_nothing_is_long(tok):
    rows, *_ = _lengths(tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(sft_data(rows, tok, max_tokens=10_000, overlong="filter")) == list(
            sft_data(rows, tok)
        )


def test_examples_are_named_tuples(tok):
    ex = sft_data([GOOD], tok)[0]
    assert isinstance(ex, SFTExample) and ex._fields == (
        "prompt_ids",
        "response_ids",
        "response_mask",
        "index",
    )
