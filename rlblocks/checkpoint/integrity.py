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
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from rlblocks.base.safe_files import UnsafeFile, read_json, regular_file
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
    cause``); empty when every file is as it was written. Nothing the manifest says is trusted
    before it is checked: it is read as bounded JSON (`rlblocks.base.safe_files`), each entry
    must be a path inside the folder with a size and a digest, and each file must be a regular
    file of that size before its bytes are read (a FIFO or a link to ``/dev/zero`` would block
    the read or never end it)."""
    try:
        listed = _entries(read_json(folder / MANIFEST))
    except (UnsafeFile, ValueError) as err:
        return [f"{folder / MANIFEST}: unreadable ({err})"]
    found = []
    present = set(_files(folder))
    sizes: dict[str, int] = {}
    for name in sorted(listed):
        if name in present:
            try:
                sizes[name] = regular_file(folder / name).st_size
            except UnsafeFile as err:
                found.append(str(err))
    hashed = digests(folder, [n for n, size in sizes.items() if size == listed[n][0]])
    for name, (size, expected) in sorted(listed.items()):
        path = folder / name
        if name not in present:
            found.append(f"{path}: missing")
        elif name not in sizes:
            continue  # not a regular file: named above
        elif name not in hashed:
            found.append(f"{path}: {sizes[name]} bytes, {size} written (truncated?)")
        elif hashed[name] != expected:
            found.append(f"{path}: its {ALGORITHM} differs from the one written (changed bytes)")
    found += [f"{folder / name}: not in the manifest" for name in sorted(present - set(listed))]
    return found


def _entries(document: Any) -> dict[str, tuple[int, str]]:
    """The manifest's ``files`` as ``{path: (bytes, digest)}``; ``ValueError`` naming the first
    entry that is not a relative path inside the folder with a byte count and a SHA-256."""
    files = document.get("files") if isinstance(document, dict) else None
    if not isinstance(files, dict):
        raise ValueError("manifest.json: no 'files' mapping; skip this checkpoint")  # noqa: TRY004 (damage, not a caller's type)
    entries = {}
    for name, entry in files.items():
        parts = Path(name).parts
        size = entry.get("bytes") if isinstance(entry, dict) else None
        hexdigest = entry.get(ALGORITHM) if isinstance(entry, dict) else None
        if not parts or Path(name).is_absolute() or ".." in parts:
            raise ValueError(
                f"manifest.json: the entry {name!r} is not a path inside the folder; skip this checkpoint"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(
                f"manifest.json: the entry {name!r} has the size {size!r}, not a byte count; skip this checkpoint"
            )
        if not (isinstance(hexdigest, str) and re.fullmatch(r"[0-9a-f]{64}", hexdigest)):
            raise ValueError(
                f"manifest.json: the entry {name!r} has no {ALGORITHM} digest; skip this checkpoint"
            )
        entries[name] = (size, hexdigest)
    return entries


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
