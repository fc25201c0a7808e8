"""from_verl against verl itself: verl's own ``default_compute_score`` (what its reward manager
calls), imported from verl 0.9.1's package, scores rows through `from_verl`.

Importing all of verl needs tensordict, Ray and more; its reward-scoring modules need only the
standard library. scripts/install.sh therefore installs the verl wheel without dependencies
beside the environment (``<venv>/verl-scoring``), and the fixture below imports
``verl.utils.reward_score`` from there without running ``verl/__init__.py`` and
``verl/utils/__init__.py`` (the heavy ones): the scoring code is verl's, unchanged.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest

from rlblocks.rewards import from_verl
from rlblocks.rollouts import Rollouts

SCORING = Path(sys.prefix) / "verl-scoring"


@pytest.fixture(scope="module")
def verl_scoring():
    if not (SCORING / "verl" / "utils" / "reward_score" / "gsm8k.py").is_file():
        pytest.fail(f"verl's scoring modules are not in {SCORING}; run bash scripts/install.sh")
    saved = {k: v for k, v in sys.modules.items() if k == "verl" or k.startswith("verl.")}
    for name, folder in (("verl", SCORING / "verl"), ("verl.utils", SCORING / "verl" / "utils")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]  # a package whose __init__ is not run
        sys.modules[name] = package
    try:
        yield importlib.import_module("verl.utils.reward_score")
    finally:
        for name in [k for k in sys.modules if k == "verl" or k.startswith("verl.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def rows(completions: list[str], sources: list[str], truths: list[str]) -> Rollouts:
    """Rows laid out as verl's data preprocessing writes them (data_source, reward_model)."""
    return Rollouts.from_lists(
        prompt_ids=[[5]] * len(completions),
        response_ids=[[7, 8]] * len(completions),
        completions=completions,
        metadata=[
            {"data_source": s, "reward_model": {"style": "rule", "ground_truth": t}}
            for s, t in zip(sources, truths, strict=True)
        ],
    )


def test_verl_gsm8k_scorer(verl_scoring):
    # verl's gsm8k scorer, strict: the answer after "#### " is compared with the ground truth
    # (commas dropped); no "####" gives the format score, 0.
    import verl.utils.reward_score as scoring

    assert scoring.__file__.startswith(str(SCORING))  # verl's own module, from the wheel
    reward = from_verl(verl_scoring.default_compute_score)
    ro = rows(
        ["so 3 + 4 = 7\n#### 7", "#### 1,000", "the answer is 7", "#### 8"],
        ["openai/gsm8k"] * 4,
        ["7", "1000", "7", "7"],
    )
    assert reward(ro).rewards.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_verl_math_dapo_scorer_returns_a_dict(verl_scoring):
    # DAPO's math scorer returns {"score": ±1, "acc": bool, "pred": str}: from_verl takes the
    # score as the reward and the numbers among the rest (acc) as reward/<key> means.
    reward = from_verl(verl_scoring.default_compute_score)
    ro = rows(["Answer: 12", "Answer: 13"], ["math_dapo", "math_dapo"], ["12", "12"])
    out = reward(ro)
    assert out.rewards.tolist() == [1.0, -1.0]
    assert out.metrics["reward/acc"] == 0.5
