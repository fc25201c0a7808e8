"""What most tests build: a random ragged `Rollouts` batch, a tiny `PolicyTrainer` and an
`HFEngine` for it.

A plain module, not a test file: ``pythonpath = ["tests"]`` in pyproject.toml puts ``tests`` on
``sys.path``, so tests and the helper modules import it with ``from builders import ...``
(spawned data-parallel workers too); the trainer and critic tests reach `ragged_rollouts`
through their ``make_rollouts`` fixture.
"""

from __future__ import annotations

from typing import Any

import torch

from rlblocks.models import tiny, tiny_tokenizer
from rlblocks.rollout import HFEngine
from rlblocks.rollouts import Rollouts
from rlblocks.trainer import PolicyTrainer

VOCAB = 384  # the tiny tokenizer's vocabulary


def ragged_rollouts(
    b: int = 8,
    *,
    seed: int = 0,
    max_prompt: int = 6,
    max_response: int = 8,
    group_size: int = 1,
) -> Rollouts:
    """``b`` rows of random token ids with random prompt and response lengths (left-padded
    prompts of 1..``max_prompt`` tokens, right-padded responses of 2..``max_response``).

    Row 0 has a prompt of one token and a response of exactly one valid token; every other row
    has some masked-out "observation" tokens in its response (each kept with probability 0.75,
    the first always). Rows form groups of ``group_size`` consecutive rows. The same arguments
    give the same batch on every call.
    """
    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks = [], [], []
    for i in range(b):
        n_prompt = 1 if i == 0 else int(torch.randint(1, max_prompt + 1, (), generator=g))
        n_response = 1 if i == 0 else int(torch.randint(2, max_response + 1, (), generator=g))
        prompts.append(torch.randint(3, VOCAB, (n_prompt,), generator=g).tolist())
        responses.append(torch.randint(3, VOCAB, (n_response,), generator=g).tolist())
        mask = (torch.rand(n_response, generator=g) > 0.25).tolist()
        mask[0] = True
        masks.append(mask)
    return Rollouts.from_lists(
        prompts,
        responses,
        response_masks=masks,
        group_ids=torch.arange(b) // group_size,
        pad_token_id=0,
    )


def tiny_trainer(
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    device: str = "cpu",
    reference: Any = None,
    tokenizer: bool = True,
    model_config: dict[str, Any] | None = None,
    module: torch.nn.Module | None = None,
    **settings: Any,
) -> PolicyTrainer:
    """A `PolicyTrainer` around a fresh tiny model (``rb.models.tiny(seed=seed, **model_config)``,
    weights in ``dtype``, on ``device``) with its tokenizer (none with ``tokenizer=False``).

    No reference unless asked (``reference="copy"``, or ``"auto"`` for the library's default):
    most tests score none, and a frozen copy doubles the memory. ``settings`` go to
    `PolicyTrainer` as given: ``lora``, ``config``, or any `TrainConfig` field
    (``micro_batch_size=2``, ``log_entropy=True``, ...); ``lr`` is 1e-2 unless given or a
    ``config`` is (then the config's; `PolicyTrainer`'s own default is 1e-6). ``model_config``
    holds `Qwen2Config` overrides (``{"num_hidden_layers": 3}``). Two calls with the same
    arguments give two trainers with the same weights. Building one draws nothing from the
    global RNG (``tiny`` forks it); LoRA's initialisation does, as with `PolicyTrainer` itself.

    ``module``: wrap this existing model instead of building one (a test that also reads or
    scores the model object itself, or hands it to a second trainer); it is used as given, so
    ``dtype``, ``seed``, ``device`` and ``model_config`` must stay at their defaults.
    """
    if "config" not in settings:
        settings.setdefault("lr", 1e-2)
    if module is None:
        net, tok = tiny(seed=seed, dtype=dtype, **(model_config or {}))
        net = net.to(device)
    else:
        if (dtype, seed, device, model_config) != (torch.float32, 0, "cpu", None):
            raise ValueError("tiny_trainer(module=...): dtype, seed, device, model_config unused")
        net, tok = module, tiny_tokenizer()
    return PolicyTrainer(net, tokenizer=tok if tokenizer else None, reference=reference, **settings)


def tiny_engine(
    policy: PolicyTrainer, *, shared: bool = True, seed: int = 0, **kw: Any
) -> HFEngine:
    """An `HFEngine` with ``policy``'s tokenizer (the tiny one), progress bar off: around
    ``policy.model`` itself (``shared=True``), or around its own fresh float32 tiny model of
    ``seed`` (the weights a default `tiny_trainer` starts from, synced by the resharder).
    ``kw`` go to `HFEngine` (``chat=True``, ...)."""
    tokenizer = policy.tokenizer if policy.tokenizer is not None else tiny_tokenizer()
    model = policy.model if shared else tiny(seed=seed)[0]
    return HFEngine(model, tokenizer, **{"progress": False, **kw})


class Counter:
    """A `Stateful` checkpoint block holding one count ``n`` (what a test sets it to)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]
