"""The token budget that fills a device (``rlblocks.planner.budget``) and the trainer's use of it
(``rlblocks.trainer.numerics.fit_token_budget``), against the planner's own parts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rlblocks as rb
from rlblocks.planner import model_shape
from rlblocks.planner.budget import STEP, token_budget
from rlblocks.planner.sizing import GIB, MARGIN
from rlblocks.trainer.numerics import fit_token_budget


@pytest.fixture(scope="module")
def shape():
    return model_shape(rb.models.tiny()[0], dtypes=(torch.float32,))


def _working(shape, budget_setup_tokens: int) -> int:
    plan = rb.plan(shape.name, shape=shape, dtype="fp32", tokens=budget_setup_tokens,
                   reference=False, engine=None, device_memory=GIB)  # fmt: skip
    return plan.trainer["activations"] + plan.trainer["logits"]


def test_the_budget_is_the_largest_step_multiple_that_fits(shape):
    free, total = 200 * 2**20, 1 * GIB  # 200 MiB free of 1 GiB: 200 − 102.4 MiB usable
    budget = token_budget(shape, free=free, total=total, param_dtype=torch.float32,
                          compute_dtype=torch.float32)  # fmt: skip
    usable = free - int(MARGIN * total)
    # Gradients + AdamW's two moments: 3 × every trainable float32 parameter.
    assert budget.fixed == 3 * 4 * shape.trainable
    assert budget.tokens > 0 and budget.tokens % STEP == 0
    assert budget.fixed + _working(shape, budget.tokens) <= usable
    assert budget.fixed + _working(shape, budget.tokens + STEP) > usable
    assert "micro_batch_tokens=" in budget.reason("PolicyTrainer")


def test_a_device_too_small_gives_no_budget_and_the_trainer_says_why(shape):
    model = rb.models.tiny()[0]
    config = rb.trainer.TrainConfig()
    with pytest.raises(ValueError, match=r"PolicyTrainer: the device's free memory .* does not"):
        fit_token_budget(model, config, owner="PolicyTrainer", free=2**20, total=GIB)


def test_the_trainer_fills_an_unset_budget_and_refuses_one_that_cannot_fit(shape):
    model = rb.models.tiny()[0]
    free, total = 200 * 2**20, GIB
    chosen, reason = fit_token_budget(model, rb.trainer.TrainConfig(), owner="PolicyTrainer",
                                      free=free, total=total)  # fmt: skip
    expected = token_budget(shape, free=free, total=total, param_dtype=torch.float32,
                            compute_dtype=torch.float32).tokens  # fmt: skip
    assert chosen.micro_batch_tokens == expected and reason is not None
    # Rows per forward as asked: nothing chosen.
    rows = rb.trainer.TrainConfig(micro_batch_size=4)
    assert fit_token_budget(model, rows, owner="x", free=free, total=total) == (rows, None)
    # A budget the plan says needs more than the whole free memory: refused, naming the field.
    huge = rb.trainer.TrainConfig(micro_batch_tokens=expected * 64)
    with pytest.raises(ValueError, match=r"TrainConfig.micro_batch_tokens: .* pass "):
        fit_token_budget(model, huge, owner="PolicyTrainer", free=free, total=total)
    # One within the free memory (past the margin) is the user's call.
    fine = dataclasses.replace(huge, micro_batch_tokens=expected)
    assert fit_token_budget(model, fine, owner="x", free=free, total=total) == (fine, None)


def test_on_the_cpu_nothing_is_chosen():
    trainer = rb.trainer.PolicyTrainer(rb.models.tiny()[0], reference=None)
    assert trainer.config.micro_batch_tokens is None


def test_bf16_asked_where_the_device_has_none_is_refused_and_never_chosen():
    # torch answers for the device: on a machine without a CUDA device with bf16 (this one,
    # or an older card), torch.cuda.is_bf16_supported() is False.
    from rlblocks.trainer.numerics import resolve_numerics

    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        pytest.skip("this machine's GPU has bf16")
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"PolicyTrainer: bf16=True, and .* has no bf16"):
        resolve_numerics(
            rb.trainer.TrainConfig(bf16=True), cuda, torch.float32, owner="PolicyTrainer"
        )
    decided = resolve_numerics(rb.trainer.TrainConfig(), cuda, torch.float32, owner="x")
    assert (decided.bf16, decided.compile) == (False, True)  # compiled on a GPU, no autocast
    cpu = resolve_numerics(rb.trainer.TrainConfig(), torch.device("cpu"), torch.float32, owner="x")
    assert (cpu.bf16, cpu.compile) == (False, False)
