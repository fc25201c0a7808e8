"""Which optional per-token inputs a policy loss takes: read from its signature.

A policy loss is ``loss_fn(logprobs, old_logprobs, advantages, mask, /, **kw)``; the trainer can
also give it ``ref_logprobs`` (the reference policy), ``entropy`` (per token, with gradient) and
``rollout_logprobs`` (what the engine sampled with). Computing the first two costs a forward
pass or a vocabulary-wide reduction, so the trainer only does it for losses that name them.
``inspect.signature`` sees through ``functools.partial`` and callable dataclasses, so
``partial(my_loss, beta=0.1)`` is inspected like ``my_loss``.

A loss that wraps another (``kl_regularized``, ``TruncatedIS``) takes ``**kwargs`` to pass on
what the inner loss takes; read as such it would accept everything, and the trainer would
compute the entropy (and score the reference) for nothing. Such a wrapper declares what it
really takes with :func:`forwarding_signature` as its ``__signature__``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from inspect import Parameter, Signature

OPTIONAL_INPUTS = ("ref_logprobs", "entropy", "rollout_logprobs")
POSITIONAL_INPUTS = ("logprobs", "old_logprobs", "advantages", "mask")


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


def forwarding_signature(loss_fn: Callable[..., object], *, required: Iterable[str]) -> Signature:
    """The signature of a loss that wraps ``loss_fn`` and passes it the optional inputs it takes.

    ``(logprobs, old_logprobs, advantages, mask, /, *, ...)`` with, of ``OPTIONAL_INPUTS``:
    the names in ``required`` (the wrapper's own needs) and those ``loss_fn`` requires, without
    a default; the others ``loss_fn`` accepts, with the default None. Set it as the wrapper's
    ``__signature__`` so that :func:`loss_inputs` (the trainer) reads what is really used.
    """
    inner = loss_inputs(loss_fn)
    own = frozenset(required)
    unknown = own - set(OPTIONAL_INPUTS)
    if unknown:
        raise ValueError(
            f"forwarding_signature: required={sorted(own)} names {sorted(unknown)}, which no "
            f"loss is given; name only {list(OPTIONAL_INPUTS)}"
        )
    params = [Parameter(n, Parameter.POSITIONAL_ONLY) for n in POSITIONAL_INPUTS]
    for name in OPTIONAL_INPUTS:
        if name in own or name in inner.required:
            params.append(Parameter(name, Parameter.KEYWORD_ONLY))
        elif name in inner.accepted:
            params.append(Parameter(name, Parameter.KEYWORD_ONLY, default=None))
    return Signature(params)
