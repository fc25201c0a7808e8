"""TensorBoard: the event files, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

from pathlib import Path

import pytest
from tracking_cases import NAMES, SAMPLE_ROWS, comparable, log_script, scalar_steps

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_events(folder: Path) -> EventAccumulator:
    events = EventAccumulator(
        str(folder / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}
    )
    events.Reload()
    return events


def scalars(events: EventAccumulator) -> dict[int, dict[str, float | str]]:
    out: dict[int, dict[str, float | str]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            assert tag not in out.setdefault(event.step, {}), f"step {event.step} twice in {tag}"
            out[event.step][tag] = comparable(event.value)
    return out


def texts(events: EventAccumulator, tag: str) -> dict[int, str]:
    return {
        e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")
    }


def test_event_files_hold_the_jsonl_metrics_config_and_samples(tmp_path):
    log_script(tmp_path, "tensorboard")
    events = read_events(tmp_path)
    assert set(events.Tags()["scalars"]) == set(NAMES)
    assert scalars(events) == scalar_steps(tmp_path)
    config = texts(events, "config")
    assert list(config) == [0] and '"lr": 1e-05' in config[0]
    samples = texts(events, "samples")
    assert sorted(samples) == [0, 2]
    for prompt, completion, reward in SAMPLE_ROWS:
        # Markdown cells: a "|" in model text is escaped so the table keeps three columns.
        assert f"| {prompt} | {completion.replace('|', chr(92) + '|')} | {reward} |" in samples[2]


def test_resume_purges_the_steps_after_the_checkpoint(tmp_path):
    log_script(tmp_path, "tensorboard")  # steps 0..3
    log_script(tmp_path, "tensorboard", steps=range(2, 5), resume_step=2, offset=10.0)
    got = scalars(read_events(tmp_path))  # raises on a step logged twice
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert got == scalar_steps(tmp_path)
    assert got[1]["reward/mean"] == 0.25 and got[2]["reward/mean"] == 10.5  # old, then new
