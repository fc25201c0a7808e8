"""Rule-based rewards: ``reward_fn(rollouts) -> RewardOutput(rewards (b) float32, metrics)``.

- `math_answer` / `math_answer_reward`: final-answer correctness (GSM8K ``####``, ``\\boxed{}``);
  `math_verify_reward` / `math_verify_score`: the same with math-verify's symbolic comparison.
- `from_trl` / `from_verl`: reward functions written for TRL's GRPOTrainer and verl's reward
  manager, called with the arguments those give them, guarded like `per_sample`.
- `format_reward` / `think_answer_format`: whole-completion regular-expression match.
- `checked`: the `RewardFn` contract enforced where rewards enter a loop (every recipe uses
  it): a clear error for a wrong output, the fallback score for a NaN/inf row, counted, and
  `RewardFailedError` after ``max_failed_calls`` (5) calls in a row whose every row fell back.
- `per_sample`: any ``fn(completion, **row) -> float`` as a batch reward, with a time limit,
  a fallback score and failure counts. The two rewards above are built with it.
- `ProcessPool`: worker processes for `per_sample(fn, pool=...)`, for rewards whose time limit
  must really stop them (CPU-bound loops, programs they start, crashes).
- `code_reward`: run the program in a completion against its tests in a `Sandbox` (limits,
  namespaces, no network): the fraction of tests passed, each run counted by outcome.
- `combine`: weighted sum of rewards; `overlong`: DAPO's soft overlong punishment.
- `keep_informative_groups`: DAPO dynamic sampling, a (b) bool mask of rows to keep.
- `RewardModel`: a trained reward model (sequence classification) scoring each row, its
  conversation rendered with the reward model's own chat template; `prompts_in_metadata` puts
  the original prompts where it reads them.

``REWARDS`` (`rlblocks.rewards.names`) maps names to ready-made reward functions for config
files and CLIs only, each registered where it is built; in code, pass the functions themselves.
"""

from rlblocks.interfaces import RewardFn, RewardOutput
from rlblocks.rewards.checked import RewardFailedError, checked
from rlblocks.rewards.code_tests import code_reward, extract_program
from rlblocks.rewards.combine import combine
from rlblocks.rewards.filters import GroupFilter, keep_informative_groups
from rlblocks.rewards.format import THINK_ANSWER, format_reward, think_answer_format
from rlblocks.rewards.guard import RewardRowError, SampleFn, per_sample
from rlblocks.rewards.interop import from_trl, from_verl, trl_inputs, verl_inputs
from rlblocks.rewards.isolation import ProcessPool
from rlblocks.rewards.math import (
    answers_equal,
    extract_answer,
    math_answer,
    math_answer_reward,
    math_answer_score,
    truth_answer,
)
from rlblocks.rewards.mathverify import (
    math_verify_reward,
    math_verify_score,
    require_math_verify,
)
from rlblocks.rewards.model import RewardModel, prompts_in_metadata
from rlblocks.rewards.names import REWARDS
from rlblocks.rewards.overlong import overlong, overlong_penalty
from rlblocks.rewards.remote_sandbox import RemoteSandbox
from rlblocks.rewards.sandbox import RunResult, Sandbox, SandboxLimits

__all__ = [
    "REWARDS",
    "THINK_ANSWER",
    "GroupFilter",
    "ProcessPool",
    "RemoteSandbox",
    "RewardFailedError",
    "RewardFn",
    "RewardModel",
    "RewardOutput",
    "RewardRowError",
    "RunResult",
    "SampleFn",
    "Sandbox",
    "SandboxLimits",
    "answers_equal",
    "checked",
    "code_reward",
    "combine",
    "extract_answer",
    "extract_program",
    "format_reward",
    "from_trl",
    "from_verl",
    "keep_informative_groups",
    "math_answer",
    "math_answer_reward",
    "math_answer_score",
    "math_verify_reward",
    "math_verify_score",
    "overlong",
    "overlong_penalty",
    "per_sample",
    "prompts_in_metadata",
    "require_math_verify",
    "think_answer_format",
    "trl_inputs",
    "truth_answer",
    "verl_inputs",
]
