"""Tools as plain Python functions, the tool-call format, and `ToolEnv`, which runs them.

- **A tool is a function** with type hints and a Google-style docstring; its JSON schema (the
  chat template's ``tools=`` format) is built by ``transformers.utils.get_json_schema``, so what
  the model is told and what the function takes cannot drift apart.
- **The call format** is the one Qwen2.5's and Hermes' chat templates teach: a JSON object
  between tags,
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``, any
  number of them in a turn. `parse_tool_calls` reads them; a call it cannot read (bad JSON, no
  name, arguments that are not an object, a tag never closed, brackets nested deeper than
  ``MAX_DEPTH``, a number Python refuses to read) comes back with ``error`` set. The nesting
  is measured by one pass over the text before the JSON parser (which recurses) sees it: a
  model writing a thousand ``[`` is an error message, not a ``RecursionError``.
- **A model family's own format**: a tokenizer that carries a ``response_template`` (the
  declarative parsing spec transformers reads in ``tokenizer.parse_response``; a model's
  ``tokenizer_config.json`` may ship one, e.g. Qwen3's ``<function=name><parameter=...>``
  calls) is read by `ResponseTemplateParser`, with the same guarantees: a turn it cannot read
  is one call with ``error`` set, and nothing raises. `tool_call_parser` picks it when the
  tokenizer has a template and the ``<tool_call>`` JSON parser above otherwise (what
  `rlblocks.envs.AgentEngine` does by default). The JSON parser stays hand-written: it is the
  fallback for tokenizers without a template (SmolLM2's, the tiny model's, any transformers
  before the templates), and it reads the calls of a turn one by one, so one bad call does
  not cost the others (the template parser fails the whole turn).
- **Running a call never raises.** An unknown tool, wrong arguments, an exception in the tool,
  a tool past its time limit, a value that cannot be shown as text and a worker process that
  died all become the tool message's content, ``"Error: ..."``, so the model reads what went
  wrong and the episode goes on. The value becomes text inside the call's guard
  (`rlblocks.envs.tool_worker.run`), and the text is cut to ``max_result_chars``.
- **Time limits** are per tool. By default a call runs in a worker process that a call past
  its limit kills, with everything it started (`rlblocks.envs.runners.ProcessRunner`); a
  `ThreadRunner` runs calls in this process instead, where a late call cannot be stopped.
"""

from __future__ import annotations

import json
import re
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
from rlblocks.envs.runners import ProcessRunner, ThreadRunner, ToolRunner, tool_name
from rlblocks.envs.tool_worker import MAX_RESULT_CHARS, shown
from rlblocks.isolation.worker import describe

TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
MAX_DEPTH = 32
"""The deepest nesting of brackets a tool call's JSON may have (a real call has a few)."""
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a tool function (``transformers.utils.get_json_schema``):
    ``{"type": "function", "function": {"name", "description", "parameters"}}``. Raises when
    the function lacks a docstring, a type hint or an argument's description."""
    return get_json_schema(fn)


def parse_tool_calls(text: str, *, max_depth: int = MAX_DEPTH) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``, in order.

    ``arguments`` may also be a JSON string holding an object (some models write it so). A call
    that cannot be read comes back with ``name`` None (or the name it gave) and ``error``
    saying why, a call nesting brackets deeper than ``max_depth`` among them (refused before
    the JSON parser, which recurses, reads it); nothing raises.
    """
    calls = []
    for match in TOOL_CALL.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall(None, error="the <tool_call> tag is never closed", text=body))
            continue
        try:
            calls.append(_read_call(body, max_depth))
        except Exception as error:  # noqa: BLE001 - a last guard: model text never raises
            calls.append(ToolCall(None, error=f"the tool call cannot be read ({error})", text=body))
    return calls


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[ ]`` and ``{ }`` in JSON ``text``, brackets inside strings not
    counted; one linear pass, no recursion."""
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _loads(text: str, max_depth: int) -> tuple[Any, str | None]:
    """``(value, None)`` of JSON ``text``, or ``(None, why it cannot be read)``."""
    depth = nesting_depth(text)
    if depth > max_depth:
        return None, f"the tool call nests brackets {depth} deep, more than the {max_depth} allowed"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as error:
        return None, f"the tool call is not valid JSON ({error.msg})"
    except (ValueError, RecursionError) as error:  # an integer of more than 4300 digits
        return None, f"the tool call cannot be read ({describe(error)})"


