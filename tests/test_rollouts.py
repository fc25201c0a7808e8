import dataclasses

import pytest
import torch

from rlblocks.rollouts import OPTIONAL_FIELDS, ROW_FIELDS, Rollouts


def make(n_rows: int = 4) -> Rollouts:
    # Row i: prompt of i+1 tokens, response of 4-i tokens (row 3 has one response token).
    prompts = [[10 + i] * (i + 1) for i in range(n_rows)]
    responses = [[20 + i] * (n_rows - i) for i in range(n_rows)]
    return Rollouts.from_lists(
        prompts,
        responses,
        pad_token_id=0,
        rollout_logprobs=[[-0.5 * (j + 1) for j in range(len(r))] for r in responses],
        group_ids=[7, 7, 3, 3][:n_rows],
        prompts=[f"p{i}" for i in range(n_rows)],
        completions=[f"c{i}" for i in range(n_rows)],
        metadata=[{"ground_truth": str(i)} for i in range(n_rows)],
    )


def assert_same(a: Rollouts, b: Rollouts) -> None:
    for name in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "group_ids"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), msg=name)
    for name in OPTIONAL_FIELDS:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), msg=name)
    assert a.prompts == b.prompts and a.completions == b.completions
    assert a.metadata == b.metadata
    assert a.extras.keys() == b.extras.keys()
    for k in a.extras:
        torch.testing.assert_close(a.extras[k], b.extras[k])


def test_from_lists_pads_prompts_left_and_responses_right():
    ro = make()
    # Longest prompt has 4 tokens, longest response 4 tokens.
    assert ro.prompt_ids.tolist()[0] == [0, 0, 0, 10]
    assert ro.response_ids.tolist()[3] == [23, 0, 0, 0]
    assert ro.attention_mask.tolist()[1] == [False, False, True, True, True, True, True, False]
    assert ro.response_mask.tolist()[2] == [True, True, False, False]
    assert ro.response_lengths.tolist() == [4, 3, 2, 1]
    # real tokens: (1+4) + (2+3) + (3+2) + (4+1) = 20
    assert ro.num_tokens == 20
    assert ro.input_ids.shape == (4, 8)
    assert ro.rollout_logprobs[0].tolist() == [-0.5, -1.0, -1.5, -2.0]
    assert ro.rollout_logprobs[3].tolist() == [-0.5, 0.0, 0.0, 0.0]


def test_defaults_fill_text_and_metadata():
    ro = Rollouts.from_lists([[1], [2]], [[3], [4, 5]])
    assert ro.prompts == ["", ""] and ro.completions == ["", ""]
    assert ro.metadata == [{}, {}]
    assert ro.group_ids.tolist() == [0, 1]
    assert ro.rollout_logprobs is None


def test_select_by_mask_indices_and_slice():
    ro = make()
    by_mask = ro.select(torch.tensor([False, True, False, True]))
    by_index = ro.select([1, 3])
    assert_same(by_mask, by_index)
    assert by_index.completions == ["c1", "c3"]
    assert by_index.group_ids.tolist() == [7, 3]
    reordered = ro.select(torch.tensor([3, 0]))
    assert reordered.metadata == [{"ground_truth": "3"}, {"ground_truth": "0"}]
    assert ro.select(slice(1, 3)).prompts == ["p1", "p2"]
    with pytest.raises(IndexError, match="out of range"):
        ro.select([4])
    with pytest.raises(ValueError, match="bool mask has shape"):
        ro.select(torch.tensor([True, False]))


def test_split_by_rows_round_trips():
    ro = make().replace(advantages=torch.randn(4, 4), rewards=torch.arange(4.0))
    ro = ro.with_extras(scores=torch.arange(4.0))
    for rows in (1, 2, 3, 4, 10):
        parts = ro.split(rows=rows)
        assert [len(p) for p in parts] == [min(rows, 4 - i) for i in range(0, 4, rows)]
        assert_same(Rollouts.concat(parts), ro)


