"""Shared set-up of the agent rollout tests: an environment whose observations do not depend on
what the model writes, a recording engine, the expected rows rebuilt from the recordings, and
an engine that writes scripted text (for what a model may write that the loop must survive).

The tiny model writes noise, so the main tests drive the episodes with `ScriptedEnv`: each turn
is answered with a fixed user message (``Observation k: go on``) until ``turns`` turns are done.
The expected observation ids are written out from the tiny model's ChatML template by hand
here (`chatml_observation`), independently of `rlblocks.envs.ChatFormat`.
"""

from __future__ import annotations

from typing import Any

import torch

import rlblocks as rb
from rlblocks.envs import EnvStep, ModelTurn
from rlblocks.envs.base import initial_messages

PROMPTS = ["What is 2 + 3?", "Say hi", "7 times 8"]
# Turns end at a space (the tiny model's noise has one within a few tokens) or after 8 tokens.
SAMPLING = rb.SamplingParams(max_new_tokens=8, stop=(" ",), seed=0)


class ScriptedEnv:
    """Answers turn k with ``Observation k: go on`` (a user message) until ``turns`` model turns
    are done; per-turn reward 0.25 · (k + 1); final reward: the number of turns it saw."""

    tools = ()

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns

    def reset(self, prompt: Any, metadata: dict) -> list[dict]:
        return initial_messages(prompt)

    def step(self, turn: ModelTurn, state: dict) -> EnvStep:
        state.setdefault("seen", []).append(turn.token_ids)
        if turn.index + 1 >= self.turns:
            return EnvStep(done=True, reward=0.25 * (turn.index + 1))
        message = {"role": "user", "content": f"Observation {turn.index}: go on"}
        return EnvStep([message], reward=0.25 * (turn.index + 1))

    def reward(self, state: dict) -> float:
        return float(len(state.get("seen", [])))


class ScriptedEngine:
    """A rollout engine whose k-th call answers every prompt with ``turns[k]`` (the last one
    again after the script ends), then ``<|im_end|>``: the model's text, exactly."""

    model = None  # no module here: AgentEngine sets no token limit of its own
    serves_adapters = False

    def __init__(self, turns: list[str]) -> None:
        self.turns, self.calls = turns, 0
        self.tokenizer = rb.models.tiny_tokenizer()
        self.sampling = rb.SamplingParams(max_new_tokens=4096)

    def generate(self, prompts, *, group_size=1, sampling=None, metadata=None) -> rb.Rollouts:
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return rb.Rollouts.from_lists(
            [list(p) for p in prompts],
            [ids] * len(prompts),
            rollout_logprobs=[[0.0] * len(ids)] * len(prompts),
        )


class RecordingHFEngine(rb.rollout.HFEngine):
    """The real HF engine; every ``generate`` call's prompts and answer are kept in ``calls``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list, rb.Rollouts]] = []

    def generate(self, prompts, **kwargs):
        out = super().generate(prompts, **kwargs)
        self.calls.append(([list(p) for p in prompts], out))
        return out


def chatml_observation(tokenizer: Any, sampled: list[int], text: str) -> list[int]:
    """The ids the tiny ChatML template puts after a model turn and before the next: the
    ``<|im_end|>`` (unless the model sampled it), a newline, the user message, the next
    assistant header. Written from the template by hand."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    closing = "\n" if sampled and sampled[-1] == im_end else "<|im_end|>\n"
    rendered = f"{closing}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def expected_rows(engine: Any, ro: rb.Rollouts, tokenizer: Any) -> list[dict]:
    """For each row of ``ro``: the response ids, mask and log-probs rebuilt from the engine's
    recorded calls (the sampled ids of each turn) and `chatml_observation` (the ids between
    turns): the sequence the row must hold.

    Call k's rows are the episodes still going, in row order: call 0 has every episode, and an
    episode is in call k + 1 when its sequence + sampled ids + observation is the next prompt
    there (checked in order, so identical episodes of one prompt are told apart by position).
    """
    b = len(ro)
    sequences = [ro.prompt_ids[r][ro.prompt_mask[r]].tolist() for r in range(b)]
    rows = [{"ids": [], "mask": [], "logprobs": []} for _ in range(b)]
    active = list(range(b))
    for k, (prompts, out) in enumerate(engine.calls):
        assert prompts == [sequences[r] for r in active], f"call {k} got other prompts"
        following = engine.calls[k + 1][0] if k + 1 < len(engine.calls) else []
        going = []
        for j, r in enumerate(active):
            valid = out.response_mask[j]
            sampled = out.response_ids[j][valid].tolist()
            rows[r]["ids"] += sampled
            rows[r]["mask"] += [True] * len(sampled)
            rows[r]["logprobs"] += out.rollout_logprobs[j][valid].tolist()
            sequences[r] = sequences[r] + sampled
            observation = chatml_observation(tokenizer, sampled, f"Observation {k}: go on")
            if len(going) < len(following) and following[len(going)] == sequences[r] + observation:
                rows[r]["ids"] += observation
                rows[r]["mask"] += [False] * len(observation)
                rows[r]["logprobs"] += [0.0] * len(observation)
                sequences[r] = sequences[r] + observation
                going.append(r)
        active = going
    return rows


def model_segments(mask: list[bool]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of True in a row's response mask: the model's turns."""
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def split_into_turns(ro: rb.Rollouts, advantages: torch.Tensor) -> tuple[rb.Rollouts, list]:
    """The single-turn equivalent of a multi-turn batch: each model turn of each row becomes its
    own row whose prompt is everything before the turn (prompt, earlier turns, observations) and
    whose response is the turn, all of it counted. Returns the batch and each new row's
    per-token advantages (the multi-turn row's at those tokens)."""
    prompts, responses, logprobs, advs, groups = [], [], [], [], []
    for r in range(len(ro)):
        prompt = ro.prompt_ids[r][ro.prompt_mask[r]].tolist()
        real = ro.response_attention_mask[r]
        response = ro.response_ids[r][real].tolist()
        mask = ro.response_mask[r][real].tolist()
        for start, end in model_segments(mask):
            prompts.append(prompt + response[:start])
            responses.append(response[start:end])
            logprobs.append(ro.rollout_logprobs[r][real][start:end].tolist())
            advs.append(advantages[r][real][start:end].tolist())
            groups.append(int(ro.group_ids[r]))
    split = rb.Rollouts.from_lists(
        prompts,
        responses,
        pad_token_id=ro.pad_token_id,
        rollout_logprobs=logprobs,
        group_ids=groups,
    )
    t = split.response_ids.shape[1]
    padded = torch.zeros(len(split), t, dtype=torch.float32)
    for i, a in enumerate(advs):
        padded[i, : len(a)] = torch.tensor(a)
    return split, padded
