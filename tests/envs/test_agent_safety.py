"""Nothing a model or a tool writes raises out of `AgentEngine.generate`: each failure is an
error observation the model reads, counted in the episode's info.

The model's text is the input under test, so `agent_cases.ScriptedEngine` writes it: its turn
k answers every episode with the token ids of a scripted text (a real rollout engine for the
agent loop: it takes token-id prompts and returns ``Rollouts``). Everything after the text runs
for real:
the default parser, `ToolEnv` with its worker process, the tiny model's chat template, the
tokenizer and the observation rule.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from agent_cases import ScriptedEngine

from rlblocks.envs import AgentEngine, EnvStep, ToolEnv, calculator, env_reward
from rlblocks.envs.base import initial_messages


@pytest.fixture
def tool_env():
    """Builds `ToolEnv`s and stops their worker processes after the test."""
    made: list[ToolEnv] = []

    def make(tools: list, **kwargs: Any) -> ToolEnv:
        made.append(ToolEnv(tools, **kwargs))
        return made[-1]

    yield make
    for env in made:
        env.close()


def call(name: str, arguments: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def episode(turns: list[str], env: Any) -> dict:
    """One episode of ``env`` on the scripted turns; its ``metadata["agent"]``, with the
    batch's `env_reward` metrics under ``"metrics"``."""
    agent = AgentEngine(ScriptedEngine(turns), env, max_turns=len(turns))
    ro = agent.generate(["Use the tools."])
    return {**ro.metadata[0]["agent"], "metrics": env_reward(ro).metrics}


def tool_messages(info: dict) -> list[str]:
    return [m["content"] for m in info["messages"] if m["role"] == "tool"]


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        # ~500 tiny-model tokens of brackets: json.loads raised RecursionError out of generate.
        ("[" * 1000 + "]" * 1000, "the tool call nests brackets 1001 deep, more than the 32"),
        # Python refuses to read an integer literal past 4300 digits: a ValueError escaped too.
        ('{"expression": ' + "7" * 5000 + "}", "Exceeds the limit (4300 digits)"),
    ],
)
def test_model_text_the_parser_cannot_read_is_an_error_observation(tool_env, arguments, error):
    info = episode([call("calculator", arguments), "The answer is 4."], tool_env([calculator]))
    assert info["end"] == "done" and info["turns"] == 2  # the episode went on
    assert info["malformed"] == info["tool_errors"] == info["tool_calls"] == 1
    assert info["metrics"]["agent/malformed"] == info["metrics"]["agent/tool_errors"] == 1.0
    (content,) = tool_messages(info)
    assert content.startswith("Error: ") and error in content, content[:300]


def tuple_keys() -> dict:
    """Map pairs to their sum."""
    return {(1, 2): 3}


def huge_int() -> int:
    """A number with 5001 digits."""
    return 10**5000


def cycle() -> list:
    """A list that holds itself."""
    items: list = []
    items.append(items)
    return items


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no str")

    __repr__ = __str__


def unprintable() -> Unprintable:
    """An object neither JSON nor repr can show."""
    return Unprintable()


def lone_surrogate() -> str:
    """Text no tokenizer takes."""
    return "a\ud800b"


def test_results_json_cannot_encode_are_observations_not_a_dead_batch(tool_env):
    # Before: json.dumps raised in ToolEnv (TypeError, ValueError), and the tokenizer raised on
    # the surrogate: every case killed generate with a RuntimeError from ToolEnv.step.
    tools = [tuple_keys, huge_int, cycle, unprintable, lone_surrogate]
    info = episode(["".join(call(t.__name__) for t in tools), "Done."], tool_env(tools))
    assert info["end"] == "done" and info["tool_calls"] == 5
    keys, digits, loop, broken, surrogate = tool_messages(info)
    assert keys == "{(1, 2): 3}"  # not JSON: its repr
    assert loop == "[[...]]"
    assert digits.startswith("Error: the tool's result (a int) cannot be shown as text")
    assert "Exceeds the limit (4300 digits)" in digits
    assert broken == (
        "Error: the tool's result (a Unprintable) cannot be shown as text: RuntimeError: no str"
    )
    assert surrogate == "a?b"
    assert info["tool_errors"] == 2


class ContentNoneEnv:
    """Answers the first turn with a tool message whose content is None (OpenAI's "no
    content"), then ends."""

    tools = ()

    def reset(self, prompt: Any, metadata: dict) -> list[dict]:
        return initial_messages(prompt)

    def step(self, turn, state: dict) -> EnvStep:
        if turn.index == 1:
            return EnvStep(done=True)
        return EnvStep([{"role": "tool", "content": None}, {"role": "user", "content": 7}])

    def reward(self, state: dict) -> float:
        return 1.0


def test_an_observation_with_content_none_is_rendered_as_empty_text():
    # Before: the tiny model's ChatML template concatenated None (TypeError out of generate).
    engine = ScriptedEngine(["hello", "bye"])
    agent = AgentEngine(engine, ContentNoneEnv(), max_turns=2)
    ro = agent.generate(["Say hello."])
    info = ro.metadata[0]["agent"]
    assert info["end"] == "done" and info["turns"] == 2
    observation = ro.response_ids[0][ro.response_attention_mask[0] & ~ro.response_mask[0]]
    expected = (
        "\n<|im_start|>tool\n<|im_end|>\n<|im_start|>user\n7<|im_end|>\n<|im_start|>assistant\n"
    )
    assert engine.tokenizer.decode(observation) == expected  # None as "", 7 as its text


def flood() -> str:
    """Ten million characters."""
    return "x" * 10_000_000


def test_a_huge_result_is_cut_with_a_marker_and_the_turn_renders_fast(tool_env):
    env = tool_env([flood], timeout=30.0)
    start = time.perf_counter()
    info = episode([call("flood"), "Done."], env)
    took = time.perf_counter() - start
    (content,) = tool_messages(info)
    marker = "\n[... 9992000 more characters cut: the result has 10000000, the limit is 8000]"
    assert content == "x" * 8000 + marker
    assert env.max_result_chars == 8000  # the documented default
    # Before: the 10 MB observation was rendered and tokenized whole (25-35 s here, 9 s on a
    # quieter machine). Now 8 kB of it: the whole episode, the worker's start and the 10 MB
    # string built in the worker included, took 0.2-0.6 s; 5 s leaves room for a loaded
    # 2-core machine and is still far from the uncut cost.
    assert took < 5.0, took
    (content,) = tool_messages(
        episode([call("flood"), "Done."], tool_env([flood], max_result_chars=10))
    )
    assert (
        content
        == "x" * 10
        + "\n[... 9999990 more characters cut: the result has 10000000, the limit is 10]"
    )