def test_split_by_token_budget():
    ro = make()
    # Real tokens per row: [5, 5, 5, 5].
    assert [len(p) for p in ro.split(token_budget=10)] == [2, 2]
    assert [len(p) for p in ro.split(token_budget=14)] == [2, 2]
    assert [len(p) for p in ro.split(token_budget=15)] == [3, 1]
    # A budget below one row's length still makes progress, one row at a time.
    assert [len(p) for p in ro.split(token_budget=3)] == [1, 1, 1, 1]
    # Both limits: each part satisfies both.
    assert [len(p) for p in ro.split(rows=2, token_budget=100)] == [2, 2]
    for part in ro.split(token_budget=10):
        assert part.num_tokens <= 10
    assert_same(Rollouts.concat(ro.split(token_budget=7)), ro)


def test_split_token_budget_uneven_lengths():
    ro = Rollouts.from_lists([[1]] * 5, [[2] * 1, [2] * 6, [2] * 2, [2] * 2, [2] * 9])
    # Real tokens per row: 2, 7, 3, 3, 10. Budget 10: [2+7], [3+3], [10].
    assert [p.num_tokens for p in ro.split(token_budget=10)] == [9, 6, 10]


def test_split_rejects_bad_arguments():
    ro = make()
    with pytest.raises(ValueError, match="^Rollouts.split: neither rows nor token_budget given"):
        ro.split()
    with pytest.raises(ValueError, match="^Rollouts.split: rows=0; use rows >= 1"):
        ro.split(rows=0)


def test_concat_repads_different_widths():
    a = Rollouts.from_lists([[1, 2, 3]], [[4]])
    b = Rollouts.from_lists([[5]], [[6, 7, 8]])
    both = Rollouts.concat([a, b])
    assert both.prompt_ids.tolist() == [[1, 2, 3], [0, 0, 5]]
    assert both.response_ids.tolist() == [[4, 0, 0], [6, 7, 8]]
    assert both.attention_mask.tolist() == [
        [True, True, True, True, False, False],
        [False, False, True, True, True, True],
    ]
    assert both.response_lengths.tolist() == [1, 3]


def test_concat_rejects_mismatched_parts():
    a = make(2)
    b = make(2).replace(rollout_logprobs=None)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        Rollouts.concat([a, b])
    with pytest.raises(ValueError, match="extras"):
        Rollouts.concat([a, a.with_extras(x=torch.zeros(2))])


def test_repeat_keeps_group_ids_and_order():
    ro = Rollouts.from_lists([[1], [2]], [[], []], group_ids=[5, 9], prompts=["a", "b"])
    rep = ro.repeat(3)
    assert rep.prompts == ["a", "a", "a", "b", "b", "b"]
    assert rep.group_ids.tolist() == [5, 5, 5, 9, 9, 9]
    assert rep.prompt_ids.flatten().tolist() == [1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="^Rollouts.repeat: n=0; use n >= 1"):
        ro.repeat(0)


def test_trim_drops_unused_padding_columns():
    ro = make().select([2, 3])  # prompts of 3 and 4 tokens, responses of 2 and 1
    trimmed = make().select([1, 2]).trim()
    assert trimmed.prompt_ids.shape == (2, 3)  # longest prompt among rows 1, 2 is 3
    assert trimmed.response_ids.shape == (2, 3)  # longest response is 3
    assert ro.trim().response_ids.shape == (2, 2)
    assert_same(Rollouts.concat([ro.trim()]), ro.trim())


def test_to_moves_every_tensor():
    ro = make().with_extras(adv=torch.zeros(4, 4)).to("meta")
    assert ro.prompt_ids.device.type == "meta"
    assert ro.rollout_logprobs.device.type == "meta"
    assert ro.extras["adv"].device.type == "meta"


