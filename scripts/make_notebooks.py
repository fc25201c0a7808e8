"""Build notebooks/*.ipynb from the cell lists in notebooks/src/*.py (no outputs stored).

A source file is Python with cells separated by lines ``# %%`` (code) or ``# %% [markdown]``
(Markdown, each line starting with ``# ``); the first code cell tagged ``# parameters`` gets
the papermill ``parameters`` tag. Run: python scripts/make_notebooks.py [--out FOLDER]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def cells_of(source: str) -> list:
    cells = []
    for chunk in re.split(r"^# %%", source, flags=re.MULTILINE)[1:]:
        header, _, body = chunk.partition("\n")
        body = body.strip("\n")
        if "[markdown]" in header:
            text = "\n".join(
                line[2:] if line.startswith("# ") else line.lstrip("#")
                for line in body.splitlines()
            )
            cells.append(nbformat.v4.new_markdown_cell(text))
        else:
            cell = nbformat.v4.new_code_cell(body)
            if "parameters" in header:
                cell.metadata["tags"] = ["parameters"]
            cells.append(cell)
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
