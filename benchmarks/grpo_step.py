"""What does one GRPO step cost in rlblocks, next to plain PyTorch and to TRL, on SmolLM2-135M?

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 nice -n 19 python benchmarks/grpo_step.py [--beta 0.04]

One step: ``--group-size`` responses to each of ``--prompts`` chat prompts, the math-answer
reward, rewards standardized within each group, one clipped-surrogate update (ε = (0.2, 0.28),
token-mean loss, gradient norm clipped to 1, AdamW) of every weight. Three systems do it on the
same model (default the built-in ``"smollm2-135m"``, float32), the same prompts at each step
index and the same shapes:

- **floor**: transformers and torch only, written here: the chat template, ``model.generate``
  (T = 1, no top-k / top-p), the reward, one forward with ``logits_to_keep`` over the response
  tokens and its backward, ``clip_grad_norm_``, ``torch.optim.AdamW``. On-policy with one
  update the ratio is 1, so π_old is the detached current log-prob: no extra forward.
- **rlblocks**: what a user writes: ``PolicyTrainer.from_pretrained(model, lr=...,
  reference=None)``, an ``HFEngine`` sharing its model, ``rb.recipes.grpo(...,
  loss_fn=partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28)))`` with its defaults: the
  engine samples with the trainer's own module, so its log-probs are π_old and nothing is
  scored before the update (``rlblocks-recompute`` scores π_old anyway, one forward more).
- **rlblocks-async**: the same recipe one step off (``run=rb.run.RunOptions(staleness=1,
  old_logprobs="rollout")``): the engine, on its own copy of the weights, samples the next
  batch in a thread while the trainer updates; π_old is the engine's log-probs
  (``rlblocks-async-recompute`` scores it with the trainer). With ``--threads 1`` the two
  sides run on two cores where the others run on one: that is the point of it, on a machine
  whose cores the sequential systems leave idle. Its run takes one more step at the end, left
  out like the warm-up (a run's last step has no next batch to overlap with).
- **trl**: ``trl.GRPOTrainer`` (skipped without trl) on a model object from the same file, its
  tokenizer as ``processing_class``, a ``datasets.Dataset`` whose "prompt" column holds the
  same chat messages in step order (``shuffle_dataset=False``); ``per_device_train_batch_size
  = generation_batch_size = prompts × group size`` and ``num_generations = group size`` make
  one generation and one optimizer step a step. TRL's defaults otherwise (``loss_type="dapo"``,
  ``optim="adamw_torch_fused"``), with ``epsilon_high=0.28``, a constant learning rate,
  ``use_cpu=True``, no bf16 / fp16, logging, saving or evaluation.

``--beta`` > 0 adds the KL loss β·k3 everywhere: ``rb.losses.kl_regularized`` with
``reference="copy"``, TRL's ``beta`` (its reference loaded from the same folder), a frozen copy
scored without grad in the floor.

**EOS and equal shapes.** Every response is exactly ``--max-new-tokens`` long, because EOS is
held back until then: ``SamplingParams(min_new_tokens=max_new_tokens)`` in rlblocks,
``generation_kwargs={"min_new_tokens": N}`` in TRL (checked to reach its ``GenerationConfig``),
``min_new_tokens`` in the floor's ``generate``; in all three Hugging Face's
``MinNewTokensLengthLogitsProcessor`` sets the EOS logits to −inf. The ``tok/step`` column
(prompt + response tokens, each system's own count) shows the work is equal, and the run stops
if a system's responses are not all that long.

**Protocol.** ``--repeats`` rounds; in round r each system runs ``--steps`` steps on a model
loaded fresh, seeded with ``--seed``, in an order rotated by r, so that a busy spell of the
shared machine does not always hit the same system. The first step of a run is a warm-up, left
out. Per system: the median seconds of all timed steps, the spread (lowest and highest median
of a round), and the median of each phase:

    rollout    generation (rlblocks time/rollout; TRL's "transformers.generate" block)
    reward     the reward (the floor: and the advantages)
    logprobs   no-grad scoring before the update: π_old and π_ref in rlblocks (time/logprobs,
               which the recipe loop takes out of time/update), π_ref in the floor and TRL
    update     forward, backward, clipping, optimizer step (rlblocks time/update; TRL: from
               the end of its _prepare_inputs to the end of the optimizer step)
    sync       weights into the engine (rlblocks time/sync; the model is shared: ~0)
    other      the rest of the step (advantages in rlblocks, batching in TRL)

TRL times its phases in ``profiling_context`` blocks that report only to wandb / mlflow /
trackio: ``ProfilingContext._log_metrics`` is wrapped here to record them. A TRL step is timed
by a ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end``.

**Adding a system** is a function ``(Setup) -> list[StepTime] | None`` and an entry in
``SYSTEMS``; a variant of the recipe is a ``partial`` of ``run_rlblocks`` with
`rlblocks.run.RunOptions` keywords, as ``rlblocks-recompute`` and ``rlblocks-async`` are. ``torch.set_num_threads(--threads)`` is called before every run and the count
seen during the steps printed. ``--model tiny`` runs it all in seconds (the test suite does).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
import transformers
from transformers import GenerationConfig

import rlblocks as rb
from rlblocks.data import PromptBatch, PromptBatches, arithmetic_prompts
from rlblocks.rewards.math import math_answer_score
from rlblocks.trainer.allocator import keep_freed_memory

CLIP = (0.2, 0.28)  # DAPO clip-higher: ratio kept in [1 − 0.2, 1 + 0.28]
PHASES = ("rollout", "reward", "logprobs", "update", "sync")


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every system is given: the same model file, prompts and shapes."""

    model: str
    batches: tuple[PromptBatch, ...]
    """One batch of prompts per step, the same for every system."""
    group_size: int
    max_new_tokens: int
    lr: float
    beta: float
    seed: int

    @property
    def rows(self) -> int:
        return len(self.batches[0]) * self.group_size


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One step of one system."""

    seconds: float
    phases: dict[str, float]
    """Seconds per phase of ``PHASES``; the rest of ``seconds`` is "other"."""
    tokens: int
    """Prompt + response tokens of the step (equal work check)."""
    response_tokens: int
    threads: int


System = Callable[[Setup], "list[StepTime] | None"]


# ---------------------------------------------------------------------- floor
def response_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, t: int
) -> torch.Tensor:
    """log π(y_k) of the last ``t`` tokens of each row, (b t) float32: one forward, only the
    t positions that predict them go through the LM head."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding, as generate counts them
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=t + 1)
    logits = out.logits[:, :-1].float()  # position j predicts token j + 1
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -t:, None])[..., 0]


