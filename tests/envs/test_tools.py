"""Tool calls: parsing the ``<tool_call>`` format, schemas from docstrings, running tools with
time limits, and `ToolEnv` answering every call (errors included) without raising."""

from __future__ import annotations

import threading
import time

import pytest

from rlblocks.envs import ModelTurn, ToolCall, ToolEnv, calculator, parse_tool_calls, tool_schema
from rlblocks.envs.tools import MAX_DEPTH, call_tool, nesting_depth


def turn(text: str, index: int = 0) -> ModelTurn:
    return ModelTurn(text, tuple(parse_tool_calls(text)), index)


# ---------------------------------------------------------------------- parsing
def test_parse_well_formed_calls():
    text = (
        "First <tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2+3"}}\n'
        "</tool_call> then <tool_call>"
        '{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}'  # arguments as a JSON string
        "</tool_call> done"
    )
    assert parse_tool_calls(text) == [
        ToolCall(
            "calculator",
            {"expression": "2+3"},
            text='{"name": "calculator", "arguments": {"expression": "2+3"}}',
        ),
        ToolCall(
            "lookup", {"key": "a"}, text='{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}'
        ),
    ]
    assert parse_tool_calls("no call here, <tool> either") == []
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>') == [
        ToolCall("f", {}, text='{"name": "f"}')
    ]


@pytest.mark.parametrize(
    ("text", "name", "error"),
    [
        ("<tool_call>{name: calculator}</tool_call>", None, "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', None, 'needs a "name"'),
        ('<tool_call>["calculator"]</tool_call>', None, 'needs a "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "f", "must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', "f", "must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": {}}', None, "never closed"),
    ],
)
def test_parse_malformed_calls(text, name, error):
    (call,) = parse_tool_calls(text)
    assert call.name == name and error in call.error


def test_nesting_is_measured_outside_strings_and_bounded_before_parsing():
    assert nesting_depth('{"a": [1, {"b": "[[[{{"}], "c": "\\"]"}') == 3  # strings do not count
    assert nesting_depth("[" * 100_000) == 100_000  # one pass, no recursion

    def call_nesting(levels: int) -> str:  # the object and its arguments are 2 levels
        inner = "[" * (levels - 2) + "]" * (levels - 2)
        return f'<tool_call>{{"name": "f", "arguments": {{"x": {inner}}}}}</tool_call>'

    (call,) = parse_tool_calls(call_nesting(MAX_DEPTH))
    assert call.error is None and call.name == "f"
    (call,) = parse_tool_calls(call_nesting(MAX_DEPTH + 1))
    assert call.error == "the tool call nests brackets 33 deep, more than the 32 allowed"
    (call,) = parse_tool_calls(call_nesting(MAX_DEPTH + 1), max_depth=MAX_DEPTH + 1)
    assert call.error is None


# ---------------------------------------------------------------------- schema
def test_schema_from_the_docstring():
    assert tool_schema(calculator) == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression and return its value.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": 'The expression, e.g. "(12 + 7) * 3": numbers, '
                        "+ - * / // % ** and parentheses.",
                    }
                },
                "required": ["expression"],
            },
            "return": {"type": "string"},
        },
    }


def test_a_tool_without_docstring_is_refused():
    def bare(x: int) -> int:
        return x

    with pytest.raises(Exception, match="no docstring"):
        ToolEnv([bare])


# ---------------------------------------------------------------------- running tools
def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def test_call_tool_returns_results_and_errors_as_text():
    assert call_tool(calculator, {"expression": "6 * 7"}, timeout=5) == "42"
    assert call_tool(lambda: {"a": [1, 2]}, {}, timeout=5) == '{"a": [1, 2]}'
    assert call_tool(calculator, {"expression": "1/0"}, timeout=5) == (
        "Error: CalculatorError: division by zero"
    )
    wrong = call_tool(calculator, {"expr": "1"}, timeout=5)
    assert wrong.startswith("Error: TypeError:") and "expr" in wrong


