"""DAPO, written only with public blocks: GRPO plus four changes, each one visible line.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476. One step:

1. **Dynamic sampling** (§3.2, eq. 11): sample G responses for a batch of prompts, score them,
   drop the groups whose *accuracy* rewards are all equal (all right or all wrong: zero
   group-relative advantage, no gradient), and draw more prompt batches until the step has
   its number of groups (`sample_informative_groups`);
2. **Overlong reward shaping** (§3.4, eq. 13): the training reward is the task reward plus
   a length penalty that ramps from 0 to −1 over the last ``cache_length`` tokens before
   ``max_length`` (`rlblocks.rewards.overlong`, added with `rlblocks.rewards.combine`);
3. advantage = the shaped reward standardized within its group (GRPO's, no critic);
4. **Clip-higher** (§3.1): the clipped surrogate with (ε_low, ε_high) = (0.2, 0.28), reduced
   with the **token-level mean** (§3.3, the trainer's ``TrainConfig.aggregation``);
5. push the new weights into the rollout engine.

Choices made here:

- The filter looks at the task reward, never the shaped total, as verl's
  ``filter_groups.metric=acc`` does: a group of G wrong answers of different lengths has a
  spread of shaped rewards but teaches nothing about correctness. The task reward is scored once
  per row: the shaped reward and the filter share one call (`_scored_once`).
- When ``max_rounds`` rounds do not collect enough groups, a ``RuntimeWarning`` says how many
  were collected; the step trains on what was collected, or, if nothing was, is **skipped** (no
  update, no sync; its metrics say ``sampling/skipped = 1``) and still counts as a step. verl
  raises instead; a warning keeps a long run alive through a hard stretch of the data.
- More groups than needed: the first ``groups_needed`` (whole groups) are kept, the others are
  thrown away, as verl does; they are not carried over to the next step (they would be stale).
- Like the GRPO recipe, no KL term by default (DAPO drops it, §2.3).
- The loop around the step (progress, ``time/*``, ``on_step``, checkpoints) and where its
  rollouts come from are the run floor's, `rlblocks.run`, shared by every recipe. Every
  generation round is ``time/rollout``, every scoring ``time/reward``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rlblocks import interfaces
from rlblocks.advantage import grpo as grpo_advantage
from rlblocks.losses import TokenMean, clipped_surrogate
from rlblocks.recipes.defaults import DEFAULT_SAMPLING
from rlblocks.recipes.names import RECIPES
from rlblocks.rewards import checked, combine, keep_informative_groups, overlong
from rlblocks.run import RolloutSource, Run, RunOptions, run_config


class InformativeGroups(NamedTuple):
    """What `sample_informative_groups` collected.

    ``rollouts``: the kept rows, whole groups, group ids unique across rounds (None when no
    group was collected); ``rewards``: (b) float32 training rewards of those rows (``reward_fn``'s,
    the shaped total in DAPO); ``metrics``: floats, see `sample_informative_groups`.
    """

    rollouts: interfaces.Rollouts | None
    rewards: Tensor
    metrics: dict[str, float]


def sample_informative_groups(
    rounds: Iterator[interfaces.Rollouts],
    reward_fn: interfaces.RewardFn,
    *,
    groups_needed: int | None = None,
    max_rounds: int = 8,
    accuracy_fn: interfaces.RewardFn | None = None,
) -> InformativeGroups:
    """DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2, eq. 11): draw rounds of
    rollouts until ``groups_needed`` groups have accuracy rewards that are not all equal.

        keep group G  ⇔  0 < |{oᵢ ∈ G : oᵢ correct}| < |G|      (eq. 11, 0/1 accuracy)
                      ⇔  max_{i∈G} accᵢ − min_{i∈G} accᵢ > 1e-6   (any accuracy scale)

    Each round takes the next generated batch from ``rounds`` (`rlblocks.run.RolloutSource.rounds`
    in the recipe; in a loop of one's own, ``engine.generate`` of each prompt batch in turn, e.g.
    a generator over the batches), scores it with ``reward_fn`` (the training reward) and filters on
    ``accuracy_fn`` (None: on ``reward_fn`` itself) with `rlblocks.rewards.keep_informative_groups`.
    Group ids are renumbered ``0, 1, 2, …`` in the order the groups were generated, so they stay
    unique after concatenating rounds (an engine may number every call from 0). Rounds stop
    when enough groups are collected, after ``max_rounds`` rounds, or when ``rounds`` runs out;
    then exactly ``groups_needed`` whole groups are kept (the first collected), or all of
    them with a ``RuntimeWarning`` saying how many were collected out of how many wanted after
    how many rounds.

    ``groups_needed``: None means the number of groups in the first round.
    Returns `InformativeGroups(rollouts (b …) or None, rewards (b) float32, metrics)`; nothing
    carries a gradient. Metrics: ``sampling/rounds``, ``sampling/groups_generated``,
    ``sampling/groups_filtered`` (uninformative), ``sampling/groups_collected`` (informative),
    ``sampling/groups_kept`` (returned), ``sampling/groups_wanted``, ``sampling/accuracy_mean``
    (over every generated row), ``sampling/short`` (1.0 when fewer than wanted were kept), and
    ``reward_fn``'s own metrics averaged over the rounds (rounds of equal size: a mean stays the
    mean over all generated rows, a count becomes a count per round).
    """
    if max_rounds < 1 or (groups_needed is not None and groups_needed < 1):
        raise ValueError(
            f"sample_informative_groups: max_rounds={max_rounds}, groups_needed={groups_needed}; "
            f"need max_rounds >= 1 and groups_needed >= 1 (or None)"
        )
    parts: list[tuple[interfaces.Rollouts, Tensor]] = []
    scored: list[dict[str, Any]] = []  # per round: reward metrics, accuracy
    generated = collected = 0
    while len(scored) < max_rounds and (groups_needed is None or collected < groups_needed):
        rollouts = next(rounds, None)
        if rollouts is None:
            break
        rollouts = _renumber_groups(rollouts, start=generated)  # unique across rounds
        groups_needed = groups_needed or len(torch.unique(rollouts.group_ids))
        rewards, reward_metrics = reward_fn(rollouts)  # the training reward (shaped)
        accuracy = rewards if accuracy_fn is None else accuracy_fn(rollouts).rewards
        keep, counts = keep_informative_groups(accuracy, rollouts.group_ids)  # eq. 11
        generated += int(counts["filter/groups_kept"] + counts["filter/groups_filtered"])
        collected += int(counts["filter/groups_kept"])
        scored.append({"metrics": reward_metrics, "accuracy": accuracy.float()})
        if keep.any():
            parts.append((rollouts.select(keep), rewards[keep].float()))
    return _first_groups(parts, scored, groups_needed or 0, generated, collected, max_rounds)


@RECIPES.register("dapo")
def dapo(
    policy: interfaces.PolicyTrainer,
    engine: interfaces.RolloutEngine,
    reward_fn: interfaces.RewardFn,
    batches: Iterable[Any],
    *,
    steps: int,
    groups_per_step: int | None = None,
    max_rounds: int = 8,
    advantage: interfaces.AdvantageEstimator = grpo_advantage,
    clip: tuple[float, float] = (0.2, 0.28),
    max_length: int | None = None,
    cache_length: int | None = None,
    overlong_factor: float = 1.0,
    group_size: int = 8,
    sampling: interfaces.SamplingParams = DEFAULT_SAMPLING,
    run: RunOptions | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` DAPO steps (module docstring); returns one metrics dict per step.

    ``reward_fn`` is the **task** reward (accuracy): dynamic sampling filters on it, and the
    training reward is ``combine([("accuracy", reward_fn, 1), ("overlong", overlong(…),
    overlong_factor)])``, i.e. rᵢ = accᵢ + overlong_factor · R_length(|yᵢ|) (eq. 13), with
    L_max = ``max_length`` (None: ``sampling.max_new_tokens``) and L_cache = ``cache_length``
    (None: L_max // 5, DAPO's 4096 of 20480). ``overlong_factor=0`` turns the shaping off.
    ``clip`` is (ε_low, ε_high) of the clipped surrogate. ``groups_per_step``: groups trained on
    per step (None: the prompts of one batch); ``max_rounds``: generation rounds per step at
    most. The policy should aggregate with token-mean (DAPO §3.3); a ``UserWarning`` says so
    when its ``config.aggregation`` is something else.

    Metrics: those of `sample_informative_groups` (``sampling/…``, ``accuracy/mean``,
    ``overlong/mean``, ``reward/mean`` = the shaped total), the trainer's, the resharder's, and
    the ones every recipe reports (`rlblocks.run.clock`): ``time/*`` (all generation rounds
    are ``time/rollout``, all scoring ``time/reward``), ``step_seconds``, ``response_length``
    (of the trained rows) and ``kl/token`` when the loss has a KL term; ``sampling/skipped``
    is 1.0 for a step with no informative group (no update, no sync, no
    ``response_length``; ``on_step`` gets None for its rollouts). The run also ends when
    ``batches`` runs out. ``run``: as in `rlblocks.recipes.grpo`; one step off, the first
    round of a step was sampled during the last update and refill rounds are sampled in the
    step (`rlblocks.run.source`).
    """
    if group_size < 2:
        raise ValueError(f"dapo: group_size={group_size}; dynamic sampling needs group_size >= 2")
    _warn_unless_token_mean(policy)
    config = run_config("dapo", locals())  # logged once, checked on resume
    run = Run("dapo", steps=steps, blocks={"policy": policy}, config=config, options=run)
    reward_fn = checked(reward_fn)  # the RewardFn contract; a NaN/inf row gets 0.0, counted
    loss_fn: interfaces.PolicyLoss = partial(clipped_surrogate, clip=clip)  # clip-higher, §3.1
    task = _scored_once(reward_fn)  # scored once, read by the shaped reward and the filter
    shaped = _shaped_reward(task, sampling, max_length, cache_length, overlong_factor)
    source = RolloutSource(engine, policy, batches, run, group_size=group_size, sampling=sampling)
    loss_fn = source.corrected(loss_fn)  # RunOptions.correction: for stale rows (k steps off)
    with run.driving(source):  # the run also ends when the prompt batches run out
        for step in run:
            with run.phase("rollout"):  # 1.-2. dynamic sampling, shaped reward
                sampled = sample_informative_groups(
                    source.rounds(),
                    run.timed("reward", shaped),  # scoring is time/reward
                    groups_needed=groups_per_step,
                    max_rounds=max_rounds,
                    accuracy_fn=run.timed("reward", task),
                )
            metrics = {**sampled.metrics, "sampling/skipped": float(sampled.rollouts is None)}
            if sampled.rollouts is None:  # nothing informative: no update, no sync
                run.record(metrics)
                continue
            rollouts = sampled.rollouts.replace(rewards=sampled.rewards)
            advantages, _ = advantage(sampled.rewards, rollouts.response_mask, rollouts.group_ids)
            with run.phase("update"):  # 3.-4.
                metrics |= policy.step(rollouts, advantages, loss_fn=loss_fn)
            metrics |= source.sync()  # 5.
            run.record(metrics, rollouts)
    return run.history


