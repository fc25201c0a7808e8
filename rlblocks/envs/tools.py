"""Tools as plain Python functions, the tool-call format, and `ToolEnv`, which runs them.

- **A tool is a function** with type hints and a Google-style docstring; its JSON schema (the
  chat template's ``tools=`` format) is built by ``transformers.utils.get_json_schema``, so what
  the model is told and what the function takes cannot drift apart.
- **The call format** is the one Qwen2.5's and Hermes' chat templates teach: a JSON object
  between tags,
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``, any
  number of them in a turn. `parse_tool_calls` reads them; a call it cannot read (bad JSON, no
  name, arguments that are not an object, a tag never closed) comes back with ``error`` set.
- **Running a call never raises.** An unknown tool, wrong arguments, an exception in the tool
  and a tool past its time limit all become the tool message's content, ``"Error: ..."``, so
  the model reads what went wrong and the episode goes on.
- **Time limits** are per tool. A call runs in its own daemon thread and is waited for at most
  its limit; a thread cannot be killed, so a tool that never returns keeps its thread (and any
  CPU it burns) until it ends. Tools that may hang or burn CPU (running model-written code)
  belong in a process that a limit can kill: give such a tool a function that runs the work in
  a subprocess with its own timeout (``subprocess.run(..., timeout=...)``).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers.utils import get_json_schema

from rlblocks.envs.base import (
    EnvStep,
    Message,
    ModelTurn,
    ToolCall,
    initial_messages,
    last_answer,
)

TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a tool function (``transformers.utils.get_json_schema``):
    ``{"type": "function", "function": {"name", "description", "parameters"}}``. Raises when
    the function lacks a docstring, a type hint or an argument's description."""
    return get_json_schema(fn)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``, in order.

    ``arguments`` may also be a JSON string holding an object (some models write it so). A call
    that cannot be read comes back with ``name`` None (or the name it gave) and ``error``
    saying why; nothing raises.
    """
    calls = []
    for match in TOOL_CALL.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall(None, error="the <tool_call> tag is never closed", text=body))
            continue
        calls.append(_read_call(body))
    return calls


def _read_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(None, error=f"the tool call is not valid JSON ({error.msg})", text=body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(
            None, error='the tool call needs a "name" (a string) and "arguments"', text=body
        )
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(
            call["name"], error='the tool call\'s "arguments" must be a JSON object', text=body
        )
    return ToolCall(call["name"], arguments, text=body)


def call_tool(fn: Callable[..., Any], arguments: Mapping[str, Any], *, timeout: float) -> str:
    """``fn(**arguments)`` as text (a string as it is, anything else as JSON), or
    ``"Error: ..."`` if it raises or takes longer than ``timeout`` seconds (it then goes on in
    its daemon thread: module docstring). Never raises."""
    return _call(fn, arguments, timeout)[0]


def _call(fn: Callable[..., Any], arguments: Mapping[str, Any], timeout: float) -> tuple[str, bool]:
    """``(text, ok)`` of one call (`call_tool`)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(**arguments)
        except BaseException as error:  # noqa: BLE001 - any failure is the model's observation
            box["error"] = error

    worker = threading.Thread(target=run, daemon=True, name=f"tool-{_name(fn)}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return f"Error: {_name(fn)} did not finish within {timeout:g} s", False
    if "error" in box:
        error = box["error"]
        return f"Error: {type(error).__name__}: {error}", False
    value = box["value"]
    return (value if isinstance(value, str) else json.dumps(value, default=str)), True


class ToolEnv:
    """An `Environment` where the model answers a question, calling tools on the way.

    ``tools``: the tool functions (schemas from their docstrings, `tool_schema`). Each model turn
    with tool calls is answered by one ``{"role": "tool", "name": ..., "content": ...}`` message
    per call, in order (the result, or ``"Error: ..."``); a turn without a call ends the
    episode: it is the answer. ``timeout``: seconds a call may take, one number for every tool
    or ``{name: seconds}`` (tools not named get ``default_timeout``). ``max_calls_per_turn``:
    calls past it are answered with an error, not run. ``system_prompt``: a system message put
    first. ``examples``: messages shown before each task (after its system message, if any): a
    worked exchange with a tool call teaches a small model the format better than a
    description does. ``reward``: ``fn(completion, **metadata) -> float`` scored on the last model turn's
    text (the `rlblocks.rewards.per_sample` signature: ``rb.rewards.math_answer_score``-style
    checks fit); None gives 0.0 and leaves scoring to a reward function on the rollouts.

    Per-episode counts in the rollout's info: ``tool_calls``, ``tool_errors`` (calls answered
    with an error, malformed ones included) and ``malformed`` (calls that could not be read).
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        *,
        reward: Callable[..., float] | None = None,
        system_prompt: str | None = None,
        examples: Sequence[Message] = (),
        timeout: float | Mapping[str, float] = 5.0,
        default_timeout: float = 5.0,
        max_calls_per_turn: int = 8,
    ) -> None:
        self.functions = {_name(fn): fn for fn in tools}
        if len(self.functions) != len(tools):
            raise ValueError(
                f"ToolEnv: two tools share a name: {[_name(fn) for fn in tools]}; give every "
                "tool its own name"
            )
        self.tools = [tool_schema(fn) for fn in tools]
        limits = timeout if isinstance(timeout, Mapping) else dict.fromkeys(self.functions, timeout)
        unknown = set(limits) - set(self.functions)
        if unknown:
            raise ValueError(
                f"ToolEnv: timeouts for tools it does not have: {sorted(unknown)}; name only its "
                f"tools {sorted(self.functions)}"
            )
        self.timeouts = {name: float(limits.get(name, default_timeout)) for name in self.functions}
        if any(t <= 0 for t in self.timeouts.values()):
            raise ValueError(
                f"ToolEnv: timeouts must be > 0, got {self.timeouts}; pass positive seconds"
            )
        if max_calls_per_turn < 1:
            raise ValueError(
                f"ToolEnv: max_calls_per_turn must be >= 1, got {max_calls_per_turn}; pass a "
                "positive count"
            )
        self.reward_fn = reward
        self.system_prompt = system_prompt
        self.examples = initial_messages(list(examples)) if examples else []
        self.max_calls_per_turn = max_calls_per_turn

    def reset(self, prompt: Any, metadata: Mapping[str, Any]) -> list[Message]:
        """The episode's first messages: the system prompt (when given and the prompt has none),
        the worked examples, then the task's messages."""
        messages = initial_messages(prompt)
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        first = int(messages[0]["role"] == "system")
        examples = [dict(m) for m in self.examples]
        return messages[:first] + examples + messages[first:]

    def step(self, turn: ModelTurn, state: dict[str, Any]) -> EnvStep:
        """Answer every tool call of the model's turn with a tool message (errors as text, counted
        in ``info``); a turn without tool calls ends the episode."""
        if not turn.tool_calls:
            return EnvStep(done=True)
        messages, errors = [], 0
        for k, call in enumerate(turn.tool_calls):
            content, ok = self._answer(call, k)
            errors += not ok
            messages.append({"role": "tool", "name": call.name or "unknown", "content": content})
        malformed = sum(call.error is not None for call in turn.tool_calls)
        info = {"tool_calls": len(turn.tool_calls), "tool_errors": errors, "malformed": malformed}
        return EnvStep(messages, info=info)

    def reward(self, state: dict[str, Any]) -> float:
        """The episode's reward: ``reward(last assistant answer, **metadata)``, 0.0 without a
        reward function."""
        if self.reward_fn is None:
            return 0.0
        return float(self.reward_fn(last_answer(state["messages"]), **state["metadata"]))

    def _answer(self, call: ToolCall, k: int) -> tuple[str, bool]:
        """``(content, ok)`` of the tool message answering call ``k`` of a turn."""
        if k >= self.max_calls_per_turn:
            return f"Error: more than {self.max_calls_per_turn} tool calls in one turn", False
        if call.error is not None:
            return f"Error: {call.error}: {call.text!r:.200}", False
        fn = self.functions.get(call.name or "")
        if fn is None:
            names = sorted(self.functions)
            return f"Error: no tool named {call.name!r}; the tools are {names}", False
        return _call(fn, call.arguments, self.timeouts[call.name])


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


__all__ = ["TOOL_CALL", "ToolEnv", "call_tool", "parse_tool_calls", "tool_schema"]
