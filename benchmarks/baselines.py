"""The algorithm family on the main job's task: held-out accuracy and wall time, side by side.

    HF_HUB_OFFLINE=1 python benchmarks/baselines.py --out runs/baselines      # 6 algorithms x 3 seeds
    python benchmarks/baselines.py --algorithms grpo rloo --seeds 0 --model tiny --steps 2

Each algorithm is the main job (``python -m rlblocks``: every flag this script does not know is
one of its flags, ``--steps``, ``--lr``, ``--model``, ...) run as the ``rlblocks-train`` job it
stands for (`rlblocks.app.demo.train_argv`), with the keys that make it that algorithm changed
(`ALGORITHMS`). The runs are ``python -m rlblocks.app.train``, one per algorithm and seed, in
``--out/<algorithm>/seed-<s>``; as in ``benchmarks/learning.py`` (`learning.run_seed`), a
finished run is read back, an unfinished one resumed from its checkpoint.

The same budget of sampled tokens for each: every algorithm samples prompts per step x group
size responses of at most ``--max-new-tokens`` tokens a step, for the same steps. PPO samples
each prompt once, so it takes prompts per step x group size prompts a step; DAPO samples one
round a step (``max_rounds: 1``), so its dynamic sampling drops the groups whose rewards are all
equal instead of sampling more to replace them.

Then it prints, and writes to ``--out/table.md``, the setup and one row per algorithm: held-out
accuracy after training (mean ± sample std over the seeds, min - max), the gain over the
untrained model, the share of greedy answers cut off at the budget, and the wall minutes and
seconds per step, with what each algorithm changes.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from rlblocks.app import demo

_spec = importlib.util.spec_from_file_location("learning", Path(__file__).with_name("learning.py"))
assert _spec is not None and _spec.loader is not None
learning = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(learning)


def _unchanged(keys: dict[str, Any]) -> dict[str, Any]:
    return {}


class Algorithm(NamedTuple):
    """One row of the table: its name, what it changes in the main job (the table says it), and
    the keys it sets (None: removed) on the main job's `rlblocks-train` keys."""

    label: str
    changes: str
    keys: Callable[[dict[str, Any]], dict[str, Any]] = _unchanged


def _ppo(keys: dict[str, Any]) -> dict[str, Any]:
    """PPO: each prompt sampled once (as many prompts as the others' responses), a critic of
    the same model trained at 10x the policy's learning rate (verl's examples), no KL term."""
    rows = keys["prompts_per_step"] * keys["group_size"]
    critic = {"lr": round(10 * keys["trainer.lr"], 12), "micro_batch_size": 8, "max_grad_norm": 1.0}
    return {
        "recipe": "ppo",
        "group_size": 1,
        "prompts_per_step": rows,
        "kl_coef": 0.0,
        "advantage.name": None,
        "loss.clip": [0.2, 0.2],
    } | {f"critic.{k}": v for k, v in critic.items()}


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(
        "GRPO",
        "the main job: group mean and std, token-mean, clip (0.2, 0.28)",
    ),
    "dr_grpo": Algorithm(
        "Dr. GRPO",
        "advantage dr_grpo (no division by the group's std); each sequence's token sum divided "
        "by the token budget (seq-mean-token-sum-norm)",
        lambda keys: {
            "advantage.name": "dr_grpo",
            "trainer.aggregation": "seq-mean-token-sum-norm",
        },
    ),
    "dapo": Algorithm(
        "DAPO",
        "recipe dapo: groups with equal rewards dropped (one sampling round, no refill), soft "
        "overlong penalty (L_cache = budget / 5), clip (0.2, 0.28), token-mean",
        lambda keys: (
            {"recipe": "dapo", "max_rounds": 1, "clip": [0.2, 0.28]}
            | {"loss.name": None, "loss.clip": None, "kl_coef": None, "overlong_shaping": None}
        ),
    ),
    "ppo": Algorithm(
        "PPO",
        "recipe ppo: one sample per prompt, a critic (the same model with a value head, lr 10x "
        "the policy's), GAE λ 0.95 γ 1, whitened advantages, clip 0.2",
        _ppo,
    ),
    "rloo": Algorithm(
        "RLOO",
        "advantage rloo: the mean of the group's other samples as baseline",
        lambda keys: {"advantage.name": "rloo"},
    ),
    "reinforce_pp": Algorithm(
        "REINFORCE++",
        "advantage reinforce_pp_baseline: the group mean subtracted, then normalized over the "
        "whole batch",
        lambda keys: {"advantage.name": "reinforce_pp_baseline"},
    ),
}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = learning.seeds_parser(__doc__, Path("runs/baselines"), "runs and table.md")
    p.add_argument(
        "--algorithms",
        nargs="+",
        choices=list(ALGORITHMS),
        default=list(ALGORITHMS),
        help="which rows, in this order",
    )
    args, passthrough = p.parse_known_args(argv)
    if any(flag.split("=")[0] in ("--seed", "--out", "--resume") for flag in passthrough):
        p.error("--seed, --out and --resume are set per run by this script; use --seeds, --out")
    demo_args = demo.parse_args(passthrough)  # an unknown flag fails here, before any run
    if demo_args.teacher is not None or demo_args.staleness or demo_args.workers:
        raise SystemExit(
            "baselines.py runs the main job's synchronous GRPO setting in one process: "
            "--teacher, --staleness/--async and --workers are not among its flags"
        )
    return args, passthrough


