"""ValueModel: which hidden state gives V(s_k), masking, padding invariance, initialisation.

Comparisons between batched and one-row forwards use float64 models: the matmuls of a padded
batch and of a single row are blocked differently, which in float32 leaves rounding noise near
the default tolerance and in float64 far below it.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from transformers import GPT2Config, GPT2LMHeadModel

from rlblocks.critic import CriticTrainer, ValueModel
from rlblocks.models import save_tiny, tiny
from rlblocks.rollouts import Rollouts


@torch.no_grad()
def _slow_values(vm: ValueModel, ro: Rollouts) -> torch.Tensor:
    """Each row alone, unpadded, default positions: V_k = head(h[len(prompt) + k − 1])."""
    b, t = ro.response_ids.shape
    out = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        prompt = ro.prompt_ids[i][ro.prompt_mask[i]]
        response = ro.response_ids[i][ro.response_attention_mask[i]]
        hidden = vm.backbone(torch.cat([prompt, response])[None]).last_hidden_state[0]
        for k in range(len(response)):
            if ro.response_mask[i, k]:  # the state before token k: last column that sees < k
                out[i, k] = vm.head(hidden[len(prompt) + k - 1]).item()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_values_match_one_unpadded_row_at_a_time(value_model64, make_rollouts, seed):
    # The loop runs each row alone without padding, so agreement is the left-padding invariance
    # (position ids from the attention mask) and the column convention of the module docstring.
    ro = make_rollouts(seed=seed)
    vm = value_model64()
    with torch.no_grad():
        values = vm(ro)
    assert values.shape == ro.response_ids.shape and values.dtype == torch.float64
    assert_close(values, _slow_values(vm, ro))


def test_a_row_alone_equals_the_row_in_a_padded_batch(value_model64, make_rollouts):
    ro = make_rollouts(seed=3)
    vm = value_model64()
    with torch.no_grad():
        batched = vm(ro)
        for i in range(len(ro)):
            alone = vm(ro.select([i]).trim())  # no padding at all
            t = alone.shape[1]
            assert_close(alone[0], batched[i, :t])
            assert (batched[i, t:] == 0).all()


def test_float32_values_are_zero_exactly_where_the_mask_is_false(make_rollouts):
    ro = make_rollouts(seed=4)
    assert (~ro.response_mask & ro.response_attention_mask).any()  # observation tokens exist
    torch.manual_seed(0)
    vm = ValueModel(tiny()[0], init_std=0.1)
    with torch.no_grad():
        values = vm(ro)
        bf16 = vm(ro, bf16=True)
    assert values.dtype == torch.float32 and bf16.dtype == torch.float32  # head in float32
    assert (values[~ro.response_mask] == 0).all()
    assert (values[ro.response_mask] != 0).all()
    assert (bf16[~ro.response_mask] == 0).all()


def test_head_initialisation_hand_worked(make_rollouts):
    ro = make_rollouts(seed=5)
    vm = ValueModel(tiny()[0])  # default: zero weight and bias, so V = 0·h + 0 = 0 everywhere
    with torch.no_grad():
        assert (vm(ro) == 0).all()
        vm.head.bias.fill_(1.5)  # V = 0·h + 1.5 = 1.5 on counted tokens, 0 elsewhere
        expected = torch.where(ro.response_mask, 1.5, 0.0)
        assert_close(vm(ro), expected)
    torch.manual_seed(0)
    random = ValueModel(tiny()[0], init_std=0.5)
    # 64 draws of N(0, 0.5²): the sample std lies within 0.5 ± 0.15 with overwhelming odds.
    assert (
        0.35 < float(random.head.weight.detach().std()) < 0.65
        and float(random.head.bias.detach()) == 0.0
    )
    with pytest.raises(ValueError, match="init_std"):
        ValueModel(tiny()[0], init_std=-1.0)


def test_initialised_from_a_policy_copy(make_rollouts):
    policy, _ = tiny(seed=3)
    vm = ValueModel(policy)
    backbone = vm.backbone.state_dict()
    assert backbone.keys() == policy.model.state_dict().keys()
    for name, value in policy.model.state_dict().items():
        assert torch.equal(backbone[name], value), name
        assert backbone[name].data_ptr() != value.data_ptr()  # copied, not shared
    assert not any("lm_head" in n for n in vm.state_dict())
    assert vm.head.weight.shape == (1, 64)
    with torch.no_grad():
        vm.backbone.embed_tokens.weight.add_(1.0)
    assert not torch.equal(policy.model.embed_tokens.weight, vm.backbone.embed_tokens.weight)
    shared = ValueModel(policy, copy=False)
    assert shared.backbone is policy.model


def test_critic_from_pretrained_loads_the_checkpoint_backbone(tmp_path):
    path = save_tiny(tmp_path / "tiny", seed=2)
    vm = CriticTrainer.from_pretrained(path).model
    original = tiny(seed=2)[0].model.state_dict()
    for name, value in vm.backbone.state_dict().items():
        assert torch.equal(value, original[name]), name
    assert (vm.head.weight == 0).all()


def test_other_architectures_gpt2(make_rollouts):
    # GPT-2 keeps its transformer under ``.transformer``: found through ``base_model``.
    config = GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=384,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(config).to(torch.float64).eval()
    torch.manual_seed(0)
    vm = ValueModel(lm, init_std=0.1)
    assert vm.head.in_features == 32
    ro = make_rollouts(seed=6)
    with torch.no_grad():
        assert_close(vm(ro), _slow_values(vm, ro))


def test_needs_a_prompt_column():
    vm = ValueModel(tiny()[0])
    ro = Rollouts.from_lists([[]], [[5, 6]])
    with pytest.raises(ValueError, match="no prompt column"):
        vm(ro)
