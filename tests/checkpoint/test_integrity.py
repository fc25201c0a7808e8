"""What a checkpoint folder holds cannot be turned against the run, and damage never resumes
silently: a pickle planted in any of its state files is refused by name and never runs, a
damaged newest checkpoint (changed bytes, a truncated file) is named and skipped for the newest
intact one, non-finite weights are refused at save, a format-1 ``state.pt`` is refused.

The files are picked by their role, under the names of this format or of format 1 (state.pt,
trainer.pt, rng-0.pt, DCP's pickled .metadata), so that each test also runs against the
rlblocks that wrote pickles (and fails there)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from builders import Counter, ragged_rollouts, tiny_trainer

import rlblocks as rb
from rlblocks.checkpoint import Checkpointer, CheckpointError

LOSS = rb.recipes.defaults.PPO_CLIP


class Marker:
    """Unpickling it runs a shell command that writes ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _weights(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.state_dict().items()}


def _saved(root: Path, steps=(1, 2)) -> tuple[Checkpointer, dict[int, dict]]:
    """Checkpoints of a policy trained one step more before each, and a counter."""
    ckpt = Checkpointer(root, keep_last=None)
    policy, counter, weights = tiny_trainer(), Counter(), {}
    for step in steps:
        policy.step(ragged_rollouts(8, seed=step), torch.randn(8), loss_fn=LOSS)
        counter.n = step
        ckpt.save(step, {"policy": policy, "counter": counter})
        weights[step] = _weights(policy)
    return ckpt, weights


def _fresh() -> dict:
    return {"policy": tiny_trainer(), "counter": Counter()}


def _role(folder: Path, role: str) -> Path:
    """The file that plays ``role`` in a checkpoint folder, in this format or format 1."""
    names = {
        "run state": ["state.json", "state.pt"],
        "trainer state": ["policy/trainer.json", "policy/trainer.pt"],
        "random state": ["policy/rng-0.json", "policy/rng-0.pt"],
        "optimizer layout": ["policy/state/layout.json", "policy/state/.metadata"],
        "model weights": ["policy/model/model.safetensors"],
    }
    if role == "optimizer shard":  # the largest file of DCP's folder
        return max((folder / "policy" / "state").iterdir(), key=lambda p: p.stat().st_size)
    return next(folder / n for n in names[role] if (folder / n).is_file())


def _rehash(folder: Path) -> None:
    """Write the manifest again, as someone who can write into the folder can."""
    if (folder / "manifest.json").is_file():
        from rlblocks.checkpoint.integrity import write_manifest

        write_manifest(folder)


@pytest.mark.parametrize("role", ["run state", "trainer state", "random state", "optimizer layout"])
def test_a_pickle_planted_in_a_checkpoint_never_runs(tmp_path, role):
    ckpt, _ = _saved(tmp_path / "ckpt", steps=(1,))
    folder = tmp_path / "ckpt" / "step-00000001"
    target, marker = _role(folder, role), tmp_path / "ran"
    target.write_bytes(pickle.dumps(Marker(marker)))
    _rehash(folder)  # the checksums pass: the reader itself must refuse the file
    with pytest.raises(CheckpointError, match=f"{target}.* is not a state file"):
        ckpt.load(_fresh())
    assert not marker.exists()


def test_a_format_1_checkpoint_is_refused_by_name(tmp_path):
    ckpt, _ = _saved(tmp_path / "ckpt", steps=(1,))
    folder, marker = tmp_path / "ckpt" / "step-00000001", tmp_path / "ran"
    for name in ("state.json", "state.safetensors", "manifest.json"):
        (folder / name).unlink(missing_ok=True)
    torch.save({"format": 1, "blocks": Marker(marker)}, folder / "state.pt")
    with pytest.raises(
        CheckpointError, match=r"state\.pt is a checkpoint of an older rlblocks .* start the run"
    ):
        ckpt.load(_fresh())
    assert not marker.exists()


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-64] ^= 0xFF  # inside the last tensor's values, not the header
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "model weights": _flip,
    "run state": _truncate,
    "optimizer shard": _truncate,
}


@pytest.mark.parametrize("role", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_named_and_skipped(tmp_path, role):
    ckpt, weights = _saved(tmp_path / "ckpt")
    damaged = _role(tmp_path / "ckpt" / "step-00000002", role)
    DAMAGE[role](damaged)
    blocks = _fresh()
    with pytest.warns(UserWarning, match=f"step 2 is damaged: {damaged}") as caught:
        restored = ckpt.load(blocks)
    assert (restored.step, blocks["counter"].n) == (1, 1)
    for name, tensor in _weights(blocks["policy"]).items():
        assert torch.equal(tensor, weights[1][name]), name  # the weights of step 1, exactly
    aside = tmp_path / "ckpt" / "damaged-step-00000002"
    assert any(str(aside) in str(w.message) for w in caught)
    assert ckpt.steps() == [1] and aside.is_dir()  # kept for a look, out of the way
    ckpt.save(2, blocks)  # the resumed run saves step 2 again


def test_no_intact_checkpoint_names_every_damaged_file(tmp_path):
    ckpt, _ = _saved(tmp_path / "ckpt")
    model = _role(tmp_path / "ckpt" / "step-00000002", "model weights")
    shard = _role(tmp_path / "ckpt" / "step-00000001", "optimizer shard")
    _flip(model)
    _truncate(shard)
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as error:
        ckpt.load(_fresh())
    message = str(error.value)
    assert "no intact checkpoint" in message
    assert f"step 2: {model}" in message and f"step 1: {shard}" in message
    assert ckpt.steps() == [1, 2]  # nothing moved: there was nowhere to resume from


def test_a_damaged_checkpoint_asked_for_by_step_is_refused(tmp_path):
    ckpt, _ = _saved(tmp_path / "ckpt")
    _flip(_role(tmp_path / "ckpt" / "step-00000001", "model weights"))
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="model.safetensors"):
        ckpt.load(_fresh(), step=1)


