"""Training data: prompt datasets for RL steps, tokenized examples for supervised fine-tuning.

    ds = rb.data.load_prompts("train.parquet", prompt="question", ground_truth="answer",
                              template="Question: {prompt}\\nAnswer:")
    ds = rb.data.gsm8k("gsm8k/train.parquet")               # ground truth = number after ####
    ds = rb.data.arithmetic_prompts(1000, difficulty=2)     # built-in offline task, no download
    for batch in rb.data.PromptBatches(ds, prompts_per_step=8, seed=0):
        ro = engine.generate(batch.prompts, group_size=4, metadata=batch.metadata)
    sft = rb.data.sft_data("chats.jsonl", tokenizer, max_tokens=1024)  # or prompt/completion
    for batch in rb.data.SFTBatches(sft, batch_size=8, epochs=3):  # Rollouts; response_mask
        logs = policy.step(batch, zeros, loss_fn=nll)               # True on assistant tokens

- `dataset`: `PromptRow`, `PromptDataset` (the rows, and the source indices a filter dropped).
- `prompts`: `load_prompts` (files, Datasets, dicts; templates, chat messages; malformed rows
  reported by row and column).
- `length`: `prompt_token_ids` and `limit_prompt_length` (overlong "error" / "truncate" /
  "filter").
- `batches`: `PromptBatches` and `SFTBatches`, deterministic, resumable (``state_dict``) batch
  iterators.
- `sft`: `sft_data`, `SFTData`, `SFTExample`: conversations or prompt / completion pairs as
  token ids with a mask of the assistant tokens, rendered as the RL prompts are.
- `arithmetic`: seeded integer word problems with disjoint train / test splits.
- `gsm8k`: the GSM8K layout (``#### 72`` answers).
- `names`: ``DATA``, the builders a config file names (each registers itself).
"""

from rlblocks.data.arithmetic import (
    LEVELS,
    TEST_FRACTION,
    Difficulty,
    arithmetic,
    arithmetic_prompts,
)
from rlblocks.data.batches import PromptBatch, PromptBatches, SFTBatches
from rlblocks.data.dataset import PromptDataset, PromptRow
from rlblocks.data.gsm8k import gsm8k, gsm8k_final_answer
from rlblocks.data.length import limit_prompt_length, prompt_token_ids
from rlblocks.data.names import DATA
from rlblocks.data.prompts import (
    BOXED_INSTRUCTION,
    HASH_INSTRUCTION,
    instruction_template,
    load_prompts,
    read_rows,
)
from rlblocks.data.sft import SFTData, SFTExample, sft_data

__all__ = [
    "BOXED_INSTRUCTION",
    "DATA",
    "HASH_INSTRUCTION",
    "LEVELS",
    "TEST_FRACTION",
    "Difficulty",
    "PromptBatch",
    "PromptBatches",
    "PromptDataset",
    "PromptRow",
    "SFTBatches",
    "SFTData",
    "SFTExample",
    "arithmetic",
    "arithmetic_prompts",
    "gsm8k",
    "gsm8k_final_answer",
    "instruction_template",
    "limit_prompt_length",
    "load_prompts",
    "prompt_token_ids",
    "read_rows",
    "sft_data",
]
