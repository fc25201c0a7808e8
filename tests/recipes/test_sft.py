"""SFT on the RL trainer: the held-out loss falls and sampled answers change; lr 0 changes
nothing. The data side (tokenizing chats, exact masks) is tests/data/test_sft.py."""

import pytest
import torch
from builders import tiny_trainer
from toy_tasks import count_prompts, digit_examples, digit_fraction

import rlblocks as rb


def fine_tune(lr: float, steps: int = 20):
    """SFT the tiny model on 32 digit examples, 8 a step; held-out: 16 other prompts."""
    policy = tiny_trainer(lr=lr)
    tokenizer = policy.tokenizer
    train = digit_examples(tokenizer, 0, 32)
    held_out = digit_examples(tokenizer, 100, 16)
    batches = (train.select(list(range(k % 4 * 8, k % 4 * 8 + 8))) for k in range(steps))
    before = rb.recipes.held_out_nll(policy, held_out)
    history = rb.recipes.sft(
        policy,
        batches,
        steps=steps,
        held_out=held_out,
        eval_every=5,
        run=rb.run.RunOptions(progress=False),
    )
    return policy, tokenizer, before, history


def digit_reward(policy, tokenizer) -> float:
    engine = rb.rollout.HFEngine(policy.model, tokenizer, progress=False)
    prompts = count_prompts()
    rollouts = engine.generate(
        prompts.prompts, group_size=4, sampling=rb.SamplingParams(max_new_tokens=8, seed=0)
    )
    rewards, _ = rb.rewards.per_sample(digit_fraction, timeout=None)(rollouts)
    return rewards.mean().item()


@pytest.fixture(scope="module")
def trained():
    return fine_tune(lr=1e-2)


def test_sft_lowers_the_held_out_loss(trained):
    _, _, before, history = trained
    evals = [h["eval/nll"] for h in history if "eval/nll" in h]
    assert len(evals) == 4  # steps 5, 10, 15, 20
    # A random tiny model spreads its mass over a 384-token vocabulary: nll ≈ ln 384 ≈ 5.95.
    assert before == pytest.approx(5.95, abs=0.3)
    # Held-out prompts are other numbers, targets the same rotations of "0123456789": learnt,
    # the loss falls far below the uniform one (measured 2.82, 1.59, 1.12, 0.92; the first
    # digit, one of 10 rotations, alone costs up to ln 10 / 9 ≈ 0.26 per token).
    assert evals[-1] < 1.5, evals
    assert history[-1]["nll"] < 1.5


def test_sft_with_zero_learning_rate_changes_nothing():
    _, _, before, history = fine_tune(lr=0.0, steps=5)
    assert history[-1]["eval/nll"] == pytest.approx(before, abs=1e-6)


def test_sft_raises_the_toy_task_reward_past_the_lr0_control(trained):
    policy, tokenizer, _, _ = trained
    control, tok = fine_tune(lr=0.0, steps=2)[:2]
    # Random tiny model: ~2% digits (measured 0.019); after 20 SFT steps on digit targets
    # most characters are (measured 0.86, 64 samples). The threshold sits between the two.
    assert digit_reward(control, tok) < 0.2
    assert digit_reward(policy, tokenizer) > 0.5


@pytest.mark.parametrize("pieces", [{"micro_batch_tokens": 0}, {"micro_batch_size": 1}])
def test_an_sft_step_does_not_depend_on_the_micro_batches(pieces):
    """Token-budget (or one-row) micro-batches of chats of different lengths give the update of
    the whole batch: one normalizer for the batch, as in RL (float64, so only rounding differs)."""
    _, tokenizer = rb.models.tiny(seed=0)
    chats = [
        {
            "messages": [
                {"role": "user", "content": "Count: " + "1" * k},
                {"role": "assistant", "content": "2" * (3 * k + 1)},
            ]
        }
        for k in range(1, 7)
    ]
    batch = rb.data.sft_data(chats, tokenizer).rollouts()
    if "micro_batch_tokens" in pieces:  # the longest chat's tokens: one or two chats a piece
        pieces = {"micro_batch_tokens": int(batch.attention_mask.sum(-1).max())}
    weights = []
    for options in ({}, pieces):
        policy = tiny_trainer(torch.float64, tokenizer=False, lr=1e-3, **options)
        rb.recipes.sft(
            policy,
            [batch],
            steps=1,
            run=rb.run.RunOptions(progress=False),
        )
        weights.append(torch.cat([p.detach().flatten() for p in policy.model.parameters()]))
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=1e-12)
    assert not torch.equal(
        weights[0],
        torch.cat(
            [p.flatten() for p in rb.models.tiny(seed=0, dtype=torch.float64)[0].parameters()]
        ),
    )  # it did train
