"""Execute the tutorial notebooks and store them, outputs included, for the documentation site.

    python scripts/render_notebooks.py                 # all six: the real model, notebook defaults
    python scripts/render_notebooks.py --only 01,04    # some of them, by number
    python scripts/render_notebooks.py --smoke         # tiny model, 2 steps: a quick check
    python scripts/render_notebooks.py --no-execute    # plain copies without outputs
    python scripts/render_notebooks.py --prose-only --only 08   # a rendered copy's text cells

notebooks/NN_name.ipynb is executed into docs/notebooks/NN_name.ipynb, which mkdocs-jupyter
renders as it is (``execute: false``). Each notebook runs in a fresh kernel of this Python, in a
temporary working folder (what it writes under runs/ is thrown away), with this checkout first
on PYTHONPATH, under a wall-clock limit for the whole notebook (``--timeout`` seconds).

The executed copy starts with a markdown cell tagged ``rendered-header`` (when, how and on what
it ran; the same facts are in ``metadata.rlblocks_render``); tests/test_notebooks.py drops that
cell and checks that every other cell is the tutorial's, so the copies cannot drift from the
tutorials. Per-cell timing metadata is not recorded, and the temporary folder and this
checkout's path are replaced in the outputs (by ``.`` and ``<repo>``). A ``--smoke`` run goes to
build/notebooks-smoke unless ``--out`` says otherwise, so it never lands in docs/ by accident.

``--prose-only`` takes a tutorial's Markdown cells into its existing rendered copy without
running anything (a typo, a link, a paragraph), and refuses when a code cell differs from the
one that ran: outputs only ever come from the code beside them. The copy's header then says
when its text was updated.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
HEADER_TAG = "rendered-header"  # tests/test_notebooks.py skips the cell with this tag


def tutorials(only: str | None) -> list[Path]:
    """notebooks/NN_*.ipynb, all or those whose number is in ``only`` ("01,04")."""
    paths = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if only is None:
        return paths
    wanted = {n.strip().zfill(2) for n in only.split(",") if n.strip()}
    picked = [p for p in paths if p.name[:2] in wanted]
    missing = wanted - {p.name[:2] for p in picked}
    if missing:
        raise SystemExit(f"--only: no notebook numbered {', '.join(sorted(missing))} in notebooks/")
    return picked


def machine() -> str:
    """This machine in words: cores this process may use, CPU model, GPU if torch sees one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        models = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = models[0] if models else cpu
    words = f"{cores}-core CPU ({cpu})"
    if os.environ.get("OMP_NUM_THREADS"):  # the tutorials may share the machine: say how
        words += f", OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    try:
        import torch
    except ImportError:
        return words
    if torch.cuda.is_available():
        words += f", GPU: {torch.cuda.get_device_name(0)}"
    return words


def parameters(nb: Any) -> dict[str, Any]:
    """The values the notebook's ``parameters`` cell sets under the current environment."""
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
            namespace: dict[str, Any] = {}
            exec(cell.source, namespace)  # noqa: S102 -- this repository's own cell, as the kernel ran it
            return {k: v for k, v in namespace.items() if k.isupper()}
    return {}


def scrub(nb: Any, replacements: dict[str, str]) -> None:
    """Replace machine paths (keys) in every text output of ``nb`` (stream, text/* data and
    error tracebacks), in place; images and widget data are left alone."""

    def clean(text: str) -> str:
        for old, new in replacements.items():
            text = text.replace(old, new)
        return text

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = clean(out["text"])
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/") and isinstance(value, str):
                    out["data"][mime] = clean(value)
            if "traceback" in out:
                out["traceback"] = [clean(line) for line in out["traceback"]]
                out["evalue"] = clean(out.get("evalue", ""))


def header(path: Path, info: dict[str, Any]) -> Any:
    """The first cell of a rendered copy: when, how and on what it ran."""
    params = ", ".join(f"{k} = {v!r}" for k, v in info["parameters"].items() if k != "SMOKE")
    mode = "in smoke mode (the tiny model, a quick check)" if info["smoke"] else "as it is"
    text = (
        f"> **Executed copy.** `notebooks/{path.name}`, run top to bottom {mode} by "
        f"`scripts/render_notebooks.py` on {info['date']}: {params}; on a {info['machine']}, "
        f"in {info['wall_seconds'] / 60:.1f} minutes. The outputs are that one run's: yours will "
        "differ in the details."
    )
    if "prose_updated" in info:
        text += f" Its text cells were updated on {info['prose_updated']}, no code cell changed."
    cell = nbformat.v4.new_markdown_cell(text)
    cell.metadata["tags"] = [HEADER_TAG]
    return cell


