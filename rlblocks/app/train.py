"""``rlblocks-train``: run a recipe from a YAML file, with command-line overrides::

    python -m rlblocks.app.train examples/grpo_arithmetic.yaml
    python -m rlblocks.app.train examples/grpo_arithmetic.yaml --model.name tiny --steps 2
    python -m rlblocks.app.train runs/grpo/config.yaml --resume      # go on where it stopped

The keys and their parser are `rlblocks.app.cli`'s (docs/configs.md); this module builds the blocks
a configuration names (`build`) and runs them with the stages of `rlblocks.app.job` around the
recipe (`main`). ``python -m rlblocks`` is this command with every key given by its flags.
"""

from __future__ import annotations

__all__ = [  # the command's names, its parser's (rlblocks.app.cli) and the registries it reads
    "CORRECTIONS",
    "DATA",
    "DEFAULT_CORRECTION",
    "LOSSES",
    "PREFERENCES",
    "RECIPES",
    "RUN_KEYS",
    "SavedConfig",
    "build",
    "cli",
    "dump",
    "held_out_of",
    "main",
    "parse",
    "parser",
    "run_options",
    "step_line",
]

import copy
import inspect
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser, Namespace

from rlblocks.advantage import ESTIMATORS
from rlblocks.app.cli import (
    BUILT,
    NOT_CONFIGURABLE,
    RUN_KEYS,
    bound,
    dump,
    parse,
    parser,
    pick,
    sampling_params,
    section_kwargs,
    train_config,
)
from rlblocks.app.job import (
    HeldOut,
    memory_plan,
    placement_for,
    prompt_key,
    sft_stage,
)
from rlblocks.base.extras import is_installed
from rlblocks.checkpoint import Checkpointer
from rlblocks.checkpoint.lock import FolderInUseError
from rlblocks.critic import CriticTrainer
from rlblocks.data import DATA, PromptBatches
from rlblocks.interfaces import RewardFn
from rlblocks.losses import (
    CORRECTIONS,
    LOSSES,
    PREFERENCES,
    kl_regularized,
    uses_reference,
)
from rlblocks.losses.offpolicy import DEFAULT_CORRECTION
from rlblocks.models import load_tokenizer, resolve_device
from rlblocks.placement import Local
from rlblocks.recipes import RECIPES
from rlblocks.rewards import REWARDS, combine, overlong
from rlblocks.rollout import ENGINES, HFEngine
from rlblocks.run import RunOptions
from rlblocks.tracking import Tracker
from rlblocks.tracking.runlog import write_atomic
from rlblocks.trainer import PolicyTrainer, Teacher
from rlblocks.trainer.allocator import ENV


