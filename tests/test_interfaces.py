from collections.abc import Iterable

import pytest
import torch

from rlblocks.interfaces import (
    Dispatch,
    Handle,
    PolicyTrainer,
    Resharder,
    RolloutEngine,
    Rollouts,
    SamplingParams,
    Stateful,
    dispatch,
    dispatch_of,
)


class EchoEngine:
    """The smallest engine that honours the RolloutEngine contract: it echoes the prompt ids."""

    model = None  # no torch module in this process
    serves_adapters = False
    tokenizer = None  # ids are characters

    def __init__(self) -> None:
        self.version = 0

    def generate(self, prompts, *, group_size=1, sampling=None, metadata=None):
        ids = [[ord(c) for c in p] for p in prompts]
        ro = Rollouts.from_lists(ids, ids, prompts=list(prompts), completions=list(prompts))
        return ro.repeat(group_size)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int):
        self.version = version

    def weight_spec(self):
        return {}  # no weights: a sync must send none

    def load_adapter(self, path, *, version: int):
        raise NotImplementedError("EchoEngine has no weights")

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass


def test_structural_blocks_are_recognised_without_inheritance():
    engine = EchoEngine()
    assert isinstance(engine, RolloutEngine)
    ro = engine.generate(["ab", "c"], group_size=2)
    assert ro.group_ids.tolist() == [0, 0, 1, 1]
    assert ro.completions == ["ab", "ab", "c", "c"]
    # An engine is not a trainer, a resharder or stateful: the checks really discriminate.
    assert not isinstance(engine, PolicyTrainer)
    assert not isinstance(engine, Resharder)
    assert not isinstance(engine, Stateful)
    assert not isinstance(engine, Handle)  # a block in this process, not a placement's handle


def test_an_engine_missing_part_of_the_contract_is_not_an_engine():
    class NoSleep(EchoEngine):
        sleep = None  # what a caller relies on is checked, not assumed

    assert not isinstance(NoSleep(), RolloutEngine)


def test_dispatch_is_declared_on_the_method():
    class Block:
        @dispatch(Dispatch.ALL)
        def step(self, rollouts):
            return len(rollouts)

        @dispatch("rows")
        def score(self, rollouts):
            return rollouts

        def plain(self):
            return 1

    assert dispatch_of(Block.step) is Dispatch.ALL
    assert dispatch_of(Block().score) is Dispatch.ROWS  # bound methods keep it
    assert dispatch_of(Block.plain) is None
    with pytest.raises(ValueError, match="'columns' is not a valid Dispatch"):
        dispatch("columns")


def test_sampling_params_validate():
    assert SamplingParams().temperature == 1.0
    with pytest.raises(ValueError, match=r"^SamplingParams.top_p: must be in \(0, 1\], got 0.0; "):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="^SamplingParams.max_new_tokens: must be >= 1, got 0; "):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="^SamplingParams.temperature: must be >= 0, got -1; "):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="^SamplingParams.top_k: must be >= 0, got -1; "):
        SamplingParams(top_k=-1)
    assert SamplingParams(max_new_tokens=4, min_new_tokens=4).min_new_tokens == 4  # the limit
    with pytest.raises(
        ValueError,
        match=r"^SamplingParams.min_new_tokens: must be in \[0, max_new_tokens = 4\], got 5; ",
    ):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(ValueError, match="^SamplingParams.min_new_tokens: must be in .*, got -1; "):
        SamplingParams(min_new_tokens=-1)