def test_non_finite_weights_are_refused_at_save(tmp_path):
    ckpt, _ = _saved(tmp_path / "ckpt", steps=(1,))
    policy = tiny_trainer()
    with torch.no_grad():
        policy.model.model.norm.weight[3] = float("nan")
        policy.model.model.norm.weight[4] = float("inf")
    with pytest.raises(
        CheckpointError,
        match=r"step 2 would hold non-finite weights: 'model\.norm\.weight' in "
        r"policy/model/model\.safetensors has 2 NaN/inf values",
    ):
        ckpt.save(2, {"policy": policy, "counter": Counter()})
    listed = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert listed == [".checkpointer.lock", "step-00000001"]  # no partial folder


def _listed_as_empty(folder: Path, path: Path) -> None:
    """Rewrite the manifest's entry of ``path`` as 0 bytes, what ``stat`` says of a FIFO or of
    /dev/zero: the sizes agree, so the old check went on to read the file."""
    import json

    document = json.loads((folder / "manifest.json").read_text())
    document["files"][path.relative_to(folder).as_posix()]["bytes"] = 0
    (folder / "manifest.json").write_text(json.dumps(document))


def _as_fifo(folder: Path, path: Path) -> None:
    path.unlink()
    os.mkfifo(path)  # opening it for reading waits for a writer, for ever
    _listed_as_empty(folder, path)


def _as_link_to_dev_zero(folder: Path, path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")  # reading it never ends
    _listed_as_empty(folder, path)


def _manifest_with_infinity(folder: Path) -> None:
    text = (folder / "manifest.json").read_text()
    (folder / "manifest.json").write_text(
        text.replace('"bytes": ', '"bytes": Infinity, "was": ', 1)
    )


def _manifest_nested_deep(folder: Path) -> None:
    (folder / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)


def _manifest_reaching_outside(folder: Path) -> None:
    import json

    document = json.loads((folder / "manifest.json").read_text())
    name, entry = next(iter(document["files"].items()))
    document["files"] = {f"../../{name}": entry}
    (folder / "manifest.json").write_text(json.dumps(document))


def _meta_of_another_step(folder: Path) -> None:
    import json

    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "step": 7}))
    _rehash(folder)  # the checksums pass: the step inside must still match the folder's


SHAPE = {  # (how the folder is damaged, what the warning names)
    "a FIFO in the weights' place": (lambda f: _as_fifo(f, _role(f, "model weights")), "a FIFO"),
    "a link to /dev/zero": (lambda f: _as_link_to_dev_zero(f, _role(f, "run state")), "symbolic"),
    "Infinity in the manifest": (_manifest_with_infinity, "Infinity is not a JSON number"),
    "a manifest nested 100,000 deep": (_manifest_nested_deep, "RecursionError"),
    "a manifest entry outside the folder": (_manifest_reaching_outside, "not a path inside"),
    "meta.json of another step": (_meta_of_another_step, "the step inside is 7, the folder's 2"),
}


@pytest.mark.timeout(60)  # a FIFO or /dev/zero read would hang here: fail instead
@pytest.mark.parametrize("case", list(SHAPE))
def test_a_checkpoint_of_the_wrong_shape_is_named_and_skipped(tmp_path, case):
    # These hung loading (a FIFO, /dev/zero), raised OverflowError / RecursionError instead of
    # falling back, read outside the folder, or resumed a step under another step's name.
    damage, named = SHAPE[case]
    ckpt, weights = _saved(tmp_path / "ckpt")
    damage(tmp_path / "ckpt" / "step-00000002")
    blocks = _fresh()
    with pytest.warns(UserWarning, match=f"step 2 is damaged: .*{named}"):
        restored = ckpt.load(blocks)
    assert (restored.step, blocks["counter"].n) == (1, 1)
    for name, tensor in _weights(blocks["policy"]).items():
        assert torch.equal(tensor, weights[1][name]), name


def test_a_safetensors_header_that_lies_is_named(tmp_path):
    # The header claims a tensor reaches past the end of the file; with the checksums
    # rewritten to match, loading raised a bare SafetensorError naming no checkpoint.
    import json
    import struct

    ckpt, _ = _saved(tmp_path / "ckpt", steps=(1,))
    folder = tmp_path / "ckpt" / "step-00000001"
    weights = _role(folder, "model weights")
    data = weights.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + 10**9]
    text = json.dumps(header).encode().ljust(size)[:size]
    weights.write_bytes(data[:8] + text + data[8 + size :])
    _rehash(folder)
    with pytest.raises(
        CheckpointError, match=r"step-00000001: a .safetensors file is not what its header says"
    ):
        ckpt.load(_fresh())