def floor_generate(
    model: torch.nn.Module, tokenizer, prompts: list, group_size: int, config: GenerationConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + response ids (b s) and the prompt's attention mask (b tp), group_size rows a
    prompt: the chat template, left padding (rb.models.load sets it), ``model.generate``."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
             for p in prompts]  # fmt: skip
    enc = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    prompt_ids = enc.input_ids.repeat_interleave(group_size, 0)
    prompt_mask = enc.attention_mask.repeat_interleave(group_size, 0)
    with torch.no_grad():
        ids = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                             generation_config=config)  # fmt: skip
    return ids, prompt_mask


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r − mean of its group) / (std of its group + 1e-6), (b 1): GRPO's outcome advantage."""
    groups = rewards.view(-1, group_size)
    mean, std = groups.mean(-1, keepdim=True), groups.std(-1, keepdim=True)
    return ((groups - mean) / (std + 1e-6)).view(-1, 1)


def run_floor(setup: Setup) -> list[StepTime]:
    model, tokenizer = rb.models.load(setup.model)
    reference = copy.deepcopy(model).requires_grad_(False) if setup.beta else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
    eos, n, g = tokenizer.eos_token_id, setup.max_new_tokens, setup.group_size
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
    )  # fmt: skip
    steps = []
    for batch in setup.batches:
        clock = [time.perf_counter()]
        ids, prompt_mask = floor_generate(model, tokenizer, batch.prompts, g, config)
        response = ids[:, prompt_mask.shape[1] :]
        clock.append(time.perf_counter())  # rollout
        truths = [row.ground_truth for row in batch.rows for _ in range(g)]
        texts = tokenizer.batch_decode(response, skip_special_tokens=True)
        rewards = torch.tensor([math_answer_score(c, y) for c, y in zip(texts, truths)])
        advantages = group_advantages(rewards, g)
        clock.append(time.perf_counter())  # reward
        is_eos = (response == eos).long()
        response_mask = is_eos.cumsum(-1) - is_eos == 0  # up to and including the first EOS
        mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
        t = response.shape[1]
        if reference is not None:
            with torch.no_grad():
                ref_logprobs = response_logprobs(reference, ids, mask, t)
        clock.append(time.perf_counter())  # logprobs
        model.train()
        logprobs = response_logprobs(model, ids, mask, t)
        ratio = torch.exp(logprobs - logprobs.detach())  # 1, with the gradient of π_θ
        clipped = ratio.clamp(1 - CLIP[0], 1 + CLIP[1])
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        if reference is not None:
            log_r = ref_logprobs - logprobs
            per_token = per_token + setup.beta * (torch.exp(log_r) - log_r - 1)  # k3
        loss = (per_token * response_mask).sum() / response_mask.sum()  # token mean
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        clock.append(time.perf_counter())  # update
        phases = dict(zip(PHASES, [b - a for a, b in itertools.pairwise(clock)] + [0.0]))
        tokens, threads = int(mask.sum()), torch.get_num_threads()
        steps.append(StepTime(clock[-1] - clock[0], phases, tokens, int(response_mask.sum()),
                              threads))  # fmt: skip
    return steps


