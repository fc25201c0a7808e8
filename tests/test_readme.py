"""The README's Python examples run as written, in order, in one namespace."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch, capsys):
    # The built-in 135M model is swapped for the tiny one so that this runs in seconds; the
    # code is otherwise executed exactly as written.
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path))
    text = README.read_text().replace('"smollm2-135m"', '"tiny"')
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) >= 3, "README lost its examples"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 (our own README)
    # The GRPO cell printed one line per step and pushed two weight versions.
    printed = [line for line in capsys.readouterr().out.splitlines() if line[:2] in ("0 ", "1 ")]
    assert len(printed) == 2
    assert namespace["resharder"].version == 2
    # The first example's claims hold: rewards of the four completions, Dr.GRPO advantages.
    torch.testing.assert_close(namespace["rewards"], torch.tensor([1.0, 0.0, 1.0, 1.0]))
    # Group 0: rewards 1, 0 -> mean 0.5 -> +0.5, -0.5; group 1: 1, 1 -> 0, 0.
    assert namespace["adv"][:, 0].tolist() == [0.5, -0.5, 0.0, 0.0]
    assert namespace["logprobs"].grad is not None
    assert namespace["per_token"].shape == namespace["ro"].response_ids.shape


def test_readme_test_command_is_what_ci_runs():
    lines = README.read_text().splitlines()
    index = lines.index("# run the tests")
    assert "pytest" in lines[index + 1]
    assert lines[0] == "# rlblocks"
