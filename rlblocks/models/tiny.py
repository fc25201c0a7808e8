"""A tiny Qwen2-style model and a locally trained tokenizer, for tests and tutorials.

Built from scratch in well under a second, with no download: a byte-level BPE tokenizer trained
with ``tokenizers`` on a small built-in corpus (Qwen2's pre-tokenizer, a ChatML chat template)
and a randomly initialised ``Qwen2ForCausalLM`` (head_dim 32, the smallest the CPU attention of
vLLM serves). ``save_tiny(path)`` writes both with ``save_pretrained`` so that
``rlblocks.models.load(path)`` reloads them like any Hugging Face checkpoint.

The tokenizer is saved as a plain ``PreTrainedTokenizerFast``: transformers 5's ``AutoTokenizer``
would otherwise rebuild a "qwen2" tokenizer class around the vocabulary and swap in its own
pre-tokenizer, so the reloaded tokenizer would split text differently from the one trained here.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation, whitespace.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS = [
    "What is 12 + 7? Answer: 19. What is 30 - 4? The answer is 26.",
    "Tom has 3 apples and buys 5 more. How many apples does he have now? #### 8",
    "Compute 6 * 7 = 42, then 42 / 2 = 21. So the final answer is \\boxed{21}.",
    "<think> add the numbers first, then subtract </think> <answer> 15 </answer>",
    "The quick brown fox jumps over the lazy dog. A cat sat on the mat with a hat.",
    "Please reason step by step, and put your final answer after ####.",
    "user assistant system: You are a helpful assistant. Hello! How are you today?",
    "one two three four five six seven eight nine ten eleven twelve hundred thousand",
    "plus minus times divided by equals sum difference product total left right each",
]


def tiny_tokenizer(*, vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a built-in corpus, with a ChatML chat template.

    Every string encodes (the 256 byte tokens are in the vocabulary); ``<|im_end|>`` is the
    end-of-turn / EOS token and ``<|endoftext|>`` the padding token.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tokenizer.to_str()


def tiny_config(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> Qwen2Config:
    """A 2-layer Qwen2 config sized for a unit test: hidden 64, 2 heads of 32, tied embeddings."""
    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    settings.update(overrides)
    return Qwen2Config(**settings)


def tiny(
    *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides: Any
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """A freshly initialised tiny model and its tokenizer; the same ``seed`` gives the same weights.

    ``config_overrides`` go to :class:`~transformers.Qwen2Config` (e.g. ``num_hidden_layers=4``).
    """
    tokenizer = tiny_tokenizer()
    config = tiny_config(tokenizer, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(dtype).eval(), tokenizer  # type: ignore[arg-type]  # transformers types .to as wraps(Module.to)


def save_tiny(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny model and tokenizer to ``path`` (``save_pretrained``); returns the path."""
    path = Path(path)
    model, tokenizer = tiny(seed=seed, **config_overrides)
    save_on_any_rank(model, path)
    tokenizer.save_pretrained(path)
    return path


def save_on_any_rank(model: PreTrainedModel, path: str | Path) -> None:
    """``model.save_pretrained(path)``, even on a non-zero rank of a process group.

    Once ``torch.distributed`` is initialized, transformers writes model files only on rank 0
    (``should_save_on_this_rank``); a built-in model converted into the cache by rank 1 of a
    worker group would then lack its ``config.json``. Here the process saves whatever its rank.
    """
    model.should_save_on_this_rank = lambda is_main_process: True  # type: ignore[method-assign]  # this instance only
    try:
        model.save_pretrained(path)
    finally:
        del model.should_save_on_this_rank
