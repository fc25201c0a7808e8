"""Multi-turn environments and tools, and the agent rollout that runs them on any engine.

- `Environment`: the contract of a multi-turn task (``reset``, ``step``, ``reward``), in the
  spirit of Prime Intellect's ``verifiers`` environments; `EnvStep`, `ModelTurn`, `ToolCall`
  are what passes between it and the rollout.
- `ToolEnv`: the model answers a question and may call tools (plain Python functions with a
  docstring; `tool_schema` builds their JSON schema); `parse_tool_calls` reads the
  ``<tool_call>{...}</tool_call>`` format, `ResponseTemplateParser` a model family's own (the
  tokenizer's ``response_template``), `tool_call_parser` picks one; `calculator` is a safe arithmetic tool;
  `ProcessRunner` (the default: a worker process a time limit kills) and `ThreadRunner` are
  where its tool calls run.
- `AgentEngine`: wraps any rollout engine (HF, vLLM, local or behind a Ray placement) and is one
  itself: ``generate`` runs whole episodes, token in and token out across turns, one
  ``Rollouts`` row per episode with the observation tokens masked out of the loss.
- `ChatFormat`: the chat template's rendering, and the rule that places observation tokens
  after the model's own.
- `env_reward`: the environment's reward as a `RewardFn`, with the agent's metrics.

docs/blocks/environments.md walks through them.
"""

from rlblocks.envs.agent import ENDS, AgentEngine
from rlblocks.envs.base import Environment, EnvStep, Message, ModelTurn, ToolCall
from rlblocks.envs.calculator import CalculatorError, calculator
from rlblocks.envs.chat import ChatFormat
from rlblocks.envs.reward import agent_metrics, env_reward
from rlblocks.envs.runners import ProcessRunner, ThreadRunner
from rlblocks.envs.tools import (
    ResponseTemplateParser,
    ToolEnv,
    call_tool,
    parse_tool_calls,
    tool_call_parser,
    tool_schema,
)

__all__ = [
    "ENDS",
    "AgentEngine",
    "CalculatorError",
    "ChatFormat",
    "EnvStep",
    "Environment",
    "Message",
    "ModelTurn",
    "ProcessRunner",
    "ResponseTemplateParser",
    "ThreadRunner",
    "ToolCall",
    "ToolEnv",
    "agent_metrics",
    "calculator",
    "call_tool",
    "env_reward",
    "parse_tool_calls",
    "tool_call_parser",
    "tool_schema",
]
