"""`RewardModel`: tiny sequence-classification reward models built here, with their own tokenizer
and chat template (not the policy's ChatML), scored batched and one by one, on both padding
sides, combined with a rule reward, in a GRPO step, on a Ray role and on CUDA where there is one.

The reward models are random: what is tested is that every row is scored exactly as an unpadded
forward of that row's conversation would score it, not what the scores mean.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from tokenizers import Tokenizer
from transformers import (
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2ForSequenceClassification,
)

import rlblocks as rb
from rlblocks.data import PromptBatches, load_prompts

# The reward model's own chat format: different from the policy's ChatML on purpose.
RM_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}"
)
QUESTIONS = [
    "What is 2 + 3?",
    "Tom has 3 apples and buys 5 more. How many apples does he have now?",
    "Say hi",
    "Compute 6 * 7, then divide by 2.",
    "one two three four five six seven eight nine ten",
    "7 times 8",
]
ANSWERS = ["5", "He has 8 apples. #### 8", "Hello! How are you today?", "21", "eleven", "56"]

# Float32 tolerance of a batched score against its unpadded single-row forward. A score is the
# dot product of the 64-wide final hidden state (RMS-normed, entries ~1) with the head's weights
# (~0.02): |score| < 0.2 here, where a float32 ulp is 1.5e-8. Padding changes only the shapes the
# kernels see, hence the order of float32 additions in the matrix products and in the softmax
# over the keys; reordering a sum of n terms moves it by about sqrt(n)·2⁻²⁴ relative, and with
# n = 64-128 and two layers that is a few 1e-7 at most (measured: at most 6e-8, 4 ulps). A
# padding bug (pads attended to, the score read at a pad or at the wrong row) moves a score by
# > 1e-3: see the negative controls in test_batched_scores_equal_unpadded_single_row_forwards.
ATOL = 1e-6


def rm_tokenizer(*, pad: bool = True, side: str = "right") -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE tokenizer with the reward model's template (pad token optional)."""
    base = rb.models.tiny_tokenizer()
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(base.backend_tokenizer.to_str()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>" if pad else None,
        chat_template=RM_TEMPLATE,
        padding_side=side,
    )


def qwen_rm(tokenizer, *, seed: int = 0, **overrides) -> Qwen2ForSequenceClassification:
    config = rb.models.tiny_config(tokenizer, **{"num_labels": 1, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForSequenceClassification(config).eval()


def llama_rm(tokenizer, *, seed: int = 1) -> LlamaForSequenceClassification:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForSequenceClassification(config).eval()


def chat_rollouts(make_rollouts, n: int = 6):
    """Rows whose metadata carries the original messages; ``prompts`` holds the policy's
    ChatML rendering, which the reward model must not read."""
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS[:n]]
    policy_text = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]
    return make_rollouts(
        ANSWERS[:n],
        [{"messages": m, "ground_truth": "8"} for m in messages],
        prompts=policy_text[:n],
    )


def unpadded_scores(model, ids: list[list[int]]) -> torch.Tensor:
    """The reference: each row alone, no padding, no attention mask, default positions."""
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([row])).logits[0, 0] for row in ids])


