"""Rollout engines: sample responses to prompts and return a ``Rollouts`` batch.

``HFEngine`` runs Hugging Face ``model.generate`` in the calling process; ``CompiledEngine``
decodes with a static KV cache and one compiled graph per step (CUDA graphs on a GPU), in the
calling process;
``ContinuousBatchingEngine`` runs transformers' continuous batching (paged KV cache) in the calling
process; ``VLLMEngine`` runs vLLM in the calling process (vLLM is imported only when one is built). Every engine follows
the ``RolloutEngine`` protocol of :mod:`rlblocks.interfaces`. ``ENGINES`` names the engines a
config file picks (``rollout: hf``), each registered beside its class with its memory model.
"""

from rlblocks.rollout.compiled import CompiledEngine
from rlblocks.rollout.continuous import ContinuousBatchingEngine
from rlblocks.rollout.hf import HFEngine, sampled_logprobs
from rlblocks.rollout.names import ENGINES
from rlblocks.rollout.prompts import left_pad, render_prompts
from rlblocks.rollout.stopping import ResponseEnds, valid_tokens
from rlblocks.rollout.vllm import VLLMEngine

__all__ = [
    "ENGINES",
    "CompiledEngine",
    "ContinuousBatchingEngine",
    "HFEngine",
    "ResponseEnds",
    "VLLMEngine",
    "left_pad",
    "render_prompts",
    "sampled_logprobs",
    "valid_tokens",
]
