"""The README: its one cell runs as written, its first screen holds what a newcomer needs, and
every measured number in it names where it was measured."""

import ast
import re
from pathlib import Path

import pytest
import torch
from test_docs import DOCS, python_blocks, split_fences

import rlblocks as rb

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


def readme_cell() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) == 1, "the README shows one cell; other examples live in docs/"
    return blocks[0]


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    # The built-in 135M model is swapped for the tiny one so that this runs in seconds; the
    # code is otherwise executed exactly as written, in a fresh folder (it writes runs/readme).
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    code = compile(readme_cell().replace('"smollm2-135m"', '"tiny"'), str(README), "exec")
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 (our own README)
    # Two recorded steps, each with the reward and the run's own metrics; two weight syncs;
    # the newest checkpoint is of step 2.
    history, steps = namespace["run"].history, namespace["run"].steps
    assert len(history) == steps and all("reward/mean" in h and "time/sync" in h for h in history)
    assert namespace["source"].version == steps
    assert rb.checkpoint.Checkpointer(tmp_path / "runs" / "readme").latest() == steps
    # Run again (a notebook cell re-run, or a kernel restart): it resumes, with nothing to do.
    again: dict = {}
    exec(code, again)  # noqa: S102 (our own README)
    assert again["run"].history == history and again["source"].version == steps
    trained, restored = namespace["policy"].model.state_dict(), again["policy"].model.state_dict()
    assert all(torch.equal(trained[k], restored[k]) for k in trained)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 8 steps of 48 samples on a 2-core CPU: ~5 minutes, more when busy
def test_the_readme_cell_rewards_answers_on_the_built_in_model(tmp_path, monkeypatch):
    # The cell exactly as written, on the built-in SmolLM2-135M: its prompts can be answered
    # within its token budget, so some sampled answers are right (the mean reward is above 0).
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_cell(), str(README), "exec"), namespace)  # noqa: S102 (our own README)
    history = namespace["run"].history
    keys = ("reward/mean", "signal/informative_groups", "signal/cut_off", "response_length")
    for step, h in enumerate(history, 1):  # on failure, pytest shows what each step did
        print(f"README cell on smollm2-135m, step {step}:", {k: round(h[k], 3) for k in keys})
    rewards = [h["reward/mean"] for h in history]
    assert len(history) == namespace["run"].steps and sum(rewards) > 0
    # The share of answers cut off at the budget is printed, not held: the cell samples
    # without a seed, and two runs on one machine gave 0.15-0.54 a step and 0.52-0.85.


def loop_of(tree: ast.AST) -> str:
    """The ``with run.driving(source):`` block of ``tree``, with the ``with run.phase(...)``
    blocks replaced by their bodies, as canonical source."""

    class Unphase(ast.NodeTransformer):
        def visit_With(self, node: ast.With) -> ast.AST | list[ast.stmt]:
            self.generic_visit(node)
            if ast.unparse(node.items[0].context_expr).startswith("run.phase("):
                return node.body
            return node

    drives = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.With) and ast.unparse(n.items[0].context_expr) == "run.driving(source)"
    ]
    assert len(drives) == 1
    return ast.unparse(Unphase().visit(drives[0]))


def test_the_readme_loop_is_the_grpo_recipes_body():
    # The README says so; without the phase timers the two are the same statements.
    recipe = Path(rb.recipes.grpo.__code__.co_filename).read_text()
    assert loop_of(ast.parse(readme_cell())) == loop_of(ast.parse(recipe))
    assert 'with run.phase("update")' in recipe  # the recipe does time its phases
    # and the README cell stays a cell: today's 17 lines of code plus at most three
    code = [line for line in readme_cell().splitlines() if line.strip()]
    assert len([line for line in code if not line.lstrip().startswith("#")]) <= 20


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
    assert "run.record(" in screen
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


# The harness around the README cell run as a script: every process starts from one seed
# (torch seeds itself at random otherwise: the killed run and the whole one would sample
# differently from step 0; a resumed run restores the killed run's generator from its
# checkpoint); after the checkpoint of step 1 is written the process says so and waits to be
# killed (so that the kill lands mid-run, between two steps, whatever the machine's speed); at
# the end it saves what the run did.
KILLED_AFTER_STEP_1 = """
import os, sys, time
import torch
import rlblocks as rb

torch.manual_seed(0)

saving = rb.checkpoint.Checkpointer.save


def save(self, step, *args, **kwargs):
    out = saving(self, step, *args, **kwargs)
    if step == 1 and os.environ.get("WAIT_AFTER_STEP_1"):
        print("SAVED 1", flush=True)
        time.sleep(600)
    return out


rb.checkpoint.Checkpointer.save = save
"""
SAVE_RESULT = """
import torch
torch.save({"history": run.history, "weights": policy.model.state_dict()}, "result.pt")
"""


def test_the_readme_cell_killed_mid_run_resumes_bit_for_bit(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from resume_helpers import ENV, assert_same_records, untimed

    cell = readme_cell().replace('"smollm2-135m"', '"tiny"')
    script = tmp_path / "cell.py"
    script.write_text(KILLED_AFTER_STEP_1 + cell + SAVE_RESULT)
    env = {**ENV, "RLBLOCKS_CACHE": str(tmp_path / "cache")}
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    for folder in (killed, whole):
        folder.mkdir()
    # The killed run: SIGKILL once the checkpoint of step 1 is on disk, before step 2.
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=killed,
        env={**env, "WAIT_AFTER_STEP_1": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")
        assert any(line.strip() == "SAVED 1" for line in lines), "the run never saved step 1"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (killed / "result.pt").exists()
    # The same cell again in that folder resumes after step 1; the whole run goes uninterrupted.
    for folder in (killed, whole):
        subprocess.run([sys.executable, str(script)], cwd=folder, env=env, check=True, timeout=600)
    resumed = torch.load(killed / "result.pt", weights_only=False)
    reference = torch.load(whole / "result.pt", weights_only=False)
    steps = int(re.search(r"steps=(\d+)", cell).group(1))
    assert len(resumed["history"]) == len(reference["history"]) == steps
    assert_same_records(untimed(resumed["history"]), untimed(reference["history"]))
    for name, weight in reference["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name