# ---------------------------------------------------------------------- batched == one by one
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_batched_scores_equal_unpadded_single_row_forwards(make_rollouts, family, side):
    tokenizer = rm_tokenizer(side=side)
    model = qwen_rm(tokenizer) if family == "qwen2" else llama_rm(tokenizer)
    rm = rb.rewards.RewardModel(model, tokenizer, batch_size=4)
    ro = chat_rollouts(make_rollouts)
    ids, truncated = rm.encode(ro)
    lengths = sorted(len(row) for row in ids)
    assert truncated == 0 and lengths[0] < lengths[-1] // 2  # padding really happens
    reference = unpadded_scores(model, ids)
    batched, metrics = rm(ro)  # 6 rows: batches of 4 and 2, padded to their longest row
    torch.testing.assert_close(batched, reference, rtol=0, atol=ATOL)
    # One row at a time nothing is padded: the very same forward, bit for bit.
    one_by_one = torch.cat([rm(ro.select([i])).rewards for i in range(len(ro))])
    assert torch.equal(one_by_one, reference)
    # The scores differ from row to row by far more than the tolerance: a swapped or shifted
    # row would show.
    gaps = (reference[:, None] - reference[None, :]).abs()[~torch.eye(len(ids), dtype=torch.bool)]
    assert gaps.min() > 10 * ATOL
    # Negative controls: the shortest row padded to the batch width, scored the two wrong ways
    # a padding bug would score it, is off by far more than the tolerance.
    shortest = min(range(len(ids)), key=lambda i: len(ids[i]))
    pads = [rm.pad_token_id] * (max(len(r) for r in ids) - len(ids[shortest]))
    if side == "left":  # pads attended to (no attention mask)
        row = pads + ids[shortest]
    else:  # padded with another id than config.pad_token_id: the score is read at a pad
        row = ids[shortest] + [5] * len(pads)
    with torch.no_grad():
        wrong = model(input_ids=torch.tensor([row])).logits[0, 0]
    assert (wrong - reference[shortest]).abs() > 1e-3
    assert metrics["reward/raw_mean"] == pytest.approx(float(reference.mean()), abs=ATOL)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_and_padded_batches_give_the_unpadded_scores(make_rollouts, family):
    # float32 scores of the same tokens by differently shaped forwards: rounding only (ATOL,
    # as above); a row reading another row's tokens moves its score by more than 1e-3.
    tokenizer = rm_tokenizer()
    model = qwen_rm(tokenizer) if family == "qwen2" else llama_rm(tokenizer)
    ro = chat_rollouts(make_rollouts)
    packed = rb.rewards.RewardModel(model, tokenizer, batch_size=4)
    padded = rb.rewards.RewardModel(model, tokenizer, batch_size=4, packing=False)
    assert packed.packing and not padded.packing
    reference = unpadded_scores(model, packed.encode(ro)[0])
    torch.testing.assert_close(packed(ro).rewards, reference, rtol=0, atol=ATOL)
    torch.testing.assert_close(padded(ro).rewards, reference, rtol=0, atol=ATOL)
    # A row ending in the padding id is read at the token before it, as the pooling reads it.
    ids = [[7, 8, 9, tokenizer.pad_token_id], [5, 6]]
    torch.testing.assert_close(packed.score_ids(ids), padded.score_ids(ids), rtol=0, atol=ATOL)


def test_left_and_right_padding_give_the_same_scores(make_rollouts):
    ro = chat_rollouts(make_rollouts)
    tokenizer = rm_tokenizer(side="right")
    model = qwen_rm(tokenizer)
    right = rb.rewards.RewardModel(model, tokenizer, batch_size=6)(ro).rewards
    tokenizer.padding_side = "left"
    left = rb.rewards.RewardModel(model, tokenizer, batch_size=6)(ro).rewards
    torch.testing.assert_close(left, right, rtol=0, atol=ATOL)


def test_a_tokenizer_and_config_without_pad_token_still_batch(make_rollouts):
    # transformers refuses batches > 1 when config.pad_token_id is None; the reward model takes
    # the EOS token as padding (TRL's rule), writes it into the config, and batches.
    tokenizer = rm_tokenizer(pad=False)
    assert tokenizer.pad_token_id is None
    model = qwen_rm(tokenizer, pad_token_id=None)
    assert model.config.pad_token_id is None
    rm = rb.rewards.RewardModel(model, tokenizer, batch_size=3)
    assert rm.pad_token_id == model.config.pad_token_id == tokenizer.eos_token_id
    ro = chat_rollouts(make_rollouts)
    ids, _ = rm.encode(ro)
    assert all(row[-1] != tokenizer.eos_token_id for row in ids)  # rows end in "\n"
    torch.testing.assert_close(rm(ro).rewards, unpadded_scores(model, ids), rtol=0, atol=ATOL)


# ---------------------------------------------------------------------- what the model reads
def test_the_conversation_is_rendered_with_the_reward_models_template(make_rollouts):
    rm = rb.rewards.RewardModel(qwen_rm(rm_tokenizer()), rm_tokenizer())
    ro = chat_rollouts(make_rollouts, n=2)
    assert rm.render(ro) == [
        "### user: What is 2 + 3?\n### assistant: 5\n",
        (
            "### user: Tom has 3 apples and buys 5 more. How many apples does he have now?\n"
            "### assistant: He has 8 apples. #### 8\n"
        ),
    ]
    # A system message and a multi-turn prompt keep their roles.
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ro = make_rollouts(["Hello"], [{"messages": turns}], prompts=["ignored"])
    assert rm.render(ro) == ["### system: Be brief.\n### user: Hi\n### assistant: Hello\n"]