def test_validation_names_field_and_shape():
    ro = make()
    with pytest.raises(ValueError, match=r"response_mask: has shape \(4, 3\), expected \(4, 4\)"):
        ro.replace(response_mask=ro.response_mask[:, :3])
    with pytest.raises(TypeError, match="response_mask: must be torch.bool"):
        ro.replace(response_mask=ro.response_mask.long())
    with pytest.raises(ValueError, match=r"group_ids: has shape \(3,\)"):
        ro.replace(group_ids=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="completions: has 3 entries"):
        ro.replace(completions=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"attention_mask: has shape \(4, 7\), expected \(4, 8\)"):
        ro.replace(attention_mask=ro.attention_mask[:, 1:])
    # Row 0 has 4 response tokens, row 1 only 3: row 1 is the first with a counted pad.
    with pytest.raises(ValueError, match="response_mask: True on padding .* row 1"):
        ro.replace(response_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"extras\['adv'\].*response-aligned"):
        ro.with_extras(adv=torch.zeros(4, 5))
    with pytest.raises(TypeError, match="rollout_logprobs: must be a floating-point"):
        ro.replace(rollout_logprobs=torch.zeros(4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="row 1 has 2 response tokens but response_masks"):
        Rollouts.from_lists([[1], [1]], [[2], [3, 4]], response_masks=[[True], [True]])


def test_multi_turn_mask_is_kept_through_operations():
    # Row 0: policy tokens, 2 observation tokens, then policy tokens again.
    ro = Rollouts.from_lists(
        [[1], [1]],
        [[5, 6, 90, 91, 7], [5]],
        response_masks=[[True, True, False, False, True], [True]],
    )
    again = Rollouts.concat(ro.split(rows=1))
    assert again.response_mask[0].tolist() == [True, True, False, False, True]
    assert again.response_attention_mask[0].tolist() == [True] * 5


def test_fixed_names_are_typed_fields_carried_through_row_operations():
    b, t = 4, 4
    fields = {name: torch.randn(b, t) for name in OPTIONAL_FIELDS if name != "rollout_logprobs"}
    fields |= {name: torch.arange(b) * (i + 2) for i, name in enumerate(ROW_FIELDS)}  # (b) int
    ro = make().replace(**fields)
    mask = ro.response_mask
    picked = ro.select([2, 0])
    for name, value in fields.items():
        torch.testing.assert_close(getattr(picked, name), value[[2, 0]], msg=name)
    trimmed = ro.select([2, 3]).trim()  # rows 2 and 3 have 2 and 1 response tokens
    assert trimmed.old_logprobs.shape == (2, 2)
    torch.testing.assert_close(trimmed.advantages, fields["advantages"][2:, :2])
    assert_same(Rollouts.concat(ro.split(rows=3)), ro)
    assert ro.to("meta").returns.device.type == "meta"
    assert torch.equal(ro.response_mask, mask)  # fields are not masks: nothing else changes
    assert make().old_logprobs is None  # None until a block fills them


def test_a_misspelt_or_misshaped_fixed_name_fails_at_once():
    ro = make()
    with pytest.raises(TypeError, match="old_logprob"):
        ro.replace(old_logprob=torch.zeros(4, 4))  # no such field
    with pytest.raises(ValueError, match=r"Rollouts.extras\['old_logprobs'\].*replace"):
        ro.with_extras(old_logprobs=torch.zeros(4, 4))  # a field, not an extra
    with pytest.raises(ValueError, match=r"Rollouts.advantages: has shape \(4, 3\)"):
        ro.replace(advantages=torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"Rollouts.rewards: has shape \(3,\)"):
        ro.replace(rewards=torch.zeros(3))
    with pytest.raises(TypeError, match="ref_logprobs: must be a floating-point"):
        ro.replace(ref_logprobs=torch.zeros(4, 4, dtype=torch.long))
    assert ro.replace(rewards=torch.zeros(4, 4)).rewards.shape == (4, 4)  # per-token rewards
    with pytest.raises(ValueError, match=r"Rollouts.policy_version: has shape \(4, 4\)"):
        ro.replace(policy_version=torch.zeros(4, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="staleness: must be an integer"):
        ro.replace(staleness=torch.zeros(4))


def test_concat_needs_every_part_to_carry_the_same_fields():
    a = make(2)
    with pytest.raises(ValueError, match="some parts have returns and some do not"):
        Rollouts.concat([a, a.replace(returns=torch.zeros(2, 2))])
    assert {f.name for f in dataclasses.fields(Rollouts)} >= set(OPTIONAL_FIELDS)


def test_the_sampler_record_is_a_row_field_carried_through_row_operations():
    """``sampler`` (b 3): one (temperature, top_k, top_p) per row, never padded like a token
    field; select, split/concat, trim and to carry it; a misshaped one fails at once."""
    ro = make()  # 4 rows
    sampler = torch.tensor([[1.0, 5, 1.0], [0.7, 0, 0.9], [0.0, 0, 1.0], [1.0, 20, 0.95]],
                           dtype=torch.float64)  # fmt: skip
    ro = ro.replace(sampler=sampler)
    assert torch.equal(ro.select([3, 1]).sampler, sampler[[3, 1]])
    assert torch.equal(Rollouts.concat(ro.split(rows=3)).sampler, sampler)
    assert torch.equal(ro.select([2, 3]).trim().sampler, sampler[2:])  # columns trimmed, not it
    assert ro.to("meta").sampler.device.type == "meta"
    with pytest.raises(ValueError, match=r"Rollouts.sampler: has shape \(4, 2\)"):
        ro.replace(sampler=torch.zeros(4, 2, dtype=torch.float64))
    with pytest.raises(TypeError, match="sampler: must be a floating-point"):
        ro.replace(sampler=torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="some parts have sampler and some do not"):
        Rollouts.concat([ro, make()])
    assert make().sampler is None


# ---------------------------------------------------------------------- data out
def test_to_records_hand_worked():
    ro = Rollouts.from_lists(
        [[1, 2, 3], [4]],
        [[5, 6], [7, 8, 9]],
        response_masks=[[True, True], [True, False, True]],  # row 1: token 8 is an observation
        group_ids=[3, 3],
        prompts=["p0", "p1"],
        completions=["c0", "c1"],
        metadata=[
            {"ground_truth": "1", "prompt": [{"role": "user", "content": "q"}]},
            {"ground_truth": "2", "level": "easy"},
        ],
    )
    advantages = torch.tensor([[0.5, 0.5, 0.0], [1.0, 9.0, 3.0]])
    records = ro.replace(rewards=torch.tensor([1.0, 0.0]), advantages=advantages).to_records()
    assert records == [
        {
            "group_id": 3, "prompt": "p0", "completion": "c0", "prompt_tokens": 3,
            "response_tokens": 2, "policy_tokens": 2, "reward": 1.0,
            "advantage": 0.5,  # (0.5 + 0.5) / 2 policy tokens; the padding's 0.0 not counted
            "ground_truth": "1", "metadata.prompt": [{"role": "user", "content": "q"}],
            "level": None,
        },
        {
            "group_id": 3, "prompt": "p1", "completion": "c1", "prompt_tokens": 1,
            "response_tokens": 3, "policy_tokens": 2, "reward": 0.0,
            "advantage": 2.0,  # (1.0 + 3.0) / 2: the observation token's 9.0 not counted
            "ground_truth": "2", "metadata.prompt": None, "level": "easy",
        },
    ]  # fmt: skip
    per_token = torch.tensor([[0.0, 1.0, 0.0], [0.25, 0.0, 0.5]])
    plain = ro.to_records(rewards=per_token, advantages=torch.tensor([1.0, -1.0]))
    assert [r["reward"] for r in plain] == [1.0, 0.75]  # (b t) rewards: summed over the row
    assert [r["advantage"] for r in plain] == [1.0, -1.0]
    assert "reward" not in ro.to_records()[0] and "advantage" not in ro.to_records()[0]
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\), expected \(2,\)"):
        ro.to_records(rewards=torch.zeros(3))


def test_to_pandas_and_to_dataset_round_trip(tmp_path):
    ro = Rollouts.from_lists(
        [[1], [2]],
        [[5], [6, 7]],
        prompts=["p0", "p1"],
        completions=["c0", "c1"],
        metadata=[{"ground_truth": "1", "extra_info": {"index": 0}}] * 2,
    )
    rewards = torch.tensor([0.5, -1.0])
    records = ro.to_records(rewards=rewards)
    frame = ro.to_pandas(rewards=rewards)
    assert frame.to_dict(orient="records") == records
    assert frame.groupby("ground_truth")["reward"].mean().to_dict() == {"1": -0.25}
    ds = ro.to_dataset(rewards=rewards)
    ds.to_parquet(tmp_path / "rollouts.parquet")
    from datasets import Dataset

    assert Dataset.from_parquet(str(tmp_path / "rollouts.parquet")).to_list() == records
