"""`AgentEngine`: multi-turn episodes in an `Environment`, sampled by any `RolloutEngine`.

``AgentEngine(engine, env)`` is itself a rollout engine: ``generate(prompts, group_size=g)``
runs ``g`` episodes per prompt and returns ONE ``Rollouts`` row per episode, so every recipe,
estimator, loss and trainer takes multi-turn rollouts unchanged (``rb.recipes.grpo(policy,
AgentEngine(engine, env), rb.envs.env_reward, batches, ...)``).

One call, turn by turn:

1. Each episode's conversation comes from ``env.reset(prompt, metadata)`` and is rendered with
   the chat template (tools included: `rlblocks.envs.chat`) into the prompt ids.
2. Every active episode's ids so far go to ``engine.generate(ids, group_size=1)`` at once (one batched
   call per turn; prompts as token ids, so nothing sampled is ever re-tokenized). The sampled
   ids and their log-probs are appended as they are, ``response_mask`` True.
3. The turn's text (decoded, special tokens skipped) and its tool calls (read by the
   tokenizer's own response template when it has one, else the ``<tool_call>`` JSON parser:
   `rlblocks.envs.tool_call_parser`) go to
   ``env.step``; its observation messages become ids by the observation rule
   (`rlblocks.envs.ChatFormat.observation_ids`) and are appended with ``response_mask`` False
   and rollout log-prob 0: attended to, never trained on. Nothing the model writes raises here:
   the default parser flags what it cannot read, and `ToolEnv` answers every failure with an
   error message (`rlblocks.envs.tools`); a parser or an environment of your own that raises
   stops the call with an error naming it, the prompt and the turn.
4. When an episode ends, ``env.reward(state)`` gives its reward.

An episode ends, and ``metadata["agent"]["end"]`` says why:

- ``"done"``: the environment said so (a `ToolEnv`: a turn without a tool call);
- ``"max_turns"``: the model has had ``max_turns`` turns (the last observation is not added);
- ``"max_tokens"``: adding the observation and a full next turn (``max_new_tokens``) would pass
  ``max_total_tokens``, prompt included; the row ends with the model's turn. Every row fits:
  prompt + response <= ``max_total_tokens``;
- ``"truncated"``: the turn used all ``max_new_tokens`` without an end-of-turn or EOS token or
  a stop string: a cut-off turn is not handed to the environment.

Sampling: turn k of a call samples with ``seed + k · 1_000_003`` when ``sampling.seed`` is set,
so each turn draws fresh noise and the whole call is reproducible.

The weights live in the wrapped engine: ``update_weights``, ``weight_spec``, ``load_adapter``,
``sleep``, ``wake_up``, ``model`` and ``serves_adapters`` are the wrapped engine's, so a
`rlblocks.resharder.Resharder` syncs through the wrapper (a shared module stays shared). The
wrapped engine may be a placement's handle (a Ray worker group): each turn is then one round
trip, the environment runs in this process, and a sync reaches the workers through this
process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlblocks.envs.base import Environment, Message, ModelTurn, ToolCall, last_answer
from rlblocks.envs.chat import TOOLS_PROMPT, ChatFormat, ControlText
from rlblocks.envs.tools import tool_call_parser
from rlblocks.interfaces import Handle, Prompt, RolloutEngine, SamplingParams, WeightSpec
from rlblocks.models.context import context_length
from rlblocks.rollout.base import EngineBase, Request
from rlblocks.rollout.prompts import check_metadata
from rlblocks.rollouts import Rollouts

SEED_STRIDE = 1_000_003
"""Turn k of a seeded call samples with ``seed + k * SEED_STRIDE``."""

ENDS = ("done", "max_turns", "max_tokens", "truncated")
"""Why an episode ended (module docstring)."""


@dataclasses.dataclass
class _Episode:
    """One episode's sequence as it grows, and what it counted."""

    prompt: int  # index of its prompt in the call
    prompt_ids: list[int]
    prompt_text: str
    state: dict[str, Any]
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turn_rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    counts: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"turns": 0, "tool_calls": 0, "tool_errors": 0, "malformed": 0}
    )
    end: str | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def append(self, ids: list[int], mask: list[bool], logprobs: list[float]) -> None:
        self.ids += ids
        self.mask += mask
        self.logprobs += logprobs


