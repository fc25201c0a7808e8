"""The device rule of every ``from_pretrained``: CUDA when torch sees a GPU (else the CPU), an
explicit ``device=`` wins, and a device asked for that torch does not see is refused, naming the
block, the device, what torch sees and the fix, before any weight is read."""

from __future__ import annotations

import pytest
import torch

import rlblocks as rb
from rlblocks.models import default_device, resolve_device

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def test_the_default_is_cuda_exactly_when_cuda_is_available():
    # The decision takes the answer as an argument: both branches run on any machine.
    assert default_device(available=True) == torch.device("cuda")
    assert default_device(available=False) == torch.device("cpu")
    assert default_device() == default_device(available=torch.cuda.is_available())
    assert resolve_device(None, owner="X") == default_device()


def test_an_explicit_device_that_torch_sees_wins():
    assert resolve_device("cpu", owner="X") == torch.device("cpu")
    assert resolve_device(torch.device("meta"), owner="X") == torch.device("meta")


@NO_CUDA
def test_from_pretrained_loads_onto_the_cpu_where_there_is_no_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path))
    policy = rb.trainer.PolicyTrainer.from_pretrained("tiny", reference=None)
    assert policy.device == torch.device("cpu")
    critic = rb.critic.CriticTrainer.from_pretrained("tiny")
    assert critic.device == torch.device("cpu")


# Each entry point, given a folder that does not exist: loading first would raise OSError
# ("no model folder"), so the device error proves the device is checked before anything is read.
ENTRY_POINTS = [
    ("PolicyTrainer.from_pretrained", lambda: rb.trainer.PolicyTrainer.from_pretrained),
    ("HFEngine.from_pretrained", lambda: rb.rollout.HFEngine.from_pretrained),
    ("Teacher.from_pretrained", lambda: rb.trainer.Teacher.from_pretrained),
    ("CriticTrainer.from_pretrained", lambda: rb.critic.CriticTrainer.from_pretrained),
    ("RewardModel.from_pretrained", lambda: rb.rewards.RewardModel.from_pretrained),
    ("rlblocks.models.load", lambda: rb.models.load),
]


@NO_CUDA
@pytest.mark.parametrize(("owner", "entry"), ENTRY_POINTS, ids=[o for o, _ in ENTRY_POINTS])
@pytest.mark.parametrize("device", ["cuda", "cuda:3", torch.device("cuda", 1)])
def test_absent_cuda_is_refused_before_loading_naming_block_device_and_fix(
    tmp_path, owner, entry, device
):
    folder = tmp_path / "not-there"
    with pytest.raises(RuntimeError) as caught:
        entry()(folder, device=device)
    message = str(caught.value)
    assert message.startswith(f"{owner}: device '{torch.device(device)}' was asked for, but ")
    if torch.version.cuda is None:  # this torch: what it sees, and the fix
        assert f"torch {torch.__version__} is a build without CUDA" in message
        assert "install a CUDA build of torch" in message
    else:
        assert "sees no GPU" in message and "nvidia-smi" in message
    assert "pass device='cpu', or leave device out" in message
    assert not folder.exists()


def test_absent_mps_and_unknown_names_are_refused():
    if not torch.backends.mps.is_available():
        with pytest.raises(
            RuntimeError, match=r"^X: device 'mps' was asked for, but torch sees no MPS"
        ):
            resolve_device("mps", owner="X")
    with pytest.raises(
        ValueError, match=r"^X: device 'gpu' is not a device torch knows; pass 'cuda'"
    ):
        resolve_device("gpu", owner="X")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_from_pretrained_lands_on_cuda_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path))
    policy = rb.trainer.PolicyTrainer.from_pretrained("tiny", reference=None)
    assert policy.device.type == "cuda"
    engine = rb.rollout.HFEngine.from_pretrained("tiny", progress=False)
    assert next(engine.model.parameters()).device.type == "cuda"
    assert rb.critic.CriticTrainer.from_pretrained("tiny").device.type == "cuda"
    # An explicit device still wins.
    cpu = rb.trainer.PolicyTrainer.from_pretrained("tiny", device="cpu", reference=None)
    assert cpu.device == torch.device("cpu")
    beyond = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU torch sees
    with pytest.raises(RuntimeError, match=rf"device '{beyond}' was asked for, but torch sees"):
        rb.trainer.PolicyTrainer.from_pretrained("tiny", device=beyond)
