"""The main job's stages around a recipe, shared by ``rlblocks-train`` and the demo: the
held-out evaluation (`HeldOut`: before, after, a curve from weights kept during training), the
supervised warm start (`sft_stage`), the memory plan printed before any weight is read
(`memory_plan`) and the placement of the blocks (`placement_for`).

None of it is a block: each stage takes the blocks the run built (a policy trainer, an engine,
datasets) and writes its part of ``<out>/summary.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rlblocks.checkpoint import Checkpointer
from rlblocks.data import PromptDataset, PromptRow, SFTBatches, sft_data
from rlblocks.interfaces import RewardFn, SamplingParams
from rlblocks.placement import Local
from rlblocks.recipes import evaluate, sft
from rlblocks.rollout import ENGINES, HFEngine
from rlblocks.run import RunOptions
from rlblocks.tracking.runlog import write_atomic


def held_out_score(
    engine: Any,
    problems: PromptDataset,
    reward: RewardFn,
    *,
    max_new_tokens: int,
    when: str,
) -> dict[str, float | None]:
    """``problems`` answered greedily by ``engine`` and scored by ``reward``, printed with two
    samples: ``{when}`` is the mean score (accuracy for a 0/1 reward), ``{when}_cut`` the share
    of answers cut off at ``max_new_tokens``, ``{when}_ended`` the score of the others (None
    if none ended): a gain that only comes from answers now fitting the budget leaves
    ``{when}_ended`` where it was."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    result = evaluate(engine, problems.prompts, reward, metadata=problems.metadata, sampling=greedy)
    for _, completion, score in result.samples(2):
        print(f"  [{score:.0f}] {completion.strip()[:100]!r}")
    cut = (result.rollouts.response_lengths >= max_new_tokens).tolist()  # (b) bool
    ended = [r for r, c in zip(result.rewards, cut, strict=True) if not c]
    scores = {
        when: result.score,
        f"{when}_cut": sum(cut) / len(cut),
        f"{when}_ended": sum(ended) / len(ended) if ended else None,
    }
    ended_score = "-" if scores[f"{when}_ended"] is None else f"{scores[f'{when}_ended']:.3f}"
    print(
        f"  = {result.score:.3f}   ({scores[f'{when}_cut']:.0%} cut off at {max_new_tokens} "
        f"tokens; the answers that ended score {ended_score})",
        flush=True,
    )
    return scores


