"""Build notebooks/*.ipynb from notebooks/src/*.py (no outputs stored).

A source is a script in jupytext's percent format: cells start at ``# %%`` (code) or
``# %% [markdown]`` (Markdown, each line commented), and the code cell of the notebook's
settings is ``# %% tags=["parameters"]`` (papermill's tag, which the render script reads).
jupytext reads it; this script adds stable cell ids and the kernel. Run:
python scripts/make_notebooks.py [--out FOLDER]
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parents[1]


def cells_of(source: str) -> list:
    """The cells of a percent-format source, as jupytext reads them; of their metadata only
    the tags are kept (not jupytext's own layout keys, such as ``lines_to_next_cell``)."""
    cells = jupytext.reads(source, fmt="py:percent").cells
    for cell in cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k == "tags"}
    return cells


def main(argv: list[str]) -> int:
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else ROOT / "notebooks"
    for src in sorted((ROOT / "notebooks" / "src").glob("*.py")):
        nb = nbformat.v4.new_notebook(cells=cells_of(src.read_text()))
        for k, cell in enumerate(nb.cells):  # stable ids: rebuilding changes no unchanged cell
            cell.id = f"{src.stem[:2]}-{k:03d}"
        nb.metadata["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3",
            "language": "python",
        }
        nbformat.write(nb, out / f"{src.stem}.ipynb")
        print("wrote", out / f"{src.stem}.ipynb")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
