"""Tool calls read by the tokenizer's own response template (transformers' ``parse_response``),
against the hand-written ``<tool_call>`` JSON parser, which stays the fallback.

The templates are real response templates in the shape transformers reads (Qwen3-Coder's XML
calls; the ChatML/Hermes JSON calls of SmolLM-style models), set on the real tiny tokenizer.
"""

from __future__ import annotations

import pytest
from response_templates import HERMES_JSON, QWEN3_XML
from transformers import AutoTokenizer

import rlblocks as rb
from rlblocks.envs import ResponseTemplateParser, parse_tool_calls, tool_call_parser

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}

XML_CALL = (
    "<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n"
    "<parameter=b>\n35\n</parameter>\n</function>\n</tool_call><|im_end|>"
)


def tokenizer_with(template):
    tokenizer = rb.models.tiny_tokenizer()
    tokenizer.response_template = template
    return tokenizer


def read(calls):
    return [(c.name, c.arguments, c.error) for c in calls]


def test_a_template_reads_a_format_the_json_parser_cannot():
    parser = ResponseTemplateParser(tokenizer_with(QWEN3_XML), tools=[ADD])
    assert read(parser(XML_CALL)) == [("add", {"a": 7, "b": 35}, None)]
    # The JSON parser finds the tag but no JSON in it: the call is flagged, not run.
    (flagged,) = parse_tool_calls(XML_CALL)
    assert flagged.name is None and "not valid JSON" in flagged.error
    # Two calls in one turn, in order; a turn without a call has none.
    two = XML_CALL.replace("<|im_end|>", "") + XML_CALL.replace("add", "sub")
    assert [c.name for c in parser(two)] == ["add", "sub"]
    assert parser("The answer is 42.<|im_end|>") == []


@pytest.mark.parametrize(
    "text",
    [
        (
            'First <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> then '
            '<tool_call>{"name": "noop", "arguments": {}}</tool_call><|im_end|>'
        ),
        # arguments written as a JSON string holding the object (some models do)
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>',
        "No call here, just 19.<|im_end|>",
    ],
)
def test_the_template_and_the_json_parser_agree_on_json_calls(text):
    parser = ResponseTemplateParser(tokenizer_with(HERMES_JSON))
    assert read(parser(text)) == read(parse_tool_calls(text))


def test_a_turn_the_template_cannot_read_is_one_error_call_and_nothing_raises():
    parser = ResponseTemplateParser(tokenizer_with(HERMES_JSON))
    bad = '<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call><|im_end|>'
    (call,) = parser(bad)
    assert call.name is None and "cannot be read by the response template" in call.error
    # A thousand brackets: measured before the recursive JSON parser (which raises
    # RecursionError on this text: shown below) ever sees it.
    deep = "<tool_call>" + "[" * 5000 + "</tool_call>"
    with pytest.raises(RecursionError):
        parser.tokenizer.parse_response(deep, schema=HERMES_JSON, prefix="")
    (call,) = parser(deep)
    assert call.name is None and "nests brackets 5000 deep" in call.error
    # Parsed, but not a call the environment can run.
    (nameless,) = parser('<tool_call>{"arguments": {}}</tool_call>')
    assert nameless.name is None and '"name"' in nameless.error
    (listed,) = parser('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>')
    assert listed.name == "add" and "must be a JSON object" in listed.error


def test_the_parser_is_chosen_from_the_tokenizer(tmp_path):
    plain = rb.models.tiny_tokenizer()
    assert tool_call_parser(plain) is parse_tool_calls
    with pytest.raises(ValueError, match="has no response_template"):
        ResponseTemplateParser(plain)
    # A template saved with the tokenizer (tokenizer_config.json) comes back with it.
    tokenizer_with(QWEN3_XML).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    parser = tool_call_parser(loaded, [ADD])
    assert isinstance(parser, ResponseTemplateParser) and parser.tools == [ADD]
    assert read(parser(XML_CALL)) == [("add", {"a": 7, "b": 35}, None)]
