"""The toy task the learning tests share: a dense reward a random tiny model can climb.

The task: 16 prompts "Count: i"; the reward of a completion is its share of digits. A random
tiny model writes ~2% digits, so a working update lifts the reward to ~1 in a few dozen steps.
"""

import dataclasses
from typing import Any

import rlblocks as rb
from rlblocks.data import PromptBatches, load_prompts


def digit_fraction(completion: str, **row) -> float:
    """The share of characters that are digits (checkable by a rule, dense)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def count_prompts(n: int = 16):
    """The task's prompts, "Count: 0" … "Count: n-1" (the ground truth is unused)."""
    return load_prompts([{"prompt": f"Count: {i}", "ground_truth": "0"} for i in range(n)])


def run_group_recipe(
    recipe, policy, engine, *, steps: int, reward=None, run=None, **kw: Any
) -> list[dict]:
    """A group recipe (grpo, dapo, remax, ...) on the task: 4 prompts a step, 8 samples of at
    most 8 tokens each (``reward``: the task's digit fraction unless given), no progress bar
    (``run``'s other options as given); its history."""
    return recipe(
        policy,
        engine,
        reward or rb.rewards.per_sample(digit_fraction, timeout=None),
        PromptBatches(count_prompts(), prompts_per_step=4, seed=0),
        steps=steps,
        group_size=8,
        sampling=rb.SamplingParams(max_new_tokens=8),
        run=dataclasses.replace(run or rb.run.RunOptions(), progress=False),
        **kw,
    )


def digit_examples(tokenizer, first: int, n: int) -> rb.Rollouts:
    """SFT examples of the task: prompt "Count: i", target a digit string (the reverse of a
    fixed 10-digit string rotated by i) and EOS; prompts ``first`` … ``first + n − 1``."""
    digits = "0123456789"
    prompts, targets = [], []
    for i in range(first, first + n):
        prompts.append(tokenizer(f"Count: {i}")["input_ids"])
        target = (digits[i % 10 :] + digits[: i % 10])[:8]
        targets.append(tokenizer(target, add_special_tokens=False)["input_ids"])
        targets[-1].append(tokenizer.eos_token_id)
    return rb.Rollouts.from_lists(prompts, targets, pad_token_id=tokenizer.pad_token_id)
