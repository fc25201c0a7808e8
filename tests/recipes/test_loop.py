"""The loop every recipe shares (rlblocks/run/loop.py): the clock, early stop, the metrics
it adds; and, on the tiny model, that every recipe reports the same names for the same things."""

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
from rlblocks.run import Batches, RunOptions
from rlblocks.run.loop import PHASES, Clock, Step, run_steps, shared_metrics

TIMES = {f"time/{phase}" for phase in PHASES}
SHARED = TIMES | {"reward/mean", "step_seconds", "response_length"}


class FakeTimer:
    """A clock that reads whatever the test set it to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rows(*lengths: int) -> rb.Rollouts:
    """Rows with responses of the given lengths (token id 5, prompt [1, 2])."""
    return rb.Rollouts.from_lists([[1, 2]] * len(lengths), [[5] * n for n in lengths])


# ---------------------------------------------------------------------- the clock
def test_clock_hand_worked_nested_phases_count_each_second_once():
    timer = FakeTimer()
    clock = Clock(timer)
    with clock("rollout"):  # t = 0
        timer.now = 2.0
        with clock("reward"):  # rollout 0 -> 2 (2 s), reward from 2
            timer.now = 2.5
        timer.now = 4.0  # reward 2 -> 2.5 (0.5 s), rollout again 2.5 -> 4 (1.5 s)
    timer.now = 10.0  # outside every phase: counted nowhere
    with clock("rollout"):  # a phase entered again adds up: 10 -> 11
        timer.now = 11.0
    scored = clock.timed("update", lambda x, *, y: x + y)
    timer.now = 20.0
    assert scored(1, y=2) == 3  # the call itself took no (fake) time
    assert clock.seconds == {
        "rollout": 2.0 + 1.5 + 1.0,
        "reward": 0.5,
        "logprobs": 0.0,
        "update": 0.0,
        "sync": 0.0,
    }
    with pytest.raises(ValueError, match="unknown phase 'train'"), clock("train"):
        pass


def test_clock_stops_a_phase_that_raised():
    timer = FakeTimer()
    clock = Clock(timer)
    with pytest.raises(RuntimeError), clock("update"):
        timer.now = 3.0
        raise RuntimeError
    timer.now = 7.0
    with clock("sync"):
        timer.now = 8.0
    assert (clock.seconds["update"], clock.seconds["sync"]) == (3.0, 1.0)


# ---------------------------------------------------------------------- the metrics it adds
def test_shared_metrics_move_the_trainers_scoring_out_of_the_update():
    clock = Clock(FakeTimer())
    clock.seconds |= {"rollout": 4.0, "reward": 1.0, "update": 3.0, "sync": 0.5}
    out = Step({"reward/mean": 0.25, "seconds": 2.9, "logprob_seconds": 1.0}, rows(2, 4))
    metrics = shared_metrics(out, clock, step_seconds=9.0)
    # policy.step ran under "update" for 3 s, of which the trainer spent 1 s scoring π_old:
    # time/logprobs = 0 + 1, time/update = 3 − 1.
    assert {k: metrics[k] for k in sorted(TIMES)} == {
        "time/logprobs": 1.0,
        "time/reward": 1.0,
        "time/rollout": 4.0,
        "time/sync": 0.5,
        "time/update": 2.0,
    }
    assert metrics["step_seconds"] == 9.0
    assert metrics["response_length"] == 3.0  # (2 + 4) / 2
    assert metrics["reward/mean"] == 0.25 and "kl/token" not in metrics  # no KL term: no KL
    # No rows (DAPO's skipped step): no response length, still all five times.
    empty = shared_metrics(Step({}, None), Clock(FakeTimer()), step_seconds=1.0)
    assert "response_length" not in empty and TIMES <= set(empty)
    assert all(empty[k] == 0.0 for k in TIMES)


@pytest.mark.parametrize(
    ("reported", "kl_token"),
    [
        ({"kl_loss": 0.2}, 0.2),  # rb.losses.kl_regularized's name
        ({"kl": 0.3}, 0.3),  # rb.losses.kl_loss composed by hand (the demo, docs)
        ({"kl_loss": 0.2, "kl": 0.3}, 0.2),  # kl_regularized's first
        ({"kl/token": 0.1, "kl_loss": 0.2}, 0.1),  # PPO measured its own: never overwritten
        ({"approx_kl": 0.4, "mismatch/kl": 0.5}, None),  # KL to π_old / π_rollout: not this
    ],
)
def test_kl_to_the_reference_gets_the_shared_name_without_clobbering(reported, kl_token):
    metrics = shared_metrics(Step(dict(reported), None), Clock(), step_seconds=0.0)
    assert metrics.get("kl/token") == kl_token
    assert {k: metrics[k] for k in reported} == reported  # the loss's own names stay


# ---------------------------------------------------------------------- the loop
def _from(batches, step):
    """``step(index, batch, clock)`` as the loop's step function over a plain `Batches`."""
    source = Batches(batches)

    def step_fn(index, clock):
        batch = source.draw()
        return None if batch is None else step(index, batch, clock)

    return step_fn, source


