"""Weights & Biases offline: the run folder's transaction log, read back record by record.

wandb 0.31 ships no Python reader of its ``.wandb`` files (the record log moved to its Go core),
so :func:`read_records` reads the framing here (LevelDB's log format: 32 KiB blocks of chunks
with a CRC-32, after a 7-byte W&B header) and parses each record with wandb's own protobuf
``Record``. The CRC check makes a misread fail loudly rather than parse garbage.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from tracking_cases import CONFIG, NAMES, SAMPLE_ROWS, comparable, log_script, scalar_steps

pytest.importorskip("wandb")
import wandb
from wandb.proto import wandb_internal_pb2

BLOCK = 32768
CHUNK_HEADER = 7  # CRC-32 (4 bytes), length (2), type (1): 1 full, 2 first, 3 middle, 4 last


def read_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, parts = 7, []
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # a block's zero-filled tail
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        if kind == 0 and length == 0:  # zero padding at the end
            break
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"bad CRC at byte {pos}"
        pos += CHUNK_HEADER + length
        parts.append(chunk)
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def run_folder(folder: Path, name: str = "run") -> Path:
    # run.finish() can return before W&B's service has written the last records to disk (seen
    # under load); shutting the service down waits for it. The next wandb.init restarts it.
    wandb.teardown()
    [run] = [p for p in (folder / "wandb").glob("offline-run-*") if _run_name(p) == name]
    return run


def _run_name(run: Path) -> str:
    [log] = run.glob("run-*.wandb")
    return next(r.run.display_name for r in read_records(log) if r.HasField("run"))


def history(run: Path) -> dict[int, dict[str, object]]:
    """Step -> {key: value} of the run's history records (keys joined with '.')."""
    [log] = run.glob("run-*.wandb")
    out: dict[int, dict[str, object]] = {}
    for record in read_records(log):
        if record.HasField("history"):
            items = record.history.item
            row = {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}
            out.setdefault(record.history.step.num, {}).update(row)
    return out


def test_offline_run_holds_the_jsonl_metrics_config_and_samples(tmp_path):
    log_script(tmp_path, "wandb")
    run = run_folder(tmp_path)
    [log] = run.glob("run-*.wandb")
    [config] = [r.run.config for r in read_records(log) if r.HasField("run")]
    assert {i.key: json.loads(i.value_json) for i in config.update if i.key in CONFIG} == CONFIG
    rows = history(run)
    metrics = {s: {k: comparable(v) for k, v in r.items() if k in NAMES} for s, r in rows.items()}
    assert metrics == scalar_steps(tmp_path)
    assert not {k for r in rows.values() for k in r} & {"rewards", "note"}  # JSONL only
    tables = {s: r["samples.path"] for s, r in rows.items() if "samples.path" in r}
    assert sorted(tables) == [0, 2]
    table = json.loads((run / "files" / tables[2]).read_text())
    assert table["columns"] == ["prompt", "completion", "reward"]
    assert [tuple(row) for row in table["data"]] == SAMPLE_ROWS


def test_resume_starts_a_new_offline_run_from_the_checkpoint_step(tmp_path):
    log_script(tmp_path, "wandb")
    log_script(tmp_path, "wandb", steps=range(2, 4), resume_step=2, offset=10.0)
    assert sorted(history(run_folder(tmp_path, "run-resume2"))) == [2, 3]
    assert sorted(history(run_folder(tmp_path, "run"))) == [0, 1, 2, 3]  # left as it was