def _read_call(body: str, max_depth: int) -> ToolCall:
    call, error = _loads(body, max_depth)
    if error is not None:
        return ToolCall(None, error=error, text=body)
    return _checked_call(call, body, max_depth)


def _checked_call(call: Any, body: str, max_depth: int) -> ToolCall:
    """A read call (``{"name": ..., "arguments": ...}``) as a `ToolCall`, or what is wrong
    with it."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(
            None, error='the tool call needs a "name" (a string) and "arguments"', text=body
        )
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # a JSON string holding the object: read it the same way
        inner, error = _loads(arguments, max_depth) if arguments.strip() else ({}, None)
        arguments = arguments if error is not None else inner
    if not isinstance(arguments, dict):
        return ToolCall(
            call["name"], error='the tool call\'s "arguments" must be a JSON object', text=body
        )
    return ToolCall(call["name"], arguments, text=body)


class ResponseTemplateParser:
    """Tool calls read by a tokenizer's own response template (``tokenizer.parse_response``).

    ``tokenizer``: a Hugging Face tokenizer whose ``response_template`` describes its model
    family's output (or pass ``schema``, a template of the same shape). ``tools``: the tool
    schemas, so that arguments are cast to their declared types (``"7"`` -> 7 for an integer).
    ``prefix``: what the generation prompt pre-writes of the turn (an opening ``<think>``
    tag), which the template may need to see. The turn is read with its special tokens kept
    (``skip_special_tokens`` False: `rlblocks.envs.AgentEngine` decodes it so), since many
    templates mark their regions with them.

    Never raises for what the model wrote: a turn the template cannot read (bad JSON in a call,
    brackets nested deeper than ``max_depth``, measured before the recursive JSON parser sees
    the text) comes back as one `ToolCall` with ``error`` set, and so does a parsed call
    without a name or with arguments that are not an object.
    """

    skip_special_tokens = False
    """How `rlblocks.envs.AgentEngine` decodes the turn for this parser."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        schema: Mapping[str, Any] | None = None,
        prefix: str = "",
        max_depth: int = MAX_DEPTH,
    ) -> None:
        if not callable(getattr(tokenizer, "parse_response", None)):
            raise TypeError(
                f"ResponseTemplateParser: {type(tokenizer).__name__} has no parse_response "
                "(the transformers tested, 5.19, has it); use parse_tool_calls"
            )
        schema = schema if schema is not None else getattr(tokenizer, "response_template", None)
        if schema is None:
            raise ValueError(
                f"ResponseTemplateParser: {type(tokenizer).__name__} has no response_template; "
                "pass schema=, or use parse_tool_calls (the <tool_call> JSON format)"
            )
        self.tokenizer = tokenizer
        self.schema = dict(schema)
        self.tools = [dict(t) for t in tools]
        self.prefix = prefix
        self.max_depth = max_depth

    def __call__(self, text: str) -> list[ToolCall]:
        """The tool calls of one turn's text, in order."""
        depth = nesting_depth(text)
        if depth > self.max_depth:
            error = f"the turn nests brackets {depth} deep, more than the {self.max_depth} allowed"
            return [ToolCall(None, error=error, text=text)]
        try:
            message = self.tokenizer.parse_response(
                text, schema=self.schema, prefix=self.prefix, tools=self.tools or None
            )
        except Exception as error:  # noqa: BLE001 - model text never raises
            return [
                ToolCall(
                    None,
                    error=f"the turn cannot be read by the response template ({describe(error)})",
                    text=text,
                )
            ]
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, Mapping) else call
            try:
                body = json.dumps(function)
            except (TypeError, ValueError):
                body = repr(function)
            calls.append(_checked_call(function, body, self.max_depth))
        return calls


