"""Every tutorial notebook runs top to bottom in smoke mode (the tiny model), headless."""

import base64
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py"))


def test_every_notebook_is_built_from_its_source(tmp_path):
    # notebooks/src/*.py are the reviewable sources; the .ipynb files must match them.
    assert [p.stem for p in SOURCES] == [p.stem for p in NOTEBOOKS]
    built = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_notebooks.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0
    for nb in NOTEBOOKS:
        fresh = nbformat.read(tmp_path / nb.name, as_version=4)
        stored = nbformat.read(nb, as_version=4)
        assert [c.source for c in fresh.cells] == [c.source for c in stored.cells], nb.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_smoke_mode(path, tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_SMOKE", "1")
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    code_lines = sum(len(c.source.splitlines()) for c in nb.cells if c.cell_type == "code")
    assert code_lines < 150, f"{path.name} has {code_lines} lines of code"
    NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    images = [
        base64.b64decode(out["data"]["image/png"])
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if "data" in out and "image/png" in out["data"]
    ]
    # The dashboard leaves its final figure in the notebook as a static PNG.
    assert images and all(img[:4] == b"\x89PNG" for img in images), "no dashboard figure"
