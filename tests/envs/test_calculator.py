"""The calculator tool: exact arithmetic, and everything that is not arithmetic refused."""

import pytest

from rlblocks.envs import CalculatorError, calculator
from rlblocks.envs.calculator import evaluate


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(12 + 7) * 3", "57"),  # 19 · 3
        ("7 / 2", "3.5"),
        ("10 / 4 * 2", "5"),  # 2.5 · 2 = 5.0, shown as an integer
        ("2 ** 10", "1024"),
        ("-3 + 5", "2"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("2 / 3", "0.666666666667"),  # 12 significant digits
        ("  1.5 * 4 ", "6"),
        ("2 ** -1", "0.5"),
        ("123456789 * 987654321", "121932631112635269"),  # exact, no float rounding
    ],
)
def test_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('echo hi')", "found Call"),
        ("x + 1", "found Name"),
        ("'a' * 3", "found the constant 'a'"),
        ("True + 1", "found the constant True"),
        ("[1, 2]", "found List"),
        ("(lambda: 1)()", "found Call"),
        ("9 ** 9 ** 9", "exponent 387420489 is larger than 100"),  # right-associative: 9 ** 9
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1e308 * 10", "not a finite number"),
        ("10 ** 99 * 10 ** 99", "more than 100 digits"),
        ("1" * 101, "more than 100 digits"),
        ("1 +", "not an arithmetic expression"),
        ("1 + " * 60 + "1", "longer than 200 characters"),
    ],
)
def test_refusals(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculator(expression)


def test_a_non_string_is_refused():
    with pytest.raises(CalculatorError, match="must be a string, got int"):
        evaluate(3)
