"""`per_sample`: fallback on raise / NaN / non-number / timeout, metrics, warnings, debugging."""

from __future__ import annotations

import functools
import logging
import random
import threading
import time

import pytest
import torch

from rlblocks.rewards import ProcessPool
from rlblocks.rewards.guard import RewardRowError, per_sample

LIMIT = 0.2  # seconds: short time limits keep the suite fast


def length_score(completion: str, **row: object) -> float:
    return float(len(completion))


def test_scores_rows_and_passes_metadata_and_prompt(make_rollouts) -> None:
    seen = []

    def fn(completion: str, **row: object) -> float:
        seen.append(dict(row))
        row["mutated"] = True  # must not leak into the batch's metadata
        return float(row["bonus"]) + len(completion)

    ro = make_rollouts(["ab", "abcd"], [{"bonus": 1}, {"bonus": 10}], prompts=["p0", "p1"])
    rewards, metrics = per_sample(fn)(ro)
    # Row 0: 1 + len("ab") = 3; row 1: 10 + len("abcd") = 14.
    torch.testing.assert_close(rewards, torch.tensor([3.0, 14.0]))
    assert rewards.dtype == torch.float32 and rewards.shape == (2,)
    assert metrics == {"reward/mean": 8.5, "reward/failures": 0.0, "reward/timeouts": 0.0}
    assert sorted(seen, key=lambda r: r["bonus"]) == [
        {"bonus": 1, "prompt": "p0"},
        {"bonus": 10, "prompt": "p1"},
    ]
    assert ro.metadata == [{"bonus": 1}, {"bonus": 10}]


def test_a_raising_row_gets_the_fallback_and_one_warning(make_rollouts, caplog) -> None:
    def fn(completion: str, **row: object) -> float:
        if completion.startswith("bad"):
            raise ValueError(f"cannot parse {completion!r}")
        return 1.0

    ro = make_rollouts(["ok", "bad1", "ok", "bad2"])
    with caplog.at_level(logging.WARNING, logger="rlblocks.rewards.guard"):
        rewards, metrics = per_sample(fn, fallback=-0.5)(ro)
    # Rows 1 and 3 raise and score the fallback: mean = (1 - 0.5 + 1 - 0.5) / 4 = 0.25.
    torch.testing.assert_close(rewards, torch.tensor([1.0, -0.5, 1.0, -0.5]))
    assert metrics == {"reward/mean": 0.25, "reward/failures": 2.0, "reward/timeouts": 0.0}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one warning per batch, naming the first failing row
    assert "row 1" in warnings[0].getMessage() and "cannot parse 'bad1'" in warnings[0].getMessage()
    assert "2 of 4 rows failed" in warnings[0].getMessage()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "1.0", None])
def test_non_finite_or_non_number_results_fail(make_rollouts, bad: object) -> None:
    def fn(completion: str, **row: object) -> object:
        return bad if completion == "x" else 2

    rewards, metrics = per_sample(fn, fallback=0.0)(make_rollouts(["a", "x"]))
    torch.testing.assert_close(rewards, torch.tensor([2.0, 0.0]))
    assert metrics["reward/failures"] == 1.0 and metrics["reward/timeouts"] == 0.0


def test_bool_results_count_as_numbers(make_rollouts) -> None:
    rewards, _ = per_sample(lambda c, **row: c == "yes")(make_rollouts(["yes", "no"]))
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.0]))


def test_a_row_that_sleeps_past_the_limit_times_out(make_rollouts, caplog) -> None:
    def fn(completion: str, **row: object) -> float:
        if completion == "hang":
            time.sleep(5 * LIMIT)  # really sleeps past the limit; the thread is abandoned
        return 1.0

    ro = make_rollouts(["a", "hang", "b", "c"])
    reward = per_sample(fn, timeout=LIMIT, fallback=-1.0)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rlblocks.rewards.guard"):
        rewards, metrics = reward(ro)
    elapsed = time.monotonic() - start
    # The hung row scores -1; rows after it still run (on a fresh worker) and score 1.
    torch.testing.assert_close(rewards, torch.tensor([1.0, -1.0, 1.0, 1.0]))
    assert metrics == {"reward/mean": 0.5, "reward/failures": 1.0, "reward/timeouts": 1.0,
                       "reward/abandoned_threads": 1.0}  # fmt: skip  # still asleep: 1.0 s
    assert LIMIT <= elapsed < 4 * LIMIT  # waited for the deadline, not for the sleep (1.0 s)
    assert "row 1" in caplog.text and "no result after 0.2 s" in caplog.text


def test_deadline_counts_from_each_rows_start(make_rollouts) -> None:
    # Six rows of 0.05 s each run one after another on one worker (0.3 s in all): none may
    # time out with a 0.2 s limit, since each row's clock starts when that row starts.
    reward = per_sample(lambda c, **row: time.sleep(0.05) or 1.0, timeout=LIMIT)
    rewards, metrics = reward(make_rollouts(["a"] * 6))
    torch.testing.assert_close(rewards, torch.ones(6))
    assert metrics["reward/timeouts"] == 0.0


def test_max_workers_overlap_waiting_rows(make_rollouts) -> None:
    # Eight rows that wait 0.1 s each: one worker needs ≥ 0.8 s, four need about 0.2 s.
    reward = per_sample(lambda c, **row: time.sleep(0.1) or 2.0, timeout=1.0, max_workers=4)
    start = time.monotonic()
    rewards, _ = reward(make_rollouts(["a"] * 8))
    assert time.monotonic() - start < 0.6
    torch.testing.assert_close(rewards, torch.full((8,), 2.0))


