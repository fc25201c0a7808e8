"""The single-process paths on a CUDA device: the trainer, FSDP2 at world size 1 on NCCL, bf16.

Never in CI (no GPU there): skipped wherever torch sees no CUDA device. The Ray placement
cannot run on the GPU machines this project borrows (no Ray there), so these are the GPU checks
of the trainer itself; tests/placement/test_ray_gpu.py adds Ray where both exist.
"""

import pytest
import torch
from builders import tiny_trainer
from dp_cases import LOSS, make_batch, make_trainer, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cpu_reference(**overrides):
    trainer = make_trainer(**overrides)  # float64 on the CPU
    ro, advantages = make_batch()
    return trainer.step(ro, advantages, loss_fn=LOSS), dict(trainer.named_weights())


def test_the_trainer_steps_on_a_gpu_like_on_the_cpu():
    # float32 on the GPU against float64 on the CPU. Matmuls stay float32 (TF32 is off by
    # default for matmuls in torch), so the gradient norm agrees to float32 accumulation
    # error over a few hundred terms, ~1e-6 relative; 1e-4 leaves room for cuBLAS's other
    # summation order, while a wrong normalizer or a missed micro-batch is off by >10%.
    gpu = make_trainer(torch.float32, device="cuda")
    ro, advantages = make_batch()
    metrics = gpu.step(ro, advantages, loss_fn=LOSS)
    reference, _ = cpu_reference()
    assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    assert metrics["optimizer_steps"] == 1.0


def test_fsdp2_at_world_size_one_on_nccl(tmp_path):
    # float64 on the GPU against one float64 CPU process, really sharded (DTensor parameters),
    # and a checkpoint round trip on CUDA repeats the next step to the bit. Not float64 all
    # through: transformers computes the rotary tables and the eager attention softmax in
    # float32 whatever the model's dtype, and CUDA's exp/sin/cos differ from the CPU's by about
    # one float32 ulp (6e-8). That reaches the gradient norm at ~1e-8 relative (9.8e-9 measured
    # on an H200), so 1e-6 keeps a 100x margin while a wrong normalizer or a missed
    # micro-batch is >10% off. AdamW's first step moves a weight by lr·g/(|g| + ε) with
    # lr = 1e-3: never more than lr, and where |g| is itself of order ε = 1e-8 (embedding rows
    # the batch barely touches) float32 noise decides that step, so such elements may differ
    # by up to 2·lr. Measured on an H200: 5 of 24576 elements of a matrix beyond 1e-9, the
    # largest 1.6e-6 (and the key biases, whose true gradient is 0, are such elements). So:
    # every element within 2·lr, and all but 0.1% of all elements within 1e-6 (lr/1000), which
    # an update of the wrong direction or size breaks.
    result = run("fsdp_world_one_cuda", str(tmp_path / "out.pt"), world=1, backend="nccl")
    assert result["sharded"] and result["device"].startswith("cuda")
    reference, weights = cpu_reference(mini_batch_size=4, micro_batch_size=2)
    assert result["metrics"]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-6)
    off, total = {}, 0
    for name, value in weights.items():
        diff = (result["weights"][name] - value).abs()
        assert diff.max() <= 2e-3, (name, diff.max())
        off[name], total = int((diff > 1e-6).sum()), total + diff.numel()
    assert sum(off.values()) <= 1e-3 * total, {k: v for k, v in off.items() if v}
    assert result["resumed"]


def test_bf16_parameters_on_nccl_follow_the_float32_update(tmp_path):
    # bf16 gathered parameters (8 mantissa bits): the gradient norm within a few percent of
    # the float32 CPU update (tests/trainer/test_parallel.py reasons the same way on gloo).
    result = run("bf16_world_one_cuda", str(tmp_path / "out.pt"), world=1, backend="nccl")
    reference, _ = cpu_reference(dtype=torch.float32)
    assert result["metrics"]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=0.05)
    assert all(v.dtype == torch.float32 for v in result["weights"].values())


