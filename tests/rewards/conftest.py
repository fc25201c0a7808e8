"""A `make_rollouts` fixture: a `Rollouts` batch from completions and metadata.

Rewards read text, so the token ids are tiny fakes; only their number matters (it is the
response length that the overlong reward reads). Helpers reach the tests as fixtures, not
imports, so they work under any pytest import mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from rlblocks.rollouts import Rollouts


def _make_rollouts(
    completions: Sequence[str],
    metadata: Sequence[dict[str, Any]] | None = None,
    *,
    prompts: Sequence[str] | None = None,
    lengths: Sequence[int] | None = None,
    group_ids: Sequence[int] | None = None,
) -> Rollouts:
    b = len(completions)
    lengths = [1] * b if lengths is None else list(lengths)
    return Rollouts.from_lists(
        [[1, 2]] * b,
        [[5] * n for n in lengths],
        group_ids=group_ids,
        prompts=list(prompts) if prompts is not None else [f"prompt {i}" for i in range(b)],
        completions=list(completions),
        metadata=list(metadata) if metadata is not None else None,
    )


@pytest.fixture
def make_rollouts() -> Callable[..., Rollouts]:
    return _make_rollouts
