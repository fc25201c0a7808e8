"""The teacher block: the trainer's scores, frozen, in any micro-batching, one vocabulary."""

import pytest
import torch
from builders import tiny_engine, tiny_trainer

import rlblocks as rb


@pytest.fixture(scope="module")
def rollouts():
    engine = tiny_engine(tiny_trainer())
    return engine.generate(
        ["Count: 1", "Count: 22", "a longer prompt here"],
        group_size=2,
        sampling=rb.SamplingParams(max_new_tokens=6, seed=0),
    )


def test_teacher_scores_as_the_trainer_does(rollouts):
    policy = tiny_trainer(seed=3)
    expected = policy.logprobs(rollouts)
    teacher = rb.trainer.Teacher(policy.model, tokenizer=policy.tokenizer)
    torch.testing.assert_close(teacher.logprobs(rollouts), expected, rtol=0, atol=0)
    assert isinstance(teacher, rb.interfaces.Teacher)  # the contract the distill recipe uses
    assert not any(p.requires_grad for p in teacher.model.parameters())
    assert not teacher.model.training


@pytest.mark.parametrize("pieces", [{"micro_batch_size": 1}, {"micro_batch_tokens": 0}])
def test_teacher_scores_do_not_depend_on_micro_batching(rollouts, pieces):
    if "micro_batch_tokens" in pieces:  # the longest row's tokens: one or two rows a piece
        pieces = {"micro_batch_tokens": int(rollouts.attention_mask.sum(-1).max())}
    model, _ = rb.models.tiny(seed=3, dtype=torch.float64)
    whole = rb.trainer.Teacher(model).logprobs(rollouts)
    cut = rb.trainer.Teacher(model, **pieces).logprobs(rollouts)
    torch.testing.assert_close(cut.double(), whole.double(), rtol=1e-6, atol=1e-6)
    assert (cut[~rollouts.response_attention_mask] == 0).all()


def test_a_different_vocabulary_is_refused(rollouts):
    _, tokenizer = rb.models.tiny(seed=0)
    other = rb.models.tiny_tokenizer(vocab_size=300)
    with pytest.raises(ValueError, match="tokenizers differ at token id"):
        rb.trainer.check_same_vocabulary(tokenizer, other)
    rb.trainer.check_same_vocabulary(tokenizer, rb.models.tiny_tokenizer())  # the same: fine
    small, _ = rb.models.tiny(seed=0, vocab_size=64)
    with pytest.raises(ValueError, match="outside the teacher's vocabulary of 64"):
        rb.trainer.Teacher(small).logprobs(rollouts)
