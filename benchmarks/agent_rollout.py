"""What does the multi-turn agent loop cost next to the engine, and does the model call tools?

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/agent_rollout.py [--model tiny]

One ``rb.envs.AgentEngine.generate`` over ``rb.envs.ToolEnv([rb.envs.calculator])`` (reward:
``rb.rewards.math_answer_score`` against the ground truth) on ``--prompts`` chat prompts of
``rb.data.arithmetic_prompts(seed=1)``, ``--n`` episodes each, ``--max-turns`` turns, on an
``HFEngine`` around the model (default the built-in ``"smollm2-135m"``; ``--model tiny`` is the
test model with a 2,048-token context, room for the tools' description, for a quick check).

The engine is a subclass of ``HFEngine`` that sums the seconds of its ``generate`` calls; the
agent loop's own cost is the call's total minus that (template renderings, tokenization of the
observations, the tools, building the batch). One row is printed: the settings, the times, the
tool-call rate and how the episodes ended, and the prompt lengths. Then the observation rule
alone (``ChatFormat.observation_ids`` for one tool message after a one-exchange conversation,
what each continuing episode costs per turn): the mean of 200 calls.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import rlblocks as rb


class TimedHFEngine(rb.rollout.HFEngine):
    """``HFEngine`` that sums the wall time of its ``generate`` calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds, self.calls = 0.0, 0

    def generate(self, prompts, **kwargs):
        start = time.perf_counter()
        try:
            return super().generate(prompts, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def exact_answer(completion: str, ground_truth: str, **_: Any) -> float:
    return rb.rewards.math_answer_score(completion, ground_truth)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--stop", nargs="*", default=[])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model == "tiny":
        model, tokenizer = rb.models.tiny(max_position_embeddings=2048)
    else:
        model, tokenizer = rb.models.load(args.model)
    engine = TimedHFEngine(model, tokenizer, progress=False)
    agent = rb.envs.AgentEngine(
        engine, rb.envs.ToolEnv([rb.envs.calculator], reward=exact_answer), max_turns=args.max_turns
    )
    data = rb.data.arithmetic_prompts(n=args.prompts, chat=True, seed=1)
    sampling = rb.SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        stop=tuple(args.stop),
        seed=args.seed,
    )
    start = time.perf_counter()
    ro = agent.generate(data.prompts, group_size=args.n, sampling=sampling, metadata=data.metadata)
    total = time.perf_counter() - start
    _, metrics = rb.envs.env_reward(ro)
    lengths = ro.prompt_mask.sum(-1)
    ends = ", ".join(
        f"{metrics[f'agent/end/{end}'] * len(ro):.0f} {end}"
        for end in rb.envs.ENDS
        if metrics[f"agent/end/{end}"]
    )
    result = {
        "episodes": len(ro),
        "total": total,
        "engine": engine.seconds,
        "loop": total - engine.seconds,
        "engine_calls": engine.calls,
        "tool_calls": metrics["agent/tool_calls"] * len(ro),
        "tool_call_rate": metrics["agent/tool_call_rate"],
        "reward": metrics["reward/mean"],
        "ends": ends,
    }
    stop = " ".join(args.stop) or "none"
    print(
        f"model {args.model}, {args.threads} thread(s), T={args.temperature}, "
        f"{args.max_new_tokens} new tokens, stop {stop}, max_turns {args.max_turns}; "
        f"prompt tokens {int(lengths.min())}-{int(lengths.max())}"
    )
    print(
        "| episodes | total s | engine s | agent loop s | engine calls | tool-call rate | "
        "reward | ended |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {len(ro)} | {total:.2f} | {engine.seconds:.2f} | {total - engine.seconds:.3f} | "
        f"{engine.calls} | {metrics['agent/tool_call_rate']:.3f} | {metrics['reward/mean']:.3f} "
        f"| {ends} |"
    )
    conversation = [*agent.env.reset("What is 2 + 3?", {}), {"role": "assistant", "content": "x"}]
    start = time.perf_counter()
    for _ in range(200):
        agent.chat.observation_ids(conversation, [{"role": "tool", "content": "5"}], [1, 2])
    result["observation_ms"] = (time.perf_counter() - start) / 200 * 1e3
    print(f"observation rule: {result['observation_ms']:.2f} ms per call (mean of 200)")
    return result


if __name__ == "__main__":
    main()
