"""DAPO: the dynamic-sampling loop on a scripted engine, and the recipe end to end (tiny model).

The scripted engine and the reward below are small real classes that satisfy the
`RolloutEngine` and `RewardFn` protocols, so the loop is tested through its public contract
only. A prompt is its own script: ``"1 0"`` answers "1", "0", "1", "0", ... (a mixed group),
``"1"`` answers "1" every time (all right), ``"1 11111111"`` is all right with lengths 1 and 8.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import run_group_recipe
from weightless import Weightless

import rlblocks as rb
from rlblocks.interfaces import RewardOutput, Rollouts, SamplingParams
from rlblocks.recipes.dapo import dapo, sample_informative_groups


class Batch(NamedTuple):
    prompts: list[str]
    metadata: list[dict[str, Any]]


def batches(*rounds: list[str]):
    """An iterator of prompt batches, one per round."""
    return iter([Batch(list(r), [{"round": k} for _ in r]) for k, r in enumerate(rounds)])


class ScriptedEngine(Weightless):
    """A deterministic `RolloutEngine`: sample k of prompt "a b c" is word k mod 3.

    Each character of a completion is one token (id 5), so a completion's length in tokens is
    its length in characters. Like `HFEngine`, every call numbers its groups 0..p-1.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int, SamplingParams | None]] = []

    def generate(
        self,
        prompts: Sequence[str],
        *,
        group_size: int = 1,
        sampling: SamplingParams | None = None,
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rollouts:
        self.calls.append((list(prompts), group_size, sampling))
        meta = list(metadata) if metadata is not None else [{} for _ in prompts]
        rows = [
            (i, p, p.split()[k % len(p.split())])
            for i, p in enumerate(prompts)
            for k in range(group_size)
        ]
        return Rollouts.from_lists(
            [[1, 2]] * len(rows),
            [[5] * len(c) for _, _, c in rows],
            pad_token_id=0,
            group_ids=[i for i, _, _ in rows],
            prompts=[p for _, p, _ in rows],
            completions=[c for _, _, c in rows],
            metadata=[dict(meta[i]) for i, _, _ in rows],
        )


class Accuracy:
    """A `RewardFn`: 1.0 when the completion is only "1"s, else 0.0. Counts its calls."""

    __name__ = "accuracy"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, rollouts: Rollouts, /) -> RewardOutput:
        self.calls += 1
        r = torch.tensor([float(set(c) == {"1"}) for c in rollouts.completions])
        return RewardOutput(r, {"reward/mean": float(r.mean()), "reward/failures": 0.0})


def sample(engine, reward, source, *, group_size=2, sampling=None, **kw):
    """Dynamic sampling over the rounds ``engine`` generates from the batches of ``source``."""

    rounds = (
        engine.generate(
            batch.prompts, group_size=group_size, sampling=sampling, metadata=batch.metadata
        )
        for batch in source
    )
    return sample_informative_groups(rounds, reward, **{"max_rounds": 8, **kw})


# ---------------------------------------------------------------------- the sampling loop
def test_keeps_exactly_the_groups_needed_in_generation_order():
    engine, reward = ScriptedEngine(), Accuracy()
    source = batches(["1 0", "1", "0 1"], ["1 0", "0 0 1", "1 0"], ["0 1"])
    out = sample(engine, reward, source, groups_needed=3)
    # Round 1: "1 0" and "0 1" are mixed (kept), "1" is all right (filtered): 2 collected.
    # Round 2: "0 0 1" with 2 samples answers "0", "0" (all wrong, filtered); the two "1 0"
    # are kept: 2 + 2 = 4 collected, 1 + 1 = 2 filtered, 3 + 3 = 6 generated.
    # 4 > 3 needed: the first 3 groups are kept, the last "1 0" of round 2 is thrown away.
    assert out.rollouts.prompts == ["1 0", "1 0", "0 1", "0 1", "1 0", "1 0"]
    assert out.rollouts.completions == ["1", "0", "0", "1", "1", "0"]
    assert [m["round"] for m in out.rollouts.metadata] == [0, 0, 0, 0, 1, 1]
    m = out.metrics
    assert (m["sampling/rounds"], m["sampling/groups_generated"]) == (2, 6)
    assert (m["sampling/groups_filtered"], m["sampling/groups_collected"]) == (2, 4)
    assert (m["sampling/groups_kept"], m["sampling/groups_wanted"], m["sampling/short"]) == (
        3,
        3,
        0,
    )
    # Accuracy over all 12 generated rows: round 1 has 1+2+1 = 4 right of 6, round 2 has
    # 1+0+1 = 2 right of 6: 6 / 12.
    assert m["sampling/accuracy_mean"] == 0.5
    # reward_fn's metrics are averaged over the rounds: (4/6 + 2/6) / 2.
    torch.testing.assert_close(torch.tensor(m["reward/mean"]), torch.tensor(0.5))
    # The returned rewards belong to the returned rows.
    torch.testing.assert_close(out.rewards, reward(out.rollouts).rewards)
    # The third batch was never drawn: the loop stopped as soon as it had enough.
    assert next(source).prompts == ["0 1"]


