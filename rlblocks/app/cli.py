"""The command line of ``rlblocks-train`` (`rlblocks.app.train`): a recipe from a YAML file,
with command-line overrides::

    python -m rlblocks.app.train examples/grpo_arithmetic.yaml
    python -m rlblocks.app.train examples/grpo_arithmetic.yaml --model.name tiny --steps 2
    python -m rlblocks.app.train runs/grpo/config.yaml --resume      # go on where it stopped

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
import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

from rlblocks.advantage import ESTIMATORS
from rlblocks.app.config_yaml import MODE, DuplicateKeyError, check_unique_keys
from rlblocks.app.job import (
    SFT_TARGETS,
)
from rlblocks.data import DATA
from rlblocks.interfaces import SamplingParams
from rlblocks.losses import AGGREGATIONS, CORRECTIONS, LOSSES, PREFERENCES, SeqMeanTokenSumNorm
from rlblocks.losses.offpolicy import DEFAULT_CORRECTION
from rlblocks.models import resolve_device
from rlblocks.recipes import RECIPES
from rlblocks.rollout import ENGINES, HFEngine
from rlblocks.run.state import LOOP_ARGUMENTS
from rlblocks.trainer import TrainConfig

# The edge of the program: names for a config file. Each registry lives beside its blocks
# (rlblocks.base.registry), which register themselves; this file only reads them.
BUILT = frozenset(
    {
        *("policy", "critic", "engine", "reward_fn", "batches", "sampling", "advantage"),
        *("loss_fn", "preference", "teacher"),
    }
)
"""Recipe arguments built from their own sections, not set as top-level keys."""

SECTIONS = frozenset(
    {"model", "trainer", "critic", "sampling", "engine", "data", "advantage", "loss"}
    | {"preference", "eval"}
)
"""The keys that hold a mapping of their own keys (a null there is refused, not taken)."""

NOT_CONFIGURABLE = LOOP_ARGUMENTS | {"resharder", "kl_controller", "kl_estimator"}
"""Recipe arguments that take objects a YAML value cannot name; the defaults are used."""


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
    "workers": (
        int,
        0,
        "0: everything in this process; N: the policy (FSDP2) and the engine on N Ray workers",
    ),
    "rollout": (
        Literal[tuple(ENGINES)],
        "hf",
        (
            "the rollout engine by name (ENGINES): hf (rlblocks.rollout.HFEngine with the engine section's keywords; "
            "it shares the policy's model in this process) or vllm (VLLMEngine: its own copy of "
            "the weights, synced after every update)"
        ),
    ),
    "teacher": (
        str | None,
        None,
        "recipe distill: the teacher's model folder (its tokenizer must be the student's)",
    ),
    "sft_steps": (
        int,
        0,
        (
            "SFT steps on the training problems' answers before the recipe (0: none); with steps "
            "0 the run is the SFT stage alone"
        ),
    ),
    "sft_target": (
        Literal[SFT_TARGETS],
        "worked",
        (
            "SFT completions: worked, the expression and its value ('42 + 41 = 83', arithmetic "
            "data), or answer, the reference answer alone"
        ),
    ),
    "overlong_shaping": (
        float,
        0.0,
        (
            "factor of DAPO's soft overlong penalty added to the training reward (L_max: "
            "sampling.max_new_tokens, L_cache: half of it; rlblocks.rewards.overlong); 0: none. "
            "The held-out score stays the reward alone; recipe dapo shapes with overlong_factor"
        ),
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


NAMED_RUN_KEYS: dict[str, Mapping[str, Any]] = {"rollout": ENGINES, "correction": CORRECTIONS}
"""Run keys that take a registry's names (RUN_KEYS' type is the import-time list: the parser
reads the registry when it is built)."""


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
    fn = pick(RECIPES, recipe, "recipe")
    params = inspect.signature(fn).parameters
    p = ArgumentParser(prog="rlblocks-train", exit_on_error=False, parser_mode=MODE)
    p.add_argument("--config", action=ActionConfigFile, help="a YAML file (the positional one)")
    p.add_argument("--recipe", type=Literal[tuple(RECIPES)], default=recipe, help="RECIPES")
    for key, (kind, default, help_) in RUN_KEYS.items():
        if key in NAMED_RUN_KEYS:  # the registry's names now, a block registered late included
            choices: Any = Literal[tuple(NAMED_RUN_KEYS[key])]  # built when called
            kind = choices if default is not None else choices | None
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
    p.add_argument(
        "--reward",
        type=str | None,
        default="math_answer",
        help="REWARDS name or mod:fn (null: given in Python, main(reward_fn=))",
    )
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
    fn = pick(registry, name, f"{key}.name")
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


def pick(registry: Mapping[str, Callable[..., Any]], name: str, key: str) -> Callable[..., Any]:
    """``registry[name]``, or the function at ``package.module:function``."""
    if name in registry:
        return registry[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            found: Callable[..., Any] = getattr(__import__(module, fromlist=[attr]), attr)
            return found
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"{key}: cannot import {name!r} ({error}); check the module path and the name"
            ) from error
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
    for key in SECTIONS & {k for k, v in data.items() if v is None}:
        fix = ("leave it out for no held-out scoring, or give its keys" if key == "eval"
               else f"leave it out, or write {key}: {{}}, for its defaults")  # fmt: skip
        message = f"{key}: null; a section is a mapping of its keys: {fix}"
        raise SystemExit(_where(message, key, file, argv))
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
    for key, check in (("sampling", sampling_params), ("trainer", train_config)):
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
    for key, message in _conflicts(config):
        raise SystemExit(_where(message, key, file, argv))
    return config, p, resume


def _conflicts(config: Namespace) -> list[tuple[str, str]]:
    """Settings that cannot run together, as (the key at fault, why): refused at parse time,
    before any model is loaded and before ``out`` is made."""
    steps, staleness, workers = config.steps, config.staleness, config.workers
    tp, sp = config.trainer.tp, config.trainer.sp
    every, correction, old = config.eval_every, config.correction, config.old_logprobs
    chosen = CORRECTIONS[correction].old_logprobs if correction else "auto"
    rules = [  # (broken, key, why); steps: every recipe refuses it too, but after loading
        (steps < 0 or (steps == 0 and not config.sft_steps), "steps", (f"steps: {steps} runs no "
         "step, so nothing would be trained; pass >= 1 (0 only with sft_steps, the SFT stage "
         "alone)")),
        (config.sft_steps < 0, "sft_steps", (f"sft_steps: {config.sft_steps}; pass 0 (none) or "
         "N >= 1")),
        (staleness < 0, "staleness", f"staleness: {staleness}; pass 0 (synchronous) or k >= 1"),
        (correction is not None and not staleness, "correction", (f"correction: {correction} "
         "corrects for stale rollouts; pass staleness k >= 1")),
        ("auto" not in (chosen, old) and chosen != old, "old_logprobs", (f"old_logprobs: {old}, "
         f"but correction {correction} takes pi_old from {chosen}; leave old_logprobs at auto")),
        (every < 0 or (every and "eval" not in config), "eval_every", (f"eval_every: {every} "
         "needs an eval section and N >= 1 (0: off)")),
        (staleness and (workers or config.rollout != "hf"), "staleness", ("staleness k >= 1 "
         "runs with the in-process HF engine (workers 0, rollout hf)")),
        (every and workers, "eval_every", ("eval_every keeps weight copies in this process "
         "(workers 0)")),
        (tp > 1 and (not workers or workers % tp), "trainer.tp", (f"trainer.tp: {tp} splits the "
         f"policy over Ray workers: pass workers, a multiple of {tp} (got {workers})")),
        (sp > 1 and (not workers or workers % sp), "trainer.sp", (f"trainer.sp: {sp} splits each "
         f"micro-batch over Ray workers: pass workers, a multiple of {sp} (got {workers})")),
        (config.rollout != "hf" and workers, "rollout", (f"rollout: {config.rollout} runs in "
         "this process; it does not combine with workers")),
        (config.overlong_shaping < 0, "overlong_shaping", (f"overlong_shaping: "
         f"{config.overlong_shaping}; pass a factor >= 0 (0: none)")),
        (config.overlong_shaping and config.recipe == "dapo", "overlong_shaping", ("recipe dapo "
         "shapes its reward itself: set overlong_factor instead")),
        ((config.recipe == "distill") != (config.teacher is not None), "teacher", ("recipe "
         "distill takes a teacher (a model folder), and a teacher takes recipe distill")),
    ]  # fmt: skip
    return [(key, why) for broken, key, why in rules if broken]


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


def sampling_params(section: Namespace) -> SamplingParams:
    """The ``sampling`` section as `SamplingParams` (its checks run)."""
    return SamplingParams(**vars(section))


def train_config(section: Namespace, *, budget: int | None = None) -> TrainConfig:
    """A ``trainer`` / ``critic`` section as `TrainConfig`, ``aggregation`` by its name.
    ``budget``: the run's ``sampling.max_new_tokens``, Dr. GRPO's constant C of
    ``seq-mean-token-sum-norm`` (a name cannot carry it; without it C would be each
    micro-batch's padded width, which changes from one micro-batch to the next)."""
    aggregation = AGGREGATIONS[section.aggregation]
    if isinstance(aggregation, SeqMeanTokenSumNorm) and aggregation.max_tokens is None:
        aggregation = dataclasses.replace(aggregation, max_tokens=budget)
    return TrainConfig(**section_kwargs(section) | {"aggregation": aggregation})


def section_kwargs(section: Namespace) -> dict[str, Any]:
    """A section's values as keyword arguments (without its ``name``)."""
    return {k: v for k, v in vars(section).items() if k != "name"}


def bound(
    registry: Mapping[str, Callable[..., Any]], section: Namespace, key: str
) -> Callable[..., Any]:
    """The function ``section.name`` names, with the section's keyword arguments bound."""
    fn = pick(registry, section.name, f"{key}.name")
    return partial(fn.func if isinstance(fn, partial) else fn, **section_kwargs(section))


def dump(config: Namespace, p: ArgumentParser) -> str:
    """The resolved configuration as YAML: every key, defaults included."""
    text: str = p.dump(config, skip_unset=False)  # an untyped decorator makes dump Any
    return text
