"""Every tutorial notebook runs top to bottom in smoke mode (the tiny model), headless; its
rendered copy for the site (docs/notebooks) holds the same cells."""

import base64
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from test_docs import RB_NAME, REPO_PATH, resolves

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py"))
RENDERED = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))


def load_render_script():
    """scripts/render_notebooks.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "render_notebooks", ROOT / "scripts" / "render_notebooks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


# The first tutorial runs in the default test run; the others are marked slow (the default run
# stays under 15 minutes on 2 cores) and .ci/run runs them in a step of their own.
@pytest.mark.parametrize(
    "path",
    [NOTEBOOKS[0], *(pytest.param(p, marks=pytest.mark.slow) for p in NOTEBOOKS[1:])],
    ids=lambda p: p.stem,
)
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
    if path == NOTEBOOKS[0]:
        restarted_kernel_resumes_the_training_cell(path, tmp_path)


def restarted_kernel_resumes_the_training_cell(path: Path, folder: Path) -> None:
    """Notebook 01 ran in ``folder``; a fresh kernel (a restart) runs its cells up to the
    training cell again: the run resumes from the checkpoints the first kernel left, and
    trains no step twice."""
    nb = nbformat.read(path, as_version=4)
    training = next(i for i, c in enumerate(nb.cells) if "run.driving(" in c.source)
    nb.cells = nb.cells[: training + 1]
    NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    ).execute()
    printed = "".join(out.get("text", "") for out in nb.cells[training].get("outputs", []))
    assert "steps done: 2 of 2, this time from step 2" in printed, printed


def test_rendered_copies_hold_the_tutorials_cells():
    # docs/notebooks/*.ipynb are what the site shows; apart from the header cell that
    # scripts/render_notebooks.py puts first, their cells must be the tutorials' own.
    header_tag = load_render_script().HEADER_TAG
    assert [p.name for p in RENDERED] == [p.name for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        tutorial = nbformat.read(path, as_version=4)
        rendered = nbformat.read(ROOT / "docs" / "notebooks" / path.name, as_version=4)
        headers = [
            i for i, c in enumerate(rendered.cells) if header_tag in c.metadata.get("tags", [])
        ]
        assert headers in ([], [0]), f"docs/notebooks/{path.name}: header cells at {headers}"
        cells = rendered.cells[len(headers) :]
        assert [(c.cell_type, c.source) for c in cells] == [
            (c.cell_type, c.source) for c in tutorial.cells
        ], (
            f"docs/notebooks/{path.name} differs from notebooks/{path.name}: run "
            f"python scripts/render_notebooks.py --only {path.name[:2]} (or --no-execute)"
        )


def test_render_script_copies_and_scrubs(tmp_path):
    render = load_render_script()
    assert render.main(["--no-execute", "--only", "1,04", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [NOTEBOOKS[0].name, NOTEBOOKS[3].name]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(folder)")])
    nb.cells[0].outputs = [
        nbformat.v4.new_output("stream", text="wrote /tmp/render-x/runs/p\n"),
        nbformat.v4.new_output(
            "execute_result", data={"text/plain": "'/repo/a'", "image/png": "/tmp/render-x"}
        ),
        nbformat.v4.new_output(
            "error", ename="E", evalue="in /repo/b", traceback=["/tmp/render-x/c"]
        ),
    ]
    render.scrub(nb, {"/tmp/render-x": ".", "/repo": "<repo>"})
    stream, result, error = nb.cells[0].outputs
    assert stream.text == "wrote ./runs/p\n"
    assert result.data == {"text/plain": "'<repo>/a'", "image/png": "/tmp/render-x"}  # not images
    assert (error.evalue, error.traceback) == ("in <repo>/b", ["./c"])


def test_prose_only_takes_the_text_cells_and_refuses_a_changed_code_cell(tmp_path):
    render = load_render_script()
    code = nbformat.v4.new_code_cell("print(1)")
    tutorial = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("old text"), code])
    nbformat.write(tutorial, tmp_path / "t.ipynb")
    info = {
        "date": "2026-01-01",
        "smoke": False,
        "parameters": {},
        "machine": "m",
        "python": "3",
        "wall_seconds": 60.0,
    }
    ran = nbformat.v4.new_code_cell("print(1)")
    ran.outputs = [nbformat.v4.new_output("stream", text="1\n")]
    copy = nbformat.v4.new_notebook(
        cells=[
            render.header(tmp_path / "t.ipynb", info),
            nbformat.v4.new_markdown_cell("old text"),
            ran,
        ]
    )
    copy.metadata["rlblocks_render"] = info
    nbformat.write(copy, tmp_path / "copy.ipynb")

    tutorial.cells[0].source = "new text"
    nbformat.write(tutorial, tmp_path / "t.ipynb")
    assert render.update_prose(tmp_path / "t.ipynb", tmp_path / "copy.ipynb") == 1
    updated = nbformat.read(tmp_path / "copy.ipynb", as_version=4)
    assert updated.cells[1].source == "new text"
    assert updated.cells[2].outputs[0].text == "1\n"  # the run's outputs kept
    assert "text cells were updated on" in updated.cells[0].source
    assert updated.metadata["rlblocks_render"]["wall_seconds"] == 60.0
    # Saved by another tool (its own JSON layout): a call with nothing to take leaves it alone.
    (tmp_path / "copy.ipynb").write_text(
        json.dumps(json.loads((tmp_path / "copy.ipynb").read_text()), indent=2)
    )
    before = (tmp_path / "copy.ipynb").read_bytes()
    assert render.update_prose(tmp_path / "t.ipynb", tmp_path / "copy.ipynb") == 0
    assert (tmp_path / "copy.ipynb").read_bytes() == before  # nothing to take: not rewritten

    tutorial.cells[1].source = "print(2)"
    nbformat.write(tutorial, tmp_path / "t.ipynb")
    with pytest.raises(ValueError, match="code cell 1 differs"):
        render.update_prose(tmp_path / "t.ipynb", tmp_path / "copy.ipynb")
    tutorial.cells.append(nbformat.v4.new_markdown_cell("more"))
    nbformat.write(tutorial, tmp_path / "t.ipynb")
    with pytest.raises(ValueError, match="added or removed"):
        render.update_prose(tmp_path / "t.ipynb", tmp_path / "copy.ipynb")


def test_tutorial_prose_names_only_what_exists():
    # The exercises and explanations name blocks and files that are never executed: check them.
    unknown = {}
    for path in NOTEBOOKS:
        text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
        names = {f"rb.{n}" for n in RB_NAME.findall(text) if not resolves(n)}
        names |= {p for p in REPO_PATH.findall(text) if not (ROOT / p).exists()}
        if names:
            unknown[path.name] = sorted(names)
    assert not unknown, f"the tutorials name things the repository does not have: {unknown}"


def test_the_tutorial_times_in_the_docs_are_the_rendered_runs():
    # docs/learning.md lists each tutorial's rendered run (date, minutes); the rendered copies
    # record both (scripts/render_notebooks.py), so a re-render that is not copied fails here.
    text = (ROOT / "docs" / "learning.md").read_text()
    rows = {
        name: (date, minutes)
        for name, date, minutes in re.findall(
            r"^\| \[(\w+)\]\(notebooks/\w+\.ipynb\) \| ([\d-]+) \| ([\d.]+) \|$", text, re.MULTILINE
        )
    }
    assert sorted(rows) == [p.stem for p in RENDERED]
    for path in RENDERED:
        info = nbformat.read(path, as_version=4).metadata["rlblocks_render"]
        assert rows[path.stem] == (info["date"], f"{info['wall_seconds'] / 60:.1f}"), path.name


# The tutorials that rerun a published finding print their verdict in the cell that holds this
# phrase; docs/findings.md quotes that output of the rendered run.
VERDICT = "at this scale"


def test_the_findings_page_quotes_the_rendered_runs():
    page = (ROOT / "docs" / "findings.md").read_text()
    quoted = 0
    for path in RENDERED:
        nb = nbformat.read(path, as_version=4)
        cells = [c for c in nb.cells if c.cell_type == "code" and VERDICT in c.source]
        if not cells:
            continue
        (cell,) = cells
        printed = "".join(
            o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"
        )
        lines = [line.rstrip() for line in printed.splitlines() if line.strip()]
        assert any(VERDICT in line for line in lines), f"{path.name}: the verdict cell printed none"
        missing = [line for line in lines if line not in page]
        assert not missing, f"docs/findings.md does not quote {path.name}'s run: {missing}"
        quoted += 1
    assert quoted == 2, f"{quoted} rendered tutorials print a verdict; 08 and 09 should"
