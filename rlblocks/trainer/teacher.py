"""``Teacher``: a frozen causal LM that scores the tokens a student sampled.

On-policy distillation (Agarwal et al. 2024, GKD, arXiv 2306.13649; Qwen3 technical report,
arXiv 2505.09388, sec. 4.5; Lu & Thinking Machines 2025, "On-Policy Distillation") lets the
student sample, then asks the teacher how likely each sampled token is:
``teacher.logprobs(rollouts)`` is log π_T(y_t | x, y_<t) for every response token, the input of
`rlblocks.losses.reverse_kl` and `rlblocks.advantage.teacher_kl`.

The teacher is scored exactly as the trainer scores the policy (`score_responses`: the same
position ids, the same float32 log-softmax in chunks of ``chunk_size`` tokens), micro-batch by
micro-batch (``micro_batch_size`` rows or ``micro_batch_tokens`` real tokens), without gradient,
in ``eval()`` mode. The student's and the teacher's token ids must mean the same thing: build
the teacher with the student's tokenizer, or pass ``student_tokenizer=`` to have the two
vocabularies compared once (a mismatch is refused, naming the first token that differs).

A teacher is a block like any other: ``placement.build("teacher", Teacher.from_pretrained,
path)`` puts it on its own role; ``logprobs`` is split by rows over the role's workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from rlblocks.interfaces import Dispatch, dispatch
from rlblocks.losses.entropy import DEFAULT_CHUNK_SIZE
from rlblocks.models import loading
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.batches import scored_in_pieces
from rlblocks.trainer.config import TrainConfig
from rlblocks.trainer.forward import score_responses
from rlblocks.trainer.packing import check_isolation
from rlblocks.trainer.parallel import SingleProcess


class Teacher:
    """A frozen model (any Hugging Face causal LM) scoring sampled response tokens.

    ``temperature`` divides the teacher's logits (1.0: its own distribution); ``bf16`` runs
    its forward under bfloat16 autocast. ``tokenizer`` is kept as ``teacher.tokenizer``;
    ``student_tokenizer``, when given, must have the same vocabulary (module docstring).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tokenizer: Any = None,
        student_tokenizer: Any = None,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = None,
        temperature: float = 1.0,
        bf16: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        # The trainer's batching knobs, so that the teacher is cut into pieces as it would be.
        self.config = TrainConfig(
            micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens,
            temperature=temperature,
            bf16=bf16,
            logprob_chunk_size=chunk_size,
        )
        if tokenizer is not None and student_tokenizer is not None:
            check_same_vocabulary(tokenizer, student_tokenizer)
        check_isolation(self.model, owner="Teacher")  # it scores packed rows

    # from_pretrained(name_or_path, *, dtype=float32, device=None, **kwargs): load, then
    # cls(model, tokenizer=tokenizer, **kwargs); device None: CUDA when torch sees a GPU.
    from_pretrained: classmethod[Teacher, ..., Teacher] = classmethod(loading.from_pretrained)

    @property
    def device(self) -> torch.device:
        """The device of the teacher's parameters."""
        return next(self.model.parameters()).device

    @dispatch(Dispatch.ROWS)
    @torch.no_grad()
    def logprobs(self, rollouts: Rollouts) -> Tensor:
        """log π_T(y_k | x, y_<k) of every response token: ``(b t)`` float32, 0 at padding, on
        the device of ``rollouts``."""
        home = rollouts.response_ids.device
        rollouts = rollouts.to(self.device)
        b, t = rollouts.response_ids.shape
        vocab = self.model.get_input_embeddings().num_embeddings  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
        if b and int(rollouts.input_ids.max()) >= vocab:
            raise ValueError(
                f"Teacher.logprobs: token id {int(rollouts.input_ids.max())} is outside the "
                f"teacher's vocabulary of {vocab}; give student and teacher the same tokenizer"
            )
        if b == 0:
            return torch.zeros(b, t, device=home)
        c = self.config

        def score(micro: Rollouts) -> tuple[Tensor, Tensor | None]:
            return score_responses(
                self.model,
                micro,
                temperature=c.temperature,
                bf16=bool(c.bf16),
                chunk_size=c.logprob_chunk_size,
                packing=c.packing,
            )

        (logprobs, _) = scored_in_pieces(score, rollouts, c, SingleProcess())
        assert logprobs is not None  # score_responses always gives log-probs
        return logprobs.float().to(home)


def check_same_vocabulary(teacher: Any, student: Any) -> None:
    """Refuse two tokenizers whose token ids mean different things (``get_vocab()`` differs),
    naming the first id that differs; the extra ids of a larger embedding table are fine."""
    mine, theirs = _by_id(teacher.get_vocab()), _by_id(student.get_vocab())
    for token_id in sorted(set(mine) | set(theirs)):
        if mine.get(token_id) != theirs.get(token_id):
            raise ValueError(
                f"check_same_vocabulary: teacher and student tokenizers differ at token id "
                f"{token_id}: teacher "
                f"{mine.get(token_id)!r}, student {theirs.get(token_id)!r} ({len(mine)} and "
                f"{len(theirs)} tokens); on-policy distillation needs one tokenizer for both"
            )


def _by_id(vocab: Mapping[str, int]) -> dict[int, str]:
    return {i: token for token, i in vocab.items()}


__all__ = ["Teacher", "check_same_vocabulary"]
