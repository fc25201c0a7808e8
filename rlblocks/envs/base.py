"""The `Environment` contract: what a multi-turn episode asks of the task it runs in.

An episode, as `rlblocks.envs.AgentEngine` runs it::

    messages = env.reset(prompt, metadata)              # the conversation the model starts from
    repeat:
        the model samples one turn                      # its tokens, exactly as sampled
        step = env.step(ModelTurn(...), state)          # observation messages, or done
        the observation's tokens are appended           # attended to, not trained on
    reward = env.reward(state)                          # once, however the episode ended

It is the shape of Prime Intellect's ``verifiers`` environments (a dataset row gives the
prompt, ``env_response`` answers each model turn, a rubric scores the finished rollout), written
as a `typing.Protocol` with synchronous methods: any object with these methods is an
environment. ``state`` is one plain dict per episode that the rollout creates, fills with
``prompt``, ``metadata``, ``messages`` (the conversation so far, the model's turns as decoded
text) and ``turn``, and hands to every call; an environment keeps its own per-episode data there
too (a sandbox session, a game board).

This module imports nothing else from rlblocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: A chat message: ``{"role": "user" | "assistant" | "system" | "tool", "content": str, ...}``.
Message = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from a model turn: ``name`` and ``arguments``, or what is wrong with
    it (``error`` set: the call could not be read, and is answered with that error)."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    text: str = ""
    """The call as the model wrote it (between the tags), for error messages."""


@dataclass(frozen=True)
class ModelTurn:
    """What the model said in one turn, as the environment sees it."""

    text: str
    """The decoded turn, special tokens skipped (the end-of-turn token is not in it)."""
    tool_calls: tuple[ToolCall, ...]
    """The calls parsed from the turn (by `rlblocks.envs.tool_call_parser`'s choice by
    default), in order."""
    index: int
    """0 for the model's first turn."""
    token_ids: tuple[int, ...] = ()
    """The sampled ids of the turn (what the trainer scores)."""


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to a model turn."""

    messages: Sequence[Message] = ()
    """Observation messages appended to the conversation (tool results, feedback); their tokens
    enter the sequence masked out of the loss. Ignored when ``done``. A ``content`` of None is
    rendered as "" (`rlblocks.envs.ChatFormat`)."""
    done: bool = False
    """The episode is over (the model answered, the game ended)."""
    reward: float | None = None
    """This turn's own reward, if the task has per-turn rewards (None: none). The episode's
    final reward is :meth:`Environment.reward`'s."""
    info: Mapping[str, float] = field(default_factory=dict)
    """Counts added up over the episode into its info (``tool_calls``, ``tool_errors``, ...)."""


@runtime_checkable
class Environment(Protocol):
    """A multi-turn task: initial messages, an answer to each model turn, a final reward."""

    tools: Sequence[Mapping[str, Any]]
    """JSON schemas of the tools the model may call (``transformers.utils.get_json_schema``'s
    format: ``{"type": "function", "function": {...}}``), passed to the chat template as
    ``tools=``; empty for an environment without tools."""

    def reset(self, prompt: Any, metadata: Mapping[str, Any]) -> list[Message]:
        """The conversation the model starts from, for one dataset row (``prompt``: a string or
        messages; ``metadata``: the row's other fields). Called once per episode."""
        ...

    def step(self, turn: ModelTurn, state: dict[str, Any]) -> EnvStep:
        """Answer the model's turn: observation messages, or done. Must not raise for anything
        the model wrote: a malformed call or a failing tool is an observation."""
        ...

    def reward(self, state: dict[str, Any]) -> float:
        """The episode's reward, once it ended (done, or stopped by a limit: ``state["end"]``
        says which); ``state["messages"]`` holds the whole conversation."""
        ...


def initial_messages(prompt: Any) -> list[Message]:
    """A dataset prompt as chat messages: a string becomes one user message, a message list is
    copied (each message a new dict). Raises ``TypeError`` for anything else."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if (
        isinstance(prompt, Sequence)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in prompt)
    ):
        return [dict(m) for m in prompt]
    raise TypeError(
        f"initial_messages: an environment's prompt must be a string or a non-empty list of "
        f"chat messages, got {type(prompt).__name__}: {prompt!r:.80}; pass one of those"
    )


def last_answer(messages: Sequence[Message]) -> str:
    """The content of the last assistant message ("" if there is none): an episode's answer."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")


__all__ = [
    "EnvStep",
    "Environment",
    "Message",
    "ModelTurn",
    "ToolCall",
    "initial_messages",
    "last_answer",
]
