"""Know before you launch: the memory a run needs per device, by part (``rb.plan``).

``plan(model, ...)`` sizes the model on the meta device (no weights read) and adds up what
rlblocks holds per device while it trains and samples; ``Plan`` prints the parts, the peak,
the verdict against the device and the smallest change that fits. ``benchmarks/memory_plan.py``
holds the arithmetic against measured peaks (docs/memory.md).
"""

from rlblocks.planner.shapes import ModelShape, load_config, model_shape
from rlblocks.planner.sizing import MARGIN, Plan, Setup, plan

__all__ = ["MARGIN", "ModelShape", "Plan", "Setup", "load_config", "model_shape", "plan"]