def test_timeout_none_runs_in_the_calling_thread(make_rollouts) -> None:
    threads = []

    def fn(completion: str, **row: object) -> float:
        threads.append(threading.current_thread())
        return 1.0

    per_sample(fn, timeout=None)(make_rollouts(["a", "b"]))
    assert threads == [threading.main_thread()] * 2


def test_raise_errors_reraises_the_first_error_with_its_row(make_rollouts) -> None:
    def fn(completion: str, **row: object) -> float:
        if completion != "ok":
            raise KeyError(completion)
        return 1.0

    reward = per_sample(fn, raise_errors=True)
    with pytest.raises(RewardRowError, match=r"row 2: KeyError: 'first'") as info:
        reward(make_rollouts(["ok", "ok", "first", "second"]))
    assert isinstance(info.value.__cause__, KeyError)  # the original error is chained
    with pytest.raises(RewardRowError, match="row 0: returned nan"):
        per_sample(lambda c, **row: float("nan"), raise_errors=True)(make_rollouts(["a"]))


def test_raise_errors_reports_a_timeout(make_rollouts) -> None:
    reward = per_sample(
        lambda c, **row: time.sleep(5 * LIMIT) or 1.0, timeout=LIMIT, raise_errors=True
    )
    with pytest.raises(RewardRowError, match="row 0: no result after 0.2 s"):
        reward(make_rollouts(["a"]))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("timeout", [None, 1.0])
def test_matches_a_loop_reference(make_rollouts, seed: int, timeout: float | None) -> None:
    rng = random.Random(seed)
    completions = ["".join(rng.choices("abc!", k=rng.randrange(6))) for _ in range(20)]

    def fn(completion: str, **row: object) -> float:
        if "!" in completion:
            raise RuntimeError("bang")
        return completion.count("a") - 0.5 * completion.count("b")

    rewards, metrics = per_sample(fn, timeout=timeout, fallback=-3.0, max_workers=3)(
        make_rollouts(completions)
    )
    expected = []
    for c in completions:  # the obvious loop: the fallback where the function raises
        try:
            expected.append(fn(c))
        except RuntimeError:
            expected.append(-3.0)
    torch.testing.assert_close(rewards, torch.tensor(expected))
    assert metrics["reward/failures"] == sum("!" in c for c in completions)
    assert metrics["reward/mean"] == pytest.approx(sum(expected) / len(expected))


def test_empty_batch_and_names(make_rollouts) -> None:
    rewards, metrics = per_sample(length_score)(make_rollouts([]))
    assert rewards.shape == (0,) and rewards.dtype == torch.float32
    assert metrics == {"reward/mean": 0.0, "reward/failures": 0.0, "reward/timeouts": 0.0}
    assert per_sample(length_score).__name__ == "length_score"
    assert per_sample(functools.partial(length_score)).__name__ == "length_score"
    assert per_sample(length_score, name="len").__name__ == "len"
    _, metrics = per_sample(length_score, key="length")(make_rollouts(["abc"]))
    assert metrics == {"length/mean": 3.0, "length/failures": 0.0, "length/timeouts": 0.0}


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="fallback"):
        per_sample(length_score, fallback=float("nan"))
    with pytest.raises(ValueError, match="timeout"):
        per_sample(length_score, timeout=0)
    with pytest.raises(ValueError, match="max_workers"):
        per_sample(length_score, max_workers=0)


def test_a_spinning_row_in_thread_mode_is_said_once_and_its_threads_counted(make_rollouts, caplog):
    # Before: the abandoned threads spun on for good, slowing the process, and nothing but the
    # per-batch timeout warning said anything; no metric counted them.
    stop = threading.Event()

    def spin(completion: str, **row: object) -> float:
        while not stop.is_set():  # pure Python: a deadline cannot stop this thread
            pass
        return 1.0

    reward = per_sample(spin, timeout=LIMIT)
    ro = make_rollouts(["a", "b"])
    try:
        with caplog.at_level(logging.WARNING, logger="rlblocks.rewards.guard"):
            _, first = reward(ro)  # each row times out; its thread spins on
            _, second = reward(ro)
    finally:
        stop.set()
    assert first["reward/timeouts"] == 2.0 and first["reward/abandoned_threads"] == 2.0
    assert second["reward/abandoned_threads"] == 4.0  # the first call's two still spin
    said = [r.getMessage() for r in caplog.records if "keeps running" in r.getMessage()]
    assert len(said) == 1, said  # once per reward function, not per call
    assert said[0].startswith("reward 'spin': a row ran past its 0.2 s deadline in thread mode")
    assert "reward/abandoned_threads" in said[0]
    assert "pass pool=rb.rewards.ProcessPool(workers=n) to per_sample" in said[0]
    # Stopped, the threads return: they are no longer counted (the metric stays, at 0).
    for _ in range(100):
        rewards, metrics = reward(ro)
        if metrics["reward/abandoned_threads"] == 0.0:
            break
        time.sleep(0.01)
    assert metrics["reward/abandoned_threads"] == 0.0 and rewards.tolist() == [1.0, 1.0]
    # A reward that never timed out has no such metric.
    assert "reward/abandoned_threads" not in per_sample(length_score, timeout=LIMIT)(ro)[1]

    # The fix the warning names: in a process pool the worker of a row past its deadline is
    # killed, and nothing is left running.
    def spin_forever(completion: str, **row: object) -> float:
        while True:
            pass

    caplog.clear()
    with ProcessPool(workers=1) as pool, caplog.at_level(logging.WARNING):
        rewards, metrics = per_sample(spin_forever, timeout=LIMIT, pool=pool)(ro.select([0]))
    assert rewards.tolist() == [0.0] and metrics["reward/timeouts"] == 1.0
    assert "reward/abandoned_threads" not in metrics and "keeps running" not in caplog.text
