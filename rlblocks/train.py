"""Run a recipe from a YAML file, with command-line overrides::

    python -m rlblocks.train examples/grpo_arithmetic.yaml
    python -m rlblocks.train examples/grpo_arithmetic.yaml --model.name tiny --steps 2
    python -m rlblocks.train runs/grpo/config.yaml --resume      # go on where it stopped

The file's sections are the arguments that exist already, not a new schema (docs/configs.md):
``recipe`` names a recipe (`RECIPES`) and every other top-level key is one of that recipe's own
keyword arguments (``steps``, ``group_size``, DAPO's ``max_rounds`` ...) or one of the run's
(``prompts_per_step``, ``seed``, ``out``, ``tracking``, ``checkpoint_every``, ``kl_coef``);
``trainer`` and ``critic`` are `rlblocks.trainer.TrainConfig`'s fields, ``sampling``
`rlblocks.interfaces.SamplingParams`'s, ``engine`` `rlblocks.rollout.HFEngine`'s, and
``data``, ``advantage`` and ``loss`` are a ``name`` from a registry (or ``package.module:fn``)
plus that function's keyword arguments, bound with ``functools.partial``. ``eval`` (optional)
is a second ``data``-like section, the held-out problems: each is answered greedily before
and after training, and ``<out>/summary.json`` holds the scores (`HeldOut`); the main job
(``examples/grpo_arithmetic.yaml``) is such a run. The resolved
configuration is written to ``<out>/config.yaml`` when the run starts; a run relaunched from it
is the same run. A resume with overrides (``--trainer.lr 1e-6 --resume``) trains with them from
its first step and rewrites the file, which always states what is in effect (`main`).

The library is jsonargparse (the parser of LightningCLI), chosen over OmegaConf and over plain
PyYAML with hand-written checks because it builds the parser *from the dataclasses and function
signatures themselves*: every key is checked against the type hint of the field or argument
it fills (``steps: three`` -> 'Parser key "steps": Expected a <class 'int'>'), unknown keys
are refused by name, ``--trainer.lr 1e-5`` overrides any nested key, and a new keyword argument
of a loss or estimator is configurable without touching this file. OmegaConf merges YAML and
dotted overrides well but checks types only against its own structured configs (no Literal,
no tuples of floats, no function signatures), and plain PyYAML would mean writing that checker
here. Its one runtime requirement is PyYAML. jsonargparse does not report the line of a bad
key; `_where` adds it from PyYAML's node marks.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

from rlblocks import recipes
from rlblocks.advantage import ESTIMATORS
from rlblocks.checkpoint import Checkpointer
from rlblocks.checkpoint.lock import FolderInUseError
from rlblocks.config_yaml import MODE, DuplicateKeyError, check_unique_keys
from rlblocks.critic import CriticTrainer
from rlblocks.data import PromptBatches, PromptDataset, arithmetic_prompts, gsm8k, load_prompts
from rlblocks.interfaces import RewardFn, SamplingParams
from rlblocks.losses import (
    AGGREGATIONS,
    MaskedIS,
    TruncatedIS,
    cispo,
    clip_cov,
    clipped_surrogate,
    dpo,
    gpg_loss,
    gspo,
    ipo,
    kl_cov,
    kl_regularized,
    simpo,
    uses_reference,
)
from rlblocks.losses.offpolicy import ASYNC_DEFAULT
from rlblocks.models import resolve_device
from rlblocks.recipes import evaluate
from rlblocks.rewards import REWARDS
from rlblocks.rollout import HFEngine
from rlblocks.run import RunOptions
from rlblocks.run.state import LOOP_ARGUMENTS
from rlblocks.runlog import write_atomic
from rlblocks.tracking import Tracker
from rlblocks.trainer import PolicyTrainer, TrainConfig
from rlblocks.trainer.allocator import ENV

# The edge of the program: names for a config file. Everything else takes the functions.
RECIPES: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "grpo": recipes.grpo,
    "dapo": recipes.dapo,
    "remax": recipes.remax,
    "ppo": recipes.ppo,
    "online_dpo": recipes.online_dpo,
}
"""Name -> recipe function for ``recipe:``."""

DATA: dict[str, Callable[..., Any]] = {
    "arithmetic": arithmetic_prompts,
    "file": load_prompts,  # source: a .jsonl / .json / .csv / .parquet file
    "gsm8k": gsm8k,
}
"""Name -> prompt-dataset builder for ``data.name``; the other keys are its arguments."""

LOSSES: dict[str, Callable[..., Any]] = {
    "clipped_surrogate": clipped_surrogate,
    "gspo": gspo,
    "cispo": cispo,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "gpg": gpg_loss,
}
"""Name -> policy loss for ``loss.name``; the other keys are its keyword arguments."""

PREFERENCES: dict[str, Callable[..., Any]] = {"dpo": dpo, "ipo": ipo, "simpo": simpo}
"""Name -> pair loss for ``preference.name`` (online DPO); the other keys are its keywords."""

BUILT = frozenset(
    {
        *("policy", "critic", "engine", "reward_fn", "batches", "sampling", "advantage"),
        *("loss_fn", "preference"),
    }
)
"""Recipe arguments built from their own sections, not set as top-level keys."""

NOT_CONFIGURABLE = LOOP_ARGUMENTS | {"resharder", "kl_controller", "kl_estimator"}
"""Recipe arguments that take objects a YAML value cannot name; the defaults are used."""


class Correction(NamedTuple):
    """A ``correction`` by name: what it does, and the `RunOptions` that do it."""

    does: str
    old_logprobs: Literal["auto", "recompute", "rollout"]
    correction: Any


#: ``correction``: the blocks of `rlblocks.losses.offpolicy`, applied by the recipe
#: (`RunOptions.correction`). Each needs π_old recomputed by the trainer (its ratio is π_old
#: against the engine's log-probs), except ``rollout``, where π_old *is* the engine's and the
#: PPO clip alone bounds the ratio to the sampling weights.
CORRECTIONS = {
    "rollout": Correction("pi_old = the engine's log-probs, clipped by PPO", "rollout", None),
    "none": Correction("pi_old recomputed, no importance weight", "recompute", None),
    "tis": Correction(
        "pi_old recomputed, tokens weighted by min(pi_old / pi_rollout, 2)",
        "auto",
        partial(TruncatedIS, cap=2.0),
    ),
    "icepop": Correction(
        "pi_old recomputed, tokens with pi_old / pi_rollout outside [1/2, 2] masked",
        "auto",
        ASYNC_DEFAULT,
    ),
    "seq-mask": Correction(
        "pi_old recomputed, responses with a geometric-mean ratio outside [1/2, 2] masked",
        "auto",
        partial(MaskedIS, low=0.5, high=2.0, level="geometric"),
    ),
}
#: The correction a k-steps-off run gets when none is named: RunOptions' own default.
DEFAULT_CORRECTION = "icepop"

RUN_KEYS = {
    "out": (str, "runs/train", "the run's folder: config.yaml, metrics.jsonl, checkpoints/"),
    "seed": (int, 0, "torch.manual_seed before the model is built; the prompt shuffling seed"),
    "prompts_per_step": (int, 8, "prompts per step (PromptBatches)"),
    "checkpoint_every": (int, 1, "steps between checkpoints (the newest is kept)"),
    "tracking": (list[str], ["none"], "Tracker report_to: tensorboard, wandb, mlflow, trackio"),
    "staleness": (int, 0, "RunOptions.staleness: k >= 1 samples k steps off (docs/run.md)"),
    "old_logprobs": (
        Literal["auto", "recompute", "rollout"],
        "auto",
        "RunOptions.old_logprobs: where pi_old comes from (docs/run.md)",
    ),
    "correction": (
        Literal[tuple(CORRECTIONS)] | None,
        None,
        "with staleness >= 1, the off-policy correction by name (CORRECTIONS; None: "
        f"RunOptions' default, {DEFAULT_CORRECTION}): "
        + "; ".join(f"{k}: {c.does}" for k, c in CORRECTIONS.items()),
    ),
    "eval_every": (
        int,
        0,
        (
            "with an eval section, N >= 1: also score the held-out problems on the weights after "
            "every N steps (copies kept in memory, scored after training): summary.json's curve"
        ),
    ),
}


@dataclasses.dataclass
class Model:
    """The ``model:`` section: what `PolicyTrainer.from_pretrained` loads."""

    name: str = "smollm2-135m"
    """A built-in name (``rlblocks.models``) or a model folder."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The weights' dtype."""
    device: str | None = None
    """Where the policy and the engine run; None: cuda when torch sees a GPU, else cpu (a device
    torch does not see is refused before the model is loaded)."""
    lora: dict[str, Any] | None = None
    """Keyword arguments of ``peft.LoraConfig`` (only the adapters train); None: all weights."""


