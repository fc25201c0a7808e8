"""benchmarks/grpo_step.py on the tiny model: every system runs on equal shapes, the report prints.

Timings on the tiny model mean nothing; what is checked is the plumbing: the systems train,
their responses all have ``--max-new-tokens`` tokens (EOS held back) or end at EOS with mixed
lengths (``--responses eos``), the prompt + response token counts agree across systems, the
padding each computes is counted, the results are written, and the table has a row per system.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--steps", "2", "--repeats", "2", "--max-new-tokens", "4"]


def load_benchmark(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it is executed
    spec.loader.exec_module(module)
    return module


def table_rows(out: str) -> dict[str, dict[str, str]]:
    """system -> {column: cell}, from the markdown table the benchmark prints."""
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in rows[0]]
    return {cells[0].strip(): dict(zip(head, (c.strip() for c in cells))) for cells in rows[1:]}


def test_grpo_step_floor_and_rlblocks_on_the_tiny_model(capsys):
    bench = load_benchmark("grpo_step")
    systems = ["floor", "rlblocks", "rlblocks-async"]
    medians = bench.main([*TINY, "--beta", "0.04", "--systems", *systems])
    out = capsys.readouterr().out
    assert list(medians) == systems and all(s > 0 for s in medians.values())
    rows = table_rows(out)
    assert list(rows) == systems
    tokens = {row["tok/step"] for row in rows.values()}  # prompt + response, same work
    assert len(tokens) == 1 and {row["threads"] for row in rows.values()} == {"1"}  # one thread
    assert "rlblocks / floor: " in out
    assert "round 2: rlblocks, rlblocks-async, floor" in out  # the order rotates
    assert "trl / rlblocks-async" not in out  # no TRL row, no ratio to it


def test_grpo_step_refuses_unequal_response_lengths():
    bench = load_benchmark("grpo_step")
    two_prompts = ((1, 2),)  # a stand-in batch: only its length is read
    setup = bench.Setup("tiny", two_prompts, group_size=2, max_new_tokens=4, lr=0, beta=0, seed=0)
    step = bench.StepTime(1.0, {}, tokens=20, response_tokens=7, threads=1)  # 2 x 2 x 4 = 16
    with pytest.raises(RuntimeError, match=r"floor: \[7\] response tokens in a step, expected 16"):
        bench.check_shapes("floor", [step], setup)


@pytest.mark.slow
def test_grpo_step_trl_on_the_tiny_model(capsys):
    pytest.importorskip("trl")
    bench = load_benchmark("grpo_step")
    medians = bench.main([*TINY, "--repeats", "1", "--systems", "floor", "trl"])
    rows = table_rows(capsys.readouterr().out)
    assert set(medians) == {"floor", "trl"} and rows["trl"]["tok/step"] == rows["floor"]["tok/step"]


def test_grpo_step_eos_responses_count_the_padding_and_write_results(tmp_path, capsys):
    # EOS-terminated responses on the tiny model, which the benchmark writes with an EOS hazard
    # of 4 / 16 = 0.25 a token: lengths are geometric (mean ~4), so some rows stop early and
    # the padded floor computes padding. bf16 weights on the CPU: the --dtype path.
    bench = load_benchmark("grpo_step")
    out = tmp_path / "out"
    systems = ["floor", "rlblocks", "rlblocks-padded", "rlblocks-cb"]
    argv = ["--model", "tiny", "--steps", "2", "--repeats", "1", "--max-new-tokens", "16"]
    argv += ["--responses", "eos", "--micro-batch", "4", "--dtype", "bf16", "--device", "cpu"]
    bench.main([*argv, "--systems", *systems, "--out", str(out)])
    record = json.loads((out / "results.json").read_text())
    assert record["dtype"] == "bf16" and record["eos_hazard"] == 0.25
    for name in systems:  # ran, or skipped with its reason (packing / the engine not merged)
        assert name in record["systems"] or record["skipped"][name], name
    rows = 4 * 4
    for name in ("floor", "rlblocks"):
        for step in record["systems"][name]["rounds"][0]:
            assert 0 < step["response_tokens"] < rows * 16  # EOS ended some responses
            # one training pass over the batch, no scoring forward: its real tokens are the
            # step's prompt + response tokens, counted by the hook and by the system apart
            assert step["real"] == step["trained"] == step["tokens"]
            assert step["computed"] >= step["real"]
    floor = record["systems"]["floor"]
    for step in floor["rounds"][0]:
        # the floor computes every slice of the padded (b s) batch: b·s in all, b = 16 rows
        assert step["computed"] % rows == 0 and step["computed"] > step["real"]
    pads = [1 - s["real"] / s["computed"] for s in floor["rounds"][0][1:]]
    assert floor["padding"] == pytest.approx(pads[0]) and floor["padding"] > 0
    assert floor["mfu"] > 0 and floor["peak_bytes"] > 0 and floor["generation_tokens_per_s"] > 0
    table = (out / "results.md").read_text()
    assert "| floor |" in table and "eos responses, EOS hazard 0.25" in table
    assert table_rows(capsys.readouterr().out)["floor"]["pad"] == f"{100 * pads[0]:.1f}%"


def test_grpo_step_update_flops_of_the_tiny_model(tmp_path):
    # The tiny Qwen2 (rb.models.tiny_config): hidden 64, 2 layers, 2 heads of 32, 1 KV head,
    # MLP 128, vocabulary 384 tied. Per layer q 64·64, k 64·32, v 64·32, o 64·64, MLP 3·64·128:
    # 36864 weights, 73728 for both; the head 384·64 = 24576.
    bench = load_benchmark("grpo_step")
    size = bench.model_size("tiny")
    assert (size.body, size.head, size.layers, size.heads, size.head_dim) == (
        73728,
        24576,
        2,
        2,
        32,
    )
    step = bench.StepTime(1.0, {}, 30, 8, 1, computed=40, real=30, trained=30, trained_sq=450)
    want = 6 * 73728 * 30 + 6 * 24576 * 8 + 6 * 2 * 2 * 32 * 450
    assert bench.update_flops(size, step) == want


def test_the_random_qwen2_has_qwen25_05b_parameter_count(tmp_path):
    # Qwen2.5-0.5B's published count is 494,032,768 parameters (0.36B without the embedding):
    # the config written out in the benchmark must give exactly that (built on the meta device).
    import rlblocks as rb

    bench = load_benchmark("grpo_step")
    config = rb.models.tiny_config(rb.models.tiny_tokenizer(), **bench.QWEN25_05B)
    config.save_pretrained(tmp_path)
    size = bench.model_size(str(tmp_path))
    assert size.parameters == 494_032_768 and size.head == 151936 * 896
    assert (size.layers, size.heads, size.head_dim) == (24, 14, 64)


def test_the_random_smollm2_has_smollm2s_matrices(tmp_path):
    # The built-in SmolLM2-135M (a Llama) against its random Qwen2 twin, both built on the meta
    # device: the same matrices, so the same count but for Qwen2's q/k/v biases, 30 layers of
    # 576 + 192 + 192.
    import rlblocks as rb

    bench = load_benchmark("grpo_step")
    config = rb.models.tiny_config(rb.models.tiny_tokenizer(), **bench.SMOLLM2_135M)
    config.save_pretrained(tmp_path)
    twin = bench.model_size(str(tmp_path))
    real = bench.model_size("smollm2-135m")
    assert twin.parameters == real.parameters + 30 * (576 + 192 + 192)
    assert (twin.body, twin.head, twin.layers, twin.heads, twin.head_dim) == (
        real.body,
        real.head,
        real.layers,
        real.heads,
        real.head_dim,
    )


@pytest.mark.parametrize("hazard", [0.05, 0.25])
def test_the_eos_hazard_gives_eos_that_probability_everywhere(hazard):
    # After plant_eos_hazard a logit is z_v = h_c·E_vc + r_v: h_c the normed constant channel
    # (≈ 1), E_vc = K for every token but EOS (K + Δ), r_v the rest. So the odds of EOS are
    # e^(h_c·Δ) · e^(r_eos) / Σ_{v≠eos} e^(r_v), and with every r_v in a window of width w they
    # lie within e^(±w) of e^(h_c·Δ) / (V − 1); at h_c = 1 that is hazard / (1 − hazard). The
    # bound is computed from the model's own h_c and r, so no tolerance is picked; the claims
    # that make it tight are checked too: h_c within 1e-3 of 1, w under 0.1.
    from transformers import Qwen2ForCausalLM

    import rlblocks as rb

    bench = load_benchmark("grpo_step")
    tokenizer = rb.models.tiny_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(rb.models.tiny_config(tokenizer)).double()
    eos, vocab = tokenizer.eos_token_id, model.config.vocab_size
    bench.plant_eos_hazard(model, eos, hazard)
    ids = torch.randint(0, len(tokenizer), (16, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # after the final norm
        logits = model.lm_head(hidden)
    embedding = model.get_input_embeddings().weight.detach()
    h_c = hidden[..., 0]
    rest = logits - h_c[..., None] * embedding[:, 0]
    w = (rest.max(-1).values - rest.min(-1).values).max().item()
    assert (h_c - 1).abs().max() < 1e-3 and w < 0.1
    delta = embedding[eos, 0] - embedding[0, 0]
    p = logits.softmax(-1)[..., eos]
    ratio = (p / (1 - p)) / (torch.exp(h_c * delta) / (vocab - 1))
    assert ratio.min() >= math.exp(-w) and ratio.max() <= math.exp(w)
    assert delta.item() == pytest.approx(math.log(hazard * (vocab - 1) / (1 - hazard)))


def test_row_lengths_of_padded_and_packed_forwards():
    bench = load_benchmark("grpo_step")
    cpu = torch.device("cpu")
    padded = {"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}
    assert bench.row_lengths(padded, 2, 3, cpu).tolist() == [2, 3]
    packed = {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}
    assert bench.row_lengths(packed, 1, 6, cpu).tolist() == [3, 2, 1]
    varlen = {"cu_seq_lens_q": torch.tensor([0, 3, 5, 6])}
    assert bench.row_lengths(varlen, 1, 6, cpu).tolist() == [3, 2, 1]
    left = {
        "attention_mask": torch.tensor([[0, 0, 1, 1]]),
        "position_ids": torch.tensor([[0, 0, 0, 1]]),
    }
    assert bench.row_lengths(left, 1, 4, cpu).tolist() == [2]  # one left-padded row
    assert bench.row_lengths({}, 2, 5, cpu).tolist() == [5, 5]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_grpo_step_refuses_a_cuda_device_torch_does_not_see(capsys):
    bench = load_benchmark("grpo_step")
    assert bench.default_device() == "cpu"
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda"])
    assert "--device cuda: torch sees no CUDA device; pass --device cpu" in capsys.readouterr().err


def test_the_continuous_batching_system_is_skipped_for_fixed_lengths():
    # transformers' continuous batching drops min_new_tokens: the system is skipped, with the
    # flag that makes it run, instead of sampling other shapes than the rest
    bench = load_benchmark("grpo_step")
    fixed = bench.Setup("tiny", ((1, 2),), group_size=2, max_new_tokens=4, lr=0, beta=0, seed=0)
    with pytest.raises(bench.Skipped, match=r"\(min_new_tokens\).*; pass --responses eos"):
        bench.check_engine("cb", fixed)
    bench.check_engine("cb", dataclasses.replace(fixed, responses="eos"))
    bench.check_engine("hf", fixed)


def test_keep_going_records_a_failing_system_and_runs_the_others(tmp_path, monkeypatch):
    # A system whose model folder is absent fails for real (rb.models.load raises OSError).
    # Without --keep-going that stops the benchmark; with it the others are still measured and
    # the failure is recorded, and the run ends with status 1.
    import rlblocks as rb

    bench = load_benchmark("grpo_step")
    monkeypatch.setitem(bench.SYSTEMS, "broken", lambda setup: rb.models.load(tmp_path / "absent"))
    out = tmp_path / "out"
    argv = [*TINY, "--repeats", "1", "--systems", "floor", "broken", "rlblocks", "--out", str(out)]
    with pytest.raises(OSError, match="no model folder at"):
        bench.main(argv)
    with pytest.raises(SystemExit, match=r"1 system\(s\) failed: broken: OSError: no model folder"):
        bench.main([*argv, "--keep-going"])
    record = json.loads((out / "results.json").read_text())
    assert list(record["systems"]) == ["floor", "rlblocks"]
    assert record["failed"]["broken"].startswith("OSError: no model folder at")
    assert "- broken: failed (OSError: no model folder at" in (out / "results.md").read_text()


def test_logprob_memory_measures_three_ways_on_the_tiny_model(capsys):
    # A plumbing check (the tiny model's logits are too small to show the saving): three
    # processes each report a positive peak, and the table names every way.
    bench = load_benchmark("logprob_memory")
    out = bench.main(["--model", "tiny", "--rows", "4", "--prompt", "4", "--tokens", "16"])
    assert set(bench.WAYS) <= set(out) and all(out[way] > 0 for way in bench.WAYS)
    printed = capsys.readouterr().out
    assert all(f"| {way} |" in printed for way in bench.WAYS)


# ---------------------------------------------------------------------- mesh_memory
def test_saved_for_backward_counts_each_storage_once_and_no_weight():
    # y = x Wᵀ saves x and Wᵀ (both require grad), Wᵀ a view of the weight's storage: left
    # out; y * y saves y twice, one storage; y[1:] is a view of y, the same storage again;
    # exp saves its output. So exactly x (5·4 floats), y (5·3) and exp's output (4·3).
    bench = load_benchmark("mesh_memory")
    layer = torch.nn.Linear(4, 3, bias=False)
    x = torch.randn(5, 4, requires_grad=True)
    saved = bench.SavedForBackward(layer)
    with saved.hooks():
        y = layer(x)
        loss = (y * y).sum() + (y[1:] * 2).exp().sum()
    assert saved.nbytes == (5 * 4 + 5 * 3 + 4 * 3) * 4
    loss.backward()  # the hook hands the tensors back untouched
    assert layer.weight.grad.shape == (3, 4)


def test_mesh_memory_one_process_in_this_process():
    # The one-process row's weight side, exactly: every parameter once, its gradient, AdamW's
    # two moments plus one float32 step counter per parameter tensor; nothing split.
    import rlblocks as rb

    bench = load_benchmark("mesh_memory")
    model, _ = rb.models.tiny(**bench.QUICK.model)
    params = list(model.parameters())  # tied embeddings: once
    nbytes = sum(p.numel() * 4 for p in params)
    row = bench.measure(bench.LAYOUTS[0], bench.QUICK)
    assert (row["params"], row["grads"], row["whole"]) == (nbytes, nbytes, nbytes)
    assert row["optimizer"] == 2 * nbytes + 4 * len(params)
    assert row["tokens"] == bench.QUICK.rows * (bench.QUICK.prompt + bench.QUICK.response)
    assert row["saved"] > 0 and row["rss"] >= 0


def test_mesh_memory_table_names_a_layout_not_built():
    bench = load_benchmark("mesh_memory")
    future = bench.Layout("XP2", 2, {"no_such_field": 2})
    assert bench.missing_options(future) == ["no_such_field"]
    assert bench.missing_options(bench.LAYOUTS[2]) == []  # TP2: TrainConfig.tp
    one = dict.fromkeys(bench.COLUMNS, 100) | {"tokens": 8}
    half = {**one, "params": 50, "grads": 50, "optimizer": 50, "saved": 25}
    bench.LAYOUTS += (future,)
    try:
        printed = bench.table({"one process": one, "TP2": half, "XP2": "not built yet"})
    finally:
        bench.LAYOUTS = bench.LAYOUTS[:-1]
    rows = table_rows(printed)
    assert rows["TP2"]["weight-side MiB (×)"].endswith("(0.500)")
    assert rows["TP2"]["saved activations MiB (×)"].endswith("(0.250)")
    assert rows["XP2"]["tokens/rank"] == "not built yet" and len(rows["XP2"]) == 11


def quick_weight_bytes() -> tuple[int, int]:
    """(all parameter bytes, bytes of the norms: what tensor parallelism leaves whole) of the
    quick model; every split dimension of it divides by 4."""
    import rlblocks as rb

    bench = load_benchmark("mesh_memory")
    model, _ = rb.models.tiny(**bench.QUICK.model)
    whole = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    return sum(p.numel() * 4 for p in model.parameters()), whole


def check_tp2(rows: dict, total: int, whole: int) -> None:
    # Tensor parallelism splits every weight but the norms in two, the embedding by its
    # vocabulary rows; the gradients and AdamW's moments follow their weights.
    tp2 = rows["TP2"]
    exact = [{k: v for k, v in rank.items() if k != "rss"} for rank in tp2]  # rss: the heap's
    assert len(tp2) == 2 and exact[0] == exact[1]  # the same on both ranks
    split = (total - whole) // 2 + whole
    assert (tp2[0]["params"], tp2[0]["grads"], tp2[0]["whole"]) == (split, split, whole)
    assert tp2[0]["tokens"] == rows["one process"][0]["tokens"]  # every row on every rank
    one = rows["one process"][0]["saved"]
    assert one / 2 < tp2[0]["saved"] < one  # heads and MLP features split, the residual not
    assert not [k for k in rows["one process"][0] if k.startswith("collectives/")]
    # TP's collectives are all-reduces (and the rows' hand-out); nothing is FSDP-sharded
    assert tp2[0]["collectives/all-reduce"] > 0 and "collectives/reduce-scatter" not in tp2[0]


def test_mesh_memory_quick_tp2(capsys):
    bench = load_benchmark("mesh_memory")
    rows = bench.main(["--quick", "--layouts", "TP2"])
    assert list(rows) == ["one process", "TP2"]
    check_tp2(rows, *quick_weight_bytes())
    printed = table_rows(capsys.readouterr().out)
    assert printed["one process"]["weight-side MiB (×)"].endswith("(1.000)")
    assert printed["TP2"]["weight-side MiB (×)"].endswith("(0.502)")  # the norms stay whole


@pytest.mark.slow
def test_mesh_memory_quick_every_layout(tmp_path, capsys):
    # DP2 (FSDP2) shards every weight, norms included, in two by rows; DP2×TP2 splits the
    # TP2 shards again in two over the data-parallel pair. Two equal rows: a data-parallel
    # rank trains one of them, so it sees half the tokens and saves fewer activations.
    import rlblocks as rb

    bench = load_benchmark("mesh_memory")
    rows = bench.main(["--quick", "--out", str(tmp_path)])
    total, whole = quick_weight_bytes()
    check_tp2(rows, total, whole)
    one = rows["one process"][0]
    units = rb.models.tiny(**bench.QUICK.model)[0].config.num_hidden_layers + 1  # FSDP units:
    for rank in rows["DP2"]:  # every decoder layer, then the whole model
        assert (rank["params"], rank["whole"]) == (total // 2, 0)
        assert rank["tokens"] == one["tokens"] // 2 and rank["saved"] < one["saved"]
        # each unit gathers its weights in the forward and again in the backward, and
        # reduce-scatters its gradients once
        gathers = (rank["collectives/all-gather"], rank["collectives/reduce-scatter"])
        assert gathers == (2 * units, units)
    quarter = (total - whole) // 4 + whole // 2
    for rank in rows["DP2xTP2"]:
        assert (rank["params"], rank["grads"]) == (quarter, quarter)
        assert rank["saved"] < rows["TP2"][0]["saved"]
    assert len(rows["DP2xTP2"]) == 4
    sp = rows["SP2"]
    assert isinstance(sp, list) or sp.startswith("not built yet (TrainConfig has no sp)")
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["layouts"]["DP2"] == rows["DP2"]
    assert set(table_rows(capsys.readouterr().out)) == {x.name for x in bench.LAYOUTS}


def test_replay_benchmark_on_the_tiny_model(capsys):
    """benchmarks/replay.py: per sampler, the trainer without replay is off by the kept mass,
    with replay at rounding, and the HF default row (untruncated on both sides) at rounding."""
    bench = load_benchmark("replay")
    rows = bench.main(["--model", "tiny", "--prompts", "2", "--group-size", "2",
                       "--max-new-tokens", "4"])  # fmt: skip
    out = capsys.readouterr().out
    cases = {(r["sampler"], r["case"]): r for r in rows}
    assert set(cases) == {(s, c) for s in bench.SAMPLERS for c in ("before", "after", "hf default")}
    for sampler in bench.SAMPLERS:
        assert cases[sampler, "before"]["mismatch/abs_mean"] > 0.05
        assert cases[sampler, "after"]["mismatch/abs_max"] < 1e-4
        assert cases[sampler, "hf default"]["mismatch/abs_max"] < 1e-4
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + len(rows)  # the header, a row per case


def test_packed_attention_benchmark_on_the_tiny_model(capsys, monkeypatch, tmp_path):
    """benchmarks/packed_attention.py: the three ways run on one micro-batch, agree on the
    log-probs, and the ratios and the results file come out. fp32 on the tiny model: each
    log-prob goes through a few hundred float32 roundings (eps 6e-8) of terms below 10, so the
    ways agree within 1e-4; a row attending to another moves them by more than 1e-3
    (tests/trainer/test_packing.py)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports grpo_step beside it
    bench = load_benchmark("packed_attention")
    result = bench.main(["--rows", "4", "--repeats", "1", "--max-new-tokens", "16",
                         "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert set(result["median_seconds"]) == set(bench.WAYS)
    assert all(s > 0 for s in result["median_seconds"].values())
    assert all(gap < 1e-4 for gap in result["max_logprob_gap"].values())
    assert "packed-rows / packed-batched:" in out
    saved = json.loads((tmp_path / "packed_attention.json").read_text())
    assert saved["ratios"] == result["ratios"]


def test_rollout_benchmark_measures_every_engine_on_the_tiny_model(tmp_path, capsys):
    # Timings on the tiny model mean nothing; what is checked: every engine samples the same
    # prompts, in fixed mode every row has max_new_tokens tokens (equal work), in eos mode the
    # lengths are mixed, continuous batching is skipped where it cannot hold EOS back, the ops
    # per step are counted, and the table and files are written.
    bench = load_benchmark("rollout")
    args = ["--model", "tiny", "--prompts", "3", "--n", "2", "--max-new-tokens", "6",
            "--repeats", "1", "--threads", "1", "--engines", "hf", "static", "cb",
            "--out", str(tmp_path)]  # fmt: skip
    rows = bench.main(args)
    out = capsys.readouterr().out
    assert [(r.engine, r.responses) for r in rows] == [
        ("hf", "fixed"), ("static", "fixed"), ("hf", "eos"), ("static", "eos"), ("cb", "eos"),
    ]  # fmt: skip
    fixed = [r for r in rows if r.responses == "fixed"]
    assert all(r.tokens == [6 * 6] and r.steps == 6 for r in fixed)  # 3 prompts x 2, 6 tokens
    assert all(r.mean_length < 6 for r in rows if r.responses == "eos")  # the EOS hazard
    assert all(r.ops_per_step and r.ops_per_step > 0 for r in rows)
    assert "skipped cb (fixed): continuous batching cannot hold EOS back" in out
    table = table_rows(out)
    assert set(table) == {"hf", "static", "cb"} and "of bound" in table["hf"]
    saved = json.loads((tmp_path / "rollout.json").read_text())
    assert len(saved["rows"]) == 5 and saved["setup"]["bandwidth"] > 0
    assert (tmp_path / "rollout.md").read_text().startswith("| engine |")


def test_update_benchmark_rows_total_the_tokens_in_whole_groups():
    bench = load_benchmark("update")
    for tokens in (12, 100, 3264):
        lengths = bench.row_lengths(tokens, group_size=6, prompt=(43, 62), max_new=32, seed=0)
        assert sum(p + r for p, r in lengths) == tokens and len(lengths) % 6 == 0
        assert all(p >= 1 and r >= 1 for p, r in lengths)
    # 12 tokens in a group of 6: every row trimmed to 1 prompt + 1 response token
    assert bench.row_lengths(12, group_size=6, prompt=(43, 62), max_new=32, seed=0) == [(1, 1)] * 6
    # 3 micro-batches of 1000 tokens over 3000 tokens in 48 rows: 16 rows each, a divisor of 48
    assert bench.trl_micro_rows(48, 3000, 1000) == 16
    assert bench.trl_micro_rows(42, 3000, 1000) == 14 and bench.trl_micro_rows(10, 3000, 1000) == 5


def test_update_benchmark_times_eager_and_compiled_on_the_tiny_model(tmp_path, capsys):
    # Timings on the tiny model mean nothing; what is checked: both systems step on the same
    # rows at two token counts (one compile: dynamic shapes), every time is positive, the MFU
    # is computed against the run's matmul, and the table and JSON are written.
    bench = load_benchmark("update")
    rows = bench.main(["--model", "tiny", "--tokens", "64,150", "--warmup", "1", "--steps", "2",
                       "--threads", "1", "--systems", "eager", "compiled",
                       "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert [(r.system, r.tokens) for r in rows] == [
        ("eager", 64), ("eager", 150), ("compiled", 64), ("compiled", 150),
    ]  # fmt: skip
    assert all(len(r.seconds) == 2 and min(r.seconds) > 0 and r.first_s > 0 for r in rows)
    assert all(r.flops > 0 and r.rows % 6 == 0 for r in rows)
    assert "compiled / eager at 150 tokens: " in out
    saved = json.loads((tmp_path / "update.json").read_text())
    assert saved["matmul_flops_per_s"] > 0 and len(saved["rows"]) == 4
    for row in saved["rows"]:
        assert row["median_s"] > 0 and row["tokens_per_s"] > 0 and 0 < row["mfu"]
        assert row["peak_bytes"] >= 0 and row["system"] in ("eager", "compiled")
        # Over the update's own products at their shapes: the same FLOPs, another rate.
        same = saved["same_shape_flops_per_s"][str(row["tokens"])]
        assert row["of_same_shape"] == pytest.approx(row["flops_per_s"] / same)
    assert (tmp_path / "update.md").read_text().splitlines()[2].startswith("| system |")
