"""Ulysses sequence parallelism (rlblocks/models/ulysses.py) against the one-process packed forward.

Spawned gloo ranks (tests/ulysses_cases.py), float64, the tiny Qwen2 model: a packed
micro-batch of 9 ragged rows, 65 tokens, split over the ranks (padded to 66), rows crossing
every slice boundary.

Tolerance, derived: the sequence-parallel forward runs the same float64 operations on the
same values; what may differ is the order of additions (matmuls over l instead of n tokens and
h/sp instead of h heads may block their sums differently, and a weight's gradient is summed
per rank over its slice, then across the ranks). A float64 sum of k terms is off by at most
k·ε·Σ|terms|, ε = 2⁻⁵³ ≈ 1.1e-16; the longest sums here are the vocabulary's (k = 384,
4.3e-14) and a weight gradient's over 65 tokens, and about 20 such sums lie in series between a
weight and a log-prob in the 2-layer model: at most ~1e-12 of the largest magnitude. The tests
allow 1e-10 of it (100x that bound; measured: log-probs equal exactly, gradients within 1.1e-15).
Wrong versions move the log-probs by far more (measured, largest difference): 0.14 with no
all-to-all (each rank attends within its slice), 0.27 with the all-to-all's positions
interleaved in the wrong order, 0.57 with kv heads repeated in the wrong order, 0.0015 with
rotary positions counted from each slice's start.
"""

import pytest
import torch
from ulysses_cases import MODELS, run

RELATIVE = 1e-10  # of each tensor's largest magnitude (module docstring)


def assert_equal_to_float64_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=0, atol=RELATIVE * scale)


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def equal(request, tmp_path_factory):
    """One spawned run per world size, shared by the tests of that size (it costs ~15 s)."""
    world = request.param
    out = tmp_path_factory.mktemp(f"sp{world}") / "out.pt"
    return world, run("equal_to_one_process", str(out), world=world)


def test_sequence_parallel_log_probs_equal_the_one_process_packed_forward(equal):
    # Every kept token's log-prob gathered from the ranks' slices equals the one-process packed
    # forward's, for each way the kv heads split (as they are, repeated, fewer than sp).
    world, result = equal
    assert set(result) == set(MODELS[world])
    for name, case in result.items():
        assert case["sp"]["local_length"] == 66 // world, name  # 65 tokens padded to 66
        assert case["sp"]["logprobs"].shape == case["one"]["logprobs"].shape == (35,)
        assert_equal_to_float64_rounding(case["sp"]["logprobs"], case["one"]["logprobs"])
        assert case["sp"]["logits"].shape == (1, 65, 384)
        assert_equal_to_float64_rounding(case["sp"]["logits"], case["one"]["logits"])


@pytest.mark.parametrize("loss", ["sum", "squares"])
def test_gradients_summed_over_the_ranks_equal_the_one_process_gradients(equal, loss):
    # "sum": each rank's loss is the sum of its own tokens' log-probs; the all-to-alls carry the
    # gradients of keys and values back to the ranks that computed them. "squares": every rank
    # computes the same loss, a mean of squares (each token's gradient depends on the others),
    # from the gathered log-probs; gather hands each rank its own tokens' gradient only.
    _, result = equal
    for name, case in result.items():
        expected, actual = case["one"][f"grads_{loss}"], case["sp"][f"grads_{loss}"]
        assert set(actual) == set(expected), name
        for parameter, gradient in expected.items():
            assert gradient.abs().max() > 0, (name, parameter)  # every parameter is reached
            assert_equal_to_float64_rounding(actual[parameter], gradient)


def test_layouts_that_cannot_run_are_refused_before_any_collective(tmp_path):
    # Rank 0 asks for models that cannot run and rank 1 splits over a group it is not in, each
    # alone; the forward both run afterwards still equals one process: no refusal sent anything.
    result = run("refusals", str(tmp_path / "out.pt"))
    messages = result["messages"]
    assert messages["heads"] == (
        "ValueError: ulysses.sequence_parallel: num_attention_heads = 3 of Qwen2ForCausalLM is "
        "not divisible by the sequence-parallel size sp = 2 (each rank attends over heads / sp "
        "of them); choose sp among [1, 3]"
    )
    assert messages["heads_tp"] == (
        "ValueError: ulysses.sequence_parallel: num_attention_heads = 2 of Qwen2ForCausalLM is "
        "not divisible by tp·sp = 2·2 = 4 (each rank attends over heads / (tp·sp) of them); "
        "choose sp among [1]"
    )
    assert messages["checkpointing"].startswith(
        "RuntimeError: ulysses.sequence_parallel: Qwen2ForCausalLM recomputes its layers"
    )
    assert "'transformers' packed-attention path" in messages["window"]
    assert "sliding window" in messages["window"]
    assert messages["split"] == (
        "ValueError: ulysses.split: input_ids (65,) and position_ids (65,) are not one packed "
        "(1 n) sequence of the same shape; pass Packed.input_ids and Packed.position_ids"
    )
    assert "64 tokens, the first at position 1" in messages["positions"]
    assert messages["other_inputs"] == (
        "RuntimeError: ulysses.sequence_parallel: the sequence-parallel attention was called "
        "outside its forward (queries (1, 2, 65, 32), mask False); run the model on the kwargs "
        "that sequence_parallel(model, shard) yields, inside its block"
    )
    assert "global rank 1) is not in the sequence-parallel group" in messages["group"]
    assert_equal_to_float64_rounding(result["after"], result["reference"])
