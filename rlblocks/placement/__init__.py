"""Where blocks run: ``Local()`` (this process) or ``Ray(...)`` (worker processes on a cluster).

``Ray``, ``Pool`` and ``WorkerGroup`` import Ray on first use, so ``Local()`` stays cheap.
"""

from rlblocks.placement.errors import PoolBroken, WorkerDied, WorkerError
from rlblocks.placement.local import ROLES, Local

__all__ = [
    "ROLES",
    "Local",
    "Pool",
    "PoolBroken",
    "Ray",
    "WorkerDied",
    "WorkerError",
    "WorkerGroup",
]

_FROM_RAY = ("Pool", "Ray", "WorkerGroup")


def __getattr__(name: str):
    if name in _FROM_RAY:
        from rlblocks.base.extras import require

        require("ray", needed_by=f"rb.placement.{name}")
        from rlblocks.placement import ray as _ray

        return getattr(_ray, name)
    raise AttributeError(f"module 'rlblocks.placement' has no attribute {name!r}")
