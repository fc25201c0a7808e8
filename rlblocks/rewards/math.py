"""Math answer reward: extract the final answer of a completion and compare it with the truth.

A rule-based verifier in the spirit of the GSM8K/MATH rewards of DeepSeek-R1 (DeepSeek-AI 2025,
arXiv 2501.12948, §2.2.2 "accuracy rewards") and verl's ``reward_score/gsm8k.py``. Choices:

- **Extraction** (`extract_answer`): inside the last ``<answer>…</answer>`` if there is one;
  then the text after the last ``####`` (GSM8K), then the last complete ``\\boxed{…}`` /
  ``\\fbox{…}`` (balanced braces), then the last number (``1,000``, ``-2.5``, ``3/4``,
  ``1e-3``, ``\\frac{1}{2}``). A ``\\boxed{`` cut off by the length limit is ignored.
- **Comparison** (`answers_equal`): both sides are cleaned (``$``, ``\\$``, ``\\text{}``,
  ``\\left``, trailing ``.``, ``x =``, trailing unit words) and parsed as exact `Fraction`s;
  two integers must be equal exactly; otherwise numbers are equal when
  ``|a − b| ≤ rel_tol · max(|a|, |b|)`` with ``rel_tol = 1e-6`` (forgiving for a rounded
  ``0.3333333`` against ``1/3``, strict enough for any answer written to 5 significant digits).
  ``%`` is dropped, so ``50%`` equals ``50`` (GSM8K truths are bare numbers), not ``0.5``.
  Answers that are not numbers are compared as strings after removing whitespace, ``$``,
  ``\\text{}`` and case. There is no symbolic algebra: ``x+1`` and ``1+x`` differ.

No dependency beyond the standard library (no sympy). `rlblocks.rewards.mathverify` adds
math-verify's symbolic comparison as a second backend (``math_answer_reward(score=...)``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

from rlblocks.interfaces import RewardFn
from rlblocks.rewards.guard import per_sample
from rlblocks.rewards.names import REWARDS

# ---------------------------------------------------------------------- extraction
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC_IN_TEXT = r"-?\\[dt]?frac(?:\{\s*-?[\d.,]+\s*\}|\d){2}"
_DECIMAL_IN_TEXT = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d{1,3})?(?:\s*/\s*\d+)?"
_NUMBER_IN_TEXT = re.compile(rf"{_FRAC_IN_TEXT}|{_DECIMAL_IN_TEXT}|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer written in ``text``, as a raw string, or None when there is none.

    Order: restrict to the last ``<answer>…</answer>`` block if present; then the rest of the
    line after the last ``####``; then the content of the last complete ``\\boxed{…}`` or
    ``\\fbox{…}``; then the last number. Inside an ``<answer>`` block with none of these, its
    stripped text (e.g. ``(B)``). Linear-time: no backtracking-prone patterns.
    """
    close = text.rfind("</answer>")
    open_ = text.rfind("<answer>", 0, close) if close >= 0 else -1
    if open_ >= 0:  # rfind, not a regex: linear even on a degenerate "<answer><answer>…"
        inner = text[open_ + len("<answer>") : close]
        return _extract_plain(inner) or (inner.strip() or None)
    return _extract_plain(text)