def test_group_ids_stay_unique_across_rounds():
    engine = ScriptedEngine()  # numbers the groups of every call 0..p-1
    source = batches(["1 0", "0 1"], ["1 0", "0 1"], ["0 1", "1 0"])
    out = sample(engine, Accuracy(), source, groups_needed=6, group_size=3)
    ids = out.rollouts.group_ids
    # Six groups from three calls whose own ids were 0, 1 each time: renumbered 0..5 in the
    # order they were generated, each id on exactly group_size = 3 consecutive rows.
    assert ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5]
    for g in range(6):
        assert len({out.rollouts.prompts[i] for i in (ids == g).nonzero().flatten()}) == 1
    # With unique ids the GRPO advantage sees six groups of three, not two groups of nine.
    adv, _ = rb.advantage.grpo(out.rewards, out.rollouts.response_mask, ids)
    assert (adv.sum(-1) != 0).all()


def test_non_contiguous_engine_ids_are_renumbered_in_generation_order():
    class ReversedIds(ScriptedEngine):
        def generate(self, prompts, **kw):
            ro = super().generate(prompts, **kw)
            return ro.replace(group_ids=1000 - 7 * ro.group_ids)  # 1000, 993, ...: descending

    out = sample(ReversedIds(), Accuracy(), batches(["1 0", "0 1"], ["1 0"]), groups_needed=3)
    # Old ids within a round are sorted before renumbering: prompt 1 (id 993) gets 0, prompt 0
    # (id 1000) gets 1; round 2's group gets 2. Grouping is what matters, not the order.
    assert out.rollouts.group_ids.tolist() == [1, 1, 0, 0, 2, 2]
    assert [out.rollouts.prompts[i] for i in (0, 2, 4)] == ["1 0", "0 1", "1 0"]


def test_cap_reached_warns_and_returns_what_was_collected():
    source = batches(["1", "1 0", "0"], ["0", "1"], ["1 0", "1 0"])
    with pytest.warns(RuntimeWarning) as caught:
        out = sample(ScriptedEngine(), Accuracy(), source, groups_needed=3, max_rounds=2)
    # Round 1 keeps "1 0" only, round 2 keeps nothing: 1 of 3 after the cap of 2 rounds.
    (warning,) = caught
    assert str(warning.message) == (
        "dynamic sampling collected 1 of 3 informative groups after 2 rounds (max_rounds=2); "
        "returning them"
    )
    assert out.rollouts.prompts == ["1 0", "1 0"]
    m = out.metrics
    assert (m["sampling/rounds"], m["sampling/groups_generated"]) == (2, 5)
    assert (m["sampling/groups_filtered"], m["sampling/groups_kept"], m["sampling/short"]) == (
        4,
        1,
        1,
    )
    assert next(source).prompts == ["1 0", "1 0"]  # the cap stopped the drawing


def test_all_groups_filtered_returns_nothing():
    with pytest.warns(RuntimeWarning, match=r"collected 0 of 2 .* after 3 rounds .*nothing"):
        out = sample(ScriptedEngine(), Accuracy(), batches(*[["1", "0"]] * 5), max_rounds=3)
    # groups_needed=None: the size of the first batch, 2 groups.
    assert out.rollouts is None
    assert out.rewards.shape == (0,)
    m = out.metrics
    assert (m["sampling/groups_generated"], m["sampling/groups_filtered"]) == (6, 6)
    assert (m["sampling/groups_kept"], m["sampling/groups_wanted"]) == (0, 2)


def test_running_out_of_batches_says_so():
    with pytest.warns(
        RuntimeWarning, match=r"collected 1 of 2 .* after 1 rounds \(batches ran out\)"
    ):
        out = sample(ScriptedEngine(), Accuracy(), batches(["1 0", "1"]))
    assert out.rollouts.prompts == ["1 0", "1 0"]


def test_overlong_shaping_does_not_change_which_groups_are_kept():
    accuracy = Accuracy()
    length = rb.rewards.overlong(max_length=8, cache_length=4)
    shaped = rb.rewards.combine([("accuracy", accuracy, 1.0), ("overlong", length, 1.0)])
    source = ["1 11111111", "1 0", "0 00000000"]
    # "1 11111111": both right (accuracy 1, 1) but of lengths 1 and 8: shaped 1 + 0 and
    # 1 + (4 - 8) / 4 = 0. "0 00000000": both wrong, shaped 0 and -1. Only "1 0" is informative
    # on accuracy.
    on_accuracy = sample(
        ScriptedEngine(), shaped, batches(source), groups_needed=1, accuracy_fn=accuracy
    )
    assert on_accuracy.rollouts.prompts == ["1 0", "1 0"]
    assert on_accuracy.rewards.tolist() == [1.0, 0.0]  # the shaped reward is what is returned
    # Filtering on the shaped total instead would keep the two uninformative groups first.
    on_total = sample(ScriptedEngine(), shaped, batches(source), groups_needed=3)
    assert on_total.rollouts.prompts[::2] == source
    assert on_total.rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, -1.0]


