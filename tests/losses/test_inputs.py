"""Reading a loss's optional inputs from its signature."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest

from rlblocks.losses import clipped_surrogate, kl_loss
from rlblocks.losses.inputs import OPTIONAL_INPUTS, forwarding_signature, loss_inputs


def test_plain_policy_loss_takes_nothing_extra():
    wants = loss_inputs(partial(clipped_surrogate, clip=(0.2, 0.28)))
    assert wants.accepted == frozenset() and wants.required == frozenset()


def test_named_keywords_and_defaults():
    def loss(lp, old, adv, mask, /, *, ref_logprobs, entropy=None, beta=0.1):
        return lp, {}

    wants = loss_inputs(partial(loss, beta=0.2))  # partial-aware
    assert wants.accepted == {"ref_logprobs", "entropy"}
    assert wants.required == {"ref_logprobs"}


def test_var_keyword_accepts_all_requires_none():
    def loss(lp, old, adv, mask, /, **kwargs):
        return lp, {}

    wants = loss_inputs(loss)
    assert wants.accepted == frozenset(OPTIONAL_INPUTS) and wants.required == frozenset()


def test_callable_dataclass_and_positional_only_names():
    @dataclass(frozen=True)
    class Loss:
        beta: float = 0.1

        def __call__(self, lp, old, adv, mask, /, *, rollout_logprobs):
            return lp, {}

    assert loss_inputs(Loss()).required == {"rollout_logprobs"}
    # kl_loss(logprobs, ref_logprobs, mask, /): positional-only, so not a keyword input.
    assert loss_inputs(kl_loss).accepted == frozenset()


def test_a_wrapper_declares_its_own_needs_and_what_the_inner_loss_takes():
    def inner(lp, old, adv, mask, /, *, entropy, rollout_logprobs=None):
        return lp, {}

    def wrapper(lp, old, adv, mask, /, **kwargs):
        return inner(lp, old, adv, mask, **kwargs)

    assert loss_inputs(wrapper).accepted == frozenset(OPTIONAL_INPUTS)  # read as taking all
    wrapper.__signature__ = forwarding_signature(inner, required=["ref_logprobs"])
    wants = loss_inputs(wrapper)
    assert wants.accepted == {"ref_logprobs", "entropy", "rollout_logprobs"}
    assert wants.required == {"ref_logprobs", "entropy"}
    # A **kwargs inner loss still accepts everything; the wrapper requires only its own.
    wrapper.__signature__ = forwarding_signature(wrapper_of_all, required=["rollout_logprobs"])
    wants = loss_inputs(wrapper)
    assert wants.accepted == frozenset(OPTIONAL_INPUTS)
    assert wants.required == {"rollout_logprobs"}
    with pytest.raises(ValueError, match=r"^forwarding_signature: required=\['is_weights'\]"):
        forwarding_signature(inner, required=["is_weights"])


def wrapper_of_all(lp, old, adv, mask, /, **kwargs):
    """A loss that takes every optional input and requires none."""
    return lp, {}
