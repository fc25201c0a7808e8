"""Resharders move trainer weights into a rollout engine after an update."""

from rlblocks.resharder.bucketed import Resharder, buckets

__all__ = ["Resharder", "buckets"]