# ---------------------------------------------------------------------- rlblocks
def run_rlblocks(setup: Setup, **run_options) -> list[StepTime]:
    """``rb.recipes.grpo`` as a user calls it; ``run_options`` (`rlblocks.run.RunOptions`
    keywords: ``staleness``, ``old_logprobs``) make variants of it.

    ``staleness=1``: one-step-off rollouts; the engine then samples with its own copy of the
    weights (synced after every update), and the run takes one more step at the end, left out
    like the warm-up: a run's last step has no next batch to sample during its update."""
    overlap = run_options.get("staleness", 0) > 0
    policy = rb.trainer.PolicyTrainer.from_pretrained(
        setup.model, lr=setup.lr, reference="copy" if setup.beta else None
    )
    model = copy.deepcopy(policy.model) if overlap else policy.model
    engine = rb.rollout.HFEngine(model, policy.tokenizer, chat=True, progress=False)
    batches = list(setup.batches) + ([setup.batches[0]] if overlap else [])
    loss = partial(rb.losses.clipped_surrogate, clip=CLIP)
    if setup.beta:
        loss = rb.losses.kl_regularized(loss, kl_coef=setup.beta)  # k3, as TRL
    n = setup.max_new_tokens
    sampling = rb.SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=1.0)
    counts: list[tuple[int, int, int]] = []  # tokens, response tokens, threads of each step

    def on_step(index: int, metrics: dict, ro: rb.Rollouts) -> None:  # outside the step's clock
        counts.append((int(ro.attention_mask.sum()), int(ro.response_mask.sum()),
                       torch.get_num_threads()))  # fmt: skip

    history = rb.recipes.grpo(
        policy,
        engine,
        rb.rewards.math_answer,
        batches,
        steps=len(batches),
        group_size=setup.group_size,
        sampling=sampling,
        loss_fn=loss,
        run=rb.run.RunOptions(on_step=on_step, progress=False, **run_options),
    )
    steps = [
        StepTime(m["step_seconds"], {p: m[f"time/{p}"] for p in PHASES}, *c)
        for m, c in zip(history, counts, strict=True)
    ]
    return steps[: len(setup.batches)]


# ---------------------------------------------------------------------- TRL
@contextlib.contextmanager
def trl_profiling() -> Iterator[list[tuple[str, float, float]]]:
    """``(name, start, seconds)`` of every TRL ``profiling_context`` block while inside (none
    with a TRL that has no ``ProfilingContext``: then only the update phase is filled in)."""
    records: list[tuple[str, float, float]] = []
    try:
        from trl.extras.profiling import ProfilingContext
    except ImportError:
        yield records
        return
    original = ProfilingContext._log_metrics

    def record(self: ProfilingContext, duration: float) -> None:
        records.append((self.name.split(".", 1)[-1], self._start_time, duration))
        original(self, duration)

    ProfilingContext._log_metrics = record
    try:
        yield records
    finally:
        ProfilingContext._log_metrics = original


