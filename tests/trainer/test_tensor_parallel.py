"""Tensor parallelism (``TrainConfig.tp``) on spawned gloo ranks, against one process.

The tiny model (two heads, two key-value heads: every size splits two ways), float64, the
same batch and schedule as the one-process trainer: three optimizer steps of three rows, one
row per micro-batch, so a data-parallel pair runs padding micro-batches (tests/mesh_cases.py).

**The bound.** A tensor-parallel rank computes the same sums as one process, split in pieces
and added in another order (the row-wise projections' all-reduce, the vocabulary-parallel
logsumexp): in float64 each such sum of at most ~10³ terms differs by at most ~10³ · 2⁻⁵³ ≈
1e-13 relative. AdamW's first steps scale each gradient by 1/√v: a relative error in g stays
relative in the update, and three steps of lr 1e-3 move a weight by at most ~3e-3; so weights
agree to far better than 1e-9 relative or absolute (measured: 6e-15), the gradient norm
(a square root of a sum of squares) too. A wrong split is off by O(1) of an update (the
untied case below: ~1e-3), six orders of magnitude above the bound.
"""

import pytest
import torch
from dp_cases import run
from mesh_cases import MODEL, checkpoint_shapes, update

import rlblocks as rb
from rlblocks.trainer.tensor_parallel import check_groups, check_layout, tp_plan

REL = 1e-9


def assert_same_update(result, expected, *, rel=REL):
    assert result["metrics"]["grad_norm"] == pytest.approx(
        expected["metrics"]["grad_norm"], rel=rel
    )
    assert result["metrics"]["loss"] == pytest.approx(expected["metrics"]["loss"], rel=rel)
    assert set(result["weights"]) == set(expected["weights"])
    for name, value in expected["weights"].items():
        torch.testing.assert_close(result["weights"][name], value, rtol=rel, atol=rel)


def weight_gap(result: dict, expected: dict) -> float:
    """The largest absolute difference between the two updates' weights."""
    return max(
        (result["weights"][k] - v).abs().max().item() for k, v in expected["weights"].items()
    )


def numbers(metrics: dict) -> dict:
    """The metrics that are results of the update, not timings."""
    return {k: v for k, v in metrics.items() if "second" not in k}


def every_aggregation_in_one_process():
    return {name: update(1, aggregation=mode) for name, mode in rb.losses.AGGREGATIONS.items()}


def test_tp2_gives_the_one_process_update_under_every_aggregation(tmp_path):
    result = run("mesh_cases:every_aggregation", str(tmp_path / "out.pt"), world=2)
    for name, expected in every_aggregation_in_one_process().items():
        assert_same_update(result[name], expected)
        assert result[name]["metrics"]["optimizer_steps"] == 3.0


@pytest.mark.slow
def test_dp2_tp2_gives_the_one_process_update_under_every_aggregation(tmp_path):
    result = run("mesh_cases:every_aggregation", str(tmp_path / "out.pt"), world=4)
    for name, expected in every_aggregation_in_one_process().items():
        assert_same_update(result[name], expected)


def test_sp2_gives_the_one_process_update_under_every_aggregation(tmp_path):
    # Sequence parallelism: the two ranks train on the same rows, each on its half of every
    # packed micro-batch's tokens; the same bound (measured: 3e-15).
    result = run("mesh_cases:sp2", str(tmp_path / "out.pt"), world=2)
    for name, expected in every_aggregation_in_one_process().items():
        assert_same_update(result[name], expected)
        assert result[name]["metrics"]["entropy"] == pytest.approx(
            expected["metrics"]["entropy"],
            rel=1e-6,  # a float32 metric
        )


@pytest.mark.slow  # spawned ranks: run by .ci/run's slow step
def test_sp2_ranks_whose_slice_scores_nothing_still_train_like_one_process(tmp_path):
    # A row of a long prompt and a short response: rank 0's half is prompt only. It scores
    # nothing, yet runs the layers (the all-to-alls of its peer need it) and its gradient
    # still carries the keys and values its tokens give rank 1's.
    from mesh_cases import long_prompts

    result = run("mesh_cases:sp2_long_prompts", str(tmp_path / "out.pt"), world=2)
    assert_same_update(result, long_prompts())


