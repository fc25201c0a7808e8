"""The documentation site under docs/: the nav is complete, links resolve, examples run.

Conventions the pages follow (and that this test enforces):

- Every page under ``docs/`` is listed in the ``nav`` of ``mkdocs.yml`` and every nav entry
  exists.
- Relative links between pages resolve, anchors included (``blocks/losses.md#kl-estimators``).
- Every ```` ```python ```` block runs, in page order, in one namespace per page, unless its
  first line starts with ``# not run`` (say why on that line). Examples use ``rb.models.tiny()``
  or the built-in ``"tiny"``; the built-in ``"smollm2-135m"`` is swapped for ``"tiny"`` here
  (as in tests/test_readme.py), and ``steps=N`` is capped at ``steps=2``, so that pages can show
  realistic runs and still be checked in seconds.
- Every ``rb.<name>``, ``rlblocks.<name>`` and repository path (``rlblocks/...``, ``tests/...``,
  ``scripts/...``) written anywhere in the docs exists: planned features are described in
  words, never with an API name.

mkdocs itself is not needed here; CI builds the site separately with ``mkdocs build --strict``.
"""

from __future__ import annotations

import importlib
import linecache
import re
import unicodedata
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOT_RUN = "# not run"

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^\n]*)$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
RB_NAME = re.compile(r"(?<![\w.])rb\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
PACKAGE_NAME = re.compile(r"(?<![\w./])rlblocks\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:rlblocks|tests|scripts)/[\w./-]*\w)")


# ---------------------------------------------------------------------- reading the docs
def nav_pages() -> list[str]:
    """Every page named in the nav of mkdocs.yml, in order."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def walk(entry: object) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [page for item in entry for page in walk(item)]
        if isinstance(entry, dict):
            return [page for value in entry.values() for page in walk(value)]
        raise TypeError(f"unexpected nav entry {entry!r}")

    return walk(config["nav"])


def doc_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def split_fences(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The lines outside fenced code, and ``(info, code)`` of every fenced block."""
    prose, blocks = [], []
    fence = info = None
    body: list[str] = []
    indent = 0
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence, info, indent, body = (
                match["fence"],
                match["info"].strip(),
                len(match["indent"]),
                [],
            )
        elif fence is not None and line.strip() == fence:
            blocks.append((info, "\n".join(body) + "\n"))
            fence = None
        elif fence is not None:
            body.append(line[indent:] if line[:indent].strip() == "" else line)
        else:
            prose.append(line)
    assert fence is None, "a code fence is never closed"
    return prose, blocks


def python_blocks_of(text: str) -> list[str]:
    _, blocks = split_fences(text)
    return [code for info, code in blocks if info.split(" ")[0] in ("python", "py")]


def python_blocks(page: Path) -> list[str]:
    return python_blocks_of(page.read_text())


def slugify(heading: str) -> str:
    """Python-Markdown's ``toc`` slug of a heading (what mkdocs uses for anchors)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)  # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = re.sub(r"\\\((.*?)\\\)|\$(.*?)\$", "", text)  # inline math is dropped
    text = text.replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (duplicates get ``_1``, ``_2``, as in ``toc``)."""
    prose, _ = split_fences(page.read_text())
    seen: set[str] = set()
    for line in prose:
        match = re.match(r"^#{1,6}\s+(.*?)\s*(?:\{#([\w-]+)\})?\s*#*\s*$", line)
        if not match:
            continue
        slug = match[2] or slugify(match[1])
        unique, n = slug, 0
        while unique in seen:
            n += 1
            unique = f"{slug}_{n}"
        seen.add(unique)
    return seen


def links(page: Path) -> list[str]:
    """Link targets outside code (fenced blocks and inline code spans)."""
    prose, _ = split_fences(page.read_text())
    text = re.sub(r"`[^`\n]*`", "", "\n".join(prose))
    return LINK.findall(text)


# ---------------------------------------------------------------------- (a) the nav
def test_nav_and_pages_agree():
    listed = nav_pages()
    assert len(listed) == len(set(listed)), f"pages listed twice: {listed}"
    missing = [page for page in listed if not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml lists pages that do not exist: {missing}"
    on_disk = {p.relative_to(DOCS).as_posix() for p in doc_pages()}
    unlisted = sorted(on_disk - set(listed))
    assert not unlisted, f"pages missing from the nav of mkdocs.yml: {unlisted}"
    assert listed[0] == "index.md"


# ---------------------------------------------------------------------- (c) links
@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.is_relative_to(DOCS.resolve()):
            broken.append(f"{target} (outside docs/: mkdocs cannot serve it)")
        elif not destination.is_file():
            broken.append(f"{target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target} (no heading with anchor #{anchor})")
    assert not broken, f"{page.name}: broken links: {broken}"


def test_link_checker_sees_links_and_anchors():
    # The checker itself: it finds links outside code and computes mkdocs' heading anchors.
    assert slugify("KL estimators and controllers") == "kl-estimators-and-controllers"
    assert slugify("`grpo`: group-normalized") == "grpo-group-normalized"
    assert slugify("Batch size, mini-batch, micro-batch?") == "batch-size-mini-batch-micro-batch"
    index_links = links(DOCS / "index.md")
    assert any(link.startswith("blocks/") for link in index_links), index_links


# ---------------------------------------------------------------------- (d) API names
def resolves(dotted: str) -> bool:
    """``a.b.c`` names an attribute or a module of rlblocks (submodules are imported)."""
    obj: object = importlib.import_module("rlblocks")
    prefix = "rlblocks"
    for part in dotted.split("."):
        prefix = f"{prefix}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(prefix)
        except ImportError:
            return False
    return True


def test_every_rlblocks_name_and_path_in_the_docs_exists():
    unknown = {}
    for page in doc_pages():
        text = page.read_text()
        names = {f"rb.{n}" for n in RB_NAME.findall(text) if not resolves(n)}
        names |= {f"rlblocks.{n}" for n in PACKAGE_NAME.findall(text) if not resolves(n)}
        names |= {path for path in REPO_PATH.findall(text) if not (ROOT / path).exists()}
        if names:
            unknown[page.relative_to(DOCS).as_posix()] = sorted(names)
    assert not unknown, f"the docs name things the repository does not have: {unknown}"


def test_name_checker_rejects_what_does_not_exist():
    assert resolves("losses.clipped_surrogate") and resolves("interfaces.RolloutEngine")
    assert resolves("trainer.TrainConfig") and resolves("app.demo")
    assert not resolves("losses.no_such_loss") and not resolves("no_such_module.thing")
    assert REPO_PATH.findall("see `rlblocks/recipes/grpo.py`.") == ["rlblocks/recipes/grpo.py"]


# ---------------------------------------------------------------------- (b) the examples
PAGES_WITH_CODE = [p for p in doc_pages() if python_blocks(p)]


def shrink(code: str) -> str:
    """The example as the test runs it: the tiny model, and at most 2 steps of any loop."""
    code = code.replace('"smollm2-135m"', '"tiny"')
    return re.sub(r"(?<![\w.])steps=(\d+)", lambda m: f"steps={min(int(m[1]), 2)}", code)


def test_shrink_only_touches_models_and_step_counts():
    code = 'load("smollm2-135m"); grpo(steps=30, max_steps=9, critic_warmup_steps=5); steps=1'
    assert (
        shrink(code) == 'load("tiny"); grpo(steps=2, max_steps=9, critic_warmup_steps=5); steps=1'
    )


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache of built-in models for all pages: "tiny" is converted once."""
    return tmp_path_factory.mktemp("rlblocks-cache")


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_python_examples_run(page: Path, tmp_path, monkeypatch, model_cache):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(model_cache))
    monkeypatch.chdir(tmp_path)  # examples that write files (runs/, data) write here
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    ran = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for number, code in enumerate(python_blocks(page), start=1):
            if code.lstrip().startswith(NOT_RUN):
                compile(code, f"{page.name}, block {number}", "exec")  # must still parse
                continue
            code = shrink(code)
            name = f"docs/{page.relative_to(DOCS).as_posix()}, block {number}"
            linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # tracebacks
            exec(compile(code, name, "exec"), namespace)  # noqa: S102 (our own docs)
            ran += 1
    assert ran > 0, f"{page.name}: every Python block is marked '{NOT_RUN}'"


def test_getting_started_cell_is_the_readme_cell():
    # index.md shows the README's "GRPO in one cell" verbatim; they must not drift apart.
    readme = python_blocks_of((ROOT / "README.md").read_text())
    assert python_blocks(DOCS / "index.md")[0] == readme[0]


def test_pages_with_code_run_their_examples():
    # The convention is opt-out: most blocks run. These pages must keep runnable examples.
    runnable = {
        p.relative_to(DOCS).as_posix()
        for p in PAGES_WITH_CODE
        if any(not code.lstrip().startswith(NOT_RUN) for code in python_blocks(p))
    }
    for page in ("index.md", "faq.md", "blocks/rollouts.md", "blocks/advantage.md"):
        assert page in runnable, page
