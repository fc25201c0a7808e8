"""What the tutorials promise, done in a kernel: their own cells are executed (nbclient, smoke
mode, as tests/test_notebooks.py runs them), some again after an edit a user would make, and the
kernel's state is read back afterwards.

- The warm hot-swap (notebook 04): a reward cell and a loss cell re-run mid-run, then the
  training cell again: the same policy and engine objects train on (nothing is loaded again),
  on the next batches, and the new reward and loss are the ones used.
- The live swap (notebook 05): the same loop first in this kernel (`Local`), then on two Ray
  workers; the trained state and the data position carry over.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


class Kernel:
    """A notebook's kernel: run its cells by a piece of their source, or code of the test's own,
    and read values back as JSON."""

    def __init__(self, client: NotebookClient, nb: nbformat.NotebookNode) -> None:
        self.client, self.nb = client, nb
        self.cursor = 0  # the index of the first tutorial cell not run yet

    def cell(self, marker: str) -> nbformat.NotebookNode:
        """The one code cell whose source holds ``marker``."""
        found = [c for c in self.nb.cells if c.cell_type == "code" and marker in c.source]
        assert len(found) == 1, f"{len(found)} cells hold {marker!r}"
        return found[0]

    def run(self, cell: nbformat.NotebookNode) -> nbformat.NotebookNode:
        """Run one cell: a tutorial cell again, or a new one of the test's (appended)."""
        index = next((i for i, c in enumerate(self.nb.cells) if c is cell), None)
        if index is None:
            self.nb.cells.append(cell)
            index = len(self.nb.cells) - 1
        self.client.execute_cell(cell, index)
        return cell

    def run_until(self, marker: str) -> None:
        """The tutorial's code cells in order, from the first not run yet up to and including
        the one that holds ``marker``."""
        last = self.nb.cells.index(self.cell(marker))
        for cell in self.nb.cells[self.cursor : last + 1]:
            if cell.cell_type == "code":
                self.run(cell)
        self.cursor = last + 1

    def rerun(self, marker: str, old: str, new: str) -> None:
        """Edit the cell that holds ``marker`` (``old`` -> ``new``, as a user would) and run it."""
        cell = self.cell(marker)
        assert old in cell.source, f"{old!r} is not in the cell of {marker!r}"
        cell.source = cell.source.replace(old, new)
        self.run(cell)

    def read(self, expression: str) -> object:
        """The JSON value of ``expression`` in the kernel."""
        cell = self.run(nbformat.v4.new_code_cell(f"import json\nprint(json.dumps({expression}))"))
        text = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
        return json.loads(text.strip().splitlines()[-1])


@contextmanager
def kernel(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Kernel]:
    """A kernel for ``notebooks/<name>.ipynb`` in smoke mode, working in ``tmp_path``."""
    monkeypatch.setenv("RLBLOCKS_SMOKE", "1")
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    with client.setup_kernel():
        yield Kernel(client, nb)


#: What the test reads after each run of notebook 04's training cell.
STATE_04 = """{
    "engine": id(engine), "engine_model": id(engine.model), "policy": id(policy),
    "shares_weights": engine.model is policy.model, "policy_steps": policy.steps,
    "position": batches.state_dict()["position"], "rows": PROMPTS_PER_STEP,
    "history": [{k: h[k] for k in ("reward/mean", "math_answer/mean", "brevity/mean",
                                   "brevity/weight", "kl_coef")} for h in history],
}"""