# ---------------------------------------------------------------------- helpers
def _renumber_groups(rollouts: interfaces.Rollouts, *, start: int) -> interfaces.Rollouts:
    """Group ids replaced by ``start, start + 1, …`` (same grouping, sorted by old id)."""
    _, dense = torch.unique(rollouts.group_ids, return_inverse=True)
    return rollouts.replace(group_ids=dense.to(rollouts.group_ids.dtype) + start)


def _first_groups(
    parts: list[tuple[interfaces.Rollouts, Tensor]],
    rounds: list[dict[str, Any]],
    needed: int,
    generated: int,
    collected: int,
    max_rounds: int,
) -> InformativeGroups:
    """Concatenate the kept rows, cut to the first ``needed`` groups, warn if short; metrics."""
    if collected < needed:
        why = f"max_rounds={max_rounds}" if len(rounds) == max_rounds else "batches ran out"
        what = "returning them" if collected else "nothing to train on"
        warnings.warn(
            f"dynamic sampling collected {collected} of {needed} informative groups after "
            f"{len(rounds)} rounds ({why}); {what}",
            RuntimeWarning,
            stacklevel=3,
        )
    rollouts, rewards = None, torch.zeros(0)
    if parts:
        rollouts, rewards = (
            interfaces.Rollouts.concat([r for r, _ in parts]),
            torch.cat([w for _, w in parts]),
        )
        first = torch.unique(rollouts.group_ids)[:needed]  # ids grow in generation order
        rows = torch.isin(rollouts.group_ids, first)
        rollouts, rewards = rollouts.select(rows), rewards[rows]
    return InformativeGroups(rollouts, rewards, _metrics(rounds, needed, generated, collected))


