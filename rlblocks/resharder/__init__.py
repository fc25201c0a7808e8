"""Resharders move trainer weights into a rollout engine after an update."""

from rlblocks.resharder.bucketed import Resharder, buckets, copy_weights
from rlblocks.resharder.strict import check_tokenizers, check_weights

__all__ = ["Resharder", "buckets", "check_tokenizers", "check_weights", "copy_weights"]
