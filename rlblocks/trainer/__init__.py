"""Policy training in one process: ``PolicyTrainer``, its ``TrainConfig`` and lr schedules.

trainer = PolicyTrainer(model, lr=1e-6, mini_batch_size=16, micro_batch_size=4)
logs = trainer.step(rollouts, advantages, loss_fn=partial(clipped_surrogate, clip=(0.2, 0.28)))
"""

from rlblocks.trainer.config import TrainConfig
from rlblocks.trainer.forward import position_ids, response_logits, score_responses
from rlblocks.trainer.fsdp import FSDP
from rlblocks.trainer.lora import merged_weights
from rlblocks.trainer.policy import PolicyTrainer
from rlblocks.trainer.schedules import (
    Constant,
    Cosine,
    WarmupConstant,
    constant,
    cosine,
    warmup_constant,
)
from rlblocks.trainer.teacher import Teacher, check_same_vocabulary

__all__ = [
    "FSDP",
    "Constant",
    "Cosine",
    "PolicyTrainer",
    "Teacher",
    "TrainConfig",
    "WarmupConstant",
    "check_same_vocabulary",
    "constant",
    "cosine",
    "merged_weights",
    "position_ids",
    "response_logits",
    "score_responses",
    "warmup_constant",
]
