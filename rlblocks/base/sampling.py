"""`SamplingParams`: how a `rlblocks.interfaces.RolloutEngine` samples, as data (re-exported
by `rlblocks.interfaces` and as ``rb.SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How a RolloutEngine samples. Engines map these onto their own parameters."""

    max_new_tokens: int = 256
    """Longest response, in tokens."""
    min_new_tokens: int = 0
    """Shortest response: EOS cannot be sampled, and stop strings do not end a response, before
    this many tokens (Hugging Face ``min_new_tokens``, vLLM ``min_tokens``). EOS gets probability
    0 in the sampling distribution until then (its logit is set to −inf); rollout log-probs still
    score the untruncated distribution, as with top-k / top-p. ``min_new_tokens ==
    max_new_tokens`` makes every response exactly that long (equal shapes for benchmarks)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    stop: tuple[str, ...] = ()
    """Strings that end a response (the stop string is kept in the response)."""
    seed: int | None = None
    """Seed for reproducible sampling; None draws from the global generator."""
    replay: bool = False
    """Sampling replay: the engine reports rollout log-probs of the distribution it sampled
    from (the tempered one renormalized over what top-k then top-p kept) and records
    ``(temperature, top_k, top_p)`` per row in ``Rollouts.sampler``, so that the trainer scores
    that same distribution (``rlblocks.losses.truncation``). False: log-probs of the untruncated
    tempered distribution, nothing recorded. An engine that cannot record its sampler refuses
    it by name."""

    def __post_init__(self) -> None:
        m = self.max_new_tokens
        checks = (  # (valid, field, rule, what to pass instead), checked in this order
            (m >= 1, "max_new_tokens", "must be >= 1", "pass a positive count"),
            (0 <= self.min_new_tokens <= m, "min_new_tokens",
             f"must be in [0, max_new_tokens = {m}]", "pass a count in that range"),
            (self.temperature >= 0, "temperature", "must be >= 0",
             "pass 0 for greedy decoding or a positive value"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]", "pass 1.0 to keep every token"),
            (self.top_k >= 0, "top_k", "must be >= 0", "pass 0 to keep every token"),
        )  # fmt: skip
        for valid, name, rule, fix in checks:
            if not valid:
                value = getattr(self, name)
                raise ValueError(f"SamplingParams.{name}: {rule}, got {value}; {fix}")


__all__ = ["SamplingParams"]