def train_keys(algorithm: str, passthrough: list[str], seed: int, folder: Path) -> list[str]:
    """The ``rlblocks-train`` arguments of ``algorithm``'s run of ``seed`` in ``folder``."""
    demo_args = demo.parse_args([*passthrough, "--seed", str(seed), "--out", str(folder)])
    keys = dict(_split(flag) for flag in demo.train_argv(demo_args))
    typed = {k: _typed(v) for k, v in keys.items()}
    for key, value in ALGORITHMS[algorithm].keys(typed).items():
        if value is None:
            keys.pop(key, None)
        else:
            keys[key] = demo._value(value)
    return [f"--{key}={value}" for key, value in keys.items()]


def _split(flag: str) -> tuple[str, str]:
    key, _, value = flag.removeprefix("--").partition("=")
    return key, value


def _typed(value: str) -> Any:
    """A key's value as a number where it is one (the algorithms compute with a few)."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def check(argv: list[str]) -> None:
    """Parse a run's arguments as ``rlblocks-train`` will (SystemExit naming the key that is
    wrong), so that a bad combination fails before the first run, not after hours of others."""
    from rlblocks.app import train

    train.parse(argv)


def table(
    args: argparse.Namespace, passthrough: list[str], runs: dict[str, dict[int, dict]]
) -> str:
    """The setup, one row per algorithm, and what each row changes."""
    demo_args = demo.parse_args(passthrough)
    task = demo.task_of(demo_args)
    held_out = ", ".join(
        str(n) for n in sorted({s["held_out"] for r in runs.values() for s in r.values()})
    )
    scored = "validation" if demo_args.validation else "held-out"
    rows = demo_args.prompts_per_step * demo_args.group_size
    setup = (
        f"Model: {learning.model_description(demo_args.model)}. Task: `{demo_args.task}` "
        f"({learning.describe(task.difficulty)}; instruction {task.instruction!r}). "
        f"Every algorithm: {demo_args.steps} steps of {rows} sampled responses (the main "
        f"job's {demo_args.prompts_per_step} prompts x {demo_args.group_size}) of at most "
        f"{demo_args.max_new_tokens} new tokens at temperature {demo_args.temperature:g}, one "
        f"optimizer step per batch, lr {demo_args.lr:g}, no KL term, synchronous. Scored: "
        f"{held_out} distinct {scored} problems, greedy, the same for every run, none in "
        f"training. Seeds: {', '.join(map(str, args.seeds))}."
    )
    header = (
        "| algorithm | after: mean ± std (n-1) | min - max | gain | cut after | training "
        "minutes | wall minutes | s/step |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for name, summaries in runs.items():
        after = [s["after"] for s in summaries.values()]
        gain = [s["after"] - s["before"] for s in summaries.values()]
        cut = [s["after_cut"] for s in summaries.values() if s.get("after_cut") is not None]
        training = [s["train_minutes"] for s in summaries.values() if s.get("train_minutes")]
        minutes = [s["wall_minutes"] for s in summaries.values() if s.get("wall_minutes")]
        per_step = [s["seconds_per_step"] for s in summaries.values() if s.get("seconds_per_step")]
        lines.append(
            f"| {ALGORITHMS[name].label} | {_spread(after)} | {min(after):.3f} - {max(after):.3f} "
            f"| {statistics.mean(gain):+.3f} | {_mean(cut)} | {_spread(training, '{:.1f}')} "
            f"| {_spread(minutes, '{:.1f}')} "
            f"| {_mean(per_step, '{:.1f}')} |"
        )
    legend = ["", "What each row changes in the main job:", ""]
    legend += [f"- {ALGORITHMS[name].label}: {ALGORITHMS[name].changes}." for name in runs]
    columns = (
        f"after: greedy {scored} accuracy after training; gain: after minus before (the "
        "untrained model's score, the same for every row); cut after: the share of greedy "
        "answers cut off at the token budget; training minutes: the steps alone (the sum of "
        "step_seconds); wall minutes: the whole job (model load and both scorings included; "
        "blank for a resumed run); s/step: the median seconds of a step after the first."
    )
    legend += ["", columns]
    return setup + "\n\n" + "\n".join(lines) + "\n" + "\n".join(legend) + "\n"


def _mean(values: list[float], fmt: str = "{:.3f}") -> str:
    return fmt.format(statistics.mean(values)) if values else ""


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return ""
    spread = f" ± {fmt.format(statistics.stdev(values))}" if len(values) > 1 else ""
    return fmt.format(statistics.mean(values)) + spread


def main(argv: list[str] | None = None) -> str:
    args, passthrough = parse_args(argv)
    plans = {
        (name, seed): train_keys(name, passthrough, seed, args.out / name / f"seed-{seed}")
        for name in args.algorithms
        for seed in args.seeds
    }
    for argv_ in plans.values():
        check(argv_)
    runs: dict[str, dict[int, dict]] = {}
    for (name, seed), keys in plans.items():
        folder = args.out / name / f"seed-{seed}"
        print(f"{ALGORITHMS[name].label}, seed {seed}:", flush=True)
        summary = learning.run_seed(seed, folder, [], module="rlblocks.app.train", argv=keys)
        runs.setdefault(name, {})[seed] = summary
    text = table(args, passthrough, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    print("\n" + text + f"\n(written to {args.out / 'table.md'})")
    return text


if __name__ == "__main__":
    sys.exit(main() and 0)
