"""How the engine samples: ``SamplingParams`` to a Hugging Face config, rollout log-probs, seeds.

Rollout log-probs are those of the *untruncated* tempered distribution,

    log π_T(y_k | x, y_<k) = log softmax(z_k / T)[y_k],   z_k the model's raw logits at step k,

with T = 1 for greedy decoding, whatever top-k / top-p or ``min_new_tokens`` (EOS held back)
did to the sampling. That is what a trainer computes from a forward pass at the same
temperature (``logits / T`` then ``token_logprobs``, as verl's and torchtune's actors do), so
the PPO ratio π_θ / π_old (Schulman et al. 2017, arXiv 1707.06347, eq. 6) starts at 1 when
the weights agree, up to the rounding of cached vs uncached attention. The gap between the
sampling engine and the trainer is left to the loss (truncated importance sampling: Yao et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", blog post, no
arXiv id).

With **sampling replay** (``SamplingParams.replay``) they are those of the distribution the
engine sampled from instead, log softmax(s_k)[y_k] of ``generate``'s processed scores s_k
(``output_scores``: z_k / T with −inf outside what top-k then top-p kept), and the engine
records ``(T, top_k, top_p)`` per row (:func:`sampler_record`) so that the trainer rebuilds the
kept set from its own logits (`rlblocks.losses.truncation`). The processed scores are also
where ``min_new_tokens``'s EOS ban shows (EOS at −inf for the first steps); the trainer does not
replay that ban, so keep ``min_new_tokens`` at 0 where the two must agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor
from transformers import GenerationConfig

from rlblocks.interfaces import SamplingParams


def generation_config(
    params: SamplingParams, *, pad_token_id: int, eos_token_ids: list[int]
) -> GenerationConfig:
    """A Hugging Face ``GenerationConfig`` that says everything ``params`` say.

    Temperature 0 is greedy decoding (``do_sample=False``); top_k 0 is off, as ``generate``
    reads it. ``min_new_tokens`` goes to ``generate``'s own, which sets the EOS logits to −inf
    until that many tokens are out (``MinNewTokensLengthLogitsProcessor``). Raw logits are
    returned (``output_logits``) for :func:`sampled_logprobs`; with ``params.replay`` the
    processed scores instead (``output_scores``: what was sampled from, module docstring).
    ``generate`` fills every field left unset from ``model.generation_config``: run it with a
    blank one (see ``HFEngine``) so that nothing else shapes the sampling distribution.
    """
    greedy = params.temperature == 0
    sample = {} if greedy else {"temperature": params.temperature, "top_p": params.top_p}
    return GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        min_new_tokens=params.min_new_tokens,
        do_sample=not greedy,
        **sample,
        top_k=None if greedy else params.top_k,
        num_beams=1,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_ids or None,
        use_cache=True,
        output_logits=not params.replay,
        output_scores=params.replay,
        return_dict_in_generate=True,
    )


def sampled_logprobs(logits: list[Tensor], tokens: Tensor, *, temperature: float) -> Tensor:
    """log π(y_k) = log softmax(z_k / T)[y_k] = z_k[y_k]/T − logsumexp(z_k / T), step by step.

    ``logits``: t tensors (b v), the raw logits of each decoding step (any float dtype);
    ``tokens``: (b t) int64 sampled ids. Returns (b t) float32, no grad. One (b v) step is in
    float32 at a time (entries of ``logits`` are released as they are used), never a (b t v).
    """
    if len(logits) != tokens.shape[1]:
        raise ValueError(
            f"sampled_logprobs: {len(logits)} logit steps for {tokens.shape[1]} sampled tokens; "
            "pass one (b v) logits tensor per sampled token"
        )

    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    for k in range(len(logits)):
        z = logits[k].to(device=tokens.device, dtype=torch.float32) / temperature
        logits[k] = None  # type: ignore[call-overload]  # free the step once used
        out[:, k] = z.gather(-1, tokens[:, k, None])[:, 0] - torch.logsumexp(z, dim=-1)
    return out


def sampler_record(params: SamplingParams, rows: int) -> Tensor:
    """``Rollouts.sampler`` for ``rows`` rows sampled with ``params``: ``(rows 3)`` float64 of
    (temperature, top_k, top_p); a greedy row records temperature 0 (scored untruncated at
    T = 1)."""
    row = [params.temperature, float(params.top_k), params.top_p]
    return torch.tensor([row] * rows, dtype=torch.float64).reshape(rows, 3)


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """With a seed: sample from a forked RNG (the CPU's and those of ``device``'s kind) seeded
    with it, so two runs agree and the global RNG state is the same afterwards. Without a seed:
    the global RNG, as is (it advances)."""
    if seed is None:
        yield
        return
    kind = device.type
    accelerators = [] if kind == "cpu" else list(range(getattr(torch, kind).device_count()))
    with torch.random.fork_rng(devices=accelerators, device_type="cuda" if kind == "cpu" else kind):
        torch.manual_seed(seed)
        yield