def _extract_plain(text: str) -> str | None:
    if "####" in text:
        after = text.rsplit("####", 1)[1].split("\n", 1)[0].strip()
        if after:
            return after
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` / ``\\fbox{…}`` whose braces close, else None.

    One pass matches every brace from the first box on, so a degenerate completion repeating
    ``\\boxed{`` thousands of times costs linear, not quadratic, time.
    """
    starts = [m.end() for m in _BOX_COMMAND.finditer(text)]  # index just after each "{"
    if not starts:
        return None
    closing: dict[int, int] = {}  # "{" index -> matching "}" index
    stack: list[int] = []
    for j in range(starts[0] - 1, len(text)):
        if text[j] == "{":
            stack.append(j)
        elif text[j] == "}" and stack:
            closing[stack.pop()] = j
    for start in reversed(starts):
        if (end := closing.get(start - 1)) is not None:
            return text[start:end]
    return None


# ---------------------------------------------------------------------- normalization
_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|\^\s*\{?\\circ\}?|°")
_SIMPLE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+|(?=\.\d))(?:\.\d*)?(?:[eE][-+]?\d{1,3})?")
_SLASH = re.compile(r"([-+]?\d+)\s*/\s*(\d+)")
_FRAC = re.compile(r"([-+]?)\\[dt]?frac\s*(\{[^{}]*\}|\d)\s*(\{[^{}]*\}|\d)")
_TIMES_TEN = re.compile(r"(.+?)\s*\\(?:times|cdot)\s*10\s*\^\s*\{?\s*([-+]?\d{1,3})\s*\}?")
_MAX_NUMBER_CHARS = 100  # no numeric answer is longer; longer ones compare as text
_UNIT_WORDS = re.compile(r"(.*?[\d}])\s*[A-Za-z][A-Za-z\s.]*")


def _clean(answer: str) -> str:
    """Strip the formatting that never changes an answer's value: $, \\text{}, spacing, ``.``."""
    s = answer.replace("\u2212", "-").replace("\\$", "").replace("$", "")
    for _ in range(3):  # \text{\textbf{B}} -> B: unwrap the innermost command each round
        s = _WRAPPERS.sub(r"\1", s)
    s = _SPACING.sub("", s).replace("\\%", "%").strip()
    return s.rstrip(".").strip()


def _parse_number(answer: str) -> Fraction | None:
    """The exact value of a numeric answer (see the module docstring), or None."""
    s = _clean(answer)
    if len(s) > _MAX_NUMBER_CHARS:  # keeps the unit-word pattern below cheap
        return None
    if "=" in s:  # "x = 5" -> "5"
        s = s.rsplit("=", 1)[1].strip()
    s = re.sub(r"^([-+])\s+", r"\1", s.rstrip("%").strip())
    value = _parse_core(s)
    if value is None and (m := _UNIT_WORDS.fullmatch(s)):  # "5 apples", "\frac12 cup"
        value = _parse_core(m.group(1).rstrip("%").strip())
    return value


def _parse_core(s: str) -> Fraction | None:
    try:
        if _SIMPLE.fullmatch(s):
            return Fraction(s.replace(",", ""))
        if m := _SLASH.fullmatch(s):
            return Fraction(int(m.group(1)), int(m.group(2)))
        if m := _FRAC.fullmatch(s):
            num, den = (_parse_core(g.strip("{} ")) for g in (m.group(2), m.group(3)))
            if num is None or den is None:
                return None
            return -num / den if m.group(1) == "-" else num / den
        if m := _TIMES_TEN.fullmatch(s):
            mantissa = _parse_core(m.group(1).strip())
            return None if mantissa is None else mantissa * Fraction(10) ** int(m.group(2))
    except (ValueError, ZeroDivisionError):  # 1/0, or an integer too long to parse
        return None
    return None


def _normalize_text(answer: str) -> str:
    """Non-numeric answers: cleaned, without any whitespace, lower case."""
    return re.sub(r"\s+", "", _clean(answer)).lower()


def answers_equal(pred: str | None, truth: str, *, rel_tol: float = 1e-6) -> bool:
    """Whether a predicted final answer equals the ground truth, tolerant of formatting.

    Numeric: a = parse(pred), t = parse(truth) as exact fractions; two integers must be equal,
    otherwise they are equal when ``|a − t| ≤ rel_tol · max(|a|, |t|)`` (a relative tolerance
    alone would make 1000001 equal 1000000). Non-numeric: equal normalized strings. A numeric
    answer never equals a non-numeric one. ``pred=None`` (nothing extracted) is never equal.
    """
    if pred is None:
        return False
    a, t = _parse_number(pred), _parse_number(truth)
    if a is not None and t is not None:
        if a.denominator == 1 and t.denominator == 1:  # integers: exact, 1000001 ≠ 1000000
            return a == t
        return abs(a - t) <= Fraction(repr(rel_tol)) * max(abs(a), abs(t))  # exact 1e-6
    if a is not None or t is not None:
        return False
    return _normalize_text(pred) == _normalize_text(truth)


def truth_answer(ground_truth: str) -> str:
    """The answer part of a ground truth: GSM8K solutions (``… #### 72``) and boxed solutions
    are extracted; anything else is used whole (``"72"``, ``"\\text{(B)}"``)."""
    if "####" in ground_truth or _BOX_COMMAND.search(ground_truth):
        return extract_answer(ground_truth) or ground_truth
    return ground_truth


def math_answer_score(completion: str, ground_truth: str, *, rel_tol: float = 1e-6) -> float:
    """1.0 if the final answer of ``completion`` equals ``ground_truth``, else 0.0.

    r = 𝟙[answers_equal(extract_answer(completion), truth_answer(ground_truth))], the binary
    outcome reward of DeepSeek-R1 (arXiv 2501.12948, §2.2.2) and DAPO (Yu et al. 2025,
    arXiv 2503.14476, eq. 7 before its ±1 rescaling).
    """
    pred = extract_answer(completion)
    return float(answers_equal(pred, truth_answer(str(ground_truth)), rel_tol=rel_tol))


def math_answer_reward(
    *,
    ground_truth_key: str = "ground_truth",
    rel_tol: float = 1e-6,
    timeout: float | None = 5.0,
    fallback: float = 0.0,
    score: Callable[..., float] = math_answer_score,
    name: str = "math_answer",
) -> RewardFn:
    """Batch `RewardFn` scoring ``completions[i]`` against ``metadata[i][ground_truth_key]``.

    rᵢ = score(completionᵢ, metadataᵢ[ground_truth_key], rel_tol=rel_tol) ∈ {0, 1}, (b) float32,
    no gradient. ``score`` is the comparison backend: `math_answer_score` (no dependency) or
    ``rb.rewards.math_verify_score`` (symbolic, the ``math`` extra; `math_verify_reward` builds
    that one). Runs through `per_sample`, so a row without the key, or one that makes the
    parser fail, scores ``fallback`` and is counted in ``reward/failures``.
    """

    def math_answer(completion: str, **row: object) -> float:
        return score(completion, str(row[ground_truth_key]), rel_tol=rel_tol)

    return per_sample(math_answer, timeout=timeout, fallback=fallback, name=name)


math_answer: RewardFn = REWARDS.register("math_answer", math_answer_reward())
"""The default math reward: ``metadata[i]["ground_truth"]``, rel_tol 1e-6, 5 s per row."""