def test_text_prompts_are_wrapped_with_chat_true_and_verbatim_otherwise(make_rollouts, caplog):
    tokenizer = rm_tokenizer()
    model = qwen_rm(tokenizer)
    ro = make_rollouts([" 5", " 6"], prompts=["Question: 2 + 3 =", "Question: 3 + 3 ="])
    wrapped = rb.rewards.RewardModel(model, tokenizer, chat=True)
    assert wrapped.render(ro)[0] == "### user: Question: 2 + 3 =\n### assistant:  5\n"
    verbatim = rb.rewards.RewardModel(model, tokenizer)
    with caplog.at_level(logging.WARNING, logger="rlblocks.rewards.model"):
        assert verbatim.render(ro) == ["Question: 2 + 3 = 5", "Question: 3 + 3 = 6"]
        verbatim(ro)
    warnings = [r for r in caplog.records if "scored verbatim" in r.getMessage()]
    assert len(warnings) == 1 and "row 0 has no metadata['messages']" in warnings[0].getMessage()
    # Raw text carried in the metadata is the engine's input: wrapped as a user message too.
    ro = make_rollouts(["5"], [{"messages": "2 + 3 ="}], prompts=["<|im_start|>user..."])
    assert wrapped.render(ro) == ["### user: 2 + 3 =\n### assistant: 5\n"]