def render(path: Path, out: Path, *, smoke: bool, timeout: float) -> float:
    """Execute ``path`` in a temporary folder and write the copy with outputs to ``out``;
    return the wall time in seconds. A cell error or the timeout raises, writing nothing."""
    os.environ.pop("RLBLOCKS_SMOKE", None)
    if smoke:
        os.environ["RLBLOCKS_SMOKE"] = "1"
    os.environ["RLBLOCKS_REPO"] = str(ROOT)  # the install cell's checkout (it finds rlblocks)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    nb = nbformat.read(path, as_version=4)
    start = time.monotonic()
    deadline = start + timeout
    with tempfile.TemporaryDirectory(prefix=f"render-{path.stem}-") as tmp:
        NotebookClient(
            nb,
            kernel_name="python3",
            timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
            record_timing=False,
            resources={"metadata": {"path": tmp}},
        ).execute()
        wall = time.monotonic() - start
        scrub(nb, {str(Path(tmp).resolve()): ".", tmp: ".", str(ROOT): "<repo>"})
    info = {
        "date": datetime.date.today().isoformat(),
        "smoke": smoke,
        "parameters": parameters(nb),
        "machine": machine(),
        "python": platform.python_version(),
        "wall_seconds": round(wall, 1),
    }
    nb.cells.insert(0, header(path, info))
    nb.metadata["rlblocks_render"] = info
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return wall


def update_prose(path: Path, copy: Path) -> int:
    """Take the Markdown cells of tutorial ``path`` into its rendered ``copy``, in place; return
    how many changed. Raises ValueError, naming the first cell that differs, when the copy's
    cells are not the tutorial's in type and order or a code cell's source differs."""
    if not copy.exists():
        raise ValueError(f"{copy} does not exist: render it first")
    tutorial = nbformat.read(path, as_version=4)
    rendered = nbformat.read(copy, as_version=4)
    headed = bool(rendered.cells) and HEADER_TAG in rendered.cells[0].metadata.get("tags", [])
    cells = rendered.cells[1:] if headed else rendered.cells
    if [c.cell_type for c in cells] != [c.cell_type for c in tutorial.cells]:
        raise ValueError(
            f"{copy.name}: its cells are not the tutorial's (added or removed): re-render it"
        )
    changed = 0
    for k, (old, new) in enumerate(zip(cells, tutorial.cells)):
        if new.cell_type == "code" and old.source != new.source:
            raise ValueError(
                f"{copy.name}: code cell {k} differs from the one that ran: re-render it"
            )
        if new.cell_type == "markdown" and old.source != new.source:
            old.source = new.source
            changed += 1
    if not changed:  # the copy is left as it is, byte for byte
        return 0
    if headed:
        info = rendered.metadata["rlblocks_render"]
        info["prose_updated"] = datetime.date.today().isoformat()
        rendered.cells[0] = header(path, info)
    nbformat.write(rendered, copy)
    return changed


def main(argv: list[str]) -> int:
    """Command line: render (or copy) the chosen tutorials; 1 if any of them failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="notebook numbers, comma-separated: 01,04")
    parser.add_argument("--smoke", action="store_true", help="RLBLOCKS_SMOKE=1: tiny model")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per notebook")
    parser.add_argument("--out", type=Path, help="folder (default docs/notebooks)")
    parser.add_argument("--no-execute", action="store_true", help="plain copies, no outputs")
    parser.add_argument(
        "--prose-only", action="store_true", help="take the text cells into the rendered copies"
    )
    args = parser.parse_args(argv)
    default = "build/notebooks-smoke" if args.smoke else "docs/notebooks"
    out_dir = args.out or ROOT / default
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for path in tutorials(args.only):
        if args.prose_only:
            try:
                changed = update_prose(path, out_dir / path.name)
            except ValueError as error:
                print(f"FAILED {error}")
                failed.append(path.name)
                continue
            print(f"{out_dir / path.name}: {changed} text cells updated")
            continue
        if args.no_execute:
            nbformat.write(nbformat.read(path, as_version=4), out_dir / path.name)
            print("copied", path.name, "->", out_dir / path.name)
            continue
        print("running", path.name, "...", flush=True)
        try:
            wall = render(path, out_dir / path.name, smoke=args.smoke, timeout=args.timeout)
        except Exception as error:  # noqa: BLE001 -- report it, go on with the next notebook
            print(f"FAILED {path.name}: {type(error).__name__}: {str(error)[-2000:]}")
            failed.append(path.name)
            continue
        print(f"wrote {out_dir / path.name} ({wall / 60:.1f} min)")
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
