"""Which optional per-token inputs a policy loss takes: read from its signature.

A policy loss is ``loss_fn(logprobs, old_logprobs, advantages, mask, /, **kw)``; the trainer can
also give it ``ref_logprobs`` (the reference policy), ``entropy`` (per token, with gradient) and
``rollout_logprobs`` (what the engine sampled with). Computing the first two costs a forward
pass or a vocabulary-wide reduction, so the trainer only does it for losses that name them.
``inspect.signature`` sees through ``functools.partial`` and callable dataclasses, so
``partial(my_loss, beta=0.1)`` is inspected like ``my_loss``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

OPTIONAL_INPUTS = ("ref_logprobs", "entropy", "rollout_logprobs")


@dataclass(frozen=True)
class LossInputs:
    """The optional inputs a loss accepts, and which of them it cannot do without."""

    accepted: frozenset[str]
    """Names in ``OPTIONAL_INPUTS`` the loss accepts (all of them for a ``**kwargs`` loss)."""
    required: frozenset[str]
    """Accepted names with no default value: the trainer must supply them or fail."""


def loss_inputs(loss_fn: Callable[..., object]) -> LossInputs:
    """Inspect ``loss_fn``: which of ``ref_logprobs``, ``entropy``, ``rollout_logprobs`` it takes.

    A parameter counts when it can be passed by keyword. A loss with ``**kwargs`` accepts
    everything but requires nothing (the trainer passes what it has). No tensors involved.
    """
    params = inspect.signature(loss_fn).parameters
    keyword_kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = {n: p for n, p in params.items() if n in OPTIONAL_INPUTS and p.kind in keyword_kinds}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = frozenset(OPTIONAL_INPUTS)
    else:
        accepted = frozenset(named)
    required = frozenset(n for n, p in named.items() if p.default is inspect.Parameter.empty)
    return LossInputs(accepted, required)