def parser(recipe: str, names: Mapping[str, str] | None = None) -> ArgumentParser:
    """The parser of a run of ``recipe``, with the ``data``/``advantage``/``loss`` sections for
    the builders named in ``names`` (default: the registry defaults)."""
    names = dict(names or {})
    fn = _pick(RECIPES, recipe, "recipe")
    params = inspect.signature(fn).parameters
    p = ArgumentParser(prog="rlblocks-train", exit_on_error=False, parser_mode=MODE)
    p.add_argument("--config", action=ActionConfigFile, help="a YAML file (the positional one)")
    p.add_argument("--recipe", type=Literal[tuple(RECIPES)], default=recipe, help="RECIPES")
    for key, (kind, default, help_) in RUN_KEYS.items():
        p.add_argument(f"--{key}", type=kind, default=default, help=help_)
    if (
        "loss_fn" in params and "kl_coef" not in params
    ):  # GRPO family: β of kl_regularized around the loss (0: no KL term)
        p.add_argument("--kl_coef", type=float, default=0.0, help="β of a k3 KL loss term")
    own = {k for k, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
    skip = set(params) - own | BUILT | NOT_CONFIGURABLE
    p.add_function_arguments(fn, None, skip=skip)  # type: ignore[arg-type]  # jsonargparse: set[str | int]
    p.add_class_arguments(Model, "model")
    _add_train_config(p, "trainer")
    if "critic" in params:
        _add_train_config(p, "critic")
    p.add_class_arguments(SamplingParams, "sampling")
    default_sampling = params["sampling"].default  # the recipe's default, not SamplingParams'
    p.set_defaults({f"sampling.{k}": v for k, v in dataclasses.asdict(default_sampling).items()})
    p.add_class_arguments(HFEngine, "engine", skip={"model", "tokenizer", "sampling"})
    p.set_defaults({"engine.progress": False})
    p.add_argument("--reward", type=str, default="math_answer", help="REWARDS name or mod:fn")
    _add_block(p, "data", DATA, names.get("data", "arithmetic"))
    if "advantage" in params:
        _add_block(p, "advantage", ESTIMATORS, names.get("advantage", "grpo"))
    if "loss_fn" in params:
        _add_block(p, "loss", LOSSES, names.get("loss", "clipped_surrogate"))
    if "preference" in params:
        _add_block(p, "preference", PREFERENCES, names.get("preference", "dpo"))
    if "eval" in names:  # the held-out problems: a data builder and its arguments
        _add_block(p, "eval", DATA, names["eval"])
    return p


def _add_train_config(p: ArgumentParser, key: str) -> None:
    """TrainConfig's fields under ``key``; ``aggregation`` by its `AGGREGATIONS` name.
    ``schedule`` and ``fsdp`` take objects: the defaults are used."""
    p.add_class_arguments(TrainConfig, key, skip={"aggregation", "schedule", "fsdp"})
    p.add_argument(f"--{key}.aggregation", type=Literal[tuple(AGGREGATIONS)], default="token-mean")


def _add_block(
    p: ArgumentParser, key: str, registry: Mapping[str, Callable[..., Any]], name: str
) -> None:
    """``key.name`` and the keyword arguments of the function it names (not its tensors)."""
    fn = _pick(registry, name, f"{key}.name")
    base = fn.func if isinstance(fn, partial) else fn
    skip = {
        k
        for k, v in inspect.signature(base).parameters.items()
        if v.kind is inspect.Parameter.POSITIONAL_ONLY or "Tensor" in str(v.annotation)
    }
    skip |= {"tokenizer"}  # data: the policy's, given when max_prompt_tokens is set
    p.add_argument(f"--{key}.name", type=str, default=name, help=f"{key}: a name or mod:fn")
    p.add_function_arguments(base, key, skip=skip)  # type: ignore[arg-type]  # jsonargparse: set[str | int]
    if isinstance(fn, partial):  # a registry variant (dr_grpo): its keywords are the defaults
        p.set_defaults({f"{key}.{k}": v for k, v in fn.keywords.items()})


def _pick(registry: Mapping[str, Callable[..., Any]], name: str, key: str) -> Callable[..., Any]:
    """``registry[name]``, or the function at ``package.module:function``."""
    if name in registry:
        return registry[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            found: Callable[..., Any] = getattr(__import__(module, fromlist=[attr]), attr)
            return found
        except (ImportError, AttributeError) as error:
            raise ValueError(f"{key}: cannot import {name!r} ({error})") from error
    raise ValueError(f"{key}: unknown name {name!r}; one of {sorted(registry)} or mod:function")


def parse(argv: Sequence[str]) -> tuple[Namespace, ArgumentParser, bool]:
    """``[CONFIG.yaml] [--key.sub value ...] [--resume]`` -> (config, its parser, resume).

    Errors are ``SystemExit`` messages naming the key and where it was given: the file and
    its line, or the command line."""
    argv = list(argv)
    resume = "--resume" in argv
    argv = [a for a in argv if a != "--resume"]
    file = Path(argv.pop(0)) if argv and not argv[0].startswith("-") else None
    data = _read(file) if file else {}
    sections = ("recipe", "data", "advantage", "loss", "preference", "eval")
    peeked = {k: _peek(argv, data, k) for k in sections}
    names = {k: v for k, v in peeked.items() if v is not None}
    if "eval" in data or any(a.startswith("--eval.") for a in argv):  # named or not
        names.setdefault("eval", names.get("data", "arithmetic"))  # the data's builder
    try:
        p = parser(names.pop("recipe", "grpo"), names)
        config = p.parse_args([*(["--config", str(file)] if file else []), *argv])
    except (ValueError, TypeError, argparse.ArgumentError) as error:
        raise SystemExit(_where(str(error), _key_of(str(error)), file, argv)) from error
    for key, check in (("sampling", _sampling), ("trainer", _train_config)):
        try:  # the dataclasses' own checks (__post_init__), named by section
            check(config[key])
        except (ValueError, TypeError) as error:
            field = re.search(r"\.(\w+)", str(error))
            path = f"{key}.{field[1]}" if field else key
            raise SystemExit(_where(f"{key}: {error}", path, file, argv)) from error
    try:  # a device asked for and absent: refused before the model is loaded
        resolve_device(config.model.device, owner="model.device")
    except (ValueError, RuntimeError) as error:
        raise SystemExit(_where(str(error), "model.device", file, argv)) from error
    if config.steps < 1:  # every recipe refuses it too, but only after the model is loaded
        message = f"steps: {config.steps} runs no step, so nothing would be trained; pass >= 1"
        raise SystemExit(_where(message, "steps", file, argv))
    if config.correction is not None and not config.staleness:
        message = (
            f"correction: {config.correction} corrects for stale rollouts; pass staleness k >= 1"
        )
        raise SystemExit(_where(message, "correction", file, argv))
    chosen = CORRECTIONS[config.correction].old_logprobs if config.correction else "auto"
    if "auto" not in (chosen, config.old_logprobs) and chosen != config.old_logprobs:
        message = (
            f"old_logprobs: {config.old_logprobs}, but correction {config.correction} takes "
            f"pi_old from {chosen}; leave old_logprobs at auto"
        )
        raise SystemExit(_where(message, "old_logprobs", file, argv))
    if config.eval_every < 0 or (config.eval_every and "eval" not in config):
        message = f"eval_every: {config.eval_every} needs an eval section and N >= 1 (0: off)"
        raise SystemExit(_where(message, "eval_every", file, argv))
    return config, p, resume


def _read(file: Path) -> dict[str, Any]:
    try:
        text = file.read_text()
        check_unique_keys(text)
        data = yaml.safe_load(text)
    except DuplicateKeyError as error:
        raise SystemExit(f"{file}, line {error.line}: {error}") from error
    except (OSError, yaml.YAMLError) as error:
        raise SystemExit(f"{file}: {error}") from error
    if not isinstance(data, dict):
        raise SystemExit(f"{file}: the file must hold a mapping of keys (recipe: grpo, ...)")
    return data


def _peek(argv: list[str], data: Mapping[str, Any], key: str) -> str | None:
    """The name chosen for ``key`` (recipe) or ``key.name``: on the command line, else in the
    file. Needed before parsing: it decides which arguments the parser has."""
    flag = "--recipe" if key == "recipe" else f"--{key}.name"
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    value = data.get(key)
    return value.get("name") if isinstance(value, dict) else value


def _key_of(message: str) -> str | None:
    """The dotted key a jsonargparse message is about: 'Parser key "trainer.lr"', "Group
    'data' does not accept option 'bogus'", "Option 'stepz' is not accepted"."""
    if message.startswith("unrecognized arguments"):
        flag = re.search(r"--([\w.]+)", message)
        return flag[1] if flag else None
    quoted = re.findall(r"""['"]([\w.]+)['"]""", message)
    if message.startswith("Group") and len(quoted) >= 2:
        return f"{quoted[0]}.{quoted[1]}"
    return quoted[0] if quoted else None


def _where(message: str, key: str | None, file: Path | None, argv: list[str]) -> str:
    """``message`` prefixed with where ``key`` was given: ``command line:`` when an override
    names it, else ``file, line N:`` (PyYAML's mark of the key), else ``file:``."""
    if key is not None and any(a.split("=")[0] == f"--{key}" for a in argv):
        return f"command line: {message}"
    if file is None:
        return message
    node: Any = yaml.compose(file.read_text())
    line = None
    for part in (key or "").split("."):
        if not isinstance(node, yaml.MappingNode):
            break
        found = [(k, v) for k, v in node.value if getattr(k, "value", None) == part]
        if not found:
            break
        line, node = found[0][0].start_mark.line + 1, found[0][1]
    return f"{file}, line {line}: {message}" if line else f"{file}: {message}"


def build(config: Namespace) -> tuple[Callable[..., list[dict[str, Any]]], dict[str, Any]]:
    """The recipe and the arguments ``config`` stands for, blocks built (the model loaded):
    ``fn(**arguments, run=run_options(config))`` is the run (add a checkpoint and a tracker to
    those options to save and log it)."""
    fn = RECIPES[config.recipe]
    params = inspect.signature(fn).parameters
    torch.manual_seed(config.seed)
    model = config.model
    device = resolve_device(model.device, owner="model.device")
    kl_coef = config.get("kl_coef", 0.0)  # PPO's own, or β of a KL loss term (GRPO family)
    lora = None
    if model.lora is not None:
        from peft import LoraConfig

        lora = LoraConfig(**model.lora)
    preference = (
        _bound(PREFERENCES, config.preference, "preference") if "preference" in params else None
    )
    # A reference only for a KL term or a pair loss against one: else nothing is kept or scored.
    anchored = preference is not None and uses_reference(preference)
    policy = PolicyTrainer.from_pretrained(
        model.name,
        dtype=getattr(torch, model.dtype),
        device=device,
        config=_train_config(config.trainer),
        reference="auto" if kl_coef or "critic" in params or anchored else None,
        lora=lora,
    )
    # The engine shares the trainer's model; one step off it samples with its own copy.
    engine_model = copy.deepcopy(policy.model) if config.staleness else policy.model
    engine = HFEngine(engine_model, policy.tokenizer, **vars(config.engine))
    data_kwargs = _kwargs(config.data)
    if data_kwargs.get("max_prompt_tokens") is not None:
        data_kwargs["tokenizer"] = policy.tokenizer
    dataset = _pick(DATA, config.data.name, "data.name")(**data_kwargs)
    arguments: dict[str, Any] = {
        "policy": policy,
        "engine": engine,
        "reward_fn": _pick(REWARDS, config.reward, "reward"),
        "batches": PromptBatches(
            dataset, prompts_per_step=config.prompts_per_step, seed=config.seed
        ),
        "sampling": _sampling(config.sampling),
    }
    if "critic" in params:
        arguments["critic"] = CriticTrainer.from_pretrained(
            model.name,
            dtype=getattr(torch, model.dtype),
            device=device,
            config=_train_config(config.critic),
        )
    if "advantage" in params:
        arguments["advantage"] = _bound(ESTIMATORS, config.advantage, "advantage")
    if preference is not None:
        arguments["preference"] = preference
    if "loss_fn" in params:
        loss = _bound(LOSSES, config.loss, "loss")
        wrap = kl_coef and "kl_coef" not in params  # PPO applies its own kl_coef
        arguments["loss_fn"] = kl_regularized(loss, kl_coef=kl_coef) if wrap else loss
    own = set(params) - BUILT - NOT_CONFIGURABLE
    arguments |= {k: config[k] for k in own if k in config}
    return fn, arguments


def _sampling(section: Namespace) -> SamplingParams:
    return SamplingParams(**vars(section))


def _train_config(section: Namespace) -> TrainConfig:
    fields = _kwargs(section) | {"aggregation": AGGREGATIONS[section.aggregation]}
    return TrainConfig(**fields)


def _kwargs(section: Namespace) -> dict[str, Any]:
    """A section's values as keyword arguments (without its ``name``)."""
    return {k: v for k, v in vars(section).items() if k != "name"}


def _bound(
    registry: Mapping[str, Callable[..., Any]], section: Namespace, key: str
) -> Callable[..., Any]:
    """The function ``section.name`` names, with the section's keyword arguments bound."""
    fn = _pick(registry, section.name, f"{key}.name")
    return partial(fn.func if isinstance(fn, partial) else fn, **_kwargs(section))


def dump(config: Namespace, p: ArgumentParser) -> str:
    """The resolved configuration as YAML: every key, defaults included."""
    text: str = p.dump(config, skip_unset=False)  # an untyped decorator makes dump Any
    return text


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """``rlblocks-train CONFIG.yaml [--key.sub value ...] [--resume]``: parse, run, with
    ``<out>/config.yaml`` written when the run starts; returns the recipe's metrics, one dict
    per step.

    The run holds ``<out>/checkpoints``' lock from the start (a second run on ``out`` fails at
    once). ``out`` with a checkpoint of a step needs ``--resume``; ``--resume`` needs one. A run
    that stopped before its first checkpoint is started over without ``--resume`` (its records
    are dropped). ``config.yaml`` is written once the checkpoint is loaded and the resume
    checks passed (`rlblocks.run.resume`): it states the settings in effect, the overrides of a
    resume included, and a refused resume leaves the old file."""
    config, p, resume = parse(sys.argv[1:] if argv is None else argv)
    out = Path(config.out)
    checkpoint = Checkpointer(out / "checkpoints", every=config.checkpoint_every, keep_last=1)
    try:
        with checkpoint.lock.holding():
            _check_out(out, checkpoint, resume=resume)
            fn, arguments = build(config)
            held_out = HeldOut.of(config, arguments) if "eval" in config else None
            saved = SavedConfig(out / "config.yaml", dump(config, p))
            policy = arguments["policy"]

            def on_step(step: int, record: dict[str, Any], rollouts: Any) -> None:
                print(step_line(step, record), flush=True)
                if held_out is not None:
                    held_out.snapshot(step, policy, config.steps)

            with Tracker(out, report_to=[*config.tracking, saved]) as tracker:
                run = run_options(
                    config, checkpoint=checkpoint, resume=resume, tracker=tracker, on_step=on_step
                )
                if held_out is None:
                    return fn(**arguments, run=run)
                held_out.before(out / "summary.json", resume=resume)
                start = time.perf_counter()
                history = fn(**arguments, run=run)
                summary = out / "summary.json"
                held_out.after(summary, steps=config.steps, start=start, policy=policy)
                return history
    except FolderInUseError as error:
        raise SystemExit(str(error)) from error


def _check_out(out: Path, checkpoint: Checkpointer, *, resume: bool) -> None:
    """Refuse to mix two runs in ``out``, and a ``--resume`` with nothing to resume."""
    latest = checkpoint.latest()
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
    if not resume and ((out / "config.yaml").exists() or (out / "metrics.jsonl").exists()):
        print(f"{out} holds a run that stopped before its first checkpoint: starting it over")


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

    @classmethod
    def of(cls, config: Namespace, arguments: Mapping[str, Any]) -> HeldOut:
        """The held-out set of ``config.eval``, scored with the run's engine and reward."""
        kwargs = _kwargs(config.eval)
        if kwargs.get("max_prompt_tokens") is not None:
            kwargs["tokenizer"] = arguments["policy"].tokenizer
        problems = _pick(DATA, config.eval.name, "eval.name")(**kwargs)
        if not len(problems):
            raise SystemExit("eval: the held-out set is empty; pass eval.n >= 1 (or a source)")
        training = {_key(p) for p in arguments["batches"].dataset.prompts}
        return cls(
            problems,
            arguments["engine"],
            _pick(REWARDS, config.reward, "reward"),
            config.sampling.max_new_tokens,
            in_training=sum(_key(p) in training for p in problems.prompts),
            every=config.eval_every,
            engine_kwargs=vars(config.engine),
        )

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

    def score(self, when: str, engine: Any = None) -> dict[str, float | None]:
        """`held_out_score` with this run's engine (or ``engine``), reward and budget."""
        return held_out_score(
            engine or self.engine,
            self.problems,
            self.reward,
            max_new_tokens=self.max_new_tokens,
            when=when,
        )


def _key(prompt: Any) -> str:
    """A prompt (text or chat messages) as a comparable string."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


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
    """One line of a step's record for the console: the signal (the mean reward, or the
    reverse KL to a teacher), the response length, the KL term when there is one, and the
    step's seconds by phase."""
    kl = f"kl {record['kl/token']:.4f}  " if "kl/token" in record else ""
    if "distill/reverse_kl" in record:  # distillation: the KL to the teacher is the signal
        signal = f"reverse KL to the teacher {record['distill/reverse_kl']:.3f}"
    else:
        signal = f"reward {record.get('reward/mean', float('nan')):.3f}"
    times = ", ".join(
        f"{phase} {record.get(f'time/{phase}', 0.0):.{2 if phase == 'sync' else 1}f}"
        for phase in ("rollout", "logprobs", "update", "sync")
    )
    length = record.get("response_length", float("nan"))
    return f"step {step:3d}  {signal}  length {length:.1f}  {kl}{record['step_seconds']:.1f}s ({times})"


def cli() -> None:
    """The ``rlblocks-train`` command (and ``python -m rlblocks.train``): :func:`main`, with the
    main job's host-memory setting (``RLBLOCKS_KEEP_FREED_MEMORY=1`` unless set:
    ``rlblocks.trainer.allocator``), ending with status 0 when the run ends. (A console script
    exits with what its function returns: :func:`main`'s list of metrics made it 1.)"""
    os.environ.setdefault(ENV, "1")
    main()


if __name__ == "__main__":
    cli()