def _metrics(
    rounds: list[dict[str, Any]], needed: int, generated: int, collected: int
) -> dict[str, float]:
    """Counts of the sampling loop, plus the reward metrics averaged over the rounds."""
    accuracy = torch.cat([r["accuracy"] for r in rounds]) if rounds else torch.zeros(0)
    metrics = {
        "sampling/rounds": float(len(rounds)),
        "sampling/groups_generated": float(generated),
        "sampling/groups_filtered": float(generated - collected),
        "sampling/groups_collected": float(collected),
        "sampling/groups_kept": float(min(collected, needed)),
        "sampling/groups_wanted": float(needed),
        "sampling/accuracy_mean": float(accuracy.mean()) if len(accuracy) else float("nan"),
        "sampling/short": float(collected < needed),
    }
    keys = {k for r in rounds for k in r["metrics"]}
    for k in sorted(keys):
        values = [float(r["metrics"][k]) for r in rounds if k in r["metrics"]]
        metrics[k] = sum(values) / len(values)
    return metrics


def _scored_once(reward_fn: interfaces.RewardFn) -> interfaces.RewardFn:
    """``reward_fn`` remembering its latest answer: called twice on the same `Rollouts` object
    (by the shaped reward and by the filter), it scores the rows only once."""
    last: list[Any] = [None, None]

    def scored_once(rollouts: interfaces.Rollouts, /) -> interfaces.RewardOutput:
        if last[0] is not rollouts:
            last[:] = [rollouts, reward_fn(rollouts)]
        answer: interfaces.RewardOutput = last[1]
        return answer

    return scored_once


