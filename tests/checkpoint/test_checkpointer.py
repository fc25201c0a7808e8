"""The checkpoint block's parts: folders, pruning, what resume accepts, the data position, the
run configuration, the reference's identity."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from builders import Counter, tiny_trainer

import rlblocks as rb
from rlblocks.checkpoint import Checkpointer, CheckpointError
from rlblocks.checkpoint.folders import to_prune
from rlblocks.data import PromptBatches, load_prompts
from rlblocks.run import Drawn, describe, run_config


def test_pruning_keeps_the_newest_and_every_kth():
    assert to_prune(range(1, 11), keep_last=2, keep_every=None) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert to_prune(range(1, 11), keep_last=2, keep_every=4) == [1, 2, 3, 5, 6, 7]
    assert to_prune(range(1, 11), keep_last=None, keep_every=None) == []


def test_save_load_prune_and_the_random_state(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2, keep_every=3)
    counter = Counter()
    for step in range(1, 7):
        counter.n = 10 * step
        ckpt.save(step, {"counter": counter}, history=[{"step": s} for s in range(step)])
    assert ckpt.steps() == [3, 5, 6] and ckpt.latest() == 6
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    ckpt.save(7, {"counter": counter}, config={"lr": 0.1})
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)  # moved away, then restored
    fresh = Counter()
    restored = ckpt.load({"counter": fresh})
    assert (restored.step, restored.config, fresh.n) == (7, {"lr": 0.1}, 60)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert ckpt.steps() == [3, 6, 7]  # 5 pruned once 7 is complete
    assert ckpt.load({"counter": fresh}, step=3).history == [{"step": s} for s in range(3)]


def test_only_marked_folders_count_and_leftovers_are_swept(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"counter": Counter()})
    (tmp_path / "step-00000002").mkdir()  # renamed, killed before its marker
    (tmp_path / ".partial-step-00000003").mkdir()  # killed while writing
    assert ckpt.steps() == [1]
    ckpt.save(4, {"counter": Counter()})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".checkpointer.lock",  # one writer per folder (rlblocks.checkpoint.lock): it stays
        "step-00000001",
        "step-00000004",
    ]


def test_what_resume_accepts(tmp_path):
    ckpt = Checkpointer(tmp_path)
    assert ckpt.resume_step(False) is None and ckpt.resume_step("auto") is None
    with pytest.raises(
        FileNotFoundError, match="^Checkpointer.resume_step: resume=True but .* holds no complete"
    ):
        ckpt.resume_step(True)
    ckpt.save(3, {"counter": Counter()})
    with pytest.raises(
        FileExistsError, match=r"after step 3\); pass run=rb.run.RunOptions\(resume=True\)"
    ):
        ckpt.resume_step(False)
    assert ckpt.resume_step(True) == ckpt.resume_step("auto") == 3
    with pytest.raises(CheckpointError, match=r"holds the blocks \['counter'\]"):
        ckpt.load({"other": Counter()})


def test_a_block_that_cannot_be_saved_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="block 'engine' \\(object\\) has neither"):
        Checkpointer(tmp_path).save(1, {"engine": object()})
    assert [p.name for p in tmp_path.iterdir()] == [".checkpointer.lock"]  # no partial folder


def _rows(n: int):
    return load_prompts([{"prompt": f"p{i}", "ground_truth": "0"} for i in range(n)])


@pytest.mark.parametrize("stateful", [True, False])
def test_drawn_resumes_at_the_next_batch(stateful):
    def source():
        batches = PromptBatches(_rows(10), prompts_per_step=3, seed=0, epochs=4)  # 12 batches
        return batches if stateful else list(batches)

    whole = [b.prompts for b in Drawn(source())]
    drawn = Drawn(source())
    first = [next(drawn).prompts for _ in range(5)]  # crosses the end of epoch 0 (3 batches)
    resumed = Drawn(source())
    resumed.load_state_dict(drawn.state_dict())
    rest = [batch.prompts for batch in resumed]
    assert len(whole) == 12 and first + rest == whole


def test_drawn_refuses_a_shorter_source():
    drawn = Drawn([1, 2])
    with pytest.raises(ValueError, match="had drawn 3 batches, this source holds only 2"):
        drawn.load_state_dict({"drawn": 3, "source": None})


def test_run_config_is_plain_json_without_addresses():
    loss = functools.partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28))
    config = run_config(
        "grpo",
        {
            "steps": 3,
            "sampling": rb.SamplingParams(max_new_tokens=8),
            "loss_fn": loss,
            "advantage": rb.advantage.grpo,
            "run": rb.run.RunOptions(on_step=print),
            "engine": object(),
        },
    )
    assert config["loss_fn"] == "rlblocks.losses.ppo.clipped_surrogate(clip=[0.2, 0.28])"
    assert config["sampling"]["max_new_tokens"] == 8 and config["engine"] == "object"
    assert "run" not in config and config["recipe"] == "grpo"  # the loop adds what counts
    assert describe(lambda x: x) == "function"


def test_a_changed_configuration_is_named_on_resume():
    with pytest.warns(UserWarning, match=r"lr: 0\.1 -> 0\.2"):
        rb.checkpoint.warn_if_config_differs({"lr": 0.1, "steps": 5}, {"lr": 0.2, "steps": 9})


def test_the_reference_must_be_the_initial_policy(tmp_path):
    policy = tiny_trainer(reference="copy")
    policy.save_checkpoint(tmp_path)
    trained, _ = rb.models.tiny(seed=0)
    with torch.no_grad():
        trained.model.norm.weight.add_(0.01)  # e.g. a reference built from a checkpoint
    other = tiny_trainer(module=trained, reference="copy", lr=1e-6)
    with pytest.raises(ValueError, match="must keep the initial policy as its reference"):
        other.load_checkpoint(tmp_path)
    same = tiny_trainer(reference="copy")
    same.load_checkpoint(tmp_path)  # the same initial model: accepted


@pytest.mark.parametrize("lora", [False, True])
def test_a_restored_trainer_takes_the_same_next_step(tmp_path, lora):
    """save_checkpoint / load_checkpoint of a policy (LoRA: the adapter and its optimizer) and
    a critic: the next step of the restored pair equals the original's, bit for bit."""
    from peft import LoraConfig

    def build():
        model, _ = rb.models.tiny(seed=0)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None
        policy = tiny_trainer(module=model, reference="auto", lr=1e-2, lora=config)
        return policy, rb.critic.CriticTrainer(model, lr=1e-2)

    policy, critic = build()
    engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, progress=False)
    torch.manual_seed(0)
    ro = engine.generate(
        ["Count: 1", "Count: 2"], group_size=4, sampling=rb.SamplingParams(max_new_tokens=6)
    )
    adv, returns = torch.randn(8), torch.randn(ro.response_mask.shape)
    loss = rb.recipes.defaults.PPO_CLIP

    def step(p, c):
        metrics = {**p.step(ro, adv, loss_fn=loss), **c.step(ro, returns, old_values=c.values(ro))}
        return {k: v for k, v in metrics.items() if "second" not in k}  # wall clock

    step(policy, critic)
    policy.save_checkpoint(tmp_path / "policy")
    critic.save_checkpoint(tmp_path / "critic")
    if lora:
        assert (tmp_path / "policy" / "model" / "adapter_model.safetensors").is_file()
    restored, restored_critic = build()
    restored.load_checkpoint(tmp_path / "policy")
    restored_critic.load_checkpoint(tmp_path / "critic")
    untouched, untouched_critic = build()  # negative control: no state
    step(untouched, untouched_critic)
    assert step(policy, critic) == step(restored, restored_critic)
    for a, b in ((policy, restored), (critic, restored_critic)):
        for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
            assert torch.equal(x, y), name
    assert step(untouched, untouched_critic) != step(policy, critic)