def test_a_tool_past_its_time_limit_is_an_error_and_does_not_block():
    start = time.monotonic()
    answer = call_tool(sleepy, {"seconds": 30}, timeout=0.2)
    took = time.monotonic() - start
    assert answer == "Error: sleepy did not finish within 0.2 s; it was stopped"
    assert took < 2.0  # waited 0.2 s, not 30 s (2 s: room for a loaded 2-core machine)
    # The call ran in a worker process, killed with it: no thread of it is left here
    # (tests/envs/test_runners.py checks the processes).
    assert not [t for t in threading.enumerate() if t.name == "tool-sleepy"]


# ---------------------------------------------------------------------- ToolEnv
def test_tool_env_answers_every_call_in_order():
    env = ToolEnv([calculator, sleepy], timeout={"sleepy": 0.2})
    assert env.timeouts == {"calculator": 5.0, "sleepy": 0.2}
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "(2 + 3) * 4"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
        "<tool_call>not json</tool_call>"
        '<tool_call>{"name": "sleepy", "arguments": {"seconds": 5}}</tool_call>'
    )
    step = env.step(turn(text), {"metadata": {}, "messages": []})
    assert not step.done
    assert [m["role"] for m in step.messages] == ["tool"] * 4
    assert [m["name"] for m in step.messages] == ["calculator", "search", "unknown", "sleepy"]
    contents = [m["content"] for m in step.messages]
    assert contents[0] == "20"
    assert contents[1] == "Error: no tool named 'search'; the tools are ['calculator', 'sleepy']"
    assert contents[2].startswith("Error: the tool call is not valid JSON")
    assert contents[3] == "Error: sleepy did not finish within 0.2 s; it was stopped"
    assert step.info == {"tool_calls": 4, "tool_errors": 3, "malformed": 1}


def test_a_turn_without_a_call_ends_the_episode_and_is_scored():
    def exact(completion: str, ground_truth: str, **_: object) -> float:
        return float(completion.strip() == ground_truth)

    env = ToolEnv([calculator], reward=exact, system_prompt="Use the calculator.")
    messages = env.reset("What is 2 + 3?", {"ground_truth": "5"})
    assert messages == [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    assert env.step(turn("5"), {}).done
    state = {
        "metadata": {"ground_truth": "5"},
        "messages": [*messages, {"role": "assistant", "content": " 5 "}],
    }
    assert env.reward(state) == 1.0
    state["messages"].append({"role": "assistant", "content": "6"})
    assert env.reward(state) == 0.0
    assert ToolEnv([calculator]).reward(state) == 0.0  # no reward function: 0


def test_examples_come_before_the_task_after_its_system_message():
    shown = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
    ]
    env = ToolEnv([calculator], system_prompt="Use the calculator.", examples=shown)
    first = env.reset("What is 2 + 3?", {})
    assert first == [
        {"role": "system", "content": "Use the calculator."},
        *shown,
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    first[1]["content"] = "changed"  # each episode gets its own copies
    assert env.reset("What is 2 + 3?", {})[1] == shown[0]
    without_system = ToolEnv([calculator], examples=shown).reset("What is 2 + 3?", {})
    assert without_system == [*shown, {"role": "user", "content": "What is 2 + 3?"}]


def test_calls_past_the_limit_of_a_turn_are_not_run():
    env = ToolEnv([calculator], max_calls_per_turn=2)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    step = env.step(turn(call * 3), {})
    assert [m["content"] for m in step.messages] == [
        "2",
        "2",
        "Error: more than 2 tool calls in one turn",
    ]


def test_tool_env_settings_are_checked():
    with pytest.raises(ValueError, match="timeouts for tools it does not have: \\['nope'\\]"):
        ToolEnv([calculator], timeout={"nope": 1.0})
    with pytest.raises(ValueError, match="timeouts must be > 0"):
        ToolEnv([calculator], timeout=0)
    with pytest.raises(ValueError, match="two tools share a name"):
        ToolEnv([calculator, calculator])
