"""Property-based fuzzing (hypothesis) of what a user's reward returns, through a GRPO step on
the tiny model: no unhandled exception, and every row accounted for in the metrics.

"Handled" means one of two things: the step runs and the metrics count every row the reward
could not score (rows in = rows scored + rows counted as failed), or the error is one rlblocks
raises itself, a TypeError / ValueError that states the RewardFn contract. A raw exception
from inside torch, NumPy or the trainer is a failure of this test.
"""

from __future__ import annotations

import math
import re
import time
import traceback

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import rlblocks as rb

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN guard, by design

B = 8  # rows of the step: 2 prompts x 4 samples


@pytest.fixture(scope="module")
def blocks():
    torch.manual_seed(0)
    policy = tiny_trainer(lr=1e-3)
    engine = tiny_engine(policy)
    prompts = rb.data.load_prompts(
        [{"prompt": f"Count: {i}", "ground_truth": "0"} for i in range(2)]
    )
    ro = engine.generate(
        prompts.prompts,
        group_size=4,
        sampling=rb.SamplingParams(max_new_tokens=4),
        metadata=[{}] * 2,
    )
    return policy, ro


def grpo_step(policy, ro, reward_fn) -> dict:
    """One GRPO step from the sampled rows on: reward, advantage, update (as the recipe)."""
    rewards, metrics = rb.rewards.checked(reward_fn)(ro)
    advantages, _ = rb.advantage.grpo(rewards, ro.response_mask, ro.group_ids)
    return {**metrics, **policy.step(ro, advantages, loss_fn=rb.recipes.defaults.PPO_CLIP)}


class Boom(Exception):
    pass


def good(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


ROW = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.integers(-(10**6), 10**6),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.lists(st.floats(), max_size=2),
    st.just(Boom),  # raises
    st.just("sleep"),  # runs past the time limit
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(values=st.lists(ROW, min_size=B, max_size=B))
def test_per_sample_rows_are_all_accounted_for(blocks, values):
    policy, ro = blocks

    def fn(completion: str, **row) -> float:
        value = values[row["row"]]
        if value is Boom:
            raise Boom("a parser bug")
        if value == "sleep":
            time.sleep(0.3)
        return value

    ro = ro.replace(metadata=[{"row": i} for i in range(B)])
    metrics = grpo_step(policy, ro, rb.rewards.per_sample(fn, timeout=0.1, max_workers=4))
    scored = sum(good(v) or isinstance(v, bool) for v in values)  # True/False are numbers too
    failed = B - scored
    assert scored + metrics["reward/failures"] == B
    assert metrics["reward/failures"] == failed
    assert metrics["reward/timeouts"] == sum(v == "sleep" for v in values if isinstance(v, str))
    assert metrics["reward/nonfinite"] == 0.0  # per_sample gave those rows the fallback
    assert metrics["optimizer_steps"] + metrics["skipped_steps"] == 1.0


SCORES = st.floats(allow_nan=True, allow_infinity=True, width=32)
OUTPUT = st.one_of(
    st.tuples(st.lists(SCORES, min_size=B, max_size=B), st.just({})),  # fine, maybe NaN
    st.tuples(st.lists(SCORES, max_size=2 * B), st.dictionaries(st.text(max_size=3), SCORES)),
    st.lists(SCORES, min_size=B, max_size=B),  # bare list
    st.builds(lambda n: torch.zeros(n), st.integers(0, 2 * B)),  # bare tensor
    st.tuples(
        st.builds(lambda n, m: torch.zeros(n, m), st.integers(0, B), st.integers(1, 3)), st.just({})
    ),
    st.tuples(st.lists(st.text(max_size=2), min_size=B, max_size=B), st.just({})),
    st.none(),
    st.dictionaries(st.text(max_size=3), SCORES),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(output=OUTPUT, as_tensor=st.booleans())
# found by Hypothesis: two finite float32 scores whose sum is past float32's range (the mean
# and GRPO's std overflowed, the step was skipped)
@example(output=([0.0] * 6 + [1.7014117331926443e38, 1.7014118346046923e38], {}), as_tensor=False)
def test_any_reward_output_is_scored_or_refused_with_the_contract(blocks, output, as_tensor):
    policy, ro = blocks
    scores = output[0] if isinstance(output, tuple) else None
    if as_tensor and isinstance(scores, list) and all(isinstance(x, float) for x in scores):
        output = (torch.tensor(scores), output[1])  # the same scores as a tensor

    def reward(rollouts):
        return output

    try:
        metrics = grpo_step(policy, ro, reward)
    except (TypeError, ValueError) as err:
        assert "RewardFn returns RewardOutput" in str(err), err
        return
    scores = output[0]
    scores = scores.tolist() if isinstance(scores, torch.Tensor) else scores
    assert len(scores) == B
    nonfinite = sum(not math.isfinite(s) for s in scores)
    assert metrics["reward/nonfinite"] == nonfinite  # rows in = finite + counted
    assert math.isfinite(metrics["reward/mean"])
    assert metrics["skipped_steps"] == 0.0  # a NaN row never costs the step any more


TEXT = st.one_of(
    st.text(max_size=12),  # any Unicode, lone surrogates included
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=12),
    st.just(""),
    st.just("Count: " + " ".join(map(str, range(200)))),  # past the test model's context
    st.just("x\x00y"),
)
PROMPT = st.one_of(
    TEXT,
    st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}), max_size=2),
    st.integers(),
    st.none(),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)


def raised_by_rlblocks(err: BaseException) -> bool:
    """The error was raised by rlblocks itself (the innermost frame is in the package)."""
    frames = traceback.extract_tb(err.__traceback__)
    return (
        bool(frames)
        and "/rlblocks/" in frames[-1].filename
        and "/tests/" not in frames[-1].filename
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(prompts=st.lists(PROMPT, min_size=1, max_size=3))
def test_any_prompt_row_is_trained_on_or_refused_by_rlblocks_naming_it(blocks, prompts):
    policy, _ = blocks
    policy.model.config.max_position_embeddings = 96  # a short context, so length is fuzzed too
    engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, progress=False)
    try:
        rows = rb.data.load_prompts([{"prompt": p, "ground_truth": "0"} for p in prompts])
        ro = engine.generate(
            rows.prompts, group_size=2, sampling=rb.SamplingParams(max_new_tokens=4)
        )
        metrics = grpo_step(
            policy, ro, rb.rewards.per_sample(lambda c, **row: float(len(c)), timeout=None)
        )
    except (TypeError, ValueError) as err:
        assert raised_by_rlblocks(err), "".join(traceback.format_exception(err))
        assert re.search(r"row \d|prompt \d|line \d", str(err)), err  # names the row
        event(f"refused: {type(err).__name__}")
        return
    finally:
        policy.model.config.max_position_embeddings = 512
    event("trained")
    assert len(ro) == 2 * len(prompts)  # every row generated and scored
    assert metrics["reward/failures"] == 0.0 and metrics["optimizer_steps"] == 1.0