def trl_steps(
    bounds: list[tuple[float, float, int, float, int]],
    records: list[tuple[str, float, float]],
    rows: int,
) -> list[StepTime]:
    """Each optimizer step's seconds, split into phases by the profiling blocks inside it:
    generation, reward, scoring inside ``_prepare_inputs`` (π_ref), and the update from the end
    of ``_prepare_inputs`` (forward, loss, backward, clipping, optimizer step)."""
    steps, seen = [], 0
    for begin, end, tokens_seen, length, threads in bounds:
        inside = [(name, s, d) for name, s, d in records if begin <= s <= end]

        def seconds(block: str, before: float = end, inside=inside) -> float:
            return sum(d for name, s, d in inside if name == block and s < before)

        prepared = max((s + d for name, s, d in inside if name == "_prepare_inputs"), default=begin)
        phases = {
            "rollout": seconds("transformers.generate"),
            "reward": seconds("_calculate_rewards"),
            "logprobs": seconds("_get_per_token_logps_and_entropies", before=prepared),
            "update": end - prepared,
            "sync": 0.0,
        }
        steps.append(
            StepTime(end - begin, phases, tokens_seen - seen, round(length * rows), threads)
        )
        seen = tokens_seen
    return steps


def run_trl(setup: Setup) -> list[StepTime] | None:
    try:
        import datasets
        import trl
    except ImportError as error:
        print(f"trl: skipped ({error}); pip install 'rlblocks[bench]'")
        return None

    class StepClock(transformers.TrainerCallback):
        """(begin, end, tokens seen so far, mean completion length, torch threads) of every
        optimizer step; ``trainer`` is set once built (its metrics are cleared at the end)."""

        def __init__(self) -> None:
            self.bounds: list[tuple[float, float, int, float, int]] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            end = time.perf_counter()
            length = self.trainer._metrics["train"]["completions/mean_length"][-1]
            seen, threads = state.num_input_tokens_seen, torch.get_num_threads()
            self.bounds.append((self.begin, end, seen, length, threads))

    def math_answer(completions: list, ground_truth: list[str], **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [math_answer_score(text, truth) for text, truth in zip(texts, ground_truth)]

    model, tokenizer = rb.models.load(setup.model)
    rows = [
        {"prompt": r.prompt, "ground_truth": r.ground_truth}
        for batch in setup.batches
        for r in batch.rows
    ]
    n = setup.max_new_tokens
    clock = StepClock()
    with tempfile.TemporaryDirectory() as folder, trl_profiling() as records:
        config = trl.GRPOConfig(
            output_dir=folder, max_steps=len(setup.batches), seed=setup.seed,
            # one step = one generation of prompts x group size rows = one optimizer step
            per_device_train_batch_size=setup.rows, generation_batch_size=setup.rows,
            num_generations=setup.group_size, gradient_accumulation_steps=1,
            shuffle_dataset=False,  # the dataset is in step order
            max_completion_length=n, generation_kwargs={"min_new_tokens": n},
            temperature=1.0, top_p=1.0, top_k=0,
            beta=setup.beta, epsilon=CLIP[0], epsilon_high=CLIP[1],
            learning_rate=setup.lr, lr_scheduler_type="constant",
            use_cpu=True, bf16=False, fp16=False, disable_tqdm=True, report_to="none",
            logging_strategy="no", save_strategy="no", eval_strategy="no",
        )  # fmt: skip
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=math_answer,
            args=config,
            processing_class=tokenizer,
            train_dataset=datasets.Dataset.from_list(rows),
            callbacks=[clock],
        )
        if trainer.generation_config.min_new_tokens != n:
            raise RuntimeError("TRL did not pass min_new_tokens to its GenerationConfig")
        trainer.remove_callback(transformers.PrinterCallback)  # logging is off: no summary
        clock.trainer = trainer
        trainer.train()
    return trl_steps(clock.bounds, records, trainer.args.per_device_train_batch_size)


SYSTEMS: dict[str, System] = {
    "floor": run_floor,
    "rlblocks": run_rlblocks,
    "trl": run_trl,
    "rlblocks-async": partial(run_rlblocks, staleness=1, old_logprobs="rollout"),
    "rlblocks-async-recompute": partial(run_rlblocks, staleness=1, old_logprobs="recompute"),
    "rlblocks-recompute": partial(run_rlblocks, old_logprobs="recompute"),
}


# ---------------------------------------------------------------------- protocol and report
def run_round(setup: Setup, systems: Sequence[str], threads: int) -> dict[str, list[StepTime]]:
    out = {}
    for name in systems:
        torch.set_num_threads(threads)
        torch.manual_seed(setup.seed)
        transformers.set_seed(setup.seed)
        steps = SYSTEMS[name](setup)
        gc.collect()  # the previous system's model and optimizer go before the next loads
        if steps is None:
            continue
        check_shapes(name, steps, setup)
        out[name] = steps
        timed = [s.seconds for s in steps[1:]] or [steps[0].seconds]
        print(
            f"  {name:<15} steps {' '.join(f'{s.seconds:6.2f}' for s in steps)} s   "
            f"median after warm-up {statistics.median(timed):6.2f} s",
            flush=True,
        )
    return out


