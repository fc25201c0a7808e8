"""Tests for rlblocks.data.arithmetic: exact answers, phrasing, determinism, disjoint splits."""

from __future__ import annotations

import ast
import hashlib
import operator
import re
from fractions import Fraction

import pytest

from rlblocks.data import (
    BOXED_INSTRUCTION,
    HASH_INSTRUCTION,
    LEVELS,
    TEST_FRACTION,
    Difficulty,
    arithmetic,
    arithmetic_prompts,
)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: Fraction}


def _evaluate(expression: str) -> Fraction:
    """Python's precedence rules on the expression, in exact fractions (independent of the
    left-to-right chain the generator computes)."""

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        assert isinstance(node, ast.BinOp), ast.dump(node)
        left, right = walk(node.left), walk(node.right)
        return left / right if isinstance(node.op, ast.Div) else _OPS[type(node.op)](left, right)

    return walk(ast.parse(expression, mode="eval").body)


def _chain(operands: list[int], operators: list[str]) -> list[Fraction]:
    """The running values of ((a0 op1 a1) op2 a2) ..., in exact fractions."""
    values = [Fraction(operands[0])]
    for op, b in zip(operators, operands[1:], strict=True):
        a = values[-1]
        values.append({"+": a + b, "-": a - b, "*": a * b, "/": a / Fraction(b)}[op])
    return values


# ---------------------------------------------------------------------- answers
@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_answers_are_exact_and_match_the_question(difficulty):
    level = LEVELS[difficulty]
    rows = arithmetic(300, seed=difficulty, difficulty=difficulty).to_list()
    assert {row["style"] for row in rows} == {"word", "plain"}
    for row in rows:
        operands, operators = row["operands"], row["operators"]
        assert len(operands) == level.operands and len(operators) == level.operands - 1
        assert set(operators) <= set(level.operators)
        values = _chain(operands, operators)
        # Every running value is an integer (no division remainders) and equals the answer,
        # computed left to right and, independently, from the parenthesised expression.
        assert all(v.denominator == 1 for v in values)
        assert row["answer"] == str(int(values[-1])) == str(int(_evaluate(row["expression"])))
        # The numbers in the question are the operands, in order.
        assert re.findall(r"\d+", row["question"]) == [str(o) for o in operands]
        if not level.negative or row["style"] == "word":
            assert min(values) >= 1, row
        if row["style"] == "word":
            assert row["question"].endswith(" have now?")
        else:
            assert row["expression"] in row["question"]


def test_level_4_has_negative_answers():
    answers = [int(a) for a in arithmetic(200, seed=0, difficulty=4)["answer"]]
    assert min(answers) < 0


def test_hand_worked_tiny_level():
    # Start in [2, 2] = 2 and add b in [1, 2]: the only problems are 2 + 1 = 3 and 2 + 2 = 4.
    level = Difficulty(operands=2, max_operand=2, operators="+", word_problems=0.0)
    rows = arithmetic(50, seed=0, difficulty=level).to_list()
    assert {(row["expression"], row["answer"]) for row in rows} <= {("2 + 1", "3"), ("2 + 2", "4")}
    assert {row["question"] for row in rows} <= {
        f"{t.format(expr=e)}"
        for t in ("What is {expr}?", "Compute {expr}.", "Calculate {expr}.", "Evaluate {expr}.")
        for e in ("2 + 1", "2 + 2")
    }


def test_parentheses_only_where_precedence_needs_them():
    level = Difficulty(operands=3, max_operand=9, operators="+-*/", word_problems=0.0)
    rows = arithmetic(400, seed=1, difficulty=level).to_list()
    for row in rows:
        ops = row["operators"]
        a, b, c = row["operands"]
        low_then_high = ops[0] in "+-" and ops[1] in "*/"
        # A sum followed by a product needs "(a + b) * c"; every other pair reads left to right.
        expected = (
            f"({a} {ops[0]} {b}) {ops[1]} {c}"
            if low_then_high
            else f"{a} {ops[0]} {b} {ops[1]} {c}"
        )
        assert row["expression"] == expected


def test_word_problem_phrasing_hand_worked():
    level = Difficulty(operands=2, max_operand=30, operators="+", word_problems=1.0)
    row = arithmetic(1, seed=5, difficulty=level)[0]
    a, b = row["operands"]
    story = re.fullmatch(
        r"(\w+) has (\d+) (\w+) and (.+)\. How many (\w+) does (\w+) have now\?", row["question"]
    )
    assert story is not None, row["question"]
    name, start, items, step, items_again, name_again = story.groups()
    assert (int(start), items, name) == (a, items_again, name_again)
    assert step in {f"buys {b} more", f"finds {b} more", f"gets {b} more from a friend"}
    assert row["answer"] == str(a + b)


# ---------------------------------------------------------------------- determinism and splits
def test_same_seed_same_problems():
    assert (
        arithmetic(100, seed=3, difficulty=2).to_list()
        == arithmetic(100, seed=3, difficulty=2).to_list()
    )
    assert arithmetic(100, seed=3)["question"] != arithmetic(100, seed=4)["question"]
    # A longer run starts with the shorter one.
    assert arithmetic(150, seed=3)["question"][:100] == arithmetic(100, seed=3)["question"]


@pytest.mark.parametrize("difficulty", [1, 3])
def test_train_and_test_never_share_an_expression(difficulty):
    train = set(arithmetic(2000, seed=0, difficulty=difficulty)["expression"])
    for seed in (0, 1):
        test = set(arithmetic(300, seed=seed, difficulty=difficulty, split="test")["expression"])
        assert len(test) > 30 and not train & test


