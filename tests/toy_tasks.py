"""The toy task the learning tests share: a dense reward a random tiny model can climb."""


def digit_fraction(completion: str, **row) -> float:
    """The share of characters that are digits (checkable by a rule, dense)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
