"""How the untrained model answers under each answer instruction: a screen before the sweep.

    HF_HUB_OFFLINE=1 python benchmarks/instructions.py --validation 140 \
        "Answer with just the number." "Reply with the final number only."

For each instruction (the sentence the main job appends to every problem), the built-in
model answers the main job's validation problems greedily (`rlblocks.app.demo.problems` with
``--validation``: distinct test-split expressions after the 256 held-out ones, never the
held-out set) within ``--max-new-tokens``, scored by ``rb.rewards.math_answer``. It prints one
row per instruction: the accuracy, the share of answers cut off, the accuracy of those that
ended, and two answers. The model is loaded once. An instruction under which the untrained
model already finishes and scores more leaves GRPO more groups with a right and a wrong
answer to learn from; which one trains best is for the sweep (docs/learning.md) to say.
"""

from __future__ import annotations

import argparse

import rlblocks as rb
from rlblocks.app import demo
from rlblocks.app.job import held_out_score


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("instructions", nargs="+", help="answer instructions to compare")
    p.add_argument("--validation", type=int, default=140, help="validation problems")
    p.add_argument("--eval-size", type=int, default=256, help="held-out problems before them")
    p.add_argument("--max-new-tokens", type=int, default=32, help="the answer budget")
    p.add_argument("--model", default="smollm2-135m", help="built-in name or model folder")
    p.add_argument("--task", default="arithmetic", choices=sorted(demo.TASKS))
    args = p.parse_args(argv)
    model, tokenizer = rb.models.load(args.model)
    engine = rb.rollout.HFEngine(model, tokenizer, chat=True, progress=False)
    rows = []
    for text in args.instructions:
        print(f"{text!r}:")
        task = demo.task_of(argparse.Namespace(task=args.task, instruction=text))
        _, problems = demo.problems(
            task, eval_size=args.eval_size, seed=0, validation=args.validation
        )
        scores = held_out_score(
            engine, problems, task.reward, max_new_tokens=args.max_new_tokens, when="score"
        )
        rows.append({"instruction": text, **scores})
    print("\n| instruction | accuracy | cut off | ended-only |\n|---|---|---|---|")
    for row in rows:
        ended = "-" if row["score_ended"] is None else f"{row['score_ended']:.3f}"
        print(f"| {row['instruction']} | {row['score']:.3f} | {row['score_cut']:.2f} | {ended} |")
    return rows


if __name__ == "__main__":
    main()
