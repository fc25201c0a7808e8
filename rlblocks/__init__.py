"""rlblocks: notebook-first building blocks for RL of large language models.

    import rlblocks as rb
    adv, ret = rb.advantage.grpo(rewards, ro.response_mask, ro.group_ids)
    loss, metrics = rb.losses.clipped_surrogate(logp, old_logp, adv, mask, clip=(0.2, 0.28))

Subpackages: ``advantage`` (estimators), ``losses`` (per-token losses and ``aggregate``),
``rewards`` (rule-based rewards), ``placement`` (where blocks run), ``models`` (loading, the
tiny and built-in models), ``rollout`` (engines), ``trainer`` (``PolicyTrainer``), ``critic`` (value model), ``resharder``,
``data`` (prompt datasets, the built-in arithmetic task), ``envs`` (multi-turn environments,
tools and the agent rollout), ``recipes`` (GRPO...), ``run`` (how a run is driven:
``Run`` under your loop, ``RunOptions``, where rollouts and π_old come from), ``checkpoint``
(whole-run checkpoints and resume), ``tracking`` (the ``Tracker``: metrics JSONL, with
``tracking.runlog``, plus TensorBoard, W&B, MLflow, trackio), ``notebook`` (the live ``Dashboard``),
``planner`` (``rb.plan``: the memory a run needs per device, before it loads anything);
``rb.plot`` draws a run's curves. ``interfaces`` holds the block contracts, ``Rollouts`` the
batch type; ``base`` the helpers under them, ``isolation`` the worker processes rewards and
tools run in, ``app`` the command line and the main job (``python -m rlblocks``).

The subpackages that pull in transformers or datasets are imported on first use, so that
``import rlblocks`` stays fast.
"""

import importlib
from typing import Any

from rlblocks import advantage, interfaces, losses, placement, rewards
from rlblocks.interfaces import Advantages, RewardOutput, SamplingParams
from rlblocks.rollouts import Rollouts

__version__ = "0.1.0"

__all__ = [
    "Advantages",
    "RewardOutput",
    "Rollouts",
    "SamplingParams",
    "advantage",
    "app",
    "base",
    "checkpoint",
    "critic",
    "data",
    "envs",
    "interfaces",
    "isolation",
    "losses",
    "models",
    "notebook",
    "placement",
    "plan",
    "planner",
    "plot",
    "recipes",
    "resharder",
    "rewards",
    "rollout",
    "run",
    "tracking",
    "trainer",
]

#: The parts imported on first use (they pull in transformers or datasets): every name of
#: ``__all__`` not defined above, but the two functions.
_LAZY = tuple(n for n in __all__ if n not in globals() and n not in ("plan", "plot"))


def __getattr__(name: str) -> Any:
    if name == "plan":  # rb.plan(model, ...): the memory a run needs per device, by part
        from rlblocks.planner import plan

        return plan
    if name == "plot":  # rb.plot(metrics_jsonl, "curves.png"): the dashboard's curves, as a PNG
        from rlblocks.notebook import plot

        return plot
    if name in _LAZY:
        module = importlib.import_module(f"rlblocks.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'rlblocks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"plot"})
