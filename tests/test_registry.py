"""``rlblocks.base.registry``: blocks carry their own names. A loss, an engine and a recipe defined
and registered in a module of their own (as docs/contributing.md says) are found by the
command line and sized by the planner, with no list edited anywhere; a name registered twice
is refused with both places; an unknown one lists the known names. Registries are
process-global, so every registration here is undone by ``restored``."""

import importlib
import sys
import textwrap

import pytest
import torch

import rlblocks as rb
from rlblocks.app import train
from rlblocks.app.job import memory_plan
from rlblocks.base.registry import Registry, restored
from rlblocks.losses import LOSSES
from rlblocks.recipes import RECIPES
from rlblocks.rollout import ENGINES

# A plugin module: each block registered beside its definition, the documented way.
PLUGIN = '''
from typing import Any

import torch

from rlblocks import interfaces
from rlblocks.interfaces import EngineMemory
from rlblocks.losses import LOSSES, clipped_surrogate
from rlblocks.recipes import RECIPES
from rlblocks.recipes.defaults import DEFAULT_SAMPLING
from rlblocks.rollout import ENGINES


@LOSSES.register("dummy_loss")
def dummy_loss(logprobs, old_logprobs, advantages, mask, /, *, scale: float = 1.0):
    """The clipped surrogate, scaled."""
    loss, metrics = clipped_surrogate(logprobs, old_logprobs, advantages, mask)
    return scale * loss, metrics


@ENGINES.register("dummy_engine")
class DummyEngine:
    """An engine of its own weights in a pool of the device (the planner reads only this)."""

    @classmethod
    def memory_model(cls) -> EngineMemory:
        return EngineMemory("dummy", kv_cache="pool", own_weights=True)


@RECIPES.register("dummy_recipe")
def dummy_recipe(
    policy, engine, reward_fn, batches, *,
    steps: int,
    loss_fn: interfaces.PolicyLoss = clipped_surrogate,
    group_size: int = 2,
    sampling: interfaces.SamplingParams = DEFAULT_SAMPLING,
    run: Any = None,
) -> list[dict[str, Any]]:
    """A recipe's signature: the parser is built from it."""
    return []
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plugin module imported (its blocks registered), and undone afterwards."""
    (tmp_path / "rlblocks_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    with restored(LOSSES, ENGINES, RECIPES):
        yield importlib.import_module("rlblocks_plugin")
        sys.modules.pop("rlblocks_plugin")


def test_a_new_loss_engine_and_recipe_are_found_by_the_cli_and_sized_by_the_planner(plugin):
    argv = ["--recipe", "dummy_recipe", "--steps", "1", "--model.name", "tiny",
            "--model.device", "cpu", "--loss.name", "dummy_loss", "--loss.scale", "2.0",
            "--rollout", "dummy_engine"]  # fmt: skip
    config, _, _ = train.parse(argv)
    assert (config.recipe, config.rollout, config.loss.scale) == ("dummy_recipe", "dummy_engine", 2)
    loss = train.bound(LOSSES, config.loss, "loss")
    assert loss.func is plugin.dummy_loss and loss.keywords == {"scale": 2.0}
    assert RECIPES[config.recipe] is plugin.dummy_recipe

    # The planner asks the engine for its memory model: its own copy of the weights, and a
    # pool of gpu_memory_utilization of the device (no class name tested anywhere).
    gib = 2**30
    p = rb.plan("tiny", dtype="fp32", engine=ENGINES["dummy_engine"], device_memory=gib)
    weights = p.trainer["weights"]  # fp32, one rank: the whole model
    assert p.engine == {"engine copy": weights, "kv cache": gib // 2 - weights}
    assert "dummy engine" in p.headline()
    # The run's printed plan reaches it by the name the config gave.
    text = memory_plan("tiny", dtype=torch.float32, micro_batch_size=None, max_new_tokens=4,
                       rollout_rows=2, reference=False, workers=0, tp=1,
                       engine=config.rollout, engine_copy=False)  # fmt: skip
    assert "dummy engine" in text


def test_the_registrations_are_undone_after_the_test():
    assert {"dummy_loss", "dummy_engine", "dummy_recipe"}.isdisjoint({*LOSSES, *ENGINES, *RECIPES})


def test_a_name_registered_twice_names_both_places(plugin):
    with pytest.raises(ValueError, match=r"'dummy_loss' \(loss.name\) is registered twice, at "
                       r"rlblocks_plugin:\d+ and at \S*test_registry:\d+"):  # fmt: skip
        LOSSES.register("dummy_loss", plugin.dummy_loss)


def test_an_unknown_name_lists_the_known_ones_and_the_key_that_asked():
    registry: Registry[int] = Registry("colour", key="paint.name")
    registry.register("red", 1)

    @registry.register()
    def blue() -> None: ...

    assert list(registry) == ["red", "blue"] and registry["blue"] is blue
    for value in (5, 6):  # the same line again (a notebook cell run twice): replaced
        registry.register("cell", value)
    assert registry.unregister("cell") == 6
    with pytest.raises(
        KeyError, match=r"paint.name: unknown colour 'green'; one of \['blue', 'red'\]"
    ):
        registry["green"]
    with restored(registry):
        registry.register("green", 3)
        assert registry.unregister("green") == 3
        registry.register("green", 4)
    assert "green" not in registry and "green" not in registry.where
    with pytest.raises(SystemExit, match=r"loss.name: unknown name 'nope'; one of \["):
        train.parse(["--loss.name", "nope"])