@pytest.mark.slow  # spawned ranks: run by .ci/run's slow step
def test_a_wrong_sequence_exchange_is_caught_by_the_comparison(tmp_path):
    result = run("mesh_cases:sp2_tokens_interleaved", str(tmp_path / "out.pt"), world=2)
    assert weight_gap(result, update(1)) > 1e-4


@pytest.mark.slow  # spawned ranks: run by .ci/run's slow step
def test_an_untied_output_layer_is_caught_by_the_comparison(tmp_path):
    # The check above must be able to fail: splitting the tied embeddings into two weights
    # runs without an error but trains them apart.
    result = run("mesh_cases:untied_output_layer", str(tmp_path / "out.pt"), world=2)
    assert weight_gap(result, update(1)) > 1e-4


@pytest.mark.slow  # spawned ranks: run by .ci/run's slow step
def test_a_row_wise_layer_planned_column_wise_fails(tmp_path):
    with pytest.raises(Exception, match="must have same reduction dim"):
        run("mesh_cases:row_wise_planned_column_wise", str(tmp_path / "out.pt"), world=2)


def test_a_tensor_parallel_trainer_syncs_whole_weights_into_an_engine(tmp_path):
    result = run("mesh_cases:sync_into_engine", str(tmp_path / "out.pt"), world=2)
    assert result["synced"]
    assert "model.layers.0.self_attn.q_proj.weight" in result["names"]


@pytest.mark.slow  # spawned ranks: run by .ci/run's slow step
def test_checkpoints_move_between_tp2_sp2_dp2_and_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setenv("RLBLOCKS_TP", "1")
    single = checkpoint_shapes(0)  # saves "1-tp1", resumes from it
    monkeypatch.setenv("RLBLOCKS_TP", "2")
    tp2 = run("mesh_cases:checkpoint_shapes", str(tmp_path / "tp2.pt"), world=2)  # + "2-tp2"
    monkeypatch.setenv("RLBLOCKS_TP", "1")
    dp2 = run("mesh_cases:checkpoint_shapes", str(tmp_path / "dp2.pt"), world=2)  # + "2-tp1"
    monkeypatch.setenv("RLBLOCKS_SP", "2")
    sp2 = run("mesh_cases:checkpoint_shapes", str(tmp_path / "sp2.pt"), world=2)  # + "2-sp2"
    # The same layout continues bitwise; every other layout continues within the bound.
    for result, own in ((single, "1-tp1"), (tp2, "2-tp2"), (dp2, "2-tp1"), (sp2, "2-sp2")):
        assert numbers(result[own]["metrics"]) == numbers(result["straight"]["metrics"])
        for name, value in result["straight"]["weights"].items():
            assert torch.equal(result[own]["weights"][name], value)
    assert_same_update(tp2["straight"], single["straight"])
    assert_same_update(tp2["1-tp1"], single["straight"])  # one process → TP2
    assert_same_update(dp2["1-tp1"], single["straight"])  # one process → DP2
    assert_same_update(dp2["2-tp2"], single["straight"])  # TP2 → DP2
    assert_same_update(sp2["2-tp2"], single["straight"])  # TP2 → SP2
    assert_same_update(sp2["1-tp1"], single["straight"])  # one process → SP2


# ---------------------------------------------------------------------- layouts refused
def test_heads_not_divisible_by_tp_are_refused_naming_the_sizes():
    model, _ = rb.models.tiny()  # two heads, one key-value head
    with pytest.raises(ValueError, match=r"num_key_value_heads = 1 is not divisible by .* tp = 2"):
        check_layout(model, 2, owner="PolicyTrainer.shard")
    model, _ = rb.models.tiny(**MODEL)
    with pytest.raises(ValueError, match=r"num_attention_heads = 2 is not divisible by .* tp = 4"):
        check_layout(model, 4, owner="PolicyTrainer.shard")


def test_a_vocabulary_not_divisible_by_tp_is_refused():
    model, _ = rb.models.tiny(  # every other size splits five ways; 384 vocabulary rows
        num_attention_heads=5, num_key_value_heads=5, hidden_size=80, intermediate_size=160
    )
    with pytest.raises(ValueError, match=r"vocab_size = 384 is not divisible by .* tp = 5"):
        check_layout(model, 5, owner="PolicyTrainer.shard")