def test_warm_hot_swap_of_a_reward_and_a_loss_cell(tmp_path, monkeypatch):
    with kernel("04_custom_blocks", tmp_path, monkeypatch) as nb:
        nb.run_until("history = rb.recipes.grpo(")
        first = nb.read(STATE_04)
        # Exercises 1 and 3 of the notebook: brevity weighs 1.0, no KL; then train again.
        nb.rerun(
            "def brevity(",
            "rb.rewards.per_sample(brevity): 0.2",
            "rb.rewards.per_sample(brevity): 1.0",
        )
        nb.rerun(
            "def clip_plus_kl(",
            "my_loss = partial(clip_plus_kl, beta=0.04)",
            "my_loss = partial(clip_plus_kl, beta=0.0)",
        )
        nb.run(nb.cell("history = rb.recipes.grpo("))
        second = nb.read(STATE_04)
    steps = len(first["history"])
    assert steps >= 1
    # The same objects, still sharing the weights: nothing was built or loaded again ...
    for key in ("engine", "engine_model", "policy"):
        assert second[key] == first[key], key
    assert first["shares_weights"] and second["shares_weights"]
    # ... trained on: the policy's step counter and the data go on where they stopped.
    assert (first["policy_steps"], second["policy_steps"]) == (steps, 2 * steps)
    assert (first["position"], second["position"]) == (
        steps * first["rows"],
        2 * steps * first["rows"],
    )
    # The first run used the old reward and loss, every step of the second the new ones.
    for row in first["history"]:
        assert (row["brevity/weight"], row["kl_coef"]) == (0.2, pytest.approx(0.04))
    for row in second["history"]:
        assert (row["brevity/weight"], row["kl_coef"]) == (1.0, 0.0)
        total = row["math_answer/mean"] + 1.0 * row["brevity/mean"]
        assert row["reward/mean"] == pytest.approx(total, abs=1e-6)
        assert row["brevity/mean"] > 0  # so that the weight shows in reward/mean


#: What the test reads after notebook 05's cells ran: the handles, the data, the history.
STATE_05 = """{
    "handle": type(policy).__name__, "kernel_pid": os.getpid(), "worker_pids": policy.pids(),
    "policy_steps": policy.steps, "position": batches.state_dict()["position"],
    "rows": PROMPTS_PER_STEP, "local_steps": LOCAL_STEPS, "steps": STEPS,
    "batches": [h["batch"] for h in history], "sync_bytes": [h["sync/bytes"] for h in history],
}"""

#: Right after the swap: the largest difference between the weights the Ray workers hold and
#: the state the kernel's trainer handed over.
LOADED_GAP = """max((v - state["model"][k]).abs().max().item()
    for k, v in policy.named_weights() if k in state["model"])"""


@pytest.mark.ray
@pytest.mark.slow  # about 20 s: .ci/run runs it in its Ray step
def test_live_swap_from_this_kernel_to_ray_workers(tmp_path, monkeypatch):
    with kernel("05_scale_with_ray", tmp_path, monkeypatch) as nb:
        try:
            nb.run_until("train(LOCAL_STEPS)")
            local = nb.read('{"handle": type(policy).__name__, "steps": policy.steps}')
            nb.run_until("policy.load_state_dict(state)")
            gap = nb.read(LOADED_GAP)
            nb.run_until("train(STEPS)")
            after = nb.read(STATE_05)
        finally:
            # Stop the Ray instance the placement started (Local().shutdown() does nothing).
            stop = "if 'placement' in globals():\n    placement.shutdown()"
            nb.run(nbformat.v4.new_code_cell(stop))
    done = after["local_steps"] + after["steps"]
    assert local == {"handle": "PolicyTrainer", "steps": after["local_steps"]}
    # The workers took the kernel's trained weights exactly, and their step counter.
    assert gap == 0.0
    assert after["handle"] == "WorkerGroup" and after["policy_steps"] == done
    assert len(set(after["worker_pids"])) == 2 and after["kernel_pid"] not in after["worker_pids"]
    # The data went on: the Ray steps took the next batches, not the first ones again.
    assert after["batches"] == list(range(done))
    assert after["position"] == done * after["rows"]
    # Where each step ran: one engine copy synced in the kernel, one per worker after the swap.
    local_bytes = after["sync_bytes"][: after["local_steps"]]
    ray_bytes = after["sync_bytes"][after["local_steps"] :]
    assert len(set(local_bytes)) == 1 and local_bytes[0] > 0
    assert ray_bytes == [2 * local_bytes[0]] * after["steps"]