@dataclasses.dataclass
class HeldOut:
    """The ``eval`` section's held-out problems, answered greedily by the run's engine before
    and after training; ``summary.json`` holds the scores (`held_out_score`'s keys for
    ``before`` and ``after``), ``steps``, ``held_out`` (the number of problems),
    ``held_out_in_training`` (how many of them are also training prompts: 0 for a real
    held-out set) and ``train_minutes``. A resumed run reads ``before`` from the file (the
    untrained weights are gone).

    ``every`` N >= 1 also keeps a copy of the weights after every N steps (`snapshot`, called
    after each step) and scores each after training, so that the training time is not
    disturbed: ``summary.json``'s ``curve`` lists ``step``, ``seconds`` (the sum of the steps'
    ``step_seconds`` in ``metrics.jsonl``) and ``accuracy``, from before training to the end.
    A copy taken before a resume is gone (not listed)."""

    problems: PromptDataset
    engine: Any
    reward: RewardFn
    max_new_tokens: int
    in_training: int = 0
    every: int = 0
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """How an engine for a kept copy of the weights is built (``HFEngine`` keywords)."""
    snapshots: dict[int, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    """The kept copies of the weights, by the number of steps done."""

    def before(self, summary: Path, *, resume: bool) -> None:
        """Score the untrained policy into ``summary`` (a resume reads it from there)."""
        if resume and summary.exists():
            before = json.loads(summary.read_text()).get("before")
            print(f"held-out accuracy before training (from {summary.name}): {before}")
            return
        if resume:  # the run began without eval: its untrained weights are gone
            print(f"held-out accuracy before training: unknown ({summary} was not written)")
            write_atomic(summary, json.dumps({"before": None}, indent=2) + "\n")
            return
        print(f"held-out accuracy before training ({len(self.problems)} problems, greedy):")
        if self.in_training:
            print(f"  note: {self.in_training} of them are also training prompts")
        scores = self.score("before")
        write_atomic(summary, json.dumps(scores, indent=2) + "\n")

    def after_sft(self, summary: Path, steps: int) -> None:
        """The score after the SFT stage, ``after_sft`` in ``summary`` (a resumed run whose
        SFT stage had ended keeps the recorded one: its weights were restored, not re-made)."""
        recorded = json.loads(summary.read_text())
        if "after_sft" in recorded:
            print(f"held-out accuracy after SFT (from {summary.name}): {recorded['after_sft']:.3f}")
            return
        print(f"held-out accuracy after {steps} SFT steps:")
        scores = self.score("after_sft")
        write_atomic(summary, json.dumps({**recorded, **scores}, indent=2) + "\n")

    def snapshot(self, step: int, policy: Any, steps: int) -> None:
        """After step ``step`` (0-based) of ``steps``: keep a copy of ``policy``'s weights when
        ``every`` steps are done (not after the last: that one is scored as ``after``)."""
        done = step + 1
        if self.every and done % self.every == 0 and done < steps:
            self.snapshots[done] = {
                k: v.detach().clone() for k, v in policy.model.state_dict().items()
            }

    def after(
        self, summary: Path, *, steps: int, start: float, policy: Any = None
    ) -> dict[str, Any]:
        """Score the trained policy (and the kept copies of ``policy``'s weights, with
        ``every``) and complete ``summary``; returns what it holds."""
        minutes = (time.perf_counter() - start) / 60
        print(f"held-out accuracy after {steps} steps ({minutes:.1f} min of training):")
        result = {
            **json.loads(summary.read_text()),  # before (and what a caller recorded there)
            **self.score("after"),
            "steps": steps,
            "held_out": len(self.problems),
            "held_out_in_training": self.in_training,
            "train_minutes": minutes,
        }
        print(f"  before training: {result['before']}")
        for stage, label in (("after_sft", "after SFT"), ("teacher", "the teacher")):
            if stage in result:
                print(f"  {label}: {result[stage]:.3f}")
        if self.every and policy is not None:
            result["curve"] = self.curve(policy, summary.parent / "metrics.jsonl", result, steps)
        write_atomic(summary, json.dumps(result, indent=2) + "\n")
        return result

    def curve(
        self, policy: Any, metrics: Path, summary: Mapping[str, Any], steps: int
    ) -> list[dict[str, Any]]:
        """Held-out accuracy against training seconds: before training, after every ``every``
        steps (each kept copy loaded into a copy of the model, answered by an engine of its
        own) and at the end, ``seconds`` from ``metrics``' ``step_seconds`` (a resumed run's
        too)."""
        lines = metrics.read_text().splitlines()
        seconds = [json.loads(line)["step_seconds"] for line in lines if line.strip()]
        elapsed = [sum(seconds[:s]) for s in range(len(seconds) + 1)]
        curve = [{"step": 0, "seconds": 0.0, "accuracy": summary["before"]}]
        if self.snapshots:
            probe = copy.deepcopy(policy.model)
            engine = HFEngine(probe, policy.tokenizer, **self.engine_kwargs)
            for step, weights in sorted(self.snapshots.items()):
                probe.load_state_dict(weights)
                print(f"held-out accuracy after step {step} (weights kept during training):")
                accuracy = self.score(f"step_{step}", engine)[f"step_{step}"]
                curve.append({"step": step, "seconds": elapsed[step], "accuracy": accuracy})
        curve.append({"step": steps, "seconds": elapsed[-1], "accuracy": summary["after"]})
        return curve

    def teacher(self, summary: Path, teacher: Any, name: str) -> None:
        """The teacher's greedy score on the held-out problems, recorded once in ``summary``
        as ``teacher`` (an engine around the teacher's model)."""
        recorded = json.loads(summary.read_text())
        if "teacher" in recorded:
            return
        engine = HFEngine(teacher.model, teacher.tokenizer, **self.engine_kwargs)
        greedy = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0)
        problems = self.problems
        result = evaluate(
            engine, problems.prompts, self.reward, metadata=problems.metadata, sampling=greedy
        )
        print(f"held-out accuracy of the teacher {name}: {result.score:.3f}")
        write_atomic(summary, json.dumps({**recorded, "teacher": result.score}, indent=2) + "\n")

    def score(self, when: str, engine: Any = None) -> dict[str, float | None]:
        """`held_out_score` with this run's engine (or ``engine``), reward and budget."""
        return held_out_score(
            engine or self.engine,
            self.problems,
            self.reward,
            max_new_tokens=self.max_new_tokens,
            when=when,
        )


