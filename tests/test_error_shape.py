"""Every error message rlblocks raises has one shape: ``Block: what is wrong, with the values; what to do``.

``Block`` is what the user called (``HFEngine.generate``, ``PromptBatches``, ``sft_data``,
``SamplingParams.max_new_tokens``). The test reads the source with ``ast`` and checks the static
start of every message given as a string or f-string literal; a message built elsewhere (a
variable, a helper's return value) is not checked here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rlblocks

ROOT = Path(rlblocks.__file__).parent

CHECKED = {
    "ValueError",
    "TypeError",
    "RuntimeError",
    "KeyError",
    "FileNotFoundError",
    "FileExistsError",
    "NotImplementedError",
}

# ``Block``, ``Block.method``, ``Block.field``, ``Block.extras['x']`` then ": ". No spaces: a
# sentence such as "prompts is empty: ..." is not a block name.
SHAPE = re.compile(r"^[A-Za-z_][\w.\[\]'\"=]*: ")

# An f-string may open with a value that holds the block's name (a helper shared by several
# blocks gets it as ``owner``). Only these expressions count as a block name there.
BLOCK_NAME_VALUES = {
    "owner",
    "name",  # a helper given the name of the block it serves
    "self.name",  # placement/handle.py: the method called on a pool
    "type(self).__name__",
    "type(trainer).__name__",
}

# (file under rlblocks/, start of the message): why it is deliberately not in the shape.
ALLOWED: dict[tuple[str, str], str] = {
    ("app/cli.py", "{key}: "): (
        "the CLI names the config key the user wrote (reward: ...), as a data error names its file"
    ),
}


def _static(node: ast.expr, head: bool = True) -> str | None:
    """The message with each ``{value}`` of an f-string as ``Block`` (a block-name value at the
    start), ``X`` (any other value after a name has begun) or ``{expr}``; None if not a literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "..." + "\n".join(...)
        return _static(node.left, head)
    if not isinstance(node, ast.JoinedStr):
        return None
    text = ""
    for part in node.values:
        if isinstance(part, ast.Constant):
            text += part.value
            continue
        source = ast.unparse(part.value)  # type: ignore[attr-defined]
        if not text:
            text += "Block" if source in BLOCK_NAME_VALUES else "{" + source + "}"
        elif re.fullmatch(r"[\w.\[\]'\"=]*", text):  # still inside the name
            text += "X"
        else:
            text += "{" + source + "}"
    return text


def _messages() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name not in CHECKED or not node.exc.args:
                continue
            message = _static(node.exc.args[0])
            if message is not None:
                found.append((relative, node.lineno, message))
    return found


def _allowed(relative: str, message: str) -> bool:
    return any(relative == file and message.startswith(start) for file, start in ALLOWED)


def test_the_walk_finds_the_messages():
    messages = _messages()
    assert len(messages) > 250  # the walk would pass vacuously if it found nothing
    assert any(m.startswith("HFEngine: the model is a ") for _, _, m in messages)


def test_every_error_message_starts_with_the_block():
    off = [
        f"rlblocks/{file}:{line}: {message[:90]!r}"
        for file, line, message in _messages()
        if not SHAPE.match(message) and not _allowed(file, message)
    ]
    assert not off, (
        f"{len(off)} messages not in the shape 'Block: what; what to do':\n" + "\n".join(off)
    )


# (file under rlblocks/, start of the message): why it has no "; what to do" part.
NO_ADVICE: dict[tuple[str, str], str] = {
    ("resharder/strict.py", "Resharder: the trainer's weights do not fit"): (
        "the list of mismatched weights joined after the literal is what to fix, one per "
        "line (tests/resharder/test_strict_sync.py pins the whole text)"
    ),
}


def test_every_error_message_says_what_to_do():
    off = [
        f"rlblocks/{file}:{line}: {message[:90]!r}"
        for file, line, message in _messages()
        if "; " not in message
        and not _allowed(file, message)
        and not any(file == f and message.startswith(s) for f, s in NO_ADVICE)
    ]
    assert not off, f"{len(off)} messages without '; what to do':\n" + "\n".join(off)


def test_every_allowlist_entry_is_still_used():
    messages = _messages()
    unused = [
        key
        for key in [*ALLOWED, *NO_ADVICE]
        if not any(file == key[0] and m.startswith(key[1]) for file, _, m in messages)
    ]
    assert not unused, f"allowlist entries that match no message any more: {unused}"


def test_the_shape_check_tells_apart():
    def shaped(source: str) -> bool:
        return bool(SHAPE.match(_static(ast.parse(source, mode="eval").body) or ""))

    assert shaped('f"HFEngine.generate: group_size={g}; use group_size >= 1"')
    assert shaped('f"Rollouts.{name}: has shape {s}; pass (b t)"')
    assert shaped('f"{owner}: row {i} has no metadata; sample with AgentEngine"')
    assert shaped('"Resharder: the weights do not fit:\\n" + "\\n".join(lines)')
    assert not shaped('f"{path}: no such file"')  # the file is where, not which block
    assert not shaped('"prompts is empty: pass at least one"')
    assert not shaped('f"row {i}: prompt is too long"')
    assert not shaped('"the dataset is empty"')
