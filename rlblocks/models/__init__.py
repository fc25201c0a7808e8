"""Causal LMs and tokenizers: ``load(name_or_path)``, built-in models, and the ``tiny`` factory."""

from rlblocks.models.builtin import BUILTINS, builtin_path, cache_dir
from rlblocks.models.context import check_lengths, context_length
from rlblocks.models.loading import load, load_tokenizer, prepare_tokenizer, resolve
from rlblocks.models.tiny import save_tiny, tiny, tiny_config, tiny_tokenizer

__all__ = [
    "BUILTINS",
    "builtin_path",
    "cache_dir",
    "check_lengths",
    "context_length",
    "load",
    "load_tokenizer",
    "prepare_tokenizer",
    "resolve",
    "save_tiny",
    "tiny",
    "tiny_config",
    "tiny_tokenizer",
]
