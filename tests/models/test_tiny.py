import time

import torch

from rlblocks.models import load, save_tiny, tiny, tiny_tokenizer

TRICKY = "What's 1,234 + 56?\n\n  Tom can't count. #### 1290 \\boxed{1290} <answer>x</answer> é"


def test_tiny_builds_fast_and_is_seeded():
    start = time.perf_counter()
    model, tokenizer = tiny(seed=3)
    assert time.perf_counter() - start < 2.0
    again, _ = tiny(seed=3)
    other, _ = tiny(seed=4)
    w = model.model.embed_tokens.weight
    torch.testing.assert_close(w, again.model.embed_tokens.weight)
    assert not torch.equal(w, other.model.embed_tokens.weight)
    config = model.config
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM CPU attention
    assert config.vocab_size == len(tokenizer)
    assert tokenizer.padding_side == "left"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_tokenizer_round_trips_any_text():
    tokenizer = tiny_tokenizer()
    ids = tokenizer(TRICKY, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == TRICKY
    # Qwen2's pre-tokenizer splits digits one by one.
    assert tokenizer.tokenize("123") == ["1", "2", "3"]


def test_chat_template_renders_chatml():
    tokenizer = tiny_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_save_and_load_round_trip(tmp_path):
    model, tokenizer = tiny(seed=1)
    save_tiny(tmp_path / "m", seed=1)
    loaded, loaded_tok = load(tmp_path / "m")
    # The reloaded tokenizer splits text exactly like the trained one (no swapped pre-tokenizer).
    assert loaded_tok(TRICKY).input_ids == tokenizer(TRICKY).input_ids
    assert loaded_tok.chat_template == tokenizer.chat_template
    assert loaded_tok.padding_side == "left"
    ids = torch.tensor([tokenizer(TRICKY).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
