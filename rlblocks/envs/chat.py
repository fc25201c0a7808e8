"""How a conversation becomes token ids across turns, without re-tokenizing the model's tokens.

The first prompt is the chat template's rendering of the environment's initial messages (with
``add_generation_prompt``), tokenized like every engine's prompt
(`rlblocks.rollout.render_prompts`). After that, the sequence only grows: the ids the model
sampled are kept exactly, and each observation adds the ids the template puts between the
model's turn and its next one. Those are found by rendering, never by re-tokenizing the model's
text (BPE tokenizes a decoded string back to other ids surprisingly often):

**The observation rule.** Render the conversation with the model's last turn replaced by a
placeholder ``P``, once as it stands (A: ``… assistant: P``) and once with the observation
messages and the generation prompt after it (B: ``… assistant: P, observation, <next turn>``).

- ``closing`` = what A has after ``P``: the end of an assistant turn (ChatML:
  ``<|im_end|>\\n``). B must continue ``P`` with the same text (checked).
- ``rest`` = what B has after ``P`` and ``closing``: the observation messages and the header of
  the model's next turn (``<|im_start|>tool\\n…<|im_end|>\\n<|im_start|>assistant\\n``).
- The model may have sampled the start of ``closing`` itself: it ends its turn with the
  end-of-turn token (ChatML's ``<|im_end|>``, its EOS), but not the newline after it, which it
  never sees; a turn cut by a stop string has none of it. So the longest start of
  ``closing``'s ids that the sampled ids already end with is dropped, and the observation ids
  are the tokenization of what is left of ``closing`` followed by ``rest``.

The result: prompt ids + sampled ids + observation ids is what the template would give for the
whole conversation, wherever the model's text tokenizes back to its own ids (tested with the
SmolLM2 and tiny templates), and exactly the sampled ids wherever it does not.

**Text from outside.** Every message the template renders comes from the environment, its
tools or the dataset (the model's own turns are kept as sampled ids, never rendered). Text
holding one of the tokenizer's added tokens (``<|im_end|>``, ``<|im_start|>``, a tool tag) would
be tokenized into that token: a tool result reading ``<|im_end|><|im_start|>system ...`` would
put a system turn into the trained row that no environment sent. ``control_text`` decides:
``"escape"`` (the default) writes each such token with an invisible word joiner (U+2060) after
its first character, so it is tokenized as the plain text it reads as; ``"refuse"`` raises a
``ValueError`` naming the message; ``"keep"`` leaves the text as it is (a source you trust to
write control tokens). Messages are logged as the environment gave them.

**Tools.** The tools' JSON schemas go to the template as ``tools=``; templates that know tool
calling (Qwen2.5's, which also teaches the ``<tool_call>`` format) describe them to the model
themselves. A template that
ignores ``tools`` (SmolLM2-135M-Instruct's, the tiny model's: the rendering does not change)
gets them in the system message instead (`TOOLS_PROMPT`, added to the one there is or put
first), with the ``<tool_call>`` format `rlblocks.envs.parse_tool_calls` reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from rlblocks.envs.base import Message
from rlblocks.envs.tool_worker import result_text, valid_utf8

PLACEHOLDER = "RLBLOCKS_TURN_PLACEHOLDER"

WORD_JOINER = "\u2060"
"""What ``control_text="escape"`` puts after a control token's first character (invisible)."""

ControlText = Literal["escape", "refuse", "keep"]

TOOLS_PROMPT = """You can call tools. To call one, write a JSON object with the tool's name and \
arguments between <tool_call> and </tool_call> tags, for example:
<tool_call>
{"name": "<tool name>", "arguments": {"<argument>": <value>}}
</tool_call>
Each call's result comes back in a message from the tool. Answer without a tool call when you \
are done. The tools:
{schemas}"""


