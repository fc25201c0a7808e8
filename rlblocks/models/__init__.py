"""Causal LMs and tokenizers: ``load(name_or_path)``, built-in models, the ``tiny`` factory, and
where a loaded model goes (``default_device``: CUDA when torch sees a GPU, else the CPU)."""

from rlblocks.models.builtin import BUILTINS, builtin_path, cache_dir
from rlblocks.models.context import check_lengths, context_length
from rlblocks.models.device import default_device, resolve_device
from rlblocks.models.loading import load, load_tokenizer, prepare_tokenizer, resolve
from rlblocks.models.tiny import save_tiny, tiny, tiny_config, tiny_tokenizer

__all__ = [
    "BUILTINS",
    "builtin_path",
    "cache_dir",
    "check_lengths",
    "context_length",
    "default_device",
    "load",
    "load_tokenizer",
    "prepare_tokenizer",
    "resolve",
    "resolve_device",
    "save_tiny",
    "tiny",
    "tiny_config",
    "tiny_tokenizer",
]
