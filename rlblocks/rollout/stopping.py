"""Where each response ends: the first EOS token or the first completed stop string.

``ResponseEnds`` is a Hugging Face ``StoppingCriteria``: ``generate`` calls it once per decoding
step with the ids so far. It stops a row at a stop string and records, for every row, the step
of its first end, because the ids alone cannot tell: once a row is finished ``generate`` fills
it with the padding token, which some tokenizers (SmolLM2) share with EOS, and a stop string may
span several tokens. It also ticks a progress callback once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.stopping_criteria import StopStringCriteria


class ResponseEnds(StoppingCriteria):
    """Stops rows at stop strings; ``end`` (b) int64 is each row's first end step, −1 if none.

    ``prompt_width``: columns of the (left-padded) prompt, so step k is column
    ``prompt_width + k``. ``eos_token_ids``: tokens that end a response (counted in it).
    ``stop``: strings that end a response, matched with transformers' ``StopStringCriteria``
    (the token that completes the string ends the row, the string stays in the response).
    ``on_step``: called once per decoding step (a progress bar's ``update``).
    ``min_new_tokens``: a stop string completed by step k < ``min_new_tokens`` does not end the
    row (vLLM's ``min_tokens`` ignores stop strings as long; ``generate`` holds EOS back itself).
    """

    def __init__(
        self,
        *,
        batch_size: int,
        prompt_width: int,
        eos_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        tokenizer: Any = None,
        on_step: Callable[[], object] | None = None,
        min_new_tokens: int = 0,
    ) -> None:
        self.prompt_width = prompt_width
        self.min_new_tokens = min_new_tokens
        self.eos_token_ids = torch.tensor(list(eos_token_ids), dtype=torch.long)
        self.stop = StopStringCriteria(tokenizer, list(stop)) if stop else None
        self.on_step = on_step
        self.end = torch.full((batch_size,), -1, dtype=torch.long)

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: Any) -> Tensor:
        device = input_ids.device
        self.eos_token_ids = self.eos_token_ids.to(device)  # moved once, on the first step
        ended = torch.isin(input_ids[:, -1], self.eos_token_ids)
        step = input_ids.shape[1] - self.prompt_width - 1
        if self.stop is not None and step >= self.min_new_tokens:
            ended = ended | self.stop(input_ids, scores).to(device)
        end = self.end.to(device)
        self.end = torch.where(ended & (end < 0), step, end)  # keep the first end of each row
        if self.on_step is not None:
            self.on_step()
        return ended


def stop_ends(
    prompt_ids: Tensor,
    response: Tensor,
    end: Tensor,
    *,
    stop: Sequence[str],
    eos: Sequence[int],
    tokenizer: Any,
    min_new_tokens: int = 0,
) -> Tensor:
    """Each row's end (b) after stop strings, for an engine that decoded on past them: the
    earlier of its end ``end`` (b) int64 (−1: none) and the step of the token completing its
    first stop string, replayed column by column with `ResponseEnds` (what ``generate`` runs
    as it goes; ``min_new_tokens`` kept). ``prompt_ids`` (b P) left-padded, ``response`` (b t)."""
    prompt_ids, response = prompt_ids.cpu(), response.cpu()
    ends = ResponseEnds(batch_size=response.shape[0], prompt_width=prompt_ids.shape[1],
                        eos_token_ids=eos, stop=stop, tokenizer=tokenizer,
                        min_new_tokens=min_new_tokens)  # fmt: skip
    full = torch.cat([prompt_ids, response], dim=1)
    for k in range(response.shape[1]):
        ends(full[:, : prompt_ids.shape[1] + k + 1], None)  # a view: no copy per column
    found = ends.end.to(end.device)
    return torch.where(found < 0, end, torch.where(end < 0, found, torch.minimum(found, end)))


def valid_tokens(end: Tensor, width: int) -> Tensor:
    """(b t) bool: True up to and including each row's end step; a row with ``end`` −1 (no end:
    cut at the length limit) is True throughout. ``end`` (b) int64, ``width`` = t."""
    steps = torch.arange(width, device=end.device)
    return (end[:, None] < 0) | (steps[None, :] <= end[:, None])


class FiniteLogits(LogitsProcessor):
    """Raises as soon as a decoding step's scores hold a NaN or +inf, or a row has no finite
    score: sampling would fail deep inside ``generate`` ("probability tensor contains either
    inf, nan or element < 0"), and greedy decoding would go on silently with garbage. The
    usual cause is a policy whose weights a too-large update broke. −inf alone is fine: top-k
    and top-p put it on the tokens they filter out. Costs one host sync per decoding step."""

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        broken = torch.isnan(scores).any(-1) | (scores == float("inf")).any(-1)
        broken |= (scores == float("-inf")).all(-1)
        if bool(broken.any()):
            rows = broken.nonzero().flatten().tolist()
            raise FloatingPointError(
                f"HFEngine.generate: the model's next-token scores are not finite (rows "
                f"{rows[:10]} of the batch, after {input_ids.shape[1]} tokens of the padded "
                "batch): its weights are broken, usually by an update too large for them (a "
                "learning rate too high, no max_grad_norm: the trainer's grad_norm and lr "
                "metrics of the last steps show it); lower lr, set max_grad_norm, or resume "
                "from an earlier checkpoint"
            )
        return scores