def build(
    config: Namespace, placement: Any = None, *, reward_fn: RewardFn | None = None
) -> tuple[Callable[..., list[dict[str, Any]]], dict[str, Any]]:
    """The recipe and the arguments ``config`` stands for, blocks built (the model loaded):
    ``fn(**arguments, run=run_options(config))`` is the run (add a checkpoint and a tracker to
    those options to save and log it). ``placement``: where the policy, the critic and the
    engine live (None: this process; `rlblocks.app.job.placement_for` makes the one of
    ``workers``). ``reward_fn``: a reward given in Python, instead of the ``reward`` named."""
    fn = RECIPES[config.recipe]
    params = inspect.signature(fn).parameters
    torch.manual_seed(config.seed)
    model = config.model
    device = resolve_device(model.device, owner="model.device")
    dtype = getattr(torch, model.dtype)
    placement = placement if placement is not None else Local()
    kl_coef = config.get("kl_coef", 0.0)  # PPO's own, or β of a KL loss term (GRPO family)
    preference = (
        bound(PREFERENCES, config.preference, "preference") if "preference" in params else None
    )
    # A reference only for a KL term or a pair loss against one: else nothing is kept or scored.
    anchored = preference is not None and uses_reference(preference)
    teacher = _teacher(config, device) if config.teacher is not None else None

    def trainer(role: str, cls: Any, section: Namespace, **kwargs: Any) -> Any:
        """``cls`` (`PolicyTrainer`, `CriticTrainer`) of the model, configured by ``section``,
        built where ``placement`` puts ``role``."""
        load = partial(
            cls.from_pretrained,
            model.name,
            dtype=dtype,
            device=device,
            config=train_config(section, budget=config.sampling.max_new_tokens),
            **kwargs,
        )
        return placement.build(role, load)

    policy = trainer(
        "actor",
        PolicyTrainer,
        config.trainer,
        reference="auto" if kl_coef or "critic" in params or anchored else None,
        lora=_lora(config),
    )
    engine = _engine(config, policy, placement, device)
    data_kwargs = section_kwargs(config.data)
    if data_kwargs.get("max_prompt_tokens") is not None:
        data_kwargs["tokenizer"] = policy.tokenizer
    dataset = pick(DATA, config.data.name, "data.name")(**data_kwargs)
    arguments: dict[str, Any] = {
        "policy": policy,
        "engine": engine,
        "batches": PromptBatches(
            dataset, prompts_per_step=config.prompts_per_step, seed=config.seed
        ),
        "sampling": sampling_params(config.sampling),
    }
    if params["reward_fn"].default is inspect.Parameter.empty:  # distill's is optional: none
        reward = reward_fn if reward_fn is not None else _reward(config)
        arguments["reward_fn"] = shaped(reward, config)
    if teacher is not None:
        arguments["teacher"] = teacher
    if "critic" in params:
        arguments["critic"] = trainer("critic", CriticTrainer, config.critic)
    if "advantage" in params:
        arguments["advantage"] = bound(ESTIMATORS, config.advantage, "advantage")
    if preference is not None:
        arguments["preference"] = preference
    if "loss_fn" in params:
        loss = bound(LOSSES, config.loss, "loss")
        wrap = kl_coef and "kl_coef" not in params  # PPO and distill apply their own kl_coef
        arguments["loss_fn"] = kl_regularized(loss, kl_coef=kl_coef) if wrap else loss
    own = set(params) - BUILT - NOT_CONFIGURABLE
    arguments |= {k: config[k] for k in own if k in config}
    return fn, arguments


