"""What every rollout engine of rlblocks shares: the ``generate`` entry and the checks of a call.

``generate``'s contract (rows, groups, metadata, rollout log-probs) is written once, in
`rlblocks.interfaces.RolloutEngine.generate`. :class:`EngineBase` implements the part of it that
is the same for every engine (the default ``sampling``, ``group_size`` checked before any
compute, errors naming the engine's class) and hands the call, as a :class:`Request`, to the
engine's ``_generate``; :func:`checked_prompts` is the rest of the checks an engine makes
before any compute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from rlblocks.interfaces import Dispatch, Prompt, SamplingParams, dispatch
from rlblocks.models.context import check_lengths
from rlblocks.rollout.prompts import check_metadata, render_prompts
from rlblocks.rollouts import Rollouts


class Request(NamedTuple):
    """One ``generate`` call as an engine's ``_generate`` receives it (``group_size >= 1``,
    ``sampling`` resolved to the engine's default when the caller gave none)."""

    prompts: Sequence[Prompt]
    group_size: int
    sampling: SamplingParams
    metadata: Sequence[Mapping[str, Any]] | None


class EngineBase:
    """The ``generate`` of an engine that samples in ``_generate(request)``; ``self.sampling``
    is its default ``SamplingParams``."""

    sampling: SamplingParams

    @dispatch(Dispatch.PROMPTS)
    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        group_size: int = 1,
        sampling: SamplingParams | None = None,
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rollouts:
        """``group_size`` (g) samples for each prompt, as
        `rlblocks.interfaces.RolloutEngine.generate` says (the contract); what this engine adds
        to it is in its class docstring. ``sampling`` None: the engine's own."""
        if group_size < 1:
            raise ValueError(
                f"{type(self).__name__}.generate: group_size={group_size}; use group_size >= 1"
            )
        return self._generate(Request(prompts, group_size, sampling or self.sampling, metadata))

    def _generate(self, request: Request) -> Rollouts:
        """The engine's sampling, after the checks of :meth:`generate`."""
        raise NotImplementedError(
            f"{type(self).__name__}._generate: not defined; an engine built on EngineBase "
            "defines _generate(request)"
        )


def checked_prompts(
    engine: Any, request: Request, *, limit: int | None
) -> tuple[list[str], list[list[int]], list[Mapping[str, Any]]]:
    """``(texts, ids, metadata)`` of a call, checked before any compute (errors name the
    engine's class): the prompts rendered with ``engine.tokenizer`` and ``engine.chat``
    (`rlblocks.rollout.prompts.render_prompts`), one metadata mapping per prompt, and no prompt
    plus ``max_new_tokens`` past the context ``limit`` (None: not checked)."""
    name = type(engine).__name__
    texts, ids = render_prompts(request.prompts, engine.tokenizer, chat=engine.chat)
    meta = check_metadata(request.metadata, len(ids), owner=name)
    check_lengths([len(p) for p in ids], new_tokens=request.sampling.max_new_tokens, limit=limit,
                  owner=f"{name}.generate")  # fmt: skip
    return texts, ids, meta


def check_count(value: int | None, name: str, *, owner: str, none: str) -> None:
    """Refuse a count below 1 given to an engine's constructor (None is allowed: ``none`` says
    what it means)."""
    if value is not None and value < 1:
        raise ValueError(f"{owner}: {name}={value}; use {name} >= 1, or None {none}")
