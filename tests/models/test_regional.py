"""Compiled decoder blocks (``rlblocks.models.regional``) against the eager model.

Inductor compiles on the CPU, so every property the GPU relies on is held here: each block
traces whole (``fullgraph=True``), one graph serves every block and every token count, and the
compiled update is the eager one.

The float32 bound is derived, not picked: compiled and eager are two float32 evaluations of
the same function that differ only in how kernels are fused and sums ordered. Each lies within
its own rounding error of the exact (float64) update; the test measures eager's error e = max
|eager32 − eager64| and requires |compiled32 − eager64| ≤ 2e: compiled is as accurate as
eager, up to one more reordering of every sum (a factor 2). In float64 the two must agree to
assert_close's float64 defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch._dynamo
from builders import ragged_rollouts, tiny_trainer
from dp_cases import SCHEDULE, make_batch, make_trainer, run
from torch._dynamo.utils import counters

import rlblocks as rb
from rlblocks.models.regional import compile_blocks, decoder_blocks, is_compiled
from rlblocks.trainer.forward import score_responses
from rlblocks.trainer.packing import kept_apart

LOSS = rb.losses.clipped_surrogate


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # counters and caches of other tests' compiled code
    counters.clear()
    yield
    torch._dynamo.reset()


def _scores_and_grads(model, rollouts, *, packing=True):
    model.zero_grad(set_to_none=True)
    model.train()
    with kept_apart(model) if packing else contextlib.nullcontext():
        lp, _ = score_responses(model, rollouts, chunk_size=64, packing=packing)
        lp.sum().backward()
    model.eval()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_every_block_compiles_whole_once_and_no_length_recompiles():
    model = rb.models.tiny()[0]
    assert compile_blocks(model, owner="test") == model.config.num_hidden_layers == 2
    assert all(is_compiled(block) for block in decoder_blocks(model))
    warm = ragged_rollouts(b=4, seed=0)
    _scores_and_grads(model, warm)  # warm-up: the first graph, forward and backward
    graphs = counters["stats"]["unique_graphs"]
    # fullgraph=True: one graph for both blocks per grad mode (the packing isolation check
    # scores once without gradients, then the training forward and its backward).
    assert graphs == 2
    # Batches of other row counts, prompt and response lengths: packed token counts 9 to 80.
    for b, seed in [(7, 1), (2, 2), (12, 3), (3, 4)]:
        _scores_and_grads(model, ragged_rollouts(b=b, seed=seed, max_response=9))
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["recompiles"]


def test_compiled_blocks_score_and_differentiate_like_eager_packed_and_padded():
    for packing in (True, False):
        eager64 = rb.models.tiny(dtype=torch.float64)[0]
        eager32, compiled32 = rb.models.tiny()[0], rb.models.tiny()[0]
        compile_blocks(compiled32, owner="test")
        ro = ragged_rollouts(b=6, seed=5)
        lp64, g64 = _scores_and_grads(eager64, ro, packing=packing)
        lp32, g32 = _scores_and_grads(eager32, ro, packing=packing)
        lpc, gc = _scores_and_grads(compiled32, ro, packing=packing)
        _within_eager_error(lpc, lp32, lp64)
        for name in g64:
            _within_eager_error(gc[name], g32[name], g64[name])


def _within_eager_error(compiled, eager, exact):
    error = (eager.double() - exact).abs().max()
    gap = (compiled.double() - exact).abs().max()
    assert gap <= 2 * error, (float(gap), float(error))


# token-mean in the default run; the other three (about 10 s each) in .ci/run's slow step, with
# LoRA, gradient checkpointing and FSDP2 below.
@pytest.mark.parametrize(
    "mode",
    [
        m if m == "token-mean" else pytest.param(m, marks=pytest.mark.slow)
        for m in rb.losses.AGGREGATIONS
    ],
)
def test_compiled_update_is_the_eager_update_in_every_aggregation(mode):
    # Two epochs × two mini-batches, one row per micro-batch: four AdamW steps, float32. The
    # update Δw = w_after − w_before as one vector (its 2-norm error). Not weight by weight: AdamW's
    # first step moves each weight by about lr · sign(gradient), so a weight whose gradient
    # is near 0 turns any rounding into a step of up to lr (Qwen2's RMSNorm computes in
    # float32 whatever the model's dtype, so even float64 models round there).
    aggregation = rb.losses.AGGREGATIONS[mode]
    ro, advantages = make_batch()
    settings = {"aggregation": aggregation, **SCHEDULE}
    results = {}
    for name, dtype, compiled in [("exact", torch.float64, False), ("eager", torch.float32, False),
                                  ("compiled", torch.float32, True)]:  # fmt: skip
        trainer = make_trainer(dtype, compile=compiled, **settings)
        assert trainer.config.compile is compiled
        before = torch.cat([w.double().flatten() for _, w in trainer.named_weights()])
        metrics = trainer.step(ro, advantages, loss_fn=LOSS)
        after = torch.cat([w.double().flatten() for _, w in trainer.named_weights()])
        results[name] = (metrics, after - before)
    exact, eager, compiled = results["exact"], results["eager"], results["compiled"]
    assert compiled[0]["optimizer_steps"] == 4
    for key in ("loss", "grad_norm"):  # one float32 scalar each: assert_close's defaults
        torch.testing.assert_close(compiled[0][key], eager[0][key])
    error = torch.linalg.vector_norm(eager[1] - exact[1])
    gap = torch.linalg.vector_norm(compiled[1] - exact[1])
    assert gap <= 2 * error, (float(gap), float(error))


@pytest.mark.slow  # ~25 s: in .ci/run's slow step
def test_compiled_update_is_the_eager_update_with_lora_and_gradient_checkpointing():
    from dp_cases import lora_config

    ro, advantages = make_batch()
    for settings in ({"lora": lora_config()}, {"gradient_checkpointing": True}):
        out = []
        for compiled in (False, True):
            torch.manual_seed(0)  # LoRA's initialisation draws from the global RNG
            trainer = tiny_trainer(torch.float64, compile=compiled, lr=1e-3, **settings, **SCHEDULE)
            metrics = trainer.step(ro, advantages, loss_fn=LOSS)
            out.append((metrics, dict(trainer.named_weights())))
        (eager, eager_weights), (compiled, compiled_weights) = out
        # float64 except Qwen2's RMSNorm, which computes in float32 (see above): the norms
        # agree to float32's rounding, the weights to it times AdamW's lr · sign amplification.
        torch.testing.assert_close(compiled["grad_norm"], eager["grad_norm"], rtol=1.3e-6, atol=0)
        torch.testing.assert_close(compiled_weights, eager_weights, rtol=1.3e-6, atol=1e-5)


@pytest.mark.slow  # ~35 s, two spawned ranks: in .ci/run's slow step
def test_compiled_blocks_under_fsdp2_give_the_one_process_update(tmp_path):
    # Two gloo ranks, FSDP2 over both, blocks compiled; float64 so that the sharded sums agree
    # with one compiled process to the order of additions (as tests/trainer/test_parallel.py;
    # compiled against eager is the tests above).
    result = run("compiled_sharded", str(tmp_path / "out.pt"), world=2)
    ro, advantages = make_batch()
    trainer = make_trainer(compile=True, **SCHEDULE)
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    assert result["metrics"]["optimizer_steps"] == 4
    assert result["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-9)
    for name, value in trainer.named_weights():
        torch.testing.assert_close(result["weights"][name], value, rtol=1e-9, atol=1e-9)
    # And against one eager process: float64 but for Qwen2's float32 RMSNorm (see above).
    eager = make_trainer(**SCHEDULE).step(ro, advantages, loss_fn=LOSS)
    torch.testing.assert_close(
        result["metrics"]["grad_norm"], eager["grad_norm"], rtol=1.3e-6, atol=0
    )


def test_compile_is_refused_with_tensor_parallelism_and_for_a_model_without_blocks():
    with pytest.raises(ValueError, match=r"TrainConfig.compile: .*tensor parallelism"):
        rb.trainer.TrainConfig(compile=True, tp=2)
    with pytest.raises(ValueError, match=r"PolicyTrainer: compile=True needs .*decoder blocks"):
        rb.trainer.PolicyTrainer(torch.nn.Linear(2, 2), compile=True, reference=None)
    model = rb.models.tiny()[0]
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"runs 'flex_attention'; load it with"):
        compile_blocks(model, owner="PolicyTrainer")


def test_compile_and_bf16_default_off_on_the_cpu_and_stay_as_asked():
    trainer = tiny_trainer()
    assert (trainer.config.compile, trainer.config.bf16) == (False, False)
    assert not any(is_compiled(b) for b in decoder_blocks(trainer.model))
    asked = tiny_trainer(compile=True, bf16=True)
    assert (asked.config.compile, asked.config.bf16) == (True, True)
    assert all(is_compiled(b) for b in decoder_blocks(asked.model))
    assert dataclasses.replace(asked.config).compile is True
