"""Resharders move trainer weights into a rollout engine after an update."""

from rlblocks.resharder.inprocess import InProcessResharder

__all__ = ["InProcessResharder"]