def tool_call_parser(
    tokenizer: Any, tools: Sequence[Mapping[str, Any]] = ()
) -> Callable[[str], list[ToolCall]]:
    """The tool-call parser for ``tokenizer``'s model: `ResponseTemplateParser` when the
    tokenizer carries a ``response_template`` (and transformers can read it), else
    `parse_tool_calls` (the ``<tool_call>`` JSON format of Qwen2.5 and Hermes)."""
    if getattr(tokenizer, "response_template", None) is not None and callable(
        getattr(tokenizer, "parse_response", None)
    ):
        return ResponseTemplateParser(tokenizer, tools=tools)
    return parse_tool_calls


_DEFAULT_RUNNER: list[ProcessRunner] = []  # call_tool's worker, started on its first call


def call_tool(
    fn: Callable[..., Any],
    arguments: Mapping[str, Any],
    *,
    timeout: float,
    runner: ToolRunner | None = None,
    max_result_chars: int = MAX_RESULT_CHARS,
) -> str:
    """``fn(**arguments)`` as text (a string as it is, anything else as JSON), or
    ``"Error: ..."`` if it raises or takes longer than ``timeout`` seconds (it is then stopped:
    `ProcessRunner`), cut to ``max_result_chars``. ``runner``: where it runs (None: one worker
    process shared by every ``call_tool`` of this process). Never raises for what the tool
    does."""
    if runner is None:
        if not _DEFAULT_RUNNER:
            _DEFAULT_RUNNER.append(ProcessRunner())
        runner = _DEFAULT_RUNNER[0]
    runner.prepare(fn)
    return runner.call(fn, arguments, timeout=timeout, limit=max_result_chars)[0]


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

    ``runner``: where calls run, `ProcessRunner` (None: a new one, this environment's worker
    process, killed with a call past its limit) or `ThreadRunner` (this process; a late call
    cannot be stopped). ``max_result_chars``: the most characters of a tool message the model
    reads; a longer result is cut, with a marker saying how much (`MAX_RESULT_CHARS` by
    default: a 10 MB result would take seconds to render and tokenize, and its tokens would
    pass any context). `close` (or ``with ToolEnv(...) as env``) stops the worker process.

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
        runner: ToolRunner | None = None,
        max_result_chars: int = MAX_RESULT_CHARS,
    ) -> None:
        self.functions = {tool_name(fn): fn for fn in tools}
        if len(self.functions) != len(tools):
            raise ValueError(
                f"ToolEnv: two tools share a name: {[tool_name(fn) for fn in tools]}; give every "
                "tool its own name"
            )
        if max_result_chars < 1:
            raise ValueError(
                f"ToolEnv: max_result_chars must be >= 1, got {max_result_chars}; pass a "
                "positive count"
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
        self.max_result_chars = max_result_chars
        self.runner = runner if runner is not None else ProcessRunner()
        for fn in tools:
            self.runner.prepare(fn)

    def close(self) -> None:
        """Stop the runner's worker process (a later call starts a new one)."""
        self.runner.close()

    def __enter__(self) -> ToolEnv:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        limit = self.max_result_chars
        if k >= self.max_calls_per_turn:
            return f"Error: more than {self.max_calls_per_turn} tool calls in one turn", False
        if call.error is not None:
            return shown(f"Error: {call.error}: {call.text!r:.200}", limit), False
        fn = self.functions.get(call.name or "")
        if fn is None:
            names = sorted(self.functions)
            return shown(f"Error: no tool named {call.name!r}; the tools are {names}", limit), False
        assert call.name is not None  # a call without a name has no function (above)
        return self.runner.call(fn, call.arguments, timeout=self.timeouts[call.name], limit=limit)


__all__ = [
    "MAX_DEPTH",
    "MAX_RESULT_CHARS",
    "TOOL_CALL",
    "ProcessRunner",
    "ResponseTemplateParser",
    "ThreadRunner",
    "ToolEnv",
    "call_tool",
    "nesting_depth",
    "parse_tool_calls",
    "tool_call_parser",
    "tool_schema",
]
