"""`rlblocks.base.statefile`: state written as JSON and safetensors and read back as equal values,
without unpickling anything; what is not data is refused by where it sits."""

from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
from resume_helpers import assert_same_state as assert_same

from rlblocks.base.statefile import StateFileError, read_state, read_tree, write_state

VALUES = {
    "plain": {"n": 3, "x": 0.25, "ok": True, "none": None, "name": "grpo", "list": [1, [2, 3]]},
    "floats": [float("nan"), float("inf"), -float("inf"), -0.0, 1e308],
    "big int": 2**100,
    "tuple": (1, ("a", None), []),
    "bytes": b"\x00\x80\xff pickle-looking \x80\x04",
    "keys": {1: "one", (2, 3): "pair", "$tensor": "a user's key", None: 0},
    "tensors": {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).bfloat16(),
        "int64": torch.arange(6).view(2, 3),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(7.5),
        "empty": torch.zeros(0, 3),
        "view": torch.arange(10.0)[::3],  # not contiguous, shares its storage
    },
    "arrays": {
        "u32": np.arange(624, dtype=np.uint32),
        "f16": np.linspace(0, 1, 5, dtype=np.float16).reshape(5, 1),
        "empty": np.zeros((0,), dtype=np.int8),
        "scalar": np.float64(2.5),
        "int": np.int64(-3),
    },
}


@pytest.mark.parametrize("name", list(VALUES))
def test_every_kind_of_value_comes_back_equal(tmp_path, name):
    write_state(tmp_path / "s.json", VALUES[name])
    json.loads((tmp_path / "s.json").read_text())  # plain JSON: no NaN literal, nothing else
    assert_same(read_state(tmp_path / "s.json"), VALUES[name])


def test_the_random_generators_come_back_and_draw_the_same(tmp_path):
    from rlblocks.base.rng import rng_state, set_rng_state

    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    np.random.randn()  # a cached Gaussian in NumPy's state
    write_state(tmp_path / "rng.json", rng_state())
    expected = (random.random(), np.random.randn(), torch.rand(2))
    set_rng_state(read_state(tmp_path / "rng.json"))
    assert (random.random(), np.random.randn()) == expected[:2]
    assert torch.equal(torch.rand(2), expected[2])


class Opaque:
    pass


def test_a_value_that_is_not_data_is_refused_by_its_place(tmp_path):
    value = {"blocks": {"rollouts": {"metadata": [{"answer": Opaque()}]}}}
    with pytest.raises(StateFileError, match=r"blocks/rollouts/metadata/0/answer is a .*Opaque"):
        write_state(tmp_path / "s.json", value)
    with pytest.raises(StateFileError, match="x is a NumPy array of Python objects"):
        write_state(tmp_path / "s.json", {"x": np.array([Opaque()])})


class Marker:
    """Unpickling it runs a shell command that writes ``path``."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_pickle_in_place_of_a_state_file_is_never_run(tmp_path, how):
    marker = tmp_path / "ran"
    write_state(tmp_path / "s.json", {"t": torch.ones(2)})
    if how == "pickle":
        (tmp_path / "s.json").write_bytes(pickle.dumps(Marker(marker)))
    else:
        torch.save(Marker(marker), tmp_path / "s.json")
    with pytest.raises(StateFileError, match=r"s\.json is not a state file \(plain JSON\)"):
        read_state(tmp_path / "s.json")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"format": "rlblocks.state/1", "value": {"$call": "os.system"}}', "unknown tag"),
        ('{"format": "rlblocks.state/1", "value": {"$float": "1e400"}}', r"malformed \$float"),
        ('{"value": 1}', "has the format None"),
        ("[" * 100_000, "not a state file"),
    ],
)
def test_a_file_that_write_state_never_writes_is_refused(tmp_path, text, match):
    (tmp_path / "s.json").write_text(text)
    with pytest.raises(StateFileError, match=match):
        read_state(tmp_path / "s.json")


def test_a_tensor_the_tensor_file_lacks_is_refused(tmp_path):
    write_state(tmp_path / "s.json", {"t": torch.ones(2)})
    (tmp_path / "s.json").write_text('{"format": "rlblocks.state/1", "value": {"$tensor": "x"}}')
    with pytest.raises(StateFileError, match="a tensor 'x' that its tensor file does not hold"):
        read_state(tmp_path / "s.json")


def test_a_truncated_tensor_file_is_named(tmp_path):
    write_state(tmp_path / "s.json", {"t": torch.ones(100)})
    data = (tmp_path / "s.safetensors").read_bytes()
    (tmp_path / "s.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(StateFileError, match=r"s\.safetensors cannot be read"):
        read_state(tmp_path / "s.json")
    assert read_tree(tmp_path / "s.json") == {"t": {"$tensor": "t"}}