def test_run_steps_calls_on_step_and_stops_early():
    batches = iter(range(100, 110))
    seen = []

    def step(index, batch, clock):
        with clock("rollout"):
            pass
        return Step({"reward/mean": float(batch), "index": index}, rows(1))

    def stop_after_three(index, metrics, rollouts):
        seen.append((index, metrics["reward/mean"], rollouts.batch_size))
        if index == 2:
            raise StopIteration

    run = RunOptions(on_step=stop_after_three, progress=False)
    history = run_steps("T", *_from(batches, step), steps=8, run=run)
    assert seen == [(0, 100.0, 1), (1, 101.0, 1), (2, 102.0, 1)]
    assert [h["index"] for h in history] == [0, 1, 2]  # the stopping step is recorded
    assert next(batches) == 103  # nothing drawn after the stop
    for h in history:
        assert SHARED <= set(h)
        assert sum(h[k] for k in TIMES) <= h["step_seconds"]


def test_run_steps_ends_on_steps_on_data_and_on_a_step_with_no_data():
    def step(index, batch, clock):
        return None if batch == "end" else Step({}, rows(1))

    quiet = RunOptions(progress=False)
    batches = iter("abcdef")
    assert len(run_steps("T", *_from(batches, step), steps=2, run=quiet)) == 2
    assert next(batches) == "c"  # zip(range(steps), batches): no batch drawn beyond steps
    assert len(run_steps("T", *_from(iter("ab"), step), steps=5, run=quiet)) == 2  # ran out
    # A step that finds no data ends the run and is not recorded (DAPO's batches ran out).
    seen = []
    run = RunOptions(on_step=lambda *a: seen.append(a[0]))
    history = run_steps("T", *_from(iter(["a", "end", "b"]), step), steps=5, run=run)
    assert len(history) == 1 and seen == [0]


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


def run_recipe(name: str, loss_fn=None, steps: int = 2):
    """``name`` on the tiny model and the digit-fraction task (tests/toy_tasks.py), the policy
    with a reference copy; the history and the engine's calls."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = tiny_trainer(reference="copy")
        engine = CountingEngine(policy.model, policy.tokenizer, progress=False)
        kw = {} if loss_fn is None else {"loss_fn": loss_fn}
        if name == "ppo":
            history = rb.recipes.ppo(
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
        history = rb.recipes.ppo(
            policy,
            CriticTrainer(policy.model, lr=1e-3),
            engine,
            rb.rewards.per_sample(digit_fraction, timeout=None),
            PromptBatches(count_prompts(), prompts_per_step=4, seed=0),
            steps=3,
            group_size=2,
            sampling=rb.SamplingParams(max_new_tokens=8),
            kl_in_reward=False,
            run=rb.run.RunOptions(progress=False),
        )
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
    assert recipes <= {"rlblocks.recipes.defaults"}, recipes
    assert "inspect" not in imported and "rlblocks.losses.inputs" not in imported
    assert "rlblocks.critic" not in imported  # PPO's critic is an interfaces.Critic
    concrete = {"rlblocks.trainer", "rlblocks.rollout", "rlblocks.critic", "rlblocks.placement"}
    assert not [m for m in imported for c in concrete if m == c or m.startswith(c + ".")]


@pytest.mark.parametrize("name", RECIPES_ALL)
def test_no_recipe_declares_the_loops_options(name):
    # How a run is driven is one RunOptions (run=); the loop's keywords are nobody's own.
    parameters = inspect.signature(getattr(rb.recipes, name)).parameters
    assert "run" in parameters
    assert not set(parameters) & set(rb.run.options.MOVED), name


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


def test_recipe_step_functions_stay_short():
    # Each recipe reads top to bottom: its step function is well under 100 lines.
    for module in ("dapo", "grpo", "ppo", "variants"):
        tree = ast.parse((RECIPE_DIR / f"{module}.py").read_text())
        steps = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "step"]
        assert steps, module
        for node in steps:
            assert node.end_lineno - node.lineno < 100, module
