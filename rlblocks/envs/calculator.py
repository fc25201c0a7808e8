"""A calculator tool: arithmetic evaluated from Python's syntax tree, never with ``eval``.

``ast.parse(expression, mode="eval")`` gives the tree; only number literals, the binary
operators ``+ - * / // % **``, unary ``+ -`` and parentheses are walked, so a name, a call, an
attribute, a string or a comprehension is refused before anything runs. Integers stay exact
(Python ints); ``/`` gives a float. Work is bounded: the expression is at most
``MAX_EXPRESSION`` characters, an exponent's magnitude at most ``MAX_EXPONENT`` and every
intermediate integer at most ``MAX_DIGITS`` digits, so ``9**9**9`` is an error, not a hang.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION = 200
MAX_EXPONENT = 100
MAX_DIGITS = 100

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (module docstring); ``CalculatorError`` for
    anything else, division by zero included."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an arithmetic expression: {error.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, int) and abs(node.value) >= 10**MAX_DIGITS:
            raise CalculatorError(f"the number has more than {MAX_DIGITS} digits")
        assert isinstance(node.value, int | float)  # its type is one of the two (above)
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"the exponent {right} is larger than {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(result, complex):
            raise CalculatorError("the result is not a real number")
        if isinstance(result, int) and abs(result) >= 10**MAX_DIGITS:
            raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
        return result
    what = type(node).__name__
    if isinstance(node, ast.Constant):
        what = f"the constant {node.value!r}"
    raise CalculatorError(
        f"only numbers, + - * / // % ** and parentheses are allowed, found {what}"
    )


def format_number(value: float) -> str:
    """An integer as it is; a float with an integral value as an integer (``6.0`` -> ``6``);
    other floats with up to 12 significant digits (``2/3`` -> ``0.666666666667``)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The expression, e.g. "(12 + 7) * 3": numbers, + - * / // % ** and parentheses.
    """
    return format_number(evaluate(expression))


__all__ = ["CalculatorError", "calculator", "evaluate", "format_number"]