def test_the_tinker_loop_is_one_step_on_a_gpu(make_rollouts):
    # forward_backward over chunks of 2 rows with the batch's normalizer, then optim_step,
    # against step, both float32 on the GPU. The gradients differ only in the order of float32
    # additions (other micro-batch order, atomics in the embedding's backward): ~1e-6 relative
    # on a norm of a few hundred terms, so grad_norm agrees to 1e-5 while a chunk normalized by
    # itself is ~10% off. AdamW's first step moves every weight by at most lr (|m/√v| ≤ 1),
    # whatever the gradient's scale, and by a sign-dependent ±lr where the gradient is pure
    # rounding noise (the key bias, whose true gradient is 0), so weights agree within 2·lr.
    from functools import partial

    from rlblocks.losses import clipped_surrogate

    loss = partial(clipped_surrogate, clip=(0.2, 0.28))
    lr = 1e-5
    exact = {"compile": False, "bf16": False}  # float32, eager: the comparison's premise
    stepped = tiny_trainer(device="cuda", lr=lr, micro_batch_size=2, **exact)
    tinker = tiny_trainer(device="cuda", lr=lr, micro_batch_size=2, **exact)
    ro = make_rollouts(seed=0)
    advantages = torch.randn(len(ro), generator=torch.Generator().manual_seed(0))
    logs = stepped.step(ro, advantages, loss_fn=loss)
    n = tinker.normalizer(ro)
    losses = []
    for start in range(0, len(ro), 2):
        rows = list(range(start, min(start + 2, len(ro))))
        chunk, chunk_advantages = ro.select(rows), advantages[rows]
        call = tinker.forward_backward(chunk, chunk_advantages, loss_fn=loss, normalizer=n)
        losses.append(call["loss"])
    applied = tinker.optim_step()
    assert applied["grad_norm"] == pytest.approx(logs["grad_norm"], rel=1e-5)
    assert sum(losses) == pytest.approx(logs["loss"], rel=1e-5, abs=1e-7)
    for (name, a), (_, b) in zip(stepped.model.named_parameters(), tinker.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2 * lr, msg=name)


def test_a_gpu_trainer_compiles_runs_bf16_and_fills_its_token_budget(capsys):
    # The defaults on a GPU: compiled blocks, bf16 autocast over float32 weights, and a token
    # budget from the free memory (printed). bf16 rounds each matmul input to 8 mantissa bits
    # (2⁻⁹ relative); the gradient norm, a sum over a few hundred such products, stays within
    # a few 2⁻⁸ of float64's: 5% is the bound of the bf16 tests above.
    from torch._dynamo.utils import counters

    from rlblocks.models.regional import decoder_blocks, is_compiled

    trainer = make_trainer(torch.float32, device="cuda", compile=None, bf16=None)
    assert trainer.config.compile and trainer.config.bf16
    assert trainer.config.micro_batch_tokens and "micro_batch_tokens=" in capsys.readouterr().out
    assert all(is_compiled(block) for block in decoder_blocks(trainer.model))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    ro, advantages = make_batch()
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    reference, _ = cpu_reference()
    assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=0.05)
    graphs = counters["stats"]["unique_graphs"]
    other, other_advantages = make_batch(b=6, seed=7)  # other lengths: no new graph
    trainer.step(other, other_advantages, loss_fn=LOSS)
    assert counters["stats"]["unique_graphs"] == graphs


def test_varlen_attention_matches_the_padded_rows():
    # torch's variable-length flash kernel against the rows padded inside one sdpa call, in
    # bf16 on the GPU, forward and backward: assert_close's bf16 defaults (the two kernels
    # round differently, each to bf16).
    from rlblocks.models import varlen
    from rlblocks.models.packing import attend_rows

    if not varlen.serves(torch.zeros(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("this torch has no variable-length attention kernel")
    generator = torch.Generator(device="cuda").manual_seed(0)
    bounds = ((0, 37), (37, 40), (40, 141), (141, 150))
    shapes = [(1, 4, 150, 32), (1, 2, 150, 32), (1, 2, 150, 32)]  # grouped-query: 4 heads, 2 kv
    inputs = [torch.randn(s, device="cuda", generator=generator).bfloat16() for s in shapes]
    outs, grads = [], []
    for way in ({"varlen": True}, {"varlen": False, "batched": True}):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = attend_rows(*leaves, bounds, **way)
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append([x.grad for x in leaves])
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
