"""Where blocks run: ``Local()`` today; a Ray cluster placement arrives with the scaling work."""

from rlblocks.placement.local import ROLES, Local

__all__ = ["ROLES", "Local"]
