"""The README: its one cell runs as written, its first screen holds what a newcomer needs, and
every measured number in it names where it was measured."""

import re
from pathlib import Path

import torch
from test_docs import DOCS, python_blocks, split_fences

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SCREEN = 80  # lines: a terminal or an editor at a common height, and a GitHub page above the fold

# A measured number: a decimal (0.291, 33.4), a percentage, a ratio (1.25×) or an amount of
# time. Version pins (torch==2.13.0) are in code spans, which claims() removes first.
NUMBER = re.compile(r"\d+\.\d+|\d+(?:\.\d+)?\s*(?:%|×|x\b|min\b|minutes|s\b|seconds|hours)")
SOURCE = re.compile(
    r"\]\((?:docs/[^)#]+\.md|benchmarks/[^)]+\.py)(?:#[^)]*)?\)|`benchmarks/\w+\.py"
)


def claims(text: str) -> list[tuple[str, bool]]:
    """(paragraph, whether it names a source) for each paragraph or table of ``text`` outside
    code blocks that states a measured number. A table counts as sourced when the paragraph
    just before it names one (the table's caption)."""
    prose, _ = split_fences(text)
    out, previous = [], ""
    for chunk in re.split(r"\n\s*\n", "\n".join(prose)):
        bare = re.sub(r"`[^`]*`", "", chunk)
        is_table = chunk.lstrip().startswith("|")
        sourced = bool(SOURCE.search(chunk)) or (is_table and bool(SOURCE.search(previous)))
        if NUMBER.search(bare):
            out.append((chunk, sourced))
        previous = chunk
    return out


def test_readme_python_blocks_run(tmp_path, monkeypatch, capsys):
    # The built-in 135M model is swapped for the tiny one so that this runs in seconds; the
    # code is otherwise executed exactly as written.
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path))
    text = README.read_text().replace('"smollm2-135m"', '"tiny"')
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 1, "the README shows one cell; other examples live in docs/"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102 (our own README)
    # The GRPO cell printed one line per step and pushed two weight versions.
    printed = [line for line in capsys.readouterr().out.splitlines() if line[:2] in ("0 ", "1 ")]
    assert len(printed) == 2
    assert namespace["resharder"].version == 2


def test_the_conventions_cell_does_what_its_comments_say():
    # docs/conventions.md's one-batch example (formerly the README's second cell) states the
    # rewards and the Dr.GRPO advantages of its four rows; they are checked here.
    namespace: dict = {}
    exec(compile(python_blocks(DOCS / "conventions.md")[0], "conventions.md", "exec"), namespace)  # noqa: S102
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


def test_the_first_screen_holds_the_commands_the_cell_and_the_result():
    lines = README.read_text().splitlines()
    assert len(lines) <= SCREEN + 20, f"README has {len(lines)} lines; move the rest to docs/"
    screen = "\n".join(lines[:SCREEN])
    assert "# run the main job" in screen and "# run the tests" in screen
    assert "## GRPO in one cell" in screen
    # the cell's last line and the measured result's caption fit too
    assert "print(step, reward_metrics" in screen
    assert "## What the main job learns" in screen and "held-out" in screen


def test_every_measured_number_in_the_readme_names_its_source():
    unsourced = [chunk for chunk, sourced in claims(README.read_text()) if not sourced]
    assert not unsourced, "README states numbers without a docs page or benchmark:\n\n" + (
        "\n\n".join(unsourced)
    )


def test_the_source_check_sees_what_it_should():
    text = (
        "A step took 33.4 s.\n\n"
        "Measured by `benchmarks/grpo_step.py`: 0.99x the floor.\n\n"
        "Setup ([Learning](docs/learning.md#five-seeds)):\n\n"
        "| a | 0.291 |\n|---|---|\n\n"
        "Install `torch==2.13.0` first.\n"
    )
    found = claims(text)
    assert [sourced for _, sourced in found] == [False, True, True]
    assert found[0][0] == "A step took 33.4 s."
