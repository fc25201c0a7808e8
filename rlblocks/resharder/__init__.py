"""Resharders move trainer weights into a rollout engine after an update."""

from rlblocks.resharder.bucketed import Resharder, buckets, copy_weights

__all__ = ["Resharder", "buckets", "copy_weights"]
