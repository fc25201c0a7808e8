"""What a checkpoint is checked for: a checksum per file, and finite weights.

**Checksums.** Before a checkpoint folder is published (`rlblocks.checkpoint.folders`), every
file in it is hashed (SHA-256) into ``manifest.json``: its path, size and digest. Loading checks
the folder against it first (`damage`): a file whose bytes changed (a flipped bit in
``model.safetensors``), a truncated or missing file, and a file the manifest does not list (an
extra optimizer shard would be read into the optimizer) are each named. The Checkpointer then
skips that checkpoint for the newest intact one (docs/checkpoints.md).

**Finite weights.** A checkpoint of weights that hold NaN or ±inf is no place to go back to:
`first_nonfinite` finds the first floating-point tensor with a non-finite value in the
``.safetensors`` files of the blocks' folders (the policy's weights, the optimizer's and the
critic's shards), and the Checkpointer refuses the save, naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from rlblocks.checkpoint.folders import MARKER

MANIFEST = "manifest.json"
ALGORITHM = "sha256"
_CHUNK = 1 << 20


def _files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the manifest and the marker, as POSIX relative paths."""
    found = []
    for here, _, names in os.walk(folder):
        for name in names:
            relative = (Path(here) / name).relative_to(folder).as_posix()
            if relative not in (MANIFEST, MARKER):
                found.append(relative)
    return sorted(found)


def digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB chunks."""
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def digests(folder: Path, names: list[str]) -> dict[str, str]:
    """``digest`` of each file, a few at a time (hashlib releases the GIL on large reads, so
    the shards of a checkpoint hash side by side)."""
    workers = max(1, min(4, os.cpu_count() or 1, len(names)))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(lambda name: digest(folder / name), names), strict=True))


def write_manifest(folder: Path) -> None:
    """Hash every file of ``folder`` into ``folder/manifest.json`` (the last file written
    before the folder is published)."""
    names = _files(folder)
    hashed = digests(folder, names)
    files = {
        name: {"bytes": (folder / name).stat().st_size, ALGORITHM: hashed[name]} for name in names
    }
    document = {"algorithm": ALGORITHM, "files": files}
    (folder / MANIFEST).write_text(json.dumps(document, indent=1) + "\n")


def damage(folder: Path) -> list[str]:
    """What is wrong with ``folder`` against its manifest, one entry per file (``path:
    cause``); empty when every file is as it was written."""
    try:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        listed = {str(k): (int(v["bytes"]), str(v[ALGORITHM])) for k, v in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return [f"{folder / MANIFEST}: unreadable ({type(err).__name__}: {err})"]
    found = []
    present = set(_files(folder))
    sized = [
        n for n in sorted(listed) if n in present and (folder / n).stat().st_size == listed[n][0]
    ]
    hashed = digests(folder, sized)
    for name, (size, expected) in sorted(listed.items()):
        path = folder / name
        if name not in present:
            found.append(f"{path}: missing")
        elif name not in hashed:
            found.append(f"{path}: {path.stat().st_size} bytes, {size} written (truncated?)")
        elif hashed[name] != expected:
            found.append(f"{path}: its {ALGORITHM} differs from the one written (changed bytes)")
    found += [f"{folder / name}: not in the manifest" for name in sorted(present - set(listed))]
    return found


class NonFinite(NamedTuple):
    """A tensor holding NaN or ±inf in a checkpoint's file."""

    file: Path
    tensor: str
    count: int  # type: ignore[assignment]  # the field shadows tuple.count (a public name, kept)
    numel: int


def first_nonfinite(folders: Iterable[Path]) -> NonFinite | None:
    """The first floating-point tensor with a non-finite value in the ``.safetensors`` files
    under ``folders``, or None."""
    from safetensors import safe_open

    for folder in folders:
        for file in sorted(folder.rglob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    tensor = f.get_tensor(key)
                    if tensor.is_floating_point():
                        bad = int((~torch.isfinite(tensor)).sum())
                        if bad:
                            return NonFinite(file, key, bad, tensor.numel())
    return None


__all__ = [
    "ALGORITHM",
    "MANIFEST",
    "NonFinite",
    "damage",
    "digest",
    "first_nonfinite",
    "write_manifest",
]