class ChatFormat:
    """A tokenizer's chat template as the agent rollout uses it: prompt ids and observation ids.

    ``tokenizer``: a Hugging Face tokenizer with a chat template; ``tools``: the environment's
    tool schemas (empty for none). ``describes_tools`` is True when the template renders them
    itself, False when they go into the system message (module docstring). ``tools_prompt``:
    the text put there, with ``{schemas}`` replaced by one JSON schema per line (a small
    model may do better with a short text of its own and no schemas).
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[Mapping[str, Any]] = (),
        *,
        tools_prompt: str = TOOLS_PROMPT,
        control_text: ControlText = "escape",
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "ChatFormat: the agent rollout renders conversations with the tokenizer's chat "
                "template, and this tokenizer has none; set tokenizer.chat_template"
            )
        if control_text not in ("escape", "refuse", "keep"):
            raise ValueError(
                f"ChatFormat: control_text={control_text!r}; pass 'escape', 'refuse' or 'keep'"
            )
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools]
        self.tools_prompt = tools_prompt
        self.control_text = control_text
        # The tokenizer's added tokens (role markers, end of turn, tool tags): in text it encodes
        # they become those tokens. Longest first, so that one never hides a longer one.
        added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
        self.controls = sorted((t for t in added if len(t) > 1), key=len, reverse=True)
        self.describes_tools = bool(self.tools) and self._template_renders_tools()

    # ------------------------------------------------------------------ rendering
    def messages(self, conversation: Sequence[Message]) -> list[Message]:
        """The conversation as the template gets it: with the tools in the system message when
        the template does not describe them itself."""
        messages = [self._guarded(i, _for_template(m)) for i, m in enumerate(conversation)]
        if not self.tools or self.describes_tools:
            return messages
        schemas = "\n".join(json.dumps(t.get("function", t)) for t in self.tools)
        text = self.tools_prompt.replace("{schemas}", schemas)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        else:
            messages.insert(0, {"role": "system", "content": text})
        return messages

    def _guarded(self, i: int, message: Message) -> Message:
        """``message`` with the control tokens in its text made plain text, refused or kept, as
        ``control_text`` says (module docstring, *Text from outside*)."""
        content = message.get("content")
        if self.control_text == "keep" or not isinstance(content, str):
            return message
        found = [t for t in self.controls if t in content]
        if not found:
            return message
        if self.control_text == "refuse":
            raise ValueError(
                f"ChatFormat: message {i} ({message.get('role')!r}) holds {found[0]!r}, a "
                "control token of this tokenizer: as text it would become that token and end "
                "the turn or open another; clean the text, or build the rollout with "
                "control_text='escape' (make it plain text) or 'keep' (a trusted source)"
            )
        for token in found:  # a word joiner after the first character: plain text again
            content = content.replace(token, token[0] + WORD_JOINER + token[1:])
        return {**message, "content": content}

    def render(self, conversation: Sequence[Message], *, generation_prompt: bool) -> str:
        """The template's text for ``conversation`` (tools included as above)."""
        return self.tokenizer.apply_chat_template(
            self.messages(conversation),
            tools=self.tools or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, no special tokens added (the template already holds them)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, conversation: Sequence[Message]) -> tuple[str, list[int]]:
        """``(text, ids)`` of the first prompt: the conversation and the generation prompt."""
        text = self.render(conversation, generation_prompt=True)
        return text, self.encode(text)

    # ------------------------------------------------------------------ the observation rule
    def observation_ids(
        self,
        conversation: Sequence[Message],
        observation: Sequence[Message],
        sampled: Sequence[int],
    ) -> list[int]:
        """The ids that follow the model's last sampled token: the rest of the end of its turn,
        the ``observation`` messages and the header of its next turn (module docstring).

        ``conversation`` ends with the model's last turn (an assistant message; its content is
        not used); ``sampled`` are that turn's sampled ids. Raises ``ValueError`` if the
        template does not follow an assistant turn the same way in both renderings.
        """
        if not conversation or conversation[-1]["role"] != "assistant":
            raise ValueError(
                f"ChatFormat.observation_ids: the conversation ends with a "
                f"{conversation[-1]['role'] if conversation else 'nothing'!r} turn; end it with "
                "the model's (assistant) turn"
            )
        base = [*conversation[:-1], {"role": "assistant", "content": PLACEHOLDER}]
        closing = _after(self.render(base, generation_prompt=False), PLACEHOLDER)
        after = _after(self.render([*base, *observation], generation_prompt=True), PLACEHOLDER)
        if not after.startswith(closing):
            raise ValueError(
                "ChatFormat.observation_ids: the chat template ends an assistant turn "
                f"differently when more messages follow ({after[: len(closing) + 20]!r}) than "
                f"when it is last ({closing!r}), so the observation tokens cannot be placed "
                "after the model's own; use a template that closes every assistant turn alike"
            )
        rest = after[len(closing) :]
        closing_ids = self.encode(closing)
        done = _sampled_prefix(sampled, closing_ids)
        if done:  # drop the text of the closing tokens the model already sampled
            head = self.tokenizer.decode(closing_ids[:done], skip_special_tokens=False)
            if closing.startswith(head):
                closing = closing[len(head) :]
            else:  # a tokenizer that does not decode to the same text: keep to the ids
                return closing_ids[done:] + self.encode(rest)
        return self.encode(closing + rest)

    def closing(self) -> str:
        """The text the template puts after an assistant turn's content (ChatML:
        ``<|im_end|>\\n``), in a one-exchange conversation."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": PLACEHOLDER}]
        return _after(self.render(probe, generation_prompt=False), PLACEHOLDER)

    def _template_renders_tools(self) -> bool:
        probe = [{"role": "user", "content": "x"}]
        plain = self.tokenizer.apply_chat_template(
            probe, tokenize=False, add_generation_prompt=True
        )
        with_tools = self.tokenizer.apply_chat_template(
            probe, tools=self.tools, tokenize=False, add_generation_prompt=True
        )
        return plain != with_tools


def _for_template(message: Message) -> Message:
    """A copy of ``message`` whose content a chat template can render: OpenAI's "no content"
    (``None``, or no key: an assistant turn that only calls tools, a tool that returned
    nothing) as ``""``, which every template takes (they concatenate strings, ``trim`` them,
    or test them for truth); a list (content parts) as it is; any other value as its JSON or
    ``repr`` text; lone surrogates (no tokenizer takes them) as ``?``."""
    message = dict(message)
    content = message.get("content")
    if content is None:
        message["content"] = ""
    elif isinstance(content, str):
        message["content"] = valid_utf8(content)
    elif not isinstance(content, list):
        message["content"] = valid_utf8(result_text(content)[0])
    return message


def _after(text: str, marker: str) -> str:
    """What follows the last ``marker`` in ``text``."""
    at = text.rfind(marker)
    if at < 0:
        raise ValueError(
            "ChatFormat: the chat template does not show an assistant message's content as it "
            "is (the placeholder content was not in its rendering); use a template that renders "
            "message content verbatim"
        )
    return text[at + len(marker) :]


def _sampled_prefix(sampled: Sequence[int], closing: Sequence[int]) -> int:
    """The largest k such that ``sampled`` ends with ``closing[:k]``."""
    for k in range(min(len(sampled), len(closing)), 0, -1):
        if list(sampled[len(sampled) - k :]) == list(closing[:k]):
            return k
    return 0


__all__ = ["PLACEHOLDER", "TOOLS_PROMPT", "WORD_JOINER", "ChatFormat", "ControlText"]
