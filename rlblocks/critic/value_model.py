"""``ValueModel``: a causal LM's transformer with a scalar value head, V(s) per response token.

The critic of PPO for LLMs (Ziegler et al. 2019, arXiv 1909.08593, sec. 2.2; InstructGPT,
Ouyang et al. 2022, arXiv 2203.02155, sec. 3.5) is the policy's (or the reward model's)
transformer with its LM head replaced by a linear map to one number.

**Which state a value belongs to.** ``values[i, k]`` is V(s_k), the value of the state *before*
response token k is emitted: prompt and response tokens 0 … k−1. It is read from the hidden state
at the column that predicts token k (column tp+k−1 of ``[prompt, response]``), the same column
whose logits score token k in :mod:`rlblocks.trainer.forward`. verl's critic takes the same
columns (``values[:, -response_length - 1 : -1]``). This is the convention of
:func:`rlblocks.advantage.gae`: it pairs V(k) with the reward r_k of emitting token k and with
V(next valid token), δ_k = r_k + γ V(k') − V(k); after the last token V = 0.

**Head initialisation.** Zero by default (weight and bias): every value starts at 0, so the first
GAE advantages are the plain discounted reward-to-go rather than noise from a random head, and
the backbone is exactly the checkpoint's until the head has learnt something (with a zero head
the backbone's gradient is zero on the first update). ``init_std > 0`` draws the weight from
N(0, init_std²) instead (OpenRLHF uses std = 1 / (hidden + 1)); the bias stays 0.

**Precision.** The head runs in float32 (float64 for a float64 backbone) on the hidden states cast
up, whatever the backbone's dtype, so values are never bf16.
"""

from __future__ import annotations

import contextlib
from copy import deepcopy

import torch
from torch import Tensor, nn

from rlblocks.rollouts import Rollouts
from rlblocks.trainer.forward import check_scorable, position_ids
from rlblocks.trainer.packing import check_isolation, pack, packed_attention


class ValueModel(nn.Module):
    """A transformer backbone and an ``nn.Linear(hidden, 1)`` value head.

    ``model``: a Hugging Face causal LM (its base transformer is used: ``model.base_model``,
    i.e. ``model.model`` for Llama/Qwen/Mistral, ``model.transformer`` for GPT-2) or a bare
    transformer that returns hidden states first. With ``copy=True`` (default) the backbone is
    deep-copied, so that training the critic never moves a policy that shares the module; the LM
    head is not copied. ``init_std``: see the module docstring (0 = zero-initialised head).
    """

    def __init__(self, model: nn.Module, *, init_std: float = 0.0, copy: bool = True) -> None:
        super().__init__()
        if init_std < 0:
            raise ValueError(
                f"ValueModel: init_std must be >= 0, got {init_std}; pass 0 for a zero head"
            )
        backbone = _backbone(model)
        self.backbone = deepcopy(backbone) if copy else backbone  # the LM head is left behind
        reference = next(self.backbone.parameters())
        dtype = torch.promote_types(reference.dtype, torch.float32)
        self.head = nn.Linear(_hidden_size(model), 1, dtype=dtype, device=reference.device)
        with torch.no_grad():
            self.head.weight.normal_(0.0, init_std) if init_std > 0 else self.head.weight.zero_()
            self.head.bias.zero_()

    def forward(self, rollouts: Rollouts, *, bf16: bool = False, packing: bool = False) -> Tensor:
        """V(s_k) for every response token k: the head applied to the hidden state at column
        tp+k−1 (module docstring), V_{i,k} = w·h_θ(x_{i, <tp+k})[tp+k−1] + b.

        Position ids follow the attention mask (``rlblocks.trainer.forward.position_ids``), so a
        left-padded row gets the values it would get alone. Shapes: returns ``(b t)`` float32
        (float64 for a float64 backbone), 0 where ``response_mask`` is False, with the gradient
        of the backbone and head when grad mode is on (nothing detached). ``bf16`` runs the
        backbone under ``torch.autocast(dtype=torch.bfloat16)``; the head stays in float32.
        Rows need at least one prompt column (``tp >= 1``). ``packing``: the rows run
        padding-free as one sequence, attention kept per row (``rlblocks.trainer.packing``).
        """
        check_scorable(self.backbone, rollouts, owner="ValueModel")
        t, mask = rollouts.response_ids.shape[1], rollouts.attention_mask
        autocast = (
            torch.autocast(device_type=mask.device.type, dtype=torch.bfloat16)
            if bf16
            else contextlib.nullcontext()
        )
        if packing:
            check_isolation(self.backbone, owner="ValueModel")
            packed = pack(rollouts)
            with packed_attention(self.backbone, packed) as kwargs, autocast:
                hidden = self.backbone(**kwargs)[0][0, packed.keep]  # (m h)
            values = packed.scatter(self.head(hidden.to(self.head.weight.dtype)).squeeze(-1))
            zero = torch.zeros((), dtype=values.dtype, device=values.device)
            return torch.where(rollouts.response_mask, values, zero)
        with autocast:
            outputs = self.backbone(
                input_ids=rollouts.input_ids,
                attention_mask=mask.long(),
                position_ids=position_ids(mask),
                use_cache=False,
            )
        hidden = outputs[0]  # (b tp+t h): last hidden state (ModelOutput or tuple)
        s = hidden.shape[1]
        hidden = hidden[:, s - (t + 1) : s - 1]  # columns tp−1 … tp+t−2 predict tokens 0 … t−1
        values = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        return torch.where(rollouts.response_mask, values, zero)


def _backbone(model: nn.Module) -> nn.Module:
    # PreTrainedModel.base_model is getattr(model, base_model_prefix, model): the bare
    # transformer of any HF causal LM, and the model itself when it already is one.
    backbone = getattr(model, "base_model", model)
    return backbone if isinstance(backbone, nn.Module) else model


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        size = getattr(text, "hidden_size", None)
        if isinstance(size, int):
            return size
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
    if isinstance(embeddings, nn.Embedding):
        return embeddings.embedding_dim
    raise ValueError(
        "ValueModel: cannot tell the hidden size (no config.hidden_size, no input "
        "embeddings); pass a model whose config has hidden_size"
    )
