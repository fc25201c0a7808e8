"""What every recipe shares, on the tiny model: the same names for the same metrics, the KL to
the reference under one name, and the structure the run floor leaves them (algorithms only: no
loop options, no probing of blocks, short step functions)."""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import count_prompts, digit_fraction, run_group_recipe

import rlblocks as rb
from rlblocks.critic import CriticTrainer
from rlblocks.data import PromptBatches
from rlblocks.recipes import defaults
from rlblocks.recipes.defaults import PPO_CLIP
from rlblocks.run.clock import PHASES

TIMES = {f"time/{phase}" for phase in PHASES}
SHARED = TIMES | {"reward/mean", "step_seconds", "response_length"}


# ---------------------------------------------------------------------- every recipe
class CountingEngine(rb.rollout.HFEngine):
    """The tiny model's HFEngine, counting the calls a recipe makes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def generate(self, *args, **kwargs):
        self.calls.append("generate")
        return super().generate(*args, **kwargs)

    def sleep(self) -> None:
        self.calls.append("sleep")

    def wake_up(self) -> None:
        self.calls.append("wake_up")


def run_ppo(policy, engine, *, steps: int, **kw) -> list[dict]:
    """PPO on the digit-fraction task, 4 prompts × 2 samples of at most 8 tokens a step, a
    critic on the policy's model; its history."""
    return rb.recipes.ppo(
        policy,
        CriticTrainer(policy.model, lr=1e-3),
        engine,
        rb.rewards.per_sample(digit_fraction, timeout=None),
        PromptBatches(count_prompts(), prompts_per_step=4, seed=0),
        steps=steps,
        group_size=2,
        sampling=rb.SamplingParams(max_new_tokens=8),
        run=rb.run.RunOptions(progress=False),
        **kw,
    )


def run_recipe(name: str, loss_fn=None, steps: int = 2):
    """``name`` on the tiny model and the digit-fraction task (tests/toy_tasks.py), the policy
    with a reference copy; the history and the engine's calls."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = tiny_trainer(reference="copy")
        engine = CountingEngine(policy.model, policy.tokenizer, progress=False)
        kw = {} if loss_fn is None else {"loss_fn": loss_fn}
        if name == "ppo":
            history = run_ppo(policy, engine, steps=steps, **kw)
        else:
            recipe, extra = RECIPES[name]
            history = run_group_recipe(recipe, policy, engine, steps=steps, **extra, **kw)
    return history, engine.calls


RECIPES = {
    "grpo": (rb.recipes.grpo, {}),
    "rloo": (rb.recipes.grpo, {"advantage": rb.advantage.rloo}),  # a variant: one keyword
    "remax": (rb.recipes.remax, {}),
    "dapo": (rb.recipes.dapo, {"max_rounds": 4}),
}
GENERATE_CALLS = {"grpo": 1, "rloo": 1, "remax": 2, "ppo": 1}  # per step; DAPO: one per round


@pytest.mark.parametrize("name", ["grpo", "rloo", "remax", "dapo", "ppo"])
def test_every_recipe_reports_the_same_names(name):
    history, calls = run_recipe(name)
    assert len(history) == 2
    for h in history:
        assert h.get("sampling/skipped", 0.0) == 0.0  # a trained step (DAPO can skip)
        missing = SHARED - set(h)
        assert not missing, missing
        for key in ("loss", "grad_norm", "seconds", "logprob_seconds", "sync/version"):
            assert key in h, key  # the trainer's and the resharder's
        assert all(h[k] >= 0.0 for k in TIMES), {k: h[k] for k in TIMES}
        assert h["time/rollout"] > 0 and h["time/reward"] > 0 and h["time/update"] > 0
        assert sum(h[k] for k in TIMES) <= h["step_seconds"]
        assert h["time/logprobs"] >= h["logprob_seconds"]  # the trainer's scoring, moved
        assert "kl/token" not in h or name == "ppo"  # no KL term in the default GRPO loss
    # The engine frees itself (VLLMEngine sleeps at the end of generate): no recipe calls
    # sleep or wake_up, and each generates only what its algorithm needs.
    assert set(calls) == {"generate"}
    rounds = sum(h.get("sampling/rounds", 0) for h in history)
    assert len(calls) == (rounds if name == "dapo" else GENERATE_CALLS[name] * len(history))


def test_ppo_counts_its_scoring_as_logprobs_and_its_critic_as_update():
    history, _ = run_recipe("ppo")
    for h in history:
        # π_old, π_ref and V are scored by the recipe before the update, under "logprobs";
        # the trainer, given old_logprobs and ro.ref_logprobs, scores nothing more.
        assert h["time/logprobs"] > h["logprob_seconds"]
        # The update phase holds the critic's and the policy's updates.
        assert h["time/update"] >= h["vf_seconds"] + h["seconds"] - h["logprob_seconds"]
        assert {"kl/token", "kl/seq", "kl/coef"} <= set(h)


def clip_plus_kl(logprobs, old_logprobs, advantages, mask, /, *, ref_logprobs):
    """The clipped surrogate plus 0.1·k3, composed by hand: reports kl_loss's ``kl``."""
    pg, m = rb.losses.clipped_surrogate(logprobs, old_logprobs, advantages, mask)
    kl, m_kl = rb.losses.kl_loss(logprobs, ref_logprobs, mask)
    return pg + 0.1 * kl, {**m, **m_kl}