def prompt_key(prompt: Any) -> str:
    """A prompt (text or chat messages) as a comparable string."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


SFT_TARGETS = ("worked", "answer")
"""What ``sft_target`` may be (`sft_completion`)."""


def sft_completion(row: PromptRow, target: str) -> str:
    """The SFT target of a problem: ``"worked"``, its expression and value (``"42 + 41 = 83"``:
    the computation written out, the answer last, where `rb.rewards.math_answer` reads it;
    rows of `rlblocks.data.arithmetic_prompts`, which carry the expression), or ``"answer"``,
    the reference answer alone."""
    if row.ground_truth is None:
        raise ValueError(
            f"sft_target: the row {row.prompt!r} has no reference answer to learn; give every "
            "training row a ground_truth, or run without sft_steps"
        )
    if target == "answer":
        return row.ground_truth
    expression = row.metadata.get("expression")
    if expression is None:
        raise ValueError(
            f"sft_target: worked needs the problem's expression (arithmetic data); the row "
            f"{row.prompt!r} has none: pass sft_target answer"
        )
    return f"{expression} = {row.ground_truth}"


def sft_stage(
    policy: Any,
    train: PromptDataset,
    held_out: PromptDataset | None,
    *,
    steps: int,
    target: str,
    batch_size: int,
    seed: int,
    out: Path,
    resume: bool,
) -> bool:
    """A supervised warm start of ``policy`` on the training problems' answers
    (`sft_completion`), with the held-out problems' answers as held-out loss; its records go to
    ``<out>/sft-metrics.jsonl``, its checkpoint to ``<out>/checkpoints-sft``. A resumed run
    restores it from there, and skips it once the RL stage has a checkpoint (which holds the
    weights SFT left). Returns whether it ran (or was restored)."""
    if resume and Checkpointer(out / "checkpoints").latest() is not None:
        return False  # the RL stage had begun
    rows = [train] if held_out is None else [train, held_out]
    data = [
        sft_data(
            [{"prompt": r.prompt, "completion": sft_completion(r, target)} for r in part],
            policy.tokenizer,
        )
        for part in rows
    ]
    print(f"SFT: {steps} steps of {batch_size} examples")
    history = sft(
        policy,
        SFTBatches(data[0], batch_size=batch_size, seed=seed),
        steps=steps,
        held_out=data[1].rollouts() if len(data) > 1 else None,
        eval_every=max(1, steps // 4),
        run=RunOptions(
            on_step=lambda step, m, _: tqdm.write(
                f"sft step {step:3d}  loss {m['loss']:.3f}"
                + (f"  held-out loss {m['eval/nll']:.3f}" if "eval/nll" in m else "")
            ),
            checkpoint=Checkpointer(out / "checkpoints-sft", every=steps, keep_last=1),
            resume="auto" if resume else False,
        ),
    )
    with (out / "sft-metrics.jsonl").open("w") as f:
        f.writelines(json.dumps({"step": i, **m}) + "\n" for i, m in enumerate(history))
    return True


PROMPT_TOKENS = 64
"""What the memory plan takes a prompt to be at most (the arithmetic chat prompts are shorter)."""


def memory_plan(
    model: str,
    *,
    dtype: torch.dtype,
    micro_batch_size: int | None,
    max_new_tokens: int,
    rollout_rows: int,
    reference: bool,
    workers: int,
    tp: int,
    engine: str,
    engine_copy: bool,
    lora: Any = None,
    weight_copies: int = 0,
    gpu: bool = False,
) -> str:
    """``rb.plan`` of a run (micro-batches of ``micro_batch_size`` rows, None: all the
    rollout's, of at most
    `PROMPT_TOKENS` + ``max_new_tokens`` tokens), as printed before the model loads;
    ``weight_copies``: copies of the weights kept for a held-out curve. A model the planner
    cannot size is said so, and the run goes on."""
    from rlblocks.planner import plan

    length = PROMPT_TOKENS + max_new_tokens
    try:
        planned = plan(
            model,
            dtype=dtype,
            lora=lora,
            tokens=(micro_batch_size or rollout_rows) * length,
            reference=reference,
            world=workers or 1,
            tp=tp,
            engine=ENGINES[engine],  # the planner asks the class for its memory model
            engine_copy=engine_copy,
            colocated=not workers,
            rollout_rows=rollout_rows,
            rollout_tokens=length,
        )
    except (ValueError, OSError) as error:
        return f"memory plan: not made ({error})"
    device = "per GPU" if gpu else "in this machine's RAM"
    text = f"{planned}\n(the plan of this job's tensors {device}; docs/memory.md)"
    if weight_copies:  # the weights kept for the held-out curve: the job's own, not a block's
        each = planned.trainer["weights"]
        gib = weight_copies * each / 2**30
        text += f"\n+ {weight_copies} copies of the weights for the held-out curve ({gib:.2f} GiB)"
    return text


def placement_for(workers: int, gpu: bool) -> Any:
    """This process (`rlblocks.placement.Local`), or one pool of ``workers`` Ray workers (a GPU
    each with ``gpu``); Ray is imported only then."""
    if not workers:
        return Local()
    from rlblocks.placement import Pool, Ray

    pool = Pool(workers_per_node=workers, gpus_per_worker=1.0 if gpu else 0.0)
    return Ray(pools={"default": pool})