def _shaped_reward(
    task: interfaces.RewardFn,
    sampling: interfaces.SamplingParams,
    max_length: int | None,
    cache_length: int | None,
    factor: float,
) -> interfaces.RewardFn:
    """task + factor · overlong (DAPO eq. 13) with ``combine``; the task alone if factor is 0."""
    max_length = max_length or sampling.max_new_tokens
    cache_length = cache_length or max(1, max_length // 5)
    length = overlong(max_length=max_length, cache_length=cache_length)
    components = [("accuracy", task, 1.0)]
    if factor != 0:
        components.append(("overlong", length, factor))
    return combine(components)


def _warn_unless_token_mean(policy: interfaces.PolicyTrainer) -> None:
    """DAPO's token-level loss (§3.3) is the trainer's aggregation; say so if it is not."""
    aggregation = policy.config.aggregation  # a declared attribute, read once before the loop
    if not isinstance(aggregation, TokenMean):
        warnings.warn(
            f"DAPO uses token-mean loss aggregation (arXiv 2503.14476, §3.3) but the policy "
            f"aggregates with {aggregation!r}; build it with aggregation=rb.losses.token_mean",
            UserWarning,
            stacklevel=3,
        )


__all__ = ["InformativeGroups", "dapo", "sample_informative_groups"]
