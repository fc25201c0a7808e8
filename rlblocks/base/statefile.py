"""State as data: a JSON tree whose tensors live in a ``.safetensors`` file, read back without
unpickling anything.

A checkpoint that ``torch.load`` reads with full pickle is code: an object planted in it runs
whatever its ``__reduce__`` says when the run resumes. Every piece of state a checkpoint holds
(the run's blocks, the random generators, the trainers' scheduler and counters, the layout of
the optimizer's shards) is written here instead, as two files::

    write_state(folder / "state.json", value)     # state.json, and state.safetensors if needed
    value = read_state(folder / "state.json")

What it holds: ``None``, bools, ints, floats (NaN and ±inf too), strings, bytes, lists, tuples,
dicts with any of these as keys, torch tensors and NumPy arrays (and NumPy scalars), nested
freely. Anything else is refused at write time, naming where it sits in the value
(``blocks/rollouts/ahead/metadata/0/answer: Fraction``): a class instance has no form as data.

The JSON tree (`encode`) keeps plain values as they are and tags the rest with a one-key
object: ``{"$tensor": key}``, ``{"$ndarray": key, "dtype": "<u4", "shape": [624]}``,
``{"$tuple": [...]}``, ``{"$bytes": base64}``, ``{"$float": "nan"}``, and ``{"$dict": [[k, v],
...]}`` for a dict whose keys are not all strings (or start with ``$``). A tensor's key is its
path in the value (``rng/torch``), so the same structure gives the same keys: the trainers'
optimizer state keeps its tensors in sharded files of its own (`rlblocks.trainer.checkpoint`)
and its JSON tree beside them (`write_tree` / `read_tree`). A NumPy array is stored as its raw
bytes (dtype and shape in the tree), so any dtype round-trips.

Reading checks the format and every tag and raises `StateFileError` naming the file: a pickle
put in a JSON file's place is rejected as not JSON, never executed.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlblocks.base.safe_files import UnsafeFile, read_json

#: Written into every state file; a file without it (or with another) is refused.
FORMAT = "rlblocks.state/1"
MAX_STATE_BYTES = 1 << 30
"""The largest state file read: 1 GiB of JSON (its tensors are in the ``.safetensors`` beside it)."""
TAGS = ("$tensor", "$ndarray", "$tuple", "$bytes", "$float", "$dict")


class StateFileError(ValueError):
    """A state file could not be read back as data, or a value cannot be written as data; the
    message names the file (or the place in the value) and the cause."""


# ---------------------------------------------------------------------- the tree
def encode(value: Any, *, path: str = "") -> tuple[Any, dict[str, Tensor]]:
    """``value`` as a JSON tree and the tensors its ``$tensor`` / ``$ndarray`` tags name (the
    tensors themselves, not copies; NumPy arrays as uint8 tensors of their bytes)."""
    tensors: dict[str, Tensor] = {}
    return _encode(value, path, tensors), tensors


def decode(tree: Any, tensors: Mapping[str, Tensor], *, where: str = "state") -> Any:
    """The value `encode` turned into ``tree``, with its tensors taken from ``tensors``.
    ``where`` (a file) names the source in a `StateFileError`."""
    try:
        return _decode(tree, tensors, where)
    except RecursionError:
        raise StateFileError(
            f"read_state: {where} nests too deeply to be a state file; pass a file that "
            "write_state wrote"
        ) from None


def tensor_keys(tree: Any) -> set[str]:
    """The tensor keys a tree refers to (its ``$tensor`` and ``$ndarray`` tags)."""
    if isinstance(tree, list):
        return set().union(*map(tensor_keys, tree)) if tree else set()
    if not isinstance(tree, dict):
        return set()
    if "$tensor" in tree or "$ndarray" in tree:
        return {str(tree.get("$tensor", tree.get("$ndarray")))}
    children = tree["$dict"] if "$dict" in tree else tree.values()
    return tensor_keys(list(children))


def _encode(value: Any, path: str, tensors: dict[str, Tensor]) -> Any:
    if isinstance(value, np.ndarray | np.generic):  # before float: np.float64 is a float
        return _encode_array(np.asarray(value), isinstance(value, np.generic), path, tensors)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Tensor):
        return {"$tensor": _add(tensors, path, value)}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        pairs = [
            [_encode(k, f"{path}/{k}#key", tensors), _encode(v, f"{path}/{k}", tensors)]
            for k, v in value.items()
        ]
        return {"$dict": pairs}
    kind = type(value)
    raise StateFileError(
        f"write_state: {path.lstrip('/') or 'the value'} is a {kind.__module__}.{kind.__qualname__}, "
        "which a checkpoint cannot hold as data (it holds None, bool, int, float, str, bytes, "
        "list, tuple, dict, torch tensors and NumPy arrays); turn it into those in the block's "
        "state_dict()"
    )


def _encode_array(
    array: np.ndarray, scalar: bool, path: str, tensors: dict[str, Tensor]
) -> dict[str, Any]:
    if array.dtype.hasobject:
        raise StateFileError(
            f"write_state: {path.lstrip('/')} is a NumPy array of Python objects, which a "
            "checkpoint cannot hold as data; store numbers, or a list of plain values"
        )
    raw = torch.from_numpy(np.frombuffer(array.tobytes(), dtype=np.uint8).copy())
    tag = {"$ndarray": _add(tensors, path, raw), "dtype": array.dtype.str}
    return tag | {"shape": list(array.shape), "scalar": scalar}


def _add(tensors: dict[str, Tensor], path: str, tensor: Tensor) -> str:
    """Keep ``tensor`` under its path (made unique if two keys print alike)."""
    key = path.lstrip("/") or "value"
    if key in tensors:
        key = f"{key}#{len(tensors)}"
    tensors[key] = tensor
    return key


def _decode(tree: Any, tensors: Mapping[str, Tensor], where: str) -> Any:
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    if isinstance(tree, list):
        return [_decode(v, tensors, where) for v in tree]
    if not isinstance(tree, dict):
        raise _bad(where, f"a JSON value of type {type(tree).__name__}")
    tags = [k for k in tree if k.startswith("$")]
    if not tags:
        return {k: _decode(v, tensors, where) for k, v in tree.items()}
    if tags[0] not in TAGS:
        raise _bad(where, f"the unknown tag {tags[0]!r}")
    return _decode_tagged(tags[0], tree, tensors, where)


def _decode_tagged(
    tag: str, tree: dict[str, Any], tensors: Mapping[str, Tensor], where: str
) -> Any:
    body = tree[tag]
    try:
        if tag == "$tuple":
            return tuple(_decode(v, tensors, where) for v in body)
        if tag == "$dict":
            return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in body}
        if tag == "$float":
            return float({"nan": "nan", "inf": "inf", "-inf": "-inf"}[body])
        if tag == "$bytes":
            return base64.b64decode(body.encode("ascii"), validate=True)
        if tag == "$tensor":
            return _tensor(tensors, body, where)
        dtype = np.dtype(str(tree["dtype"]))
        if dtype.hasobject:
            raise _bad(where, "a NumPy array of Python objects")
        raw = _tensor(tensors, body, where).numpy().tobytes()
        array = np.frombuffer(raw, dtype=dtype).reshape(tree["shape"]).copy()
        return array[()] if tree.get("scalar") else array
    except StateFileError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise _bad(where, f"a malformed {tag} entry ({err})") from None


def _tensor(tensors: Mapping[str, Tensor], key: Any, where: str) -> Tensor:
    if not isinstance(key, str) or key not in tensors:
        raise _bad(where, f"a tensor {key!r} that its tensor file does not hold")
    return tensors[key]


def _bad(where: str, what: str) -> StateFileError:
    return StateFileError(
        f"read_state: {where} holds {what}, which write_state never writes; the file is damaged "
        "or was not written by rlblocks: resume from another checkpoint"
    )


# ---------------------------------------------------------------------- the files
def write_tree(path: str | Path, tree: Any) -> None:
    """Write an encoded ``tree`` as ``path`` (plain JSON, with the format)."""
    text = json.dumps({"format": FORMAT, "value": tree}, allow_nan=False, separators=(",", ":"))
    Path(path).write_text(text + "\n", encoding="utf-8")


def read_tree(path: str | Path) -> Any:
    """The tree `write_tree` wrote; `StateFileError` naming ``path`` if it is not one (not
    UTF-8, not JSON, another format: a pickle in its place is all three)."""
    path = Path(path)
    try:
        document = read_json(path, max_bytes=MAX_STATE_BYTES)
    except UnsafeFile as err:
        raise StateFileError(
            f"read_state: {path} is not a state file (plain JSON): {err}; rlblocks never reads a "
            "pickle back: resume from a checkpoint this version wrote"
        ) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise StateFileError(
            f"read_state: {path} has the format {found!r}, not {FORMAT!r}; pass a file that "
            "write_state wrote"
        )
    return document.get("value")


def tensor_file(path: str | Path) -> Path:
    """Where the tensors of the state file ``path`` live: beside it, ``.safetensors``."""
    return Path(path).with_suffix(".safetensors")


def write_state(path: str | Path, value: Any) -> None:
    """Write ``value`` as ``path`` (JSON) and, when it holds tensors, ``tensor_file(path)``
    (CPU copies, contiguous). `StateFileError` names a part that is not data."""
    tree, tensors = encode(value)
    if tensors:
        from safetensors.torch import save_file

        copies = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()}
        save_file(copies, str(tensor_file(path)))
    write_tree(path, tree)


def read_state(path: str | Path) -> Any:
    """The value `write_state` wrote as ``path``; nothing is unpickled. `StateFileError`
    naming the file when it is not a state file or its tensor file is damaged."""
    tree = read_tree(path)
    keys = tensor_keys(tree)
    tensors: dict[str, Tensor] = {}
    if keys:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        file = tensor_file(path)
        try:
            tensors = load_file(str(file))
        except (OSError, SafetensorError) as err:
            raise StateFileError(
                f"read_state: {file} cannot be read ({err}); the file is damaged or missing: "
                "resume from another checkpoint"
            ) from None
    return decode(tree, tensors, where=str(path))


__all__ = [
    "FORMAT",
    "StateFileError",
    "decode",
    "encode",
    "read_state",
    "read_tree",
    "tensor_file",
    "tensor_keys",
    "write_state",
    "write_tree",
]
