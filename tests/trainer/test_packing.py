"""Padding-free packing: the layout by hand, and packed against padded scores, losses,
gradients and updates in float64.

Tolerances: packed and padded runs compute the same float64 arithmetic in other shapes, so
matrix products and attention sum in another order. Each value passes through fewer than 10⁴
float64 roundings (eps = 2.2e-16) of terms of magnitude below 10² in the tiny model, a
difference below ~2e-10 absolute; 1e-9 allows for that and is six orders of magnitude below
what a row attending to another row moves (``test_a_model_that_mixes_rows_is_refused``
measures more than 1e-3).
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
from builders import ragged_rollouts, tiny_trainer
from torch.testing import assert_close
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import rlblocks as rb
from rlblocks.critic import ValueModel
from rlblocks.models import tiny
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.forward import score_responses
from rlblocks.trainer.packing import attention_path, pack

TOL = {"rtol": 1e-9, "atol": 1e-9}
LOSS = rb.losses.clipped_surrogate


def test_pack_hand_worked():
    # Row 0: prompt [1, 2], response [4, 5, 6]; row 1: prompt [3] (left-padded), response [7].
    ro = Rollouts.from_lists([[1, 2], [3]], [[4, 5, 6], [7]], pad_token_id=0)
    packed = pack(ro)
    assert packed.input_ids.tolist() == [[1, 2, 4, 5, 6, 3, 7]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert packed.bounds == ((0, 5), (5, 7))
    # Token 4 (packed position 2) is scored by position 1, ...; token 7 (6) by position 5.
    assert packed.keep.tolist() == [1, 2, 3, 5]
    assert packed.targets.tolist() == [4, 5, 6, 7]
    grid = packed.scatter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert grid.tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]


def test_a_row_without_a_prompt_token_is_refused_naming_it():
    ro = Rollouts.from_lists([[1], [2]], [[4], [5]], pad_token_id=0)
    ro = ro.replace(attention_mask=torch.tensor([[1, 1], [0, 1]], dtype=torch.bool))
    with pytest.raises(ValueError, match="row 1 has no real prompt token"):
        pack(ro)


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_scores_equal_padded_scores(seed):
    model, _ = tiny(seed=seed, dtype=torch.float64)
    ro = ragged_rollouts(8, seed=seed)
    options = {"temperature": 0.7, "chunk_size": 5, "entropy": True}
    lp, ent = score_responses(model, ro, packing=True, **options)
    lp_pad, ent_pad = score_responses(model, ro, packing=False, **options)
    assert attention_path(model) == "rows"
    assert_close(lp, lp_pad, **TOL)
    assert_close(ent, ent_pad, **TOL)
    assert (lp[~ro.response_attention_mask] == 0).all()


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_batched_row_attention_equals_one_call_per_row(heads):
    # The GPU form (rows right-padded into one causal call) against the per-row loop, forward
    # and gradients, rows of 1 to 9 tokens, with and without grouped-query heads.
    from rlblocks.models.packing import attend_rows

    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 9, 4, 7]
    bounds = tuple(zip(torch.tensor([0, *lengths]).cumsum(0)[:-1].tolist(),
                       torch.tensor(lengths).cumsum(0).tolist(), strict=True))  # fmt: skip
    n, (hq, hkv) = sum(lengths), heads
    q, k, v = (torch.randn(1, h, n, 8, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    outputs, grads = [], []
    for batched in (False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attend_rows(*leaves, bounds, scale=0.3, batched=batched)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape))
        outputs.append(out.detach())
        grads.append([x.grad for x in leaves])
    assert outputs[0].shape == (1, hq, n, 8)
    assert_close(outputs[1], outputs[0], **TOL)
    for batched_grad, row_grad in zip(grads[1], grads[0], strict=True):
        assert_close(batched_grad, row_grad, **TOL)


def test_packed_scores_with_batched_row_attention_equal_padded(monkeypatch):
    # The GPU default run on the CPU: scores through the whole model equal the padded ones,
    # and the isolation check passes with it.
    monkeypatch.setattr(rb.models.packing, "BATCHED", True)
    model, _ = tiny(seed=1, dtype=torch.float64)
    ro = ragged_rollouts(8, seed=1)
    lp, ent = score_responses(model, ro, packing=True, chunk_size=5, entropy=True)
    lp_pad, ent_pad = score_responses(model, ro, packing=False, chunk_size=5, entropy=True)
    assert_close(lp, lp_pad, **TOL)
    assert_close(ent, ent_pad, **TOL)


def test_transformers_own_packed_masks_equal_padded_scores():
    # A sliding window in use sends the model through transformers' packed masks (the model's
    # own window rule), not the row attention; a window of 3 is shorter than every row here.
    window = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}
    model, _ = tiny(seed=0, dtype=torch.float64, **window)
    assert attention_path(model) == "transformers"
    ro = ragged_rollouts(8, seed=2)
    lp, _ = score_responses(model, ro, chunk_size=64, packing=True)
    lp_pad, _ = score_responses(model, ro, chunk_size=64, packing=False)
    assert_close(lp, lp_pad, **TOL)


def _grads(trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(rb.losses.AGGREGATIONS))
def test_packed_loss_gradient_and_update_equal_padded(name):
    mode = rb.losses.AGGREGATIONS[name]
    ro = ragged_rollouts(8, seed=3, group_size=4)
    advantages = torch.randn(8, generator=torch.Generator().manual_seed(3))
    old = tiny_trainer(torch.float64, packing=False).logprobs(ro).double()
    ro = ro.replace(old_logprobs=old + 0.05 * torch.randn(old.shape, dtype=old.dtype))
    results = []
    for packing in (True, False):
        trainer = tiny_trainer(
            torch.float64, packing=packing, aggregation=mode, micro_batch_size=3, lr=1e-3
        )
        metrics = trainer.forward_backward(ro, advantages, loss_fn=LOSS)
        grads = _grads(trainer)
        trainer.optim_step()
        results.append((metrics, grads, dict(trainer.named_weights())))
    (m1, g1, w1), (m2, g2, w2) = results
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-9, abs=1e-12)
    assert g1.keys() == g2.keys() and len(g1) > 0
    for key in g1:
        assert_close(g1[key], g2[key], **TOL)
    for key in w1:
        assert_close(w1[key], w2[key], **TOL)


def test_packed_lora_gradient_equals_padded():
    from peft import LoraConfig

    ro = ragged_rollouts(6, seed=4)
    advantages = torch.randn(6, generator=torch.Generator().manual_seed(4))
    grads = []
    for packing in (True, False):
        torch.manual_seed(0)  # LoRA's initialisation draws from the global RNG
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        trainer = tiny_trainer(torch.float64, packing=packing, lora=lora)
        trainer.forward_backward(ro, advantages, loss_fn=LOSS)
        grads.append(_grads(trainer))
    assert grads[0].keys() == grads[1].keys() and all("lora" in k for k in grads[0])
    for key in grads[0]:
        assert_close(grads[0][key], grads[1][key], **TOL)


def test_packed_gradient_checkpointing_equals_padded_and_needs_the_span():
    ro = ragged_rollouts(6, seed=5)
    advantages = torch.randn(6, generator=torch.Generator().manual_seed(5))
    grads = []
    for packing, checkpointing in ((True, True), (False, False)):
        trainer = tiny_trainer(torch.float64, packing=packing, gradient_checkpointing=checkpointing)
        trainer.forward_backward(ro, advantages, loss_fn=LOSS)
        grads.append(_grads(trainer))
    for key in grads[0]:
        assert_close(grads[0][key], grads[1][key], **TOL)
    # Outside the trainer, a checkpointed model's packed forward with gradients must say how
    # to keep the row attention through the backward pass.
    trainer.model.gradient_checkpointing_enable()
    trainer.model.train()
    with pytest.raises(RuntimeError, match="inside rlblocks.trainer.packing.kept_apart"):
        score_responses(trainer.model, ro, chunk_size=8, packing=True)
    with rb.trainer.packing.kept_apart(trainer.model):
        lp, _ = score_responses(trainer.model, ro, chunk_size=8, packing=True)
        lp.sum().backward()
    assert trainer.model.config._attn_implementation == "sdpa"  # restored


def test_checkpointed_recompute_in_another_thread_keeps_the_rows_apart():
    # On a GPU autograd runs the backward pass, and the layers a checkpointed model recomputes,
    # in a device thread of its own (the H100 run of benchmarks/memory_plan.py found the row
    # attention refusing there: its bounds were thread-local). A CPU backward runs in the
    # caller's thread, so the test runs it in another one, as CUDA does.
    ro = ragged_rollouts(6, seed=7)
    grads, errors = [], []
    for checkpointing in (True, False):
        trainer = tiny_trainer(torch.float64, packing=True, gradient_checkpointing=checkpointing)
        trainer.model.train()
        with rb.trainer.packing.kept_apart(trainer.model):
            lp, _ = score_responses(trainer.model, ro, chunk_size=8, packing=True)

            def backward(loss):
                try:
                    loss.backward()
                except RuntimeError as err:
                    errors.append(err)

            thread = threading.Thread(target=backward, args=(lp.sum(),))
            thread.start()
            thread.join()
        assert not errors, errors
        grads.append(_grads(trainer))
    for key in grads[0]:
        assert_close(grads[0][key], grads[1][key], **TOL)


def test_packed_values_equal_padded_values():
    model, _ = tiny(seed=1, dtype=torch.float64)
    critic = ValueModel(model, init_std=0.5)
    ro = ragged_rollouts(8, seed=6)
    assert_close(critic(ro, packing=True), critic(ro, packing=False), **TOL)


def _leaky_attention(module, query, key, value, attention_mask, **kwargs):
    """Causal attention over the whole packed sequence: rows see the rows before them."""
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def test_a_model_that_mixes_rows_is_refused():
    AttentionInterface.register("leaky_for_test", _leaky_attention)
    model, _ = tiny(seed=0, dtype=torch.float64)
    model.config._attn_implementation = "leaky_for_test"
    ro = ragged_rollouts(4, seed=7)
    with pytest.raises(ValueError, match="attend to each other") as refused:
        score_responses(model, ro, chunk_size=8, packing=True)
    gap = float(re.search(r"moved by (\S+) when", str(refused.value)).group(1))
    assert gap > 1e-3  # what the docstring's tolerance is compared with
    trainer = tiny_trainer(packing=True)
    trainer.model.config._attn_implementation = "leaky_for_test"
    with pytest.raises(ValueError, match="packing=False"):
        trainer.logprobs(ro)
    # Padded, the same model is usable (its causal attention is right for one row a row).
    score_responses(model, ro, chunk_size=8, packing=False)