def test_distinct_keeps_the_first_occurrence_of_each_expression():
    level = Difficulty(operands=2, max_operand=5, operators="+")  # 4 starts x 5 addends = 20
    plain = arithmetic(60, seed=0, difficulty=level).to_list()
    unique = arithmetic(12, seed=0, difficulty=level, distinct=True).to_list()
    first_seen: dict[str, dict] = {}
    for row in plain:
        first_seen.setdefault(row["expression"], row)
    assert len(first_seen) < len(plain)  # the plain sequence repeats problems
    # The distinct rows are the plain sequence with repeats dropped (phrasing included: a story
    # and a plain question of the same sum are one problem).
    assert unique == list(first_seen.values())[:12]
    assert len({row["expression"] for row in unique}) == 12
    # A larger n extends a smaller one.
    assert arithmetic(8, seed=0, difficulty=level, distinct=True).to_list() == unique[:8]


def test_distinct_refuses_more_problems_than_the_split_has():
    # Hand count: level 1 starts at 2..50 and adds 1..50 (49 x 50 = 2,450 sums) or subtracts
    # 1..a-1 (1 + 2 + ... + 49 = 1,225 differences): 3,675 expressions, of which the hash puts
    # 396 in "test" (the module's rule, written out again here: the first 8 bytes of the
    # expression's SHA-256 below TEST_FRACTION of 2^64).
    expressions = [f"{a} + {b}" for a in range(2, 51) for b in range(1, 51)]
    expressions += [f"{a} - {b}" for a in range(2, 51) for b in range(1, a)]
    test_share = [
        e
        for e in expressions
        if int.from_bytes(hashlib.sha256(e.encode()).digest()[:8], "big") < TEST_FRACTION * 2**64
    ]
    assert len(expressions) == 3675 and len(test_share) == 396
    every = arithmetic(396, seed=0, split="test", distinct=True)
    assert sorted(every["expression"]) == sorted(test_share)
    with pytest.raises(ValueError, match="only 396 distinct 'test' expressions .* 397 were asked"):
        arithmetic(397, seed=0, split="test", distinct=True)


def test_distinct_test_split_is_disjoint_from_any_train_set():
    test = set(arithmetic(300, seed=0, difficulty=2, split="test", distinct=True)["expression"])
    assert len(test) == 300
    for seed in (0, 1, 2):
        assert not test & set(arithmetic(2000, seed=seed, difficulty=2)["expression"])


# ---------------------------------------------------------------------- the ready loader
def test_arithmetic_prompts(tokenizer):
    ds = arithmetic_prompts(20, seed=0, difficulty=2)
    table = arithmetic(20, seed=0, difficulty=2)
    assert ds.prompts == [f"{q} {HASH_INSTRUCTION}" for q in table["question"]]
    assert ds.ground_truths == table["answer"]
    assert ds[0].metadata == {
        "ground_truth": table[0]["answer"],
        "data_source": "arithmetic",
        "expression": table[0]["expression"],
        "operands": table[0]["operands"],
        "operators": table[0]["operators"],
    }
    boxed = arithmetic_prompts(3, instruction=BOXED_INSTRUCTION, system="Be brief.")
    assert boxed[0].prompt[1]["content"].endswith("\\boxed{}.")
    assert arithmetic_prompts(3, instruction=None).prompts == arithmetic(3)["question"]
    held_out = arithmetic_prompts(5, split="test", distinct=True, instruction=None)
    assert held_out.prompts == arithmetic(5, split="test", distinct=True)["question"]
    fitted = arithmetic_prompts(5, tokenizer=tokenizer, max_prompt_tokens=512)
    assert len(fitted) == 5


# ---------------------------------------------------------------------- limits and errors
def test_single_operator_levels():
    for op in "+-*/":
        level = Difficulty(operands=3, operators=op, max_operand=60)
        rows = arithmetic(30, seed=0, difficulty=level).to_list()
        assert all(row["operators"] == [op, op] for row in rows)
        assert all(
            _chain(row["operands"], row["operators"])[-1] == int(row["answer"]) for row in rows
        )


def test_bad_arguments():
    with pytest.raises(ValueError, match="operators must be"):
        Difficulty(operators="+^")
    with pytest.raises(
        ValueError, match="^Difficulty: operands, max_operand and max_factor must be >= 2"
    ):
        Difficulty(operands=1)
    with pytest.raises(ValueError, match="word_problems"):
        Difficulty(word_problems=1.5)
    with pytest.raises(ValueError, match="split must be"):
        arithmetic(3, split="validation")


def test_skip_gives_the_rows_after_the_first_ones():
    assert arithmetic(5, seed=1, skip=3).to_list() == arithmetic(8, seed=1).to_list()[3:]
    distinct = arithmetic(20, seed=0, split="test", distinct=True).to_list()
    assert arithmetic(8, seed=0, split="test", distinct=True, skip=12).to_list() == distinct[12:]
    with pytest.raises(ValueError, match=r"arithmetic: skip=-1; pass skip >= 0"):
        arithmetic(3, skip=-1)
    # level 1 has 396 distinct test expressions: 300 after the first 100 are 4 too many
    with pytest.raises(
        ValueError, match=r"400 were asked with distinct=True \(skip=100 \+ n=300\)"
    ):
        arithmetic(300, seed=0, split="test", distinct=True, skip=100)