def test_bad_prompts_name_the_row(make_rollouts):
    tokenizer = rm_tokenizer()
    rm = rb.rewards.RewardModel(qwen_rm(tokenizer), tokenizer)
    ro = make_rollouts(["a", "b"], [{}, {"messages": {"role": "user", "content": "x"}}])
    with pytest.raises(TypeError, match=r"row 1: metadata\['messages'\] must be raw text"):
        rm(ro)
    no_template = rm_tokenizer()
    no_template.chat_template = None
    ro = make_rollouts(["a"], [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ValueError, match="row 0 is a chat conversation but the reward model's"):
        rb.rewards.RewardModel(qwen_rm(tokenizer), no_template)(ro)


def test_a_failing_batch_names_its_rows():
    # score_ids takes any ids: one past the model's 384-row embedding fails its batch's forward.
    tokenizer = rm_tokenizer()
    rm = rb.rewards.RewardModel(qwen_rm(tokenizer), tokenizer, batch_size=2)
    ids = [[5, 6], [7, 8, 9, 10], [11, 12, 400]]
    with pytest.raises(RuntimeError, match=re.escape("scoring rows [1, 2] (4 tokens the longest) "
                                                     "on cpu failed")):  # fmt: skip
        rm.score_ids(ids)


def test_a_tokenizer_with_more_ids_than_the_embedding_is_refused_when_built(make_rollouts):
    # Before: built without a word; the first row holding an id >= 300 failed in the forward
    # ("index out of range in self" on the CPU, a device-side assert on CUDA), reported as a
    # failing batch with advice about memory.
    tokenizer = rm_tokenizer()  # 384 ids
    model = qwen_rm(tokenizer, vocab_size=300)  # another model's embedding: 300 rows
    first = tokenizer.convert_ids_to_tokens(300)
    with pytest.raises(ValueError, match=rf"^RewardModel: the tokenizer has 384 token ids but the "
                       rf"model's input embedding has 300 rows, so ids 300..383 \(the first: "
                       rf"{re.escape(repr(first))}\) would index past it.*give the reward model "
                       r"the tokenizer it was trained with"):  # fmt: skip
        rb.rewards.RewardModel(model, tokenizer)
    model = qwen_rm(tokenizer)
    model.config.pad_token_id = 500  # e.g. set from another tokenizer after the model was built
    with pytest.raises(ValueError, match=r"the padding id 500 is outside the model's input "
                       r"embedding \(384 rows\)"):  # fmt: skip
        rb.rewards.RewardModel(model, tokenizer)
    # A larger embedding than the tokenizer (padded to a multiple of 64, as many models are).
    rm = rb.rewards.RewardModel(qwen_rm(tokenizer, vocab_size=448), tokenizer)
    assert rm(chat_rollouts(make_rollouts)).rewards.isfinite().all()


# ---------------------------------------------------------------------- length, labels, scores
def test_overlong_rows_error_or_keep_their_end(make_rollouts):
    tokenizer = rm_tokenizer()
    model = qwen_rm(tokenizer)
    ro = chat_rollouts(make_rollouts, n=3)
    full, _ = rb.rewards.RewardModel(model, tokenizer).encode(ro)
    limit = max(len(full[0]), len(full[2]))
    assert len(full[1]) > limit  # row 1 is the long apple question; rows 0 and 2 fit
    pattern = rf"row 1 has {len(full[1])} tokens .* max_length={limit}"
    with pytest.raises(ValueError, match=pattern):
        rb.rewards.RewardModel(model, tokenizer, max_length=limit)(ro)
    rm = rb.rewards.RewardModel(model, tokenizer, max_length=limit, overlong="truncate")
    ids, truncated = rm.encode(ro)
    assert truncated == 1 and ids[1] == full[1][-limit:] and ids[0] == full[0]
    rewards, metrics = rm(ro)
    assert metrics["reward/truncated"] == 1.0
    torch.testing.assert_close(rewards, unpadded_scores(model, ids), rtol=0, atol=ATOL)


def test_max_length_defaults_to_the_models_context(make_rollouts):
    tokenizer = rm_tokenizer()
    assert rb.rewards.RewardModel(qwen_rm(tokenizer), tokenizer).max_length == 512
    tokenizer.model_max_length = 100
    assert rb.rewards.RewardModel(qwen_rm(tokenizer), tokenizer).max_length == 100


def test_normalize_and_metrics_are_hand_checkable(make_rollouts):
    tokenizer = rm_tokenizer()
    model = qwen_rm(tokenizer)
    ro = chat_rollouts(make_rollouts, n=3)
    raw, metrics = rb.rewards.RewardModel(model, tokenizer)(ro)
    mean = (raw[0] + raw[1] + raw[2]) / 3
    std = (((raw - mean) ** 2).sum() / 3).sqrt()  # population std over the 3 rows
    assert metrics["reward/raw_mean"] == pytest.approx(float(mean), rel=1e-6)
    assert metrics["reward/raw_std"] == pytest.approx(float(std), rel=1e-5)
    assert metrics["reward/mean"] == metrics["reward/raw_mean"]
    sig = rb.rewards.RewardModel(model, tokenizer, normalize=torch.sigmoid)(ro)
    torch.testing.assert_close(sig.rewards, 1 / (1 + torch.exp(-raw)))
    assert sig.metrics["reward/raw_mean"] == metrics["reward/raw_mean"]
    shifted = rb.rewards.RewardModel(model, tokenizer, normalize=lambda s: (s - 0.5) * 2.0)(ro)
    torch.testing.assert_close(shifted.rewards, (raw - 0.5) * 2.0)
    with pytest.raises(ValueError, match="normalize must map the raw scores"):
        rb.rewards.RewardModel(model, tokenizer, normalize=lambda s: s.mean())(ro)


def test_several_labels_need_a_label_and_read_that_column(make_rollouts):
    tokenizer = rm_tokenizer()
    model = qwen_rm(tokenizer, num_labels=3)
    with pytest.raises(ValueError, match="the model has 3 labels"):
        rb.rewards.RewardModel(model, tokenizer)
    rm = rb.rewards.RewardModel(model, tokenizer, label=2)
    ro = chat_rollouts(make_rollouts, n=3)
    ids, _ = rm.encode(ro)
    with torch.no_grad():
        expected = torch.stack([model(input_ids=torch.tensor([r])).logits[0, 2] for r in ids])
    torch.testing.assert_close(rm(ro).rewards, expected, rtol=0, atol=ATOL)


# ---------------------------------------------------------------------- loading, combining
def test_from_pretrained_loads_a_folder_and_refuses_anything_else(make_rollouts, tmp_path):
    tokenizer = rm_tokenizer()
    model = qwen_rm(tokenizer)
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    loaded = rb.rewards.RewardModel.from_pretrained(tmp_path / "rm", batch_size=2)
    assert loaded.device == torch.device("cpu") and loaded.batch_size == 2
    ro = chat_rollouts(make_rollouts)
    in_memory = rb.rewards.RewardModel(model, tokenizer, batch_size=2)
    assert loaded.render(ro) == in_memory.render(ro)  # the template and tokenizer came along
    assert loaded.encode(ro) == in_memory.encode(ro)
    assert torch.equal(loaded(ro).rewards, in_memory(ro).rewards)  # same weights, same batches
    with pytest.raises(FileNotFoundError, match="'org/some-rm' is not a local folder"):
        rb.rewards.RewardModel.from_pretrained("org/some-rm")


def test_combined_with_a_rule_reward(make_rollouts):
    tokenizer = rm_tokenizer()
    rm = rb.rewards.RewardModel(qwen_rm(tokenizer), tokenizer)
    ro = chat_rollouts(make_rollouts)  # ground truth "8": only row 1 ("#### 8") is right
    scores = rm(ro).rewards
    reward = rb.rewards.combine({rm: 0.5, rb.rewards.math_answer: 1.0})
    rewards, metrics = reward(ro)
    correct = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(rewards, 0.5 * scores + correct)
    assert metrics["reward_model/weight"] == 0.5
    assert metrics["math_answer/mean"] == pytest.approx(1 / 6)
    assert metrics["reward_model/raw_mean"] == pytest.approx(float(scores.mean()), rel=1e-6)


def test_one_grpo_step_with_the_reward_model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = tiny_trainer()
        engine = tiny_engine(policy, chat=True)
        rm_tok = rm_tokenizer()
        rm = rb.rewards.RewardModel(qwen_rm(rm_tok), rm_tok)
        rows = [{"prompt": q, "ground_truth": "0"} for q in QUESTIONS[:2]]
        data = rb.rewards.prompts_in_metadata(load_prompts(rows, chat=True))
        seen = []
        before = [p.detach().clone() for p in policy.model.parameters()]
        history = rb.recipes.grpo(
            policy,
            engine,
            rm,
            PromptBatches(data, prompts_per_step=2, seed=0),
            steps=1,
            group_size=3,
            sampling=rb.SamplingParams(max_new_tokens=6, temperature=1.0, seed=0),
            run=rb.run.RunOptions(
                on_step=lambda step, metrics, ro: seen.append(ro), progress=False
            ),
        )
    (ro,) = seen
    assert rm.render(ro)[0].startswith("### user: ")  # the RM's template, not the policy's
    rewards = rm(ro).rewards
    assert history[0]["reward/mean"] == pytest.approx(float(rewards.mean()), rel=1e-6)
    assert history[0]["reward/raw_std"] > 0  # distinct scores: non-zero advantages
    after = list(policy.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


# ---------------------------------------------------------------------- placement and devices
# One worker: the role's plumbing (built in a worker from a folder, called through the handle,
# 13-19 s on 2 busy cores, mostly Ray and the worker starting). Two workers also split the rows
# between them (19-28 s, so marked slow).
@pytest.mark.ray
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_runs_on_a_ray_role(make_rollouts, tmp_path, workers):
    tokenizer = rm_tokenizer()
    qwen_rm(tokenizer).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    local = rb.rewards.RewardModel.from_pretrained(tmp_path / "rm", batch_size=2)
    ro = chat_rollouts(make_rollouts)
    expected = local(ro)
    with rb.placement.Ray(workers=workers) as placement:
        rm = placement.build(
            "reward", rb.rewards.RewardModel.from_pretrained, str(tmp_path / "rm"), batch_size=2
        )
        assert rm.world_size == workers
        rewards, metrics = rm(ro)  # rows split over the workers, put back in row order
        combined, combined_metrics = rb.rewards.combine(
            [("rm", rm, 1.0), (rb.rewards.math_answer, 2.0)]
        )(ro)
    # With 2 workers the batches are not the local ones (each worker scores its share): equal up
    # to float32 rounding (ATOL).
    torch.testing.assert_close(rewards, expected.rewards, rtol=0, atol=ATOL)
    assert metrics["reward/raw_mean"] == pytest.approx(
        expected.metrics["reward/raw_mean"], abs=ATOL
    )
    correct = torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(combined, expected.rewards + correct, rtol=0, atol=ATOL)
    assert combined_metrics["rm/weight"] == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scores_on_cuda_match_the_cpu(make_rollouts, tmp_path):
    tokenizer = rm_tokenizer()
    qwen_rm(tokenizer).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    cpu = rb.rewards.RewardModel.from_pretrained(tmp_path / "rm", device="cpu")
    gpu = rb.rewards.RewardModel.from_pretrained(tmp_path / "rm", dtype=torch.float32)
    assert gpu.device.type == "cuda"  # the default device where there is one
    ro = chat_rollouts(make_rollouts)
    # TF32 may be on for CUDA matmuls (10-bit mantissa, ~1e-3 relative): scores |s| < 1 agree
    # to a few 1e-3.
    torch.testing.assert_close(gpu(ro).rewards, cpu(ro).rewards, rtol=0, atol=5e-3)
    bf16 = rb.rewards.RewardModel.from_pretrained(tmp_path / "rm")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert bf16(ro).rewards.dtype == torch.float32