def shaped(reward: RewardFn, config: Namespace) -> RewardFn:
    """The training reward: ``reward`` plus ``overlong_shaping`` times DAPO's soft overlong
    penalty over the last half of ``sampling.max_new_tokens`` (0: ``reward`` itself)."""
    factor = config.get("overlong_shaping", 0.0)
    if not factor:
        return reward
    budget = config.sampling.max_new_tokens
    penalty = overlong(max_length=budget, cache_length=max(budget // 2, 1))
    return combine([("task", reward, 1.0), ("overlong", penalty, factor)])


def _lora(config: Namespace) -> Any:
    """``peft.LoraConfig`` of ``model.lora`` (None: all weights train)."""
    if config.model.lora is None:
        return None
    from peft import LoraConfig

    return LoraConfig(**config.model.lora)


def _reward(config: Namespace) -> RewardFn:
    if config.reward is None:
        raise SystemExit("reward: null names no reward; name one (REWARDS or package.module:fn)")
    reward: RewardFn = pick(REWARDS, config.reward, "reward")
    return reward


def _teacher(config: Namespace, device: torch.device) -> Any:
    """The ``teacher`` folder's model (recipe distill), loaded before any other work; one that
    cannot be loaded is refused by name."""
    tokenizer = load_tokenizer(config.model.name)
    try:
        return Teacher.from_pretrained(config.teacher, device=device, student_tokenizer=tokenizer)
    except (OSError, ValueError) as error:  # no folder, no model in it, another vocabulary
        raise SystemExit(f"teacher {config.teacher}: {error}") from error


def _engine(config: Namespace, policy: Any, placement: Any, device: torch.device) -> Any:
    """The rollout engine: on the workers with ``workers``, vLLM with ``rollout: vllm`` (its
    own copy, synced), else an ``HFEngine`` sharing the policy's model, or with ``staleness``
    its own copy sampling while the trainer updates (each side then has half of this
    machine's CPU threads: torch's thread count is process-wide)."""
    kwargs = vars(config.engine)
    if config.workers:
        return placement.build(
            "rollout",
            partial(HFEngine.from_pretrained, config.model.name, device=device, **kwargs),
        )
    if config.rollout != "hf":  # an engine with weights of its own (vllm), built from the name
        return ENGINES[config.rollout](config.model.name, chat=kwargs.get("chat"))
    if config.staleness:
        if device.type == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads() // 2))
        return HFEngine(copy.deepcopy(policy.model), policy.tokenizer, **kwargs)
    return HFEngine(policy.model, policy.tokenizer, **kwargs)


def main(
    argv: Sequence[str] | None = None, *, reward_fn: RewardFn | None = None
) -> list[dict[str, Any]]:
    """``rlblocks-train CONFIG.yaml [--key.sub value ...] [--resume]``: parse, run, with
    ``<out>/config.yaml`` written when the run starts; returns the recipe's metrics, one dict
    per step. ``reward_fn``: a reward given in Python instead of the ``reward`` named (the
    demo's tasks).

    The run holds ``<out>/checkpoints``' lock from the start (a second run on ``out`` fails at
    once). ``out`` with a checkpoint of a step needs ``--resume``; ``--resume`` needs one. A run
    that stopped before its first checkpoint is started over without ``--resume`` (its records
    are dropped). ``config.yaml`` is written once the checkpoint is loaded and the resume
    checks passed (`rlblocks.run.resume`): it states the settings in effect, the overrides of a
    resume included, and a refused resume leaves the old file.

    Around the recipe (`rlblocks.app.job`): the memory plan, printed before any weight is read;
    with ``eval``, the held-out scores before and after (``summary.json``); with ``teacher``,
    the teacher's score; with ``sft_steps``, the SFT stage before the recipe; at the end
    ``curves.png`` when matplotlib is installed."""
    config, p, resume = parse(sys.argv[1:] if argv is None else argv)
    out = Path(config.out)
    checkpoint = Checkpointer(out / "checkpoints", every=config.checkpoint_every, keep_last=1)
    try:
        with checkpoint.lock.holding():
            _check_out(out, checkpoint, resume=resume)
            gpu = resolve_device(config.model.device, owner="model.device").type == "cuda"
            print(_plan(config, gpu), flush=True)  # before any weights are read
            with placement_for(config.workers, gpu) as placement:  # Ray: stopped at the end
                fn, arguments = build(config, placement, reward_fn=reward_fn)
                return _run(
                    config,
                    p,
                    fn,
                    arguments,
                    checkpoint=checkpoint,
                    resume=resume,
                    reward_fn=reward_fn,
                )
    except FolderInUseError as error:
        raise SystemExit(str(error)) from error


def _run(
    config: Namespace,
    p: ArgumentParser,
    fn: Callable[..., list[dict[str, Any]]],
    arguments: dict[str, Any],
    *,
    checkpoint: Checkpointer,
    resume: bool,
    reward_fn: RewardFn | None = None,
) -> list[dict[str, Any]]:
    """The stages of :func:`main` once the blocks are built."""
    out = Path(config.out)
    summary = out / "summary.json"
    policy = arguments["policy"]
    held_out = held_out_of(config, arguments, reward_fn) if "eval" in config else None
    if held_out is not None:
        held_out.before(summary, resume=resume)
        if "teacher" in arguments:
            held_out.teacher(summary, arguments["teacher"], str(config.teacher))
    if config.sft_steps:  # a supervised warm start; the same trainer object goes on
        ran = sft_stage(
            policy,
            arguments["batches"].dataset,
            held_out.problems if held_out is not None else None,
            steps=config.sft_steps,
            target=config.sft_target,
            batch_size=config.prompts_per_step * config.group_size,
            seed=config.seed,
            out=out,
            resume=resume,
        )
        if ran and held_out is not None:
            held_out.after_sft(summary, config.sft_steps)

    def on_step(step: int, record: dict[str, Any], rollouts: Any) -> None:
        if held_out is not None:
            held_out.snapshot(step, policy, config.steps)
        print(step_line(step, record), flush=True)

    saved = SavedConfig(out / "config.yaml", dump(config, p))
    start = time.perf_counter()
    with Tracker(out, report_to=[*config.tracking, saved]) as tracker:
        # A resume whose run stopped in its SFT stage starts the recipe from its first step.
        resumed = resume and checkpoint.latest() is not None
        run = run_options(
            config, checkpoint=checkpoint, resume=resumed, tracker=tracker, on_step=on_step
        )
        history = fn(**arguments, run=run) if config.steps else []
    if held_out is not None:
        kept = policy if history else None  # the curve's copies: only when the recipe ran
        held_out.after(summary, steps=config.steps, start=start, policy=kept)
    wrote = ["metrics.jsonl", "summary.json" if held_out else "", "checkpoints/"]
    if history and is_installed("matplotlib"):
        import rlblocks as rb  # rb.plot: the notebook's figure, loaded only here

        rb.plot(out / "metrics.jsonl", out / "curves.png")  # the whole run, resumed too
        wrote.insert(1, "curves.png")
    elif history:
        print('  no curves.png: matplotlib is not installed (pip install "rlblocks[plot]")')
    print(f"wrote {out}/" + ", ".join(w for w in wrote if w))
    return history


def held_out_of(
    config: Namespace, arguments: Mapping[str, Any], reward_fn: RewardFn | None = None
) -> HeldOut:
    """The held-out set of ``config.eval``, scored by the run's engine and reward (or
    ``reward_fn``, given in Python)."""
    kwargs = section_kwargs(config.eval)
    if kwargs.get("max_prompt_tokens") is not None:
        kwargs["tokenizer"] = arguments["policy"].tokenizer
    problems = pick(DATA, config.eval.name, "eval.name")(**kwargs)
    if not len(problems):
        raise SystemExit("eval: the held-out set is empty; pass eval.n >= 1 (or a source)")
    training = {prompt_key(p) for p in arguments["batches"].dataset.prompts}
    return HeldOut(
        problems,
        arguments["engine"],
        reward_fn or _reward(config),
        config.sampling.max_new_tokens,
        in_training=sum(prompt_key(p) in training for p in problems.prompts),
        every=config.eval_every,
        engine_kwargs=vars(config.engine),
    )


def _plan(config: Namespace, gpu: bool) -> str:
    """:func:`rlblocks.app.job.memory_plan` of this run."""
    copies = (config.steps - 1) // config.eval_every if config.eval_every else 0
    return memory_plan(
        config.model.name,
        dtype=getattr(torch, config.model.dtype),
        micro_batch_size=config.trainer.micro_batch_size,
        max_new_tokens=config.sampling.max_new_tokens,
        rollout_rows=config.prompts_per_step * config.get("group_size", 1),
        reference=bool(config.get("kl_coef", 0.0)),
        workers=config.workers,
        tp=config.trainer.tp,
        engine=config.rollout,
        engine_copy=bool(config.staleness) or bool(config.workers),
        lora=_lora(config),
        weight_copies=max(0, copies),
        gpu=gpu,
    )


MARK = ".rlblocks-run"
"""The file a run leaves in its ``out`` folder first: the folder is a run's, whose files a later
run there may rewrite. A folder without it keeps its files: a run refuses to start over them."""

RUN_FILES = (
    *("config.yaml", "config.json", "metrics.jsonl", "samples.jsonl", "summary.json"),
    "curves.png",
)
"""The files a run writes in ``out`` besides its checkpoint folders (which guard themselves)."""


def _check_out(out: Path, checkpoint: Checkpointer, *, resume: bool) -> None:
    """Refuse to mix two runs in ``out``, a ``--resume`` with nothing to resume (a run killed
    during its SFT stage resumes from ``checkpoints-sft``), and a folder whose files no run
    left there (`MARK`; a checkpointed run being resumed proves itself); then claim ``out``."""
    latest = checkpoint.latest()
    if latest is None:
        latest = Checkpointer(out / "checkpoints-sft").latest()
    if not resume and latest:
        raise SystemExit(
            f"{out} holds a run already (checkpointed after step {latest}): pass --resume to "
            "continue it, or another out"
        )
    if resume and latest is None:
        raise SystemExit(
            f"--resume: {checkpoint.root} holds no complete checkpoint, nothing to resume (a run "
            "that stopped before its first checkpoint leaves none); run again without --resume "
            "to start it over"
        )
    claimed = (out / MARK).exists() or (resume and latest is not None)
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not claimed:
        raise SystemExit(
            f"{out} holds {', '.join(found)}, which no rlblocks run left there (it has no "
            f"{MARK}), and this run would write over them: choose another out (a new or empty "
            "folder), or move those files away"
        )
    if found and not resume:
        print(f"{out} holds a run that stopped before its first checkpoint: starting it over")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARK).write_text("this folder holds an rlblocks-train run; it may rewrite its files\n")


class SavedConfig:
    """A tracking backend that writes the CLI's resolved ``config.yaml`` when the run starts:
    after the tracker's own checks and the resume checks, so that the file always states the
    configuration in effect."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.text = path, text

    def start(self, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        """Write the file (atomically: a crash leaves the old one or the new one)."""
        write_atomic(self.path, self.text)

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        """Nothing: the metrics go to ``metrics.jsonl`` and the other backends."""

    def log_samples(self, step: int, rows: Sequence[Any]) -> None:
        """Nothing: the samples go to ``samples.jsonl`` and the other backends."""

    def close(self) -> None:
        """Nothing to flush."""


def run_options(config: Namespace, **loop: Any) -> RunOptions:
    """The ``RunOptions`` of ``config`` (``staleness``, ``old_logprobs``, ``correction`` by
    its name in `CORRECTIONS`), no progress bar, with ``loop`` (checkpoint, resume, tracker,
    on_step) added."""
    old_logprobs = config.old_logprobs
    if config.get("correction") is not None:  # a named correction: its pi_old and its block
        chosen = CORRECTIONS[config.correction]
        if old_logprobs == "auto":
            old_logprobs = chosen.old_logprobs
        loop = {"correction": chosen.correction, **loop}
    return RunOptions(progress=False, staleness=config.staleness, old_logprobs=old_logprobs, **loop)


def step_line(step: int, record: Mapping[str, Any]) -> str:
    """One line of a step's record for the console: the signal (the mean reward, the task's
    and the shaped one with ``overlong_shaping``, or the reverse KL to a teacher), the response
    length, the KL term when there is one, and the step's seconds by phase."""
    kl = f"kl {record['kl/token']:.4f}  " if "kl/token" in record else ""
    if "distill/reverse_kl" in record:  # distillation: the KL to the teacher is the signal
        signal = f"reverse KL to the teacher {record['distill/reverse_kl']:.3f}"
    elif "task/mean" in record:  # a shaped reward (overlong_shaping): the task's, then the total
        signal = f"reward {record['task/mean']:.3f} (shaped {record['reward/mean']:.3f})"
    else:
        signal = f"reward {record.get('reward/mean', float('nan')):.3f}"
    times = ", ".join(
        f"{phase} {record.get(f'time/{phase}', 0.0):.{2 if phase == 'sync' else 1}f}"
        for phase in ("rollout", "logprobs", "update", "sync")
    )
    length = record.get("response_length", float("nan"))
    return f"step {step:3d}  {signal}  length {length:.1f}  {kl}{record['step_seconds']:.1f}s ({times})"


def cli() -> None:
    """The ``rlblocks-train`` command (and ``python -m rlblocks.app.train``): :func:`main`, with the
    main job's host-memory setting (``RLBLOCKS_KEEP_FREED_MEMORY=1`` unless set:
    ``rlblocks.trainer.allocator``), ending with status 0 when the run ends. (A console script
    exits with what its function returns: :func:`main`'s list of metrics made it 1.)"""
    os.environ.setdefault(ENV, "1")
    main()


if __name__ == "__main__":
    cli()