@pytest.mark.parametrize("name", ["grpo", "remax"])  # DAPO's loss is fixed: no KL term (§2.3)
@pytest.mark.parametrize("source", ["kl_regularized", "kl_loss"])
def test_the_grpo_family_reports_a_kl_term_as_kl_token(name, source):
    if source == "kl_regularized":
        loss, key = rb.losses.kl_regularized(PPO_CLIP, kl_coef=0.1), "kl_loss"
    else:
        loss, key = clip_plus_kl, "kl"
    history, _ = run_recipe(name, loss_fn=loss)
    for h in history:
        assert h["kl/token"] == h[key]  # the same value under the shared name
    assert history[0]["kl/token"] == 0.0  # the policy starts at its reference
    assert history[-1]["kl/token"] > 0.0
    # β sits inside the loss and there is no per-sequence KL: those names stay PPO's.
    assert not {"kl/seq", "kl/coef"} & set(history[-1])


def test_ppo_keeps_its_own_kl_token_beside_the_loss_term():
    policy = tiny_trainer(reference="auto", mini_batch_size=4)
    engine = tiny_engine(policy)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        history = run_ppo(policy, engine, steps=3, kl_in_reward=False)
    # Two mini-batches: the second is scored after the first update, so the loss term's KL
    # (kl_loss, during the update) differs from the recipe's (kl/token, before it); the loop
    # keeps both rather than overwrite the recipe's measurement.
    last = history[-1]
    assert last["optimizer_steps"] == 2.0
    assert not math.isclose(last["kl/token"], last["kl_loss"], rel_tol=1e-6)
    assert last["kl/token"] > 0 and last["kl_loss"] > 0


# ---------------------------------------------------------------------- structure
RECIPE_DIR = Path(defaults.__file__).parent
RECIPE_MODULES = ("dapo", "distill", "evaluate", "grpo", "online_dpo", "ppo", "sft", "variants")
RECIPES_ALL = ("grpo", "ppo", "dapo", "remax", "distill", "online_dpo", "sft")
#: The classes of the blocks (engines, trainers, critics, placements): never probed.
BLOCK_CLASSES = {
    name
    for package in (rb.trainer, rb.rollout, rb.critic, rb.placement)
    for name in package.__all__
}


@pytest.mark.parametrize("module", RECIPE_MODULES)
def test_no_recipe_imports_another_or_probes_a_block(module):
    source = (RECIPE_DIR / f"{module}.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in {"getattr", "hasattr"}, (module, node.lineno)
            if node.func.id == "isinstance":  # on a plain value, never on a block's class
                kinds = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not kinds & BLOCK_CLASSES, (module, kinds, node.lineno)
    recipes = {m for m in imported if m.startswith("rlblocks.recipes.")}
    assert recipes <= {"rlblocks.recipes.defaults", "rlblocks.recipes.names"}, recipes
    assert "inspect" not in imported and "rlblocks.losses.inputs" not in imported
    assert "rlblocks.critic" not in imported  # PPO's critic is an interfaces.Critic
    concrete = {"rlblocks.trainer", "rlblocks.rollout", "rlblocks.critic", "rlblocks.placement"}
    assert not [m for m in imported for c in concrete if m == c or m.startswith(c + ".")]


@pytest.mark.parametrize("name", RECIPES_ALL)
def test_no_recipe_declares_the_loops_options(name):
    # How a run is driven is one RunOptions (run=); the loop's and the source's keywords are
    # nobody's own.
    parameters = inspect.signature(getattr(rb.recipes, name)).parameters
    assert "run" in parameters
    fields = rb.run.options.LOOP_FIELDS | rb.run.options.SOURCE_FIELDS
    assert not set(parameters) & fields, name


def test_the_run_floor_finds_capabilities_in_the_contracts_not_in_classes():
    # isinstance only on the Protocols of rlblocks.interfaces (Handle) or plain Python types,
    # never on a block's class: the engines', trainers', critics' and placements'.
    floor = Path(rb.run.__file__).parent
    checked = 0
    for path in floor.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                kinds = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not kinds & BLOCK_CLASSES, (path.name, kinds)
                checked += 1
    assert checked  # the test reads the floor's isinstance calls


def test_every_recipe_is_one_loop_driven_by_a_run_with_no_inner_step_function():
    # Each recipe reads top to bottom: `with run.driving(source): for step in run:` in the
    # recipe's own body, under 100 lines, and no function inside it that updates the policy
    # (a step function handed to a framework).
    found = set()
    for path in sorted(RECIPE_DIR.glob("*.py")):
        for recipe in ast.parse(path.read_text()).body:
            if not isinstance(recipe, ast.FunctionDef) or recipe.name not in RECIPES_ALL:
                continue
            inner = [n for n in ast.walk(recipe) if isinstance(n, ast.FunctionDef)][1:]
            for fn in inner:
                calls = {ast.unparse(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)}
                assert "policy.step" not in calls, (recipe.name, fn.name)
            loops = [
                n
                for n in ast.walk(recipe)
                if isinstance(n, ast.For) and ast.unparse(n.iter) == "run"
            ]
            assert len(loops) == 1, recipe.name
            assert loops[0].end_lineno - loops[0].lineno < 100, recipe.name
            drives = [n for n in ast.walk(recipe) if isinstance(n, ast.With) and loops[0] in n.body]
            assert [ast.unparse(d.items[0].context_expr) for d in drives] == [
                "run.driving(source)"
            ], recipe.name
            found.add(recipe.name)
    assert found == set(RECIPES_ALL), found