def _count_steps(folder, *, steps: int, batches: list, every: int, stop_at: int | None = None):
    """A `rlblocks.run.Run` over ``batches`` whose steps count into a `Stateful` block; it
    breaks after step ``stop_at``."""
    from rlblocks.run import Batches, Run

    counter = Counter()
    source = Batches(batches)
    ckpt = Checkpointer(folder, every=every, keep_last=None)
    run = Run(
        "count",
        steps=steps,
        blocks={"counter": counter},
        checkpoint=ckpt,
        resume="auto",
        progress=False,
    )
    with run.driving(source):
        for step in run:
            counter.n += source.draw()  # the run ends when the data runs out
            run.record({"n": float(counter.n)})
            if step == stop_at:
                break
    return ckpt.steps(), [h["n"] for h in run.history], counter.n


def test_a_run_checkpoints_when_due_and_however_it_ends(tmp_path):
    # step 0 (the initial state) first, then every 3rd step and the last
    assert _count_steps(tmp_path / "a", steps=5, batches=[1] * 9, every=3) == (
        [0, 3, 5],
        [1, 2, 3, 4, 5],
        5,
    )
    # the data runs out after 4 batches: the 4th step is saved all the same
    assert _count_steps(tmp_path / "b", steps=9, batches=[1] * 4, every=3)[0] == [0, 3, 4]
    # on_step stops the run after step index 1 (2 steps done)
    assert _count_steps(tmp_path / "c", steps=9, batches=[1] * 9, every=3, stop_at=1)[0] == [0, 2]
    # resumed from 2: the counter comes back, the data goes on at the 3rd batch, no new save
    # of step 2; a run already at its last step saves nothing
    resumed = _count_steps(tmp_path / "c", steps=4, batches=[1, 1, 10, 100], every=3)
    assert resumed == ([0, 2, 3, 4], [1, 2, 12, 112], 112)
    assert _count_steps(tmp_path / "c", steps=4, batches=[1] * 9, every=3)[0] == [0, 2, 3, 4]


def test_a_saved_step_is_never_overwritten(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1)
    ckpt.save(1, {"counter": Counter()})
    with pytest.raises(CheckpointError, match="step-00000001 is already a checkpoint"):
        ckpt.save(1, {"counter": Counter()})
    assert ckpt.steps() == [1]
