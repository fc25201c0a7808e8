"""math-verify as the comparison behind `math_answer`: symbolic equality of LaTeX answers.

`math_answer`'s own comparison parses numbers and fractions exactly and compares anything else
as text, so ``\\frac{1}{\\sqrt{2}}`` and ``\\frac{\\sqrt{2}}{2}``, or ``(x+1)^2`` and
``x^2+2x+1``, differ. Hugging Face's math-verify (the checker of TRL's ``accuracy_reward`` and
of open-r1) parses both sides into sympy and compares them symbolically: sets, intervals,
matrices, equations and numbers rounded to 6 digits.

    reward = rb.rewards.math_verify_reward()          # pip install 'rlblocks[math]'

Choices made here:

- **Extraction stays `extract_answer`'s** (``<answer>``, ``####``, ``\\boxed{}``, the last
  number), so the two backends read the same answer from a completion; math-verify only
  compares. The ground truth goes through `truth_answer` (a GSM8K or boxed solution gives its
  answer). Both are parsed as LaTeX (wrapped in ``$…$``).
- **Correct if either comparison says so**: ``answers_equal`` first (exact, and it reads
  ``1,000`` as a thousand where math-verify reads a tuple), then math-verify. So this backend
  never scores a completion lower than the default one.
- **Timeouts**: math-verify limits its own parsing and comparison with ``signal.alarm``, which
  only works in the main thread; in a `per_sample` worker thread its limits are switched off
  (as TRL does) and the row's own ``timeout`` guards it. ``None`` timeouts need math-verify
  0.8 or newer.
- A ground truth math-verify cannot parse raises ``ValueError`` (the row fails, counted and
  named by `per_sample`), unless ``answers_equal`` already matched it.
"""

from __future__ import annotations

import threading
from types import ModuleType

from rlblocks.interfaces import RewardFn
from rlblocks.rewards.math import (
    answers_equal,
    extract_answer,
    math_answer_reward,
    truth_answer,
)

__all__ = ["math_verify_reward", "math_verify_score", "require_math_verify"]

_TIMEOUT_S = 5  # math-verify's own limit per parse / comparison, in the main thread


def require_math_verify() -> ModuleType:
    """The ``math_verify`` module, or an ``ImportError`` saying how to install it."""
    try:
        import math_verify
    except ImportError as error:
        raise ImportError(
            "math_answer: the math-verify backend needs the math-verify package, which is not "
            "installed; pip install 'rlblocks[math]' (math-verify>=0.8)"
        ) from error
    return math_verify


def math_verify_score(completion: str, ground_truth: str, *, rel_tol: float = 1e-6) -> float:
    """1.0 if the final answer of ``completion`` equals ``ground_truth``, by ``answers_equal``
    or symbolically by math-verify; else 0.0 (module docstring).

    r = 𝟙[answers_equal(a, t) ∨ verify(parse($t$), parse($a$))], a = extract_answer(completion),
    t = truth_answer(ground_truth). Raises ``ImportError`` without math-verify, ``ValueError``
    when math-verify cannot parse the ground truth (and ``answers_equal`` said no).
    """
    mv = require_math_verify()
    pred, truth = extract_answer(completion), truth_answer(str(ground_truth))
    if answers_equal(pred, truth, rel_tol=rel_tol):
        return 1.0
    limit = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(f"${truth}$", parsing_timeout=limit)
    if not gold:
        raise ValueError(
            f"math_answer: math-verify cannot parse the ground truth {truth!r:.80}; give the "
            "ground truth as a number or a LaTeX expression"
        )
    if pred is None:
        return 0.0
    answer = mv.parse(f"${pred}$", parsing_timeout=limit)
    return float(bool(answer) and mv.verify(gold, answer, timeout_seconds=limit))


def math_verify_reward(
    *,
    ground_truth_key: str = "ground_truth",
    rel_tol: float = 1e-6,
    timeout: float | None = 5.0,
    fallback: float = 0.0,
) -> RewardFn:
    """`math_answer_reward` scoring with `math_verify_score`; named ``math_verify``.

    Raises ``ImportError`` here, when it is built, if math-verify is not installed (rather
    than every row failing later).
    """
    require_math_verify()
    return math_answer_reward(
        ground_truth_key=ground_truth_key,
        rel_tol=rel_tol,
        timeout=timeout,
        fallback=fallback,
        score=math_verify_score,
        name="math_verify",
    )