class AgentEngine(EngineBase):
    """Multi-turn episodes of ``env`` sampled by ``engine``; implements ``RolloutEngine``.

    ``engine``: any rollout engine (``HFEngine``, ``VLLMEngine``, a placement's handle on one).
    ``env``: an `Environment` (`ToolEnv`, or any object with its methods). ``max_turns``: model
    turns per episode. ``max_total_tokens``: the longest row, prompt included; None: the
    context of the engine's model when it lives in this process, else no limit of ours (the
    engine's own check then raises for a turn past its context). ``parser``: reads the tool
    calls of a turn's text; None: `rlblocks.envs.tool_call_parser` of the engine's tokenizer
    (its own ``response_template`` when it has one, else the ``<tool_call>`` JSON format). A
    parser with ``skip_special_tokens = False`` gets the turn with its special tokens kept,
    any other the text the environment sees. ``sampling``:
    the default ``SamplingParams`` (None: the wrapped engine's ``sampling``). ``tools_prompt``:
    how the tools are described to a model whose chat template ignores them (`ChatFormat`).
    ``control_text``: what becomes of the tokenizer's control tokens (``<|im_end|>``, ...) in
    the environment's text: made plain text (``"escape"``), refused, or kept (`ChatFormat`).

    ``generate`` (contract: `rlblocks.interfaces.RolloutEngine.generate`) runs ``g`` episodes
    per prompt, one row each. ``prompt_ids``: the rendered first prompt; ``response_ids``:
    every later token, model turns and observations, ``response_mask`` True on the model's
    sampled tokens only, ``rollout_logprobs`` the engine's at those tokens and 0 elsewhere.
    ``completions``: the decoded response (observations included). ``metadata[r]``: prompt
    ``i``'s metadata plus ``"agent"``: ``reward`` (the environment's), ``turn_rewards``,
    ``turns``, ``tool_calls``, ``tool_errors``, ``malformed``, ``end`` (module docstring),
    ``answer`` (the last model turn's text) and ``messages`` (the conversation).
    ``extras["turn_rewards"]`` (b t) float32: each per-turn reward on its turn's last token.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        env: Environment,
        *,
        max_turns: int = 4,
        max_total_tokens: int | None = None,
        parser: Callable[[str], Sequence[ToolCall]] | None = None,
        sampling: SamplingParams | None = None,
        tools_prompt: str = TOOLS_PROMPT,
        control_text: ControlText = "escape",
    ) -> None:
        if max_turns < 1:
            raise ValueError(
                f"AgentEngine: max_turns must be >= 1, got {max_turns}; pass a positive count"
            )
        if max_total_tokens is not None and max_total_tokens < 2:
            raise ValueError(
                f"AgentEngine: max_total_tokens must be >= 2, got {max_total_tokens}; pass a "
                "larger limit, or None"
            )
        self.engine = engine
        self.env = env
        self.max_turns = max_turns
        self.tokenizer = engine.tokenizer  # one round trip for a handle, once
        self.parser = parser if parser is not None else tool_call_parser(self.tokenizer, env.tools)
        self.serves_adapters = bool(engine.serves_adapters)
        self.sampling = sampling if sampling is not None else engine.sampling  # type: ignore[attr-defined]  # not in RolloutEngine
        self.chat = ChatFormat(
            self.tokenizer, env.tools, tools_prompt=tools_prompt, control_text=control_text
        )
        model = self.model
        if max_total_tokens is None and isinstance(model, nn.Module):
            max_total_tokens = context_length(model)
        self.max_total_tokens = max_total_tokens
        eos = self.tokenizer.eos_token_id
        ends = {eos} if isinstance(eos, int) else set(eos or [])
        self._turn_ends = ends | set(self.chat.encode(self.chat.closing())[:1])

    @property
    def model(self) -> nn.Module | None:
        """The wrapped engine's module (None for vLLM, or behind a placement's handle, whose
        module is in its workers: nothing is fetched)."""
        return None if isinstance(self.engine, Handle) else self.engine.model

    # ------------------------------------------------------------------ RolloutEngine
    def _generate(self, request: Request) -> Rollouts:
        """``generate`` (`EngineBase`): the episodes of every prompt, turn by turn."""
        prompts, group_size, params = request.prompts, request.group_size, request.sampling
        if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Sequence) or not prompts:
            raise TypeError(
                f"AgentEngine.generate: prompts is {type(prompts).__name__} {prompts!r:.80}, not "
                "a non-empty list of prompts; pass a list (wrap a single prompt in one)"
            )
        meta = check_metadata(request.metadata, len(prompts), owner="AgentEngine")
        episodes = [
            self._start(i, prompt, meta[i])
            for i, prompt in enumerate(prompts)
            for _ in range(group_size)
        ]
        self._check_prompts(episodes, params)
        pad, have_logprobs = None, True
        for turn in range(self.max_turns):
            active = [e for e in episodes if e.end is None]
            if not active:
                break
            seed = None if params.seed is None else params.seed + turn * SEED_STRIDE
            out = self.engine.generate(
                [e.prompt_ids + e.ids for e in active],
                group_size=1,
                sampling=dataclasses.replace(params, seed=seed),
            )
            pad = out.pad_token_id if pad is None else pad
            have_logprobs &= out.rollout_logprobs is not None
            for row, episode in enumerate(active):
                self._turn(episode, out, row, turn, params)
        for episode in episodes:
            episode.state["end"] = episode.end
        return self._rollouts(episodes, meta, pad, have_logprobs)

    def update_weights(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """The wrapped engine's ``update_weights``."""
        self.engine.update_weights(weights, version=version)

    def weight_spec(self) -> WeightSpec | None:
        """The wrapped engine's ``weight_spec``."""
        return self.engine.weight_spec()

    def load_adapter(self, path: str | Path, *, version: int) -> None:
        """The wrapped engine's ``load_adapter``."""
        self.engine.load_adapter(path, version=version)

    def sleep(self) -> None:
        """The wrapped engine's ``sleep``."""
        self.engine.sleep()

    def wake_up(self) -> None:
        """The wrapped engine's ``wake_up``."""
        self.engine.wake_up()

    # ------------------------------------------------------------------ one episode
    def _start(self, i: int, prompt: Prompt, metadata: Mapping[str, Any]) -> _Episode:
        try:
            messages = self.env.reset(prompt, metadata)
        except Exception as error:
            raise RuntimeError(
                f"AgentEngine: {type(self.env).__name__}.reset raised on prompt {i}: {error}; "
                "fix the environment (its traceback is chained above)"
            ) from error
        text, ids = self.chat.prompt(messages)
        if not ids:
            raise ValueError(
                f"AgentEngine: prompt {i} renders to no tokens; give every prompt some text"
            )
        state = {
            "prompt": prompt,
            "metadata": dict(metadata),
            "messages": list(messages),
            "turn": 0,
            "end": None,
        }
        return _Episode(i, ids, text, state)

    def _check_prompts(self, episodes: list[_Episode], params: SamplingParams) -> None:
        """Every first turn must fit: prompt + max_new_tokens <= max_total_tokens."""
        limit = self.max_total_tokens
        if limit is None:
            return
        for row, episode in enumerate(episodes):
            if len(episode) + params.max_new_tokens > limit:
                raise ValueError(
                    f"AgentEngine.generate: prompt {episode.prompt} (row {row}) has "
                    f"{len(episode)} tokens, and with max_new_tokens={params.max_new_tokens} "
                    f"passes max_total_tokens={limit}; shorten the prompt, lower "
                    f"max_new_tokens or raise max_total_tokens"
                )

    def _turn(
        self, episode: _Episode, out: Rollouts, row: int, turn: int, params: SamplingParams
    ) -> None:
        """Append row ``row`` of the engine's answer to ``episode``, then ask the environment."""
        real = out.response_attention_mask[row]
        ids = out.response_ids[row][real].tolist()
        counts = out.response_mask[row][real].tolist()
        logprobs = (
            out.rollout_logprobs[row][real].tolist()
            if out.rollout_logprobs is not None
            else [0.0] * len(ids)
        )
        episode.append(ids, counts, logprobs)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        episode.state["messages"].append({"role": "assistant", "content": text})
        episode.state["turn"] = turn
        episode.counts["turns"] += 1
        if self._cut_off(ids, params):
            episode.end = "truncated"
            return
        if getattr(self.parser, "skip_special_tokens", True):
            calls = self._parse(text, episode, turn)
        else:  # a template that marks its regions with special tokens reads them
            calls = self._parse(self.tokenizer.decode(ids), episode, turn)
        model_turn = ModelTurn(text, calls, turn, tuple(ids))
        try:
            step = self.env.step(model_turn, episode.state)
        except Exception as error:
            raise RuntimeError(
                f"AgentEngine: {type(self.env).__name__}.step raised on prompt {episode.prompt}, "
                f"turn {turn}: {error}; fix the environment (its traceback is chained above)"
            ) from error
        for key, value in step.info.items():
            episode.counts[key] = episode.counts.get(key, 0) + value
        if step.reward is not None and episode.ids:
            episode.turn_rewards.append((len(episode.ids) - 1, float(step.reward)))
        if step.done:
            episode.end = "done"
            return
        if turn + 1 >= self.max_turns:
            episode.end = "max_turns"
            return
        observation = self._observation(step, episode, turn)
        obs_ids = self.chat.observation_ids(episode.state["messages"], observation, ids)
        limit = self.max_total_tokens
        if limit is not None and len(episode) + len(obs_ids) + params.max_new_tokens > limit:
            episode.end = "max_tokens"
            return
        episode.state["messages"].extend(observation)
        episode.append(obs_ids, [False] * len(obs_ids), [0.0] * len(obs_ids))

    def _parse(self, text: str, episode: _Episode, turn: int) -> tuple[ToolCall, ...]:
        """The turn's tool calls. The default parser never raises (a call it cannot read is
        flagged); a parser of your own that raises is a bug in it, named here."""
        try:
            return tuple(self.parser(text))
        except Exception as error:
            name = getattr(self.parser, "__name__", type(self.parser).__name__)
            raise RuntimeError(
                f"AgentEngine: the parser {name} raised on prompt {episode.prompt}, turn {turn}: "
                f"{error}; make it return ToolCall(..., error=...) for text it cannot read (its "
                "traceback is chained above)"
            ) from error

    def _observation(self, step: Any, episode: _Episode, turn: int) -> list[Message]:
        """The observation messages of ``step``, each a chat message with a string role (their
        content may be anything: `ChatFormat` renders None as "" and other values as text)."""
        messages = list(step.messages)
        for k, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise TypeError(
                    f"AgentEngine: {type(self.env).__name__}.step returned observation message "
                    f"{k} {message!r:.80} on prompt {episode.prompt}, turn {turn}, which is not a "
                    'chat message; return dicts with a "role" and a "content"'
                )
        return messages

    def _cut_off(self, ids: list[int], params: SamplingParams) -> bool:
        """True when the turn used every token it had without ending: no EOS / end-of-turn
        token last, and no stop string completed by its last token."""
        if len(ids) < params.max_new_tokens:
            return False  # the engine ended it: an EOS or a stop string
        if ids[-1] in self._turn_ends:  # EOS, or the template's end-of-turn token
            return False
        if params.stop:
            before = self.tokenizer.decode(ids[:-1], skip_special_tokens=False)
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            for stop in params.stop:
                if stop in text[max(0, len(before) - len(stop) + 1) :]:
                    return False
        return True

    # ------------------------------------------------------------------ the batch
    def _rollouts(
        self,
        episodes: list[_Episode],
        meta: list[Mapping[str, Any]],
        pad: int | None,
        have_logprobs: bool,
    ) -> Rollouts:
        rows = []
        for episode in episodes:
            try:
                reward = float(self.env.reward(episode.state))
            except Exception as error:
                raise RuntimeError(
                    f"AgentEngine: {type(self.env).__name__}.reward raised on prompt "
                    f"{episode.prompt}: {error}; fix the environment (its traceback is chained "
                    "above)"
                ) from error
            messages = episode.state["messages"]
            rows.append(
                {
                    **meta[episode.prompt],
                    "agent": {
                        "reward": reward,
                        "turn_rewards": [r for _, r in episode.turn_rewards],
                        **episode.counts,
                        "end": episode.end,
                        "answer": last_answer(messages),
                        "messages": messages,
                    },
                }
            )
        ro = Rollouts.from_lists(
            [e.prompt_ids for e in episodes],
            [e.ids for e in episodes],
            pad_token_id=0 if pad is None else pad,
            response_masks=[e.mask for e in episodes],
            rollout_logprobs=[e.logprobs for e in episodes] if have_logprobs else None,
            group_ids=[e.prompt for e in episodes],
            prompts=[e.prompt_text for e in episodes],
            completions=self.tokenizer.batch_decode(
                [e.ids for e in episodes], skip_special_tokens=True
            ),
            metadata=rows,
        )
        turn_rewards = torch.zeros(ro.response_ids.shape, dtype=torch.float32)
        for b, episode in enumerate(episodes):
            for position, reward in episode.turn_rewards:
                turn_rewards[b, position] += reward
        return ro.with_extras(turn_rewards=turn_rewards)


__all__ = ["ENDS", "SEED_STRIDE", "AgentEngine"]
