"""Fixtures for the data tests: the tiny tokenizer (ChatML template, no BOS) and quiet readers."""

from __future__ import annotations

import datasets
import pytest

from rlblocks.models import tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(autouse=True, scope="session")
def _no_progress_bars():
    """No progress bars from ``datasets`` readers and writers while these tests run."""
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    yield
    if not was_disabled:
        datasets.enable_progress_bars()
