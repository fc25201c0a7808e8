"""rb.rewards.from_trl / from_verl: TRL and verl reward functions, given what those give them.

The TRL functions below are written as TRL's GRPOTrainer documentation writes them ("Using a
custom reward function", examples 1-6); the verl one as verl's ``reward_score/gsm8k.py``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from datasets import Dataset

import rlblocks as rb
from rlblocks.data import PromptBatches, load_prompts
from rlblocks.rewards import RewardRowError, from_trl, from_verl, trl_inputs


# ---------------------------------------------------------------------- as TRL documents them
def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def boxed_reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def length_reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for completion, t in zip(completions, task):
        if t == "math":
            rewards.append(1.0 if "4" in completion else -1.0)
        else:
            rewards.append(None)  # Return None for non-math tasks
    return rewards


async def async_reward_func(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [1.0 if completion else 0.0 for completion in completions]


def logging_reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]
    if log_extra:
        log_extra("golden_answer", list(ground_truth))
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards


class _Scores:
    """An awaitable that is not a coroutine (what a function wrapping its work in a custom
    awaitable or an ``asyncio`` object returns): awaiting it gives the scores."""

    def __init__(self, scores):
        self.scores = scores

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return self.scores


def awaitable_reward_func(completions, **kwargs):
    return _Scores([1.0 if completion else 0.0 for completion in completions])


# ---------------------------------------------------------------------- as verl writes it
def extract_solution(solution_str, method="strict"):
    if len(solution_str) > 300:
        solution_str = solution_str[-300:]
    solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
    if len(solutions) == 0:
        return None
    return solutions[-1].replace(",", "").replace("$", "")


def gsm8k_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = extract_solution(solution_str=solution_str)
    if answer is None:
        return 0
    return 1.0 if answer == ground_truth else 0.0


# ---------------------------------------------------------------------- plain text, no model
def test_standard_format_hand_worked(make_rollouts):
    ro = make_rollouts(
        [r" The solution is \boxed{2}.", r" The solution is \boxed{6}.", "no box"],
        [{"ground_truth": "2"}, {"ground_truth": "5"}, {"ground_truth": "1"}],
        lengths=[2, 4, 1],
    )
    rewards, metrics = from_trl(boxed_reward_func)(ro)
    assert rewards.tolist() == [1.0, 0.0, 0.0] and metrics["reward/none"] == 0.0
    rewards, _ = from_trl(length_reward_func)(ro)  # real response tokens: 2, 4, 1
    assert rewards.tolist() == [2.0, 4.0, 1.0]
    rewards, _ = from_trl(async_reward_func)(ro)
    assert rewards.tolist() == [1.0, 1.0, 1.0]
    # any awaitable is awaited, not only a coroutine (asyncio.run takes only those)
    rewards, metrics = from_trl(awaitable_reward_func)(ro)
    assert rewards.tolist() == [1.0, 1.0, 1.0] and metrics["reward/failures"] == 0.0
    reward = from_trl(logging_reward_func)
    assert reward.__name__ == "logging_reward_func"
    rewards, metrics = reward(ro)
    assert metrics["reward/accuracy"] == pytest.approx(1 / 3)  # one of three boxes right


def test_trl_inputs_of_a_conversational_dataset_hand_worked():
    question = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    data = load_prompts(
        Dataset.from_list([{"prompt": question, "solution": "4", "task": "math"}]),
        ground_truth="solution",
        keep=True,
    )
    ro = rb.Rollouts.from_lists(
        [[1, 2]] * 2,
        [[7, 8, 9], [7]],
        prompts=["<rendered>"] * 2,
        completions=["It is 4.", "5"],
        metadata=data.metadata * 2,
        group_ids=[0, 0],
    )
    inputs = trl_inputs(ro)
    assert inputs == {
        "prompts": [question, question],  # the dataset's messages, not the rendered text
        "completions": [
            [{"role": "assistant", "content": "It is 4."}],
            [{"role": "assistant", "content": "5"}],
        ],
        "completion_ids": [[7, 8, 9], [7]],
        "ground_truth": ["4", "4"],
        "data_source": ["prompts", "prompts"],
        "solution": ["4", "4"],
        "task": ["math", "math"],
    }


def test_none_scores_none_score_and_is_counted(make_rollouts):
    ro = make_rollouts(["4", "3", "def f(): ..."], [{"task": "math"}] * 2 + [{"task": "code"}])
    rewards, metrics = from_trl(math_reward_func)(ro)
    assert rewards.tolist() == [1.0, -1.0, 0.0]
    assert metrics["reward/none"] == 1.0 and metrics["reward/failures"] == 0.0
    rewards, _ = from_trl(math_reward_func, none_score=-0.5)(ro)
    assert rewards.tolist() == [1.0, -1.0, -0.5]


def test_a_failing_row_is_named_and_only_it_fails(make_rollouts, caplog):
    def to_number(completions, ground_truth, **kwargs):
        return [float(c == str(float(gt))) for c, gt in zip(completions, ground_truth)]

    ro = make_rollouts(["1.0", "2.0", "3.0"], [{"ground_truth": g} for g in ("1", "2", "x")])
    with caplog.at_level(logging.WARNING):
        rewards, metrics = from_trl(to_number, fallback=-1.0)(ro)
    # The batch call raises on row 2; row by row, rows 0 and 1 score, row 2 gets the fallback.
    assert rewards.tolist() == [1.0, 1.0, -1.0] and metrics["reward/failures"] == 1.0
    assert "row 2: ValueError" in caplog.text
    with pytest.raises(RewardRowError, match=r"reward 'to_number', row 2: ValueError"):
        from_trl(to_number, raise_errors=True)(ro)

    def wrong_length(completions, **kwargs):
        return [1.0]

    rewards, metrics = from_trl(wrong_length, timeout=None)(ro)
    # Row by row each call returns one score, which is then right.
    assert rewards.tolist() == [1.0, 1.0, 1.0] and metrics["reward/failures"] == 0.0

    def nan(completions, **kwargs):
        return [float("nan"), 1.0, "x"]

    rewards, metrics = from_trl(nan)(ro)
    assert rewards.tolist() == [0.0, 1.0, 0.0] and metrics["reward/failures"] == 2.0


def test_a_column_hiding_a_trl_argument_is_an_error(make_rollouts):
    ro = make_rollouts(["a"], [{"completions": 1}])
    with pytest.raises(ValueError, match=r"column 'completions'"):
        from_trl(format_reward_func)(ro)


def test_verl_hand_worked_dicts_and_errors(make_rollouts, caplog):
    ro = make_rollouts(
        ["so #### 72", "#### 7,2", "72", "#### 1"],
        [
            {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "72"}},
            {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "72"}},
            {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "72"}},
            {"ground_truth": "1"},  # rb.data's layout, but no data_source: named failure
        ],
    )
    with caplog.at_level(logging.WARNING):
        rewards, metrics = from_verl(gsm8k_compute_score)(ro)
    # strict: "#### 72" -> 72 right; "#### 7,2" -> "72" right (commas dropped); "72" no ####.
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0] and metrics["reward/failures"] == 1.0
    assert "row 3: KeyError" in caplog.text and "'data_source'" in caplog.text

    def with_extras(data_source, solution_str, ground_truth, extra_info=None):
        right = extract_solution(solution_str) == ground_truth
        return {"score": float(right), "acc": right, "pred": extract_solution(solution_str)}

    rewards, metrics = from_verl(with_extras)(ro.select([0, 1, 2]))
    assert rewards.tolist() == [1.0, 1.0, 0.0]
    assert metrics["reward/acc"] == pytest.approx(2 / 3) and "reward/pred" not in metrics
    rewards, metrics = from_verl(lambda **kw: {"acc": 1.0})(ro.select([0]))
    assert rewards.tolist() == [0.0] and metrics["reward/failures"] == 1.0


# ---------------------------------------------------------------------- inside a GRPO step
def test_trl_and_verl_functions_inside_a_grpo_step():
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {a} + {a}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
            "extra_info": {"split": "train", "index": i, "question": f"{a} + {a}"},
            "solution": str(2 * a),
        }
        for i, a in enumerate((1, 2, 3))
    ]
    data = load_prompts(
        Dataset.from_list(rows), ground_truth="reward_model.ground_truth", keep=True
    )
    trl_calls, verl_calls = [], []

    def trl_recorder(prompts, completions, completion_ids, **kwargs):
        trl_calls.append(dict(prompts=prompts, completions=completions,
                              completion_ids=completion_ids, **kwargs))  # fmt: skip
        return format_reward_func(completions, **kwargs)

    def verl_recorder(data_source, solution_str, ground_truth, extra_info=None):
        verl_calls.append(
            {
                "data_source": data_source,
                "solution_str": solution_str,
                "ground_truth": ground_truth,
                "extra_info": dict(extra_info),
            }
        )
        extra_info["index"] = -1  # verl's own functions may write into it
        return gsm8k_compute_score(data_source, solution_str, ground_truth, extra_info)

    reward = rb.rewards.combine(
        {from_trl(trl_recorder): 1.0, from_verl(verl_recorder): 1.0, rb.rewards.math_answer: 1.0}
    )
    seen = []
    policy = tiny_trainer(lr=1e-3)
    engine = tiny_engine(policy)
    history = rb.recipes.grpo(
        policy, engine, reward, PromptBatches(data, prompts_per_step=2, seed=0), steps=1,
        group_size=2, sampling=rb.SamplingParams(max_new_tokens=4, seed=0),
        run=rb.run.RunOptions(on_step=lambda step, metrics, ro: seen.append(ro), progress=False), )  # fmt: skip
    (ro,) = seen
    assert len(history) == 1 and len(trl_calls) == 1 and len(verl_calls) == 4
    by_solution = {row["solution"]: row for row in rows}
    expected = [by_solution[m["solution"]] for m in ro.metadata]  # the batch's rows, in order
    call = trl_calls[0]
    assert call["prompts"] == [row["prompt"] for row in expected]
    assert call["completions"] == [[{"role": "assistant", "content": c}] for c in ro.completions]
    real = ro.response_attention_mask
    assert call["completion_ids"] == [ids[m].tolist() for ids, m in zip(ro.response_ids, real)]
    for column in ("data_source", "ability", "reward_model", "extra_info", "solution"):
        assert call[column] == [row[column] for row in expected], column
    state = call["trainer_state"]  # the run's: one step, the first
    assert (state.global_step, state.max_steps) == (0, 1) and callable(call["log_metric"])
    assert set(call) - set(rows[0]) == {
        "prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
        "ground_truth",  # rb.data's own column, read from reward_model.ground_truth
    }  # fmt: skip
    for i, (got, row) in enumerate(zip(verl_calls, expected)):
        assert got == {
            "data_source": "openai/gsm8k",
            "solution_str": ro.completions[i],
            "ground_truth": row["reward_model"]["ground_truth"],
            "extra_info": {**row["extra_info"], "num_turns": None, "rollout_reward_scores": {}},
        }
    # compute_score wrote into copies: the rows' own extra_info is as the dataset holds it.
    assert [m["extra_info"] for m in ro.metadata] == [row["extra_info"] for row in expected]
    assert {"trl_recorder/mean", "verl_recorder/mean", "math_answer/mean"} <= set(history[0])
    assert torch.isfinite(torch.tensor(history[0]["reward/mean"]))


# ---------------------------------------------------------------------- signatures that cannot fit
def test_a_trl_reward_that_cannot_take_trls_arguments_is_refused_when_built(make_rollouts):
    # Before: built without a word; every call raised TypeError inside the guard, and every
    # row of every step scored the fallback, with only a warning.
    def reward_len(completions):  # TRL passes prompts, completion_ids, ... too: no **kwargs
        return [-abs(20 - len(c)) for c in completions]

    with pytest.raises(TypeError, match=r"^from_trl: reward reward_len\(completions\) cannot "
                       r"take 'prompts', 'completion_ids', 'trainer_state'.*end its parameters "
                       r"with \*\*kwargs"):  # fmt: skip
        from_trl(reward_len)
    with pytest.raises(TypeError, match=r"positional-only parameter\(s\) 'completions'"):
        from_trl(lambda completions, /, **kwargs: [1.0] * len(completions))
    # TRL's documented functions (all end in **kwargs) are taken.
    for fn in (format_reward_func, boxed_reward_func, math_reward_func, async_reward_func):
        from_trl(fn)


def test_a_trl_reward_that_does_not_fit_the_columns_is_refused_before_scoring(make_rollouts):
    ro = make_rollouts(["4", "5"], [{"ground_truth": "4"}, {"ground_truth": "4"}])
    calls = []

    def needs_answer(completions, answer, **kwargs):  # the rows have ground_truth, no answer
        calls.append(answer)
        return [float(c == a) for c, a in zip(completions, answer)]

    reward = from_trl(needs_answer)  # columns are known only at the first call
    with pytest.raises(TypeError, match=r"^from_trl: reward needs_answer\(completions, answer, "
                       r"\*\*kwargs\) needs 'answer', but no row has such a column \(the rows' "
                       r"columns: 'ground_truth'\).*keep=True"):  # fmt: skip
        reward(ro)
    assert calls == []  # refused before anything was scored

    def no_kwargs(prompts, completions, completion_ids, trainer_state, log_extra, log_metric):
        return [1.0] * len(completions)

    reward = from_trl(no_kwargs)  # takes TRL's own arguments, but not the column
    with pytest.raises(TypeError, match=r"cannot take the rows' column\(s\) 'ground_truth'"):
        reward(ro)
    rewards, metrics = reward(make_rollouts(["4", "5"]))  # no columns: it fits
    assert rewards.tolist() == [1.0, 1.0] and metrics["reward/failures"] == 0.0


def test_a_verl_compute_score_that_cannot_be_called_as_verl_calls_it_is_refused():
    def no_data_source(solution_str, ground_truth):
        return float(solution_str == ground_truth)

    def needs_tokenizer(data_source, solution_str, ground_truth, extra_info, tokenizer):
        return 0.0

    with pytest.raises(TypeError, match=r"^from_verl: compute_score no_data_source\(solution_str"
                       r", ground_truth\) cannot be called as verl calls it.*it cannot take "
                       r"'data_source', 'extra_info'"):  # fmt: skip
        from_verl(no_data_source)
    with pytest.raises(TypeError, match=r"it also needs 'tokenizer', which verl never passes"):
        from_verl(needs_tokenizer)
    from_verl(gsm8k_compute_score)  # verl's own, as verl writes it
    from_verl(lambda **kwargs: 0.0)


def test_a_hanging_verl_or_trl_call_is_said_once_and_its_thread_counted(make_rollouts, caplog):
    stop = threading.Event()

    def hangs(data_source, solution_str, ground_truth, extra_info=None):
        stop.wait()  # until the test ends: its thread outlives the deadline
        return 1.0

    def hangs_trl(completions, **kwargs):
        stop.wait()
        return [1.0] * len(completions)

    ro = make_rollouts(["a"], [{"data_source": "x", "ground_truth": "1"}])
    try:
        with caplog.at_level(logging.WARNING):
            for reward in (from_verl(hangs, timeout=0.1), from_trl(hangs_trl, timeout=0.1)):
                _, first = reward(ro)
                _, second = reward(ro)
                assert (first["reward/abandoned_threads"], second["reward/abandoned_threads"]) == (
                    1.0, 2.0)  # fmt: skip
    finally:
        stop.set()
    said = [r.getMessage() for r in caplog.records if "keeps running" in r.getMessage()]
    assert [m.split(":")[0] for m in said] == ["reward 'hangs'", "reward 'hangs_trl'"]
    assert all("make the function return (or raise) within timeout=" in m for m in said)


@pytest.mark.parametrize("returned", [1.0, {"score": [1.0, 0.0, 1.0]}, "1.0"])
def test_a_trl_reward_returning_no_list_is_raised_not_scored_zero(make_rollouts, returned):
    # It was a failure of every row: each scored 0 (the fallback), batch after batch, the run
    # going on. No row can ever be scored from it, so the first call raises.
    def one_value(completions, **kwargs):
        return returned

    ro = make_rollouts(["1", "2", "3"], [{}] * 3)
    kind = type(returned).__name__
    with pytest.raises(TypeError, match=rf"from_trl: one_value returned {kind}, expected a list"):
        from_trl(one_value)(ro)
    with pytest.raises(TypeError, match="returned"):
        from_trl(one_value, timeout=None)(ro)