def test_a_model_family_without_a_plan_is_refused():
    model, _ = rb.models.tiny(**MODEL)
    model.tp_plan = None
    model.config.model_type = "mystery"
    with pytest.raises(ValueError, match=r"model_type 'mystery'\) has no tensor-parallel plan"):
        tp_plan(model, owner="PolicyTrainer.shard")
    model.config.model_type = "qwen2"  # the family rlblocks has its own plan for
    assert tp_plan(model, owner="PolicyTrainer.shard")["model.layers.*.mlp.down_proj"] == "rowwise"


def test_a_plan_naming_modules_the_model_lacks_is_refused():
    # A plan of another family would split nothing and train the model whole, in silence.
    model, _ = rb.models.tiny(**MODEL)
    with pytest.warns(UserWarning):  # transformers' own setter warns, and takes it
        model.tp_plan = {"model.layers.*.self_attn.qkv_proj": "colwise"}
    with pytest.raises(ValueError, match=r"names modules .* does not have: \['model.layers"):
        check_layout(model, 2, owner="PolicyTrainer.shard")


@pytest.mark.slow  # spawned ranks: run by .ci/run's slow step
def test_a_mesh_larger_than_the_workers_is_refused_before_any_collective(tmp_path):
    with pytest.raises(Exception, match=r"tp = 4 does not divide the 2 processes"):
        run("mesh_cases:tp4_on_two", str(tmp_path / "out.pt"), world=2)


def test_lora_and_critics_under_tp_are_refused_naming_the_limit():
    from builders import tiny_trainer
    from peft import LoraConfig

    trainer = tiny_trainer(
        model_config=MODEL, tp=2, lora=LoraConfig(r=2, target_modules=["q_proj"])
    )
    with pytest.raises(NotImplementedError, match="LoRA policy cannot be tensor parallel"):
        trainer.shard()
    critic = rb.critic.CriticTrainer(rb.models.tiny(**MODEL)[0], tp=2)
    with pytest.raises(NotImplementedError, match="for the policy only"):
        critic.shard()


def test_a_tensor_parallel_group_across_machines_is_refused():
    check_groups(["a", "a", "b", "b"], 2, owner="PolicyTrainer.shard")  # a group per node
    with pytest.raises(ValueError, match=r"ranks 2-3 spans the machines \['a', 'b'\]"):
        check_groups(["a", "a", "a", "b", "b", "b"], 2, owner="PolicyTrainer.shard")


@pytest.mark.slow  # spawned ranks: run by .ci/run's slow step
def test_heads_not_divisible_by_sp_are_refused_before_any_collective(tmp_path):
    with pytest.raises(
        Exception, match=r"num_attention_heads = 2 is not divisible by the sequence"
    ):
        run("mesh_cases:sp3_on_two_heads", str(tmp_path / "out.pt"), world=3)


def test_a_sequence_parallel_layout_that_cannot_apply_is_refused():
    with pytest.raises(ValueError, match=r"sp = 2\) with tensor parallelism \(tp = 2\)"):
        rb.trainer.TrainConfig(sp=2, tp=2)
    with pytest.raises(ValueError, match="keep packing=True"):
        rb.trainer.TrainConfig(sp=2, packing=False)
    with pytest.raises(ValueError, match="gradient checkpointing"):
        rb.trainer.TrainConfig(sp=2, gradient_checkpointing=True)


def test_sampling_replay_under_sp2_is_one_process_and_refused_under_tp2(tmp_path):
    """The kept set is rebuilt per token wherever a rank scores it: sp = 2 gives the one-process
    log-probs and update (the same bound), which replay moved (the comparison can fail); a
    vocabulary-sharded head (tp = 2) is refused by name."""
    from mesh_cases import make, replay_update, replayed_batch

    result = run("mesh_cases:replay_sp2_and_tp2", str(tmp_path / "out.pt"), world=2)
    expected = replay_update()
    torch.testing.assert_close(result["sp2"]["logprobs"], expected["logprobs"], rtol=0,
                               atol=1e-6)  # fmt: skip  # float32 log-probs of float64 sums
    assert_same_update(result["sp2"], expected)
    untruncated = make().logprobs(replayed_batch()[0].replace(sampler=None))
    assert (expected["logprobs"] - untruncated).abs().max() > 0.1
    assert "sampling replay" in result["tp2"] and "TrainConfig.tp = 2" in result["tp2"]