def test_invalid_arguments():
    # The group size is the recipe's (the rounds carry their groups): dapo refuses 1.
    with pytest.raises(ValueError, match="group_size >= 2"):
        dapo(tiny_trainer(), ScriptedEngine(), Accuracy(), batches(["1 0"]), steps=1, group_size=1)
    with pytest.raises(ValueError, match="max_rounds >= 1"):
        sample(ScriptedEngine(), Accuracy(), batches(["1 0"]), max_rounds=0)


# ---------------------------------------------------------------------- the recipe
def test_recipe_filters_on_accuracy_scores_once_and_skips_empty_steps():
    policy, engine, accuracy = tiny_trainer(lr=1e-3), ScriptedEngine(), Accuracy()
    seen = []
    # Step 0 (one group wanted): "1 11111111" is right at two lengths (shaped rewards differ,
    # accuracy does not), "1 0" is mixed: one round. Step 1: nothing informative in the two
    # rounds allowed: skipped. Step 2: the batches ran out: the run ends.
    source = [["1 11111111", "1 0"], ["1", "0"], ["0", "1"]]
    with pytest.warns(RuntimeWarning, match="collected 0 of 1 .* nothing to train on"):
        history = dapo(
            policy,
            engine,
            accuracy,
            batches(*source),
            steps=5,
            group_size=2,
            groups_per_step=1,
            sampling=SamplingParams(max_new_tokens=8),
            max_length=8,
            cache_length=4,
            max_rounds=2,
            run=rb.run.RunOptions(
                on_step=lambda step, m, ro: seen.append((step, ro)), progress=False
            ),
        )
    assert len(history) == 2  # step 0 trained, step 1 skipped, then the data ran out
    assert seen[0][1].prompts == ["1 0", "1 0"] and seen[1][1] is None
    assert policy.steps == 1  # the skipped step made no update
    assert history[0]["sampling/skipped"] == 0 and history[1]["sampling/skipped"] == 1
    assert "loss" in history[0] and "loss" not in history[1]
    # Three rounds were scored; the shaped reward and the filter shared each task-reward call.
    assert accuracy.calls == 3
    # Step 0's rows "1", "11111111", "1", "0": accuracy 1, 1, 1, 0 (mean 0.75); lengths 1, 8,
    # 1, 1 give the penalties 0, (8 − 4 − 8)/4 = −1, 0, 0 (mean −0.25); totals 1, 0, 1, 0.
    assert history[0]["reward/mean"] == 0.5
    assert history[0]["accuracy/mean"] == 0.75
    assert history[0]["overlong/mean"] == -0.25


def test_recipe_warns_when_the_policy_does_not_aggregate_by_token_mean():
    policy = tiny_trainer(aggregation=rb.losses.seq_mean_token_mean)
    with pytest.warns(UserWarning, match="token-mean"):
        dapo(
            policy,
            ScriptedEngine(),
            Accuracy(),
            batches(),
            steps=1,
            run=rb.run.RunOptions(progress=False),
        )


def run_dapo(lr: float, steps: int) -> list[dict[str, float]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = tiny_trainer(lr=lr)
        engine = tiny_engine(policy)
        return run_group_recipe(
            dapo,
            policy,
            engine,
            steps=steps,
            max_length=10,  # no penalty up to 6 tokens, then −0.25 per token: −0.5 at 8
            cache_length=4,
            max_rounds=3,
        )


@pytest.mark.filterwarnings("ignore:dynamic sampling collected")
def test_dapo_raises_the_accuracy_of_a_toy_task_and_shortens_responses():
    history = run_dapo(lr=1e-2, steps=30)
    accuracy = [h["accuracy/mean"] for h in history]
    first, last = sum(accuracy[:3]) / 3, sum(accuracy[-3:]) / 3
    # Measured: ~2% digits at first; after 30 steps nearly all (last three steps ~0.99).
    assert first < 0.1
    assert last > 0.8, accuracy
    # The overlong shaping pushes the (always 8-token) responses shorter (measured: ~4 tokens).
    lengths = [h["response_length"] for h in history if h["sampling/skipped"] == 0]
    assert lengths[0] == 8.0
    assert sum(lengths[-5:]) / 5 < 6, lengths
    # Once every sample is all digits no group is informative: such steps are skipped.
    assert any(h["sampling/skipped"] == 1 for h in history)


@pytest.mark.filterwarnings("ignore:dynamic sampling collected")
def test_dapo_with_zero_learning_rate_does_not_learn():
    history = run_dapo(lr=0.0, steps=15)
    last = sum(h["accuracy/mean"] for h in history[-3:]) / 3
    assert last < 0.1, [h["accuracy/mean"] for h in history]
    for h in history:  # the sampling counts always add up
        assert h["sampling/rounds"] <= 3
        assert h["sampling/groups_generated"] == 4 * h["sampling/rounds"]
        assert h["sampling/groups_kept"] == min(h["sampling/groups_collected"], 4)