def check_shapes(name: str, steps: list[StepTime], setup: Setup) -> None:
    want = setup.rows * setup.max_new_tokens
    bad = [s.response_tokens for s in steps if s.response_tokens != want]
    if bad:
        raise RuntimeError(f"{name}: {bad} response tokens in a step, expected {want}")


def print_report(runs: dict[str, list[list[StepTime]]]) -> dict[str, float]:
    """The markdown table and the ratios; the median seconds per step of each system back."""
    head = ["system", "s/step", "spread", *PHASES, "other", "tok/step", "threads"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    medians = {}
    for name, rounds in runs.items():
        timed = [s for steps in rounds for s in (steps[1:] or steps)]
        medians[name] = statistics.median(s.seconds for s in timed)
        per_round = [statistics.median(s.seconds for s in (steps[1:] or steps)) for steps in rounds]
        phases = [statistics.median(s.phases[p] for s in timed) for p in PHASES]
        other = statistics.median(s.seconds - sum(s.phases.values()) for s in timed)
        threads = "/".join(str(t) for t in sorted({s.threads for s in timed}))
        cells = [
            name,
            f"{medians[name]:.2f}",
            f"{min(per_round):.2f}–{max(per_round):.2f}",
            *(f"{p:.2f}" for p in phases),
            f"{other:.2f}",
            f"{statistics.median(s.tokens for s in timed):.0f}",
            threads,
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    for a, b in (("rlblocks", "floor"), ("trl", "rlblocks"), ("trl", "floor")):
        if a in medians and b in medians:
            print(f"{a} / {b}: {medians[a] / medians[b]:.2f}")
    for name, seconds in medians.items():
        if name.startswith("rlblocks-") and "rlblocks" in medians:
            print(f"{name} / rlblocks: {seconds / medians['rlblocks']:.2f}")
        if name.startswith("rlblocks-async") and "trl" in medians:
            print(f"trl / {name}: {medians['trl'] / seconds:.2f}")
    return medians


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="built-in name or folder")
    p.add_argument("--steps", type=int, default=3, help="steps per run, the first a warm-up")
    p.add_argument("--repeats", type=int, default=2, help="rounds over the systems")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens of every response")
    p.add_argument("--beta", type=float, default=0.0, help="KL loss coefficient (k3)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--systems",
        nargs="+",
        default=["floor", "rlblocks", "trl", "rlblocks-async"],
        choices=list(SYSTEMS),
    )
    args = p.parse_args(argv)
    if min(args.steps, args.repeats, args.prompts, args.max_new_tokens) < 1 or args.group_size < 2:
        p.error("--steps, --repeats, --prompts, --max-new-tokens >= 1; --group-size >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    # The process's malloc setting is shared by every system run here: apply rlblocks' (a CPU
    # PolicyTrainer would at its first run) before any, so that no system runs without it.
    kept = keep_freed_memory()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    data = arithmetic_prompts(args.steps * args.prompts, seed=args.seed, chat=True)
    batches = PromptBatches(data, prompts_per_step=args.prompts, seed=0)
    setup = Setup(
        model=args.model,
        batches=tuple(b for b, _ in zip(batches, range(args.steps))),
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        beta=args.beta,
        seed=args.seed,
    )
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if "trl" in args.systems:  # importing it takes seconds
        with contextlib.suppress(ImportError):
            import trl

            versions += f", trl {trl.__version__}"
    print(
        f"{args.model}, float32, CPU, {args.threads} thread(s); {args.prompts} prompts x "
        f"{args.group_size} samples x {args.max_new_tokens} new tokens, beta {args.beta}; "
        f"{args.steps} steps per run (first one warm-up), {args.repeats} rounds; "
        f"{versions}; freed memory kept for reuse (rlblocks.trainer.allocator): {kept}",
        flush=True,
    )
    runs: dict[str, list[list[StepTime]]] = {}
    for r in range(args.repeats):
        order = args.systems[r % len(args.systems) :] + args.systems[: r % len(args.systems)]
        print(f"round {r + 1}: {', '.join(order)}", flush=True)
        for name, steps in run_round(setup, order, args.threads).items():
            runs.setdefault(name, []).append(steps)
    return print_report({n: runs[n] for n in args.systems if n in runs})


if __name__ == "__main__":
    main()
