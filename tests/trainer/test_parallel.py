"""FSDP2 data parallelism inside PolicyTrainer, in spawned processes (no Ray).

Every case compares rank 0's view of one update with the same update on the same rows in
one process. Every rank gets the whole batch and trains on its share of each mini-batch, which
the trainer splits by tokens: the three rows {0, 2, 5} go 2 + 1 over two ranks.
"""

import pytest
import torch
from dp_cases import LOSS, SCHEDULE, UNEVEN, lora_config, make_batch, make_trainer, run

import rlblocks as rb


def one_process(dtype=torch.float64, **overrides):
    trainer = make_trainer(dtype, **overrides)
    ro, advantages = make_batch()
    rows = sorted(r for rows in UNEVEN for r in rows)
    metrics = trainer.step(ro.select(rows), advantages[rows], loss_fn=LOSS)
    return metrics, dict(trainer.named_weights())


def assert_same_update(result, metrics, weights, *, rel=1e-9):
    assert result["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=rel)
    for name, value in weights.items():
        torch.testing.assert_close(result["weights"][name], value, rtol=rel, atol=rel)


def test_padding_micro_batches_keep_ranks_in_step_and_change_nothing(tmp_path):
    # Rank 0 runs 2 micro-batches of one row, rank 1 one real and one zero-weight padding
    # one; the update is the one-process update of the 3 rows (float64: to ~1e-15).
    result = run("uneven_micro_batches", str(tmp_path / "out.pt"))
    metrics, weights = one_process(micro_batch_size=1)
    assert_same_update(result, metrics, weights)
    # Loss metrics are token-weighted over real micro-batches only (float32 by design).
    assert result["metrics"]["entropy"] == pytest.approx(metrics["entropy"], rel=1e-6)


def test_cpu_offload_gives_the_same_update(tmp_path):
    result = run("cpu_offload", str(tmp_path / "out.pt"))
    metrics, weights = one_process()
    assert_same_update(result, metrics, weights)


def test_bf16_parameters_follow_the_float32_update_loosely(tmp_path):
    # bf16 all-gathered parameters (8 bits of mantissa): the gradient norm is within a few
    # percent of float32's. AdamW's first step moves each weight by ~lr·sign(gradient), so
    # elements with a near-zero gradient may flip; the update as a whole must still point the
    # same way (cosine > 0.9), and the master weights stay float32.
    result = run("bf16_params", str(tmp_path / "out.pt"))
    metrics, weights = one_process(torch.float32)
    assert result["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=0.05)
    initial = dict(make_trainer(torch.float32).named_weights())
    fp32 = torch.cat([(weights[k] - initial[k]).flatten() for k in initial])
    bf16 = torch.cat([(result["weights"][k] - initial[k]).flatten() for k in initial])
    assert torch.nn.functional.cosine_similarity(fp32, bf16, dim=0) > 0.9
    assert all(v.dtype == torch.float32 for v in result["weights"].values())


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    result = run("nan_on_one_rank", str(tmp_path / "out.pt"))
    assert result["metrics"]["skipped_steps"] == 1.0
    assert result["metrics"]["optimizer_steps"] == 0.0
    assert result["unchanged"]  # rank 0's shard is untouched although its own loss was finite


# World 3 (about 20 s) is marked slow: .ci/run runs it in its step for the parallel layouts.
@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_aggregation_gives_the_one_process_update_at_any_world_size(tmp_path, world):
    # Two epochs × two shuffled mini-batches of 4 rows, one row per micro-batch, for each of the
    # four aggregation modes. At world size 1 the trainer is sharded too (FSDP2 over a group of
    # one: the default config shards once the group has more than one process, so world 1 is
    # the SingleProcess path through the same spawned set-up); at 3 a mini-batch splits 2+1+1
    # and two ranks run padding micro-batches. float64 throughout: the sharded sums differ from
    # the one-process sums only in the order of additions (~1e-16 relative each), so the
    # gradient norms and the weights after 4 AdamW steps agree to 1e-9, while a normalizer per
    # rank instead of one for the whole mini-batch is off by 10% or more.
    result = run("every_aggregation", str(tmp_path / "out.pt"), world=world)
    ro, advantages = make_batch()
    assert set(result) == set(rb.losses.AGGREGATIONS)
    for name, mode in rb.losses.AGGREGATIONS.items():
        trainer = make_trainer(aggregation=mode, **SCHEDULE)
        metrics = trainer.step(ro, advantages, loss_fn=LOSS)
        assert result[name]["metrics"]["optimizer_steps"] == metrics["optimizer_steps"] == 4
        assert_same_update(result[name], metrics, dict(trainer.named_weights()))
        assert result[name]["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-7), name
        if world == 2:  # the ranks run packed (the default); so must one padded process
            padded = make_trainer(aggregation=mode, packing=False, **SCHEDULE)
            padded_metrics = padded.step(ro, advantages, loss_fn=LOSS)
            assert_same_update(result[name], padded_metrics, dict(padded.named_weights()))


def test_fsdp_at_world_size_one_shards_and_gives_the_one_process_update(tmp_path):
    # TrainConfig.fsdp set: a group of one process is sharded too (the path a single GPU takes
    # for mixed precision or CPU offload). Same float64 reasoning as above; the checkpoint
    # round trip must repeat the next step to the bit.
    result = run("fsdp_world_one", str(tmp_path / "out.pt"), world=1)
    assert result["sharded"] and result["device"] == "cpu"
    trainer = make_trainer(mini_batch_size=4, micro_batch_size=2)
    ro, advantages = make_batch()
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    assert_same_update(result, metrics, dict(trainer.named_weights()))
    assert result["resumed"]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: as above
def test_a_lora_policy_sharded_over_the_world_gives_the_one_process_update(
    tmp_path, monkeypatch, world
):
    # FSDP2 over 2 and 3 ranks, each unit holding frozen base weights and trained adapters:
    # after 4 AdamW steps (2 epochs x 2 mini-batches, padding micro-batches at 3) the adapters
    # and the merged weights a resharder sends are those of one process. Same float64 reasoning
    # as above: only the order of additions differs. Before, shard() refused a LoRA policy in
    # a group of more than one.
    monkeypatch.setenv("RLBLOCKS_CHECKPOINT_DIR", str(tmp_path))
    result = run("lora_sharded", str(tmp_path / "out.pt"), world=world)
    torch.manual_seed(0)  # the adapters' initial A, as every rank drew it
    trainer = make_trainer(lora=lora_config(), **SCHEDULE)
    ro, advantages = make_batch()
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    assert result["metrics"]["optimizer_steps"] == metrics["optimizer_steps"] == 4
    assert_same_update(result, metrics, dict(trainer.named_weights()))
    adapters = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert set(result["adapters"]) == set(adapters) and len(adapters) == 16  # 2 layers x 4 x A, B
    for name, value in adapters.items():
        torch.testing.assert_close(result["adapters"][name], value, rtol=1e-9, atol=1e-9)
    torch.manual_seed(0)
    initial = dict(make_trainer(lora=lora_config()).named_weights())
    moved = [k for k in initial if not torch.equal(initial[k], result["weights"][k])]
    assert moved and all("_proj" in k for k in moved)  # the update reached the merged weights
    # The adapter an adapter-serving engine loads (adapter-only sync): the same tensors.
    trainer.save_adapter(tmp_path / "one")
    from safetensors.torch import load_file

    one = load_file(tmp_path / "one" / "adapter_model.safetensors")
    assert set(result["saved"]) == set(one) and len(one) == 16
    for name, value in one.items():
        torch.testing.assert_close(result["saved"][name], value, rtol=1e-9, atol=1e-9)
