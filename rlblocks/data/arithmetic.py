"""A built-in offline task: integer arithmetic word problems generated from a seed.

    train = rb.data.arithmetic_prompts(1000, seed=0, difficulty=1)               # PromptDataset
    test = rb.data.arithmetic_prompts(200, seed=0, difficulty=1, split="test")
    table = rb.data.arithmetic(1000, seed=0, difficulty=2)   # datasets.Dataset, raw columns

Each problem is a chain ``((a₀ op₁ a₁) op₂ a₂) …`` evaluated left to right, phrased either as
a plain expression ("What is (12 + 7) * 3?", parenthesised so that the usual precedence gives
the same value) or as a short story ("Tom has 12 apples and buys 7 more. Then he collects more
until he has 3 times as many. How many apples does he have now?"). Every number in the question
is an operand, in order. Answers are exact integers written as text:

- division only by a divisor of the running value (no remainders);
- subtraction keeps the running value ≥ 1 unless ``Difficulty.negative`` (plain expressions
  only: a story never goes below one item).

**Splits** are disjoint by construction: a problem belongs to "test" when the SHA-256 of its
expression falls in the lowest ``TEST_FRACTION`` of the hash range, else to "train", and each
split's generator rejects the other's problems. So no test expression is ever in a train set,
whatever the seeds or sizes. Problems may repeat within a split when few distinct expressions
exist (level 1 has 3,675, 396 of them in "test"); ``distinct=True`` keeps the first occurrence
of each expression only (not the first phrasing: "What is 2 + 3?" and "Tom has 2 apples and
buys 3 more." are the same problem), which a held-out set should use, and refuses to return
fewer than ``n``. Same seed, split and difficulty -> the same problems (Python's
``random.Random`` seeded with a string, which is stable across platforms).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

from datasets import Dataset

from rlblocks.data.dataset import PromptDataset
from rlblocks.data.names import DATA
from rlblocks.data.prompts import (
    HASH_INSTRUCTION,
    instruction_template,
    load_prompts,
)

__all__ = ["LEVELS", "TEST_FRACTION", "Difficulty", "arithmetic", "arithmetic_prompts"]

TEST_FRACTION = 0.1
"""Share of all possible expressions reserved for the "test" split."""


@dataclass(frozen=True)
class Difficulty:
    """How hard the generated problems are."""

    operands: int = 2
    """Numbers in the chain (2 = one operation)."""
    max_operand: int = 50
    """Largest starting number and largest number added or subtracted."""
    operators: str = "+-"
    """Operations to draw from, any of ``+-*/``."""
    max_factor: int = 10
    """Largest multiplier and divisor."""
    negative: bool = False
    """Allow negative running values and answers (plain expressions only)."""
    word_problems: float = 0.5
    """Share of problems phrased as stories; the rest are plain expressions."""

    def __post_init__(self) -> None:
        if self.operands < 2 or self.max_operand < 2 or self.max_factor < 2:
            raise ValueError(
                f"Difficulty: operands, max_operand and max_factor must be >= 2, got {self}; "
                "pass values of at least 2"
            )
        if not self.operators or set(self.operators) - set("+-*/"):
            raise ValueError(
                f"Difficulty: operators must be a non-empty subset of '+-*/', got "
                f"{self.operators!r}; pass e.g. '+-'"
            )
        if not 0 <= self.word_problems <= 1:
            raise ValueError(
                f"Difficulty: word_problems must be in [0, 1], got {self.word_problems}; pass a "
                "fraction"
            )


LEVELS: dict[int, Difficulty] = {
    1: Difficulty(operands=2, max_operand=50, operators="+-"),
    2: Difficulty(operands=3, max_operand=50, operators="+-*"),
    3: Difficulty(operands=3, max_operand=100, operators="+-*/"),
    4: Difficulty(operands=4, max_operand=1000, operators="+-*/", max_factor=20, negative=True),
}
"""The built-in difficulty levels; pass a `Difficulty` for anything else."""

_NAMES = [("Tom", "he"), ("Mia", "she"), ("Ravi", "he"), ("Lena", "she"), ("Omar", "he")]
_NAMES += [("Zoe", "she"), ("Ken", "he"), ("Ana", "she")]
_ITEMS = ["apples", "marbles", "stickers", "coins", "cards", "pencils", "shells", "stamps"]
_STEPS = {
    "+": ["buys {b} more", "finds {b} more", "gets {b} more from a friend"],
    "-": ["gives {b} to a friend", "loses {b}", "sells {b}"],
    "*": ["collects more until {pron} has {b} times as many"],
    "/": ["splits them into {b} equal piles and keeps one pile"],
}
_PLAIN = ["What is {expr}?", "Compute {expr}.", "Calculate {expr}.", "Evaluate {expr}."]
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def arithmetic(
    n: int = 1000,
    *,
    seed: int = 0,
    difficulty: int | Difficulty = 1,
    split: str = "train",
    distinct: bool = False,
    skip: int = 0,
) -> Dataset:
    """``n`` generated problems as a ``datasets.Dataset``.

    Columns: ``question`` (text), ``answer`` (the exact integer as text), ``expression``
    (ASCII, evaluates to the answer), ``operands`` (list[int], in question order),
    ``operators`` (list[str], ``operators[i]`` applies ``operands[i + 1]``), ``style``
    ("word" or "plain"). The answer is ``((a₀ op₁ a₁) op₂ a₂) …`` evaluated left to right.

    ``distinct=True``: no two rows share an ``expression`` (a story and a plain question of the
    same sum count as one); the rows are those of the ``distinct=False`` sequence with repeats
    dropped, so a larger ``n`` extends a smaller one. A ValueError when the split has fewer
    than ``n`` distinct expressions (searched until `_STALL_DRAWS` draws in a row bring no new
    one).

    ``skip``: rows ``skip`` to ``skip + n − 1`` of the sequence instead of the first ``n``. With
    ``distinct=True`` the rows after a held-out set of ``skip`` drawn with the same seed share
    no expression with it: a validation set.
    """
    level = LEVELS[difficulty] if isinstance(difficulty, int) else difficulty
    if split not in ("train", "test"):
        raise ValueError(f"arithmetic: split must be 'train' or 'test', got {split!r}; pass one")
    if skip < 0:
        raise ValueError(f"arithmetic: skip={skip}; pass skip >= 0 (rows left out first)")
    total = skip + n  # rows drawn; the first skip are left out
    rng = random.Random(f"rlblocks.arithmetic:{seed}:{split}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    stall = 0  # draws since the last new row
    for draws in range(1, 1000 * total + 1001):  # rejection sampling; ~1 / TEST_FRACTION per row
        if len(rows) == total:
            break
        row = _problem(rng, level)
        stall += 1
        if row is None or _split_of(row["expression"]) != split:
            continue
        if distinct and row["expression"] in seen:
            if stall >= _STALL_DRAWS:
                raise ValueError(
                    f"arithmetic: only {len(rows)} distinct {split!r} expressions for {level} "
                    f"({draws:,} draws, none new in the last {_STALL_DRAWS:,}); {total} were "
                    f"asked with distinct=True{f' (skip={skip} + n={n})' if skip else ''}; ask for "
                    "fewer or choose a harder difficulty"
                )
            continue
        seen.add(row["expression"])
        rows.append(row)
        stall = 0
    else:
        raise RuntimeError(
            f"arithmetic: could not generate {total} problems for {level}; choose operators and "
            "bounds that admit problems"
        )
    return Dataset.from_list(rows[skip:])


_STALL_DRAWS = 100_000
"""``distinct=True`` gives up after this many draws without a new expression. Level 1's rarest
expressions ("a + b": a start of 49, "+" of 2, b of 50) come once in 49 · 2 · 50 = 4,900
draws, so 100,000 draws miss a remaining one with a chance of e^(-100,000 / 4,900) ≈ 1e-9."""


@DATA.register("arithmetic")
def arithmetic_prompts(
    n: int = 1000,
    *,
    seed: int = 0,
    difficulty: int | Difficulty = 1,
    split: str = "train",
    distinct: bool = False,
    skip: int = 0,
    instruction: str | None = HASH_INSTRUCTION,
    **load_kwargs: Any,
) -> PromptDataset:
    """`arithmetic` loaded with `load_prompts`: the question, then ``instruction`` after a space
    (e.g. `BOXED_INSTRUCTION`; None for the bare question). ``ground_truth`` is the answer;
    ``metadata`` keeps ``expression``, ``operands`` and ``operators``; ``data_source`` is
    ``"arithmetic"``. ``distinct=True``: no expression twice (see `arithmetic`; for held-out
    sets; with ``skip``, a validation set after them). ``load_kwargs`` go to `load_prompts`
    (``system``, ``chat``, ``tokenizer``, ``max_prompt_tokens``, ``overlong``).
    """
    return load_prompts(
        arithmetic(n, seed=seed, difficulty=difficulty, split=split, distinct=distinct, skip=skip),
        prompt="question",
        ground_truth="answer",
        template=instruction_template(instruction),
        keep=("expression", "operands", "operators"),
        data_source="arithmetic",
        **load_kwargs,
    )


# ---------------------------------------------------------------------- one problem
def _problem(rng: random.Random, level: Difficulty) -> dict[str, Any] | None:
    """One chain of operations and its phrasing; None when the operators allow no next step."""
    word = rng.random() < level.word_problems
    value = rng.randint(2, level.max_operand)
    operands, operators = [value], []
    for _ in range(level.operands - 1):
        choices = {op: _candidates(op, value, level, word) for op in level.operators}
        feasible = [op for op in level.operators if choices[op]]
        if not feasible:
            return None
        op = rng.choice(feasible)
        b = rng.choice(choices[op])
        value = _apply(op, value, b)
        operands.append(b)
        operators.append(op)
    expression = _expression(operands, operators)
    question = (
        _story(rng, operands, operators) if word else rng.choice(_PLAIN).format(expr=expression)
    )
    return {
        "question": question,
        "answer": str(value),
        "expression": expression,
        "operands": operands,
        "operators": operators,
        "style": "word" if word else "plain",
    }


def _candidates(op: str, value: int, level: Difficulty, word: bool) -> range | list[int]:
    """The second operands that keep ``value op b`` an allowed integer."""
    if op == "+":
        return range(1, level.max_operand + 1)
    if op == "-":
        if level.negative and not word:
            return range(1, level.max_operand + 1)
        return range(1, min(value - 1, level.max_operand) + 1)  # keep the value >= 1
    if op == "*":
        return range(2, level.max_factor + 1)
    return [d for d in range(2, level.max_factor + 1) if value != 0 and value % d == 0]


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b  # exact: b divides a (Python's // floors, which is exact here, sign included)


def _expression(operands: list[int], operators: list[str]) -> str:
    """``a₀ op₁ a₁ …`` with parentheses wherever precedence would change the left-to-right value."""
    text, top = str(operands[0]), 3  # top: lowest precedence outside parentheses so far
    for op, b in zip(operators, operands[1:], strict=True):
        if _PRECEDENCE[op] > top:
            text, top = f"({text})", 3
        text, top = f"{text} {op} {b}", min(top, _PRECEDENCE[op])
    return text


def _story(rng: random.Random, operands: list[int], operators: list[str]) -> str:
    name, pron = rng.choice(_NAMES)
    items = rng.choice(_ITEMS)
    steps = [
        rng.choice(_STEPS[op]).format(b=b, pron=pron)
        for op, b in zip(operators, operands[1:], strict=True)
    ]
    sentences = [f"{name} has {operands[0]} {items} and {steps[0]}."]
    sentences += [f"Then {pron} {step}." for step in steps[1:]]
    sentences.append(f"How many {items} does {name} have now?")
    return " ".join(sentences)


def _split_of(expression: str) -> str:
    digest = hashlib.sha256(expression.encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") < TEST_FRACTION * 2**64 else "train"
