"""Assert-style tests checked where the program cannot reach: program values cross as plain data.

A run with a test has two processes besides the runner's: the program's (P), which runs the
program and then answers requests, and the checker (Q), forked by the runner before any of
the program's code ran, which runs the test. Q never holds a program object: each name the
program defined is, in Q, plain data or a `Remote`, and calling a `Remote` (or reading its
attribute or item, or iterating it) asks P over a pipe. P answers with plain data (None,
bool, int, float, complex, str, bytes and tuples, lists, sets, frozensets and dicts of them),
which Q rebuilds with ``ast.literal_eval`` (no other type can come out of it), or with a
reference to an object of its own, which becomes another `Remote`. So:

- the test's ``==``, ``<``, ``abs``, ``sorted`` run in Q on Q's own objects: an object whose
  ``__eq__`` always returns True never reaches them, and comparing or testing the truth of a
  `Remote` raises ``TypeError`` (the test fails);
- the verdict is a line Q writes to the runner's report pipe, which P does not hold, and the
  test's text (its expected values) is read by Q only, after P was forked: P sees what it is
  asked (``f(2)``), never what is expected, so it cannot forge an answer it did not compute;
- names the program defines that are also builtins (``all``, ``sorted``, ...) stay builtins
  in the test;
- arguments travel by value: a test that checks how a function changed its argument in place
  sees its own unchanged copy; an exception the program raises is raised in Q as the builtin
  of that name (``ValueError``...), or as `ProgramError`; ``StopIteration`` and exceptions
  that are not errors become ``RuntimeError``, so that they cannot end a test's loop early.

Standard library only: it runs under the sandbox's interpreter (see `sandbox_runner`).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import os
import struct
import sys

# typing.TYPE_CHECKING without importing typing, which every sandboxed run would pay for (type
# checkers read a name TYPE_CHECKING as True)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

DEPTH = 64  # nesting beyond this travels as a reference
NOT_ERRORS = ("StopIteration", "StopAsyncIteration", "GeneratorExit", "SystemExit",
              "KeyboardInterrupt", "BaseException", "BaseExceptionGroup")  # fmt: skip
_MALFORMED = ("Sandbox.run: the program answered its test with {what}; nothing to fix in the "
              "test: a program that tampers with its answers fails it")  # fmt: skip
_SEQUENCES: dict[type, str] = {list: "l", tuple: "t", set: "s", frozenset: "fs"}
_REBUILD = {"l": list, "t": tuple, "s": set, "fs": frozenset}


class ProgramError(Exception):
    """An exception the program raised whose type is not a builtin."""


class ProgramGone(Exception):
    """The program ended (or closed its side) before answering."""


# ---------------------------------------------------------------------- plain data on the wire
def encode(value: Any, refer, depth: int = 0) -> tuple:  # any value: dispatched on its type
    """``value`` as nested tuples of tags and plain leaves; ``refer(obj)`` names what is not
    plain data (its index, or raises)."""
    kind = type(value)
    if value is None or kind in (bool, int, str, bytes):
        return ("v", value)
    if kind is float:
        return ("f", value.hex())
    if kind is complex:
        return ("c", value.real.hex(), value.imag.hex())
    if depth < DEPTH and kind in _SEQUENCES:
        return (_SEQUENCES[kind], [encode(x, refer, depth + 1) for x in value])
    if depth < DEPTH and kind is dict:
        return ("d", [(encode(k, refer, depth + 1), encode(v, refer, depth + 1))
                      for k, v in value.items()])  # fmt: skip
    return ("h", refer(value))


def decode(node: object, resolve) -> object:
    """The value of an `encode`d node; ``resolve(index)`` gives a reference's object."""
    if type(node) is not tuple or not node or type(node[0]) is not str:
        raise ValueError(_MALFORMED.format(what="a value that is not a tagged tuple"))
    tag, rest = node[0], node[1:]
    if tag == "v" and len(rest) == 1 and (rest[0] is None or type(rest[0]) in (bool, int, str,
                                                                              bytes)):  # fmt: skip
        return rest[0]
    if tag == "f" and len(rest) == 1:
        return float.fromhex(rest[0])
    if tag == "c" and len(rest) == 2:
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    if tag in _REBUILD and len(rest) == 1 and type(rest[0]) is list:
        return _REBUILD[tag](decode(x, resolve) for x in rest[0])
    if tag == "d" and len(rest) == 1 and type(rest[0]) is list:
        return {decode(k, resolve): decode(v, resolve) for k, v in rest[0]}
    if tag == "h" and len(rest) == 1 and type(rest[0]) is int:
        return resolve(rest[0])
    raise ValueError(_MALFORMED.format(what=f"a value tagged {tag!r}"[:200]))


def send(fd: int, message: object) -> None:
    """Write ``message`` (plain data) to ``fd`` as one frame: its ``repr``, length first."""
    write_frame(fd, repr(message).encode())


def write_frame(fd: int, data: bytes) -> None:
    """Write ``data`` to ``fd`` after its length (8 bytes, big-endian), all of it."""
    view = memoryview(struct.pack(">Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def receive(fd: int, limit: int) -> Any:  # a message, whose shape its reader knows
    """One message (``ast.literal_eval`` of its text); `ProgramGone` at the end of the pipe."""
    (size,) = struct.unpack(">Q", _read_exactly(fd, 8))
    if size > limit:
        raise ValueError(
            f"Sandbox.run: a value of {size} bytes crossed between the program and its test, "
            f"over the limit of {limit} (SandboxLimits.file_bytes); compare smaller values, or "
            "raise the limit"
        )
    return ast.literal_eval(_read_exactly(fd, size).decode())


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise ProgramGone("the program ended before its tests were done")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------- P: the program's side
def serve(scope: dict, requests: int, replies: int, limit: int) -> None:
    """Answer the checker's requests about the program's objects until it closes its pipe."""
    objects: list[object] = []

    def refer(obj: object) -> int:
        objects.append(obj)
        return len(objects) - 1

    while True:
        try:
            request = receive(requests, limit)
        except ProgramGone:
            return
        try:  # repr fails on a huge int here, before anything is sent
            data = repr(("ok", encode(_answer(request, scope, objects), refer))).encode()
        except BaseException as e:  # noqa: BLE001 -- the program's exception is the answer
            data = repr(("raise", type(e).__name__, _text(e))).encode()
        try:
            write_frame(replies, data)
        except OSError:  # the checker is gone
            return


def _text(e: BaseException) -> str:
    try:
        return str(e)[:1000]
    except BaseException:  # noqa: BLE001 -- the program's __str__ may raise too
        return ""


def _answer(request: tuple, scope: dict, objects: list) -> object:
    def get(i: int) -> object:
        return objects[i]

    op = request[0]
    if op == "globals":
        return {k: v for k, v in scope.items() if not k.startswith("__")}
    target = objects[request[1]]
    if op == "getattr":
        return getattr(target, request[2])
    if op == "call":
        args = [decode(a, get) for a in request[2]]
        kwargs = {k: decode(v, get) for k, v in request[3]}
        return target(*args, **kwargs)
    if op == "getitem":
        return target[decode(request[2], get)]
    if op == "iter":
        return list(target)
    if op == "len":
        return len(target)
    raise ValueError(f"Sandbox.run: unknown request {op!r} to the program; this is a bug of the "
                     "checker: report it")  # fmt: skip


# ---------------------------------------------------------------------- Q: the checker's side
class Link:
    """The checker's end of the pipes to the program."""

    def __init__(self, requests: int, replies: int, limit: int) -> None:
        self.requests, self.replies, self.limit = requests, replies, limit

    def ask(self, *request: object) -> Any:  # an answer, whose shape the request says
        """Send ``request`` to the program and return its answer, decoded (plain data or
        `Remote`); the program's exception is raised here (`_program_exception`)."""
        try:
            send(self.requests, request)
        except BrokenPipeError:  # the program's end is closed: it ended, or never served
            raise ProgramGone("the program ended before its tests were done") from None
        reply = receive(self.replies, self.limit)
        if type(reply) is tuple and len(reply) == 2 and reply[0] == "ok":
            return decode(reply[1], lambda i: Remote(self, i))
        if type(reply) is tuple and len(reply) == 3 and reply[0] == "raise":
            raise _program_exception(str(reply[1]), str(reply[2]))
        raise ValueError(_MALFORMED.format(what="a reply that is neither ok nor raise"))

    def plain(self, value: object) -> tuple:
        """``value`` for the wire: plain data and `Remote` references only."""

        def refer(obj: object) -> int:
            if type(obj) is Remote:
                return object.__getattribute__(obj, "_index")
            raise TypeError(
                f"Sandbox.run: the test passed a {type(obj).__name__} to the program; pass "
                "plain data (numbers, strings, lists, dicts...) or the program's own objects"
            )

        return encode(value, refer)


def _program_exception(name: str, message: str) -> BaseException:
    kind = getattr(builtins, name, None)
    if name in NOT_ERRORS:
        return RuntimeError(f"the program raised {name}: {message}")
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(message)
    return ProgramError(f"{name}: {message}")


def _compared(*_: object) -> bool:
    raise TypeError(
        "Sandbox.run: the test compared, or tested the truth of, a program object that is not "
        "plain data; compare plain values (numbers, strings, lists, dicts...)"
    )


class Remote:
    """An object that lives in the program's process: calls, attributes, items and iteration
    are asked of it; comparisons and truth are refused (`_compared`)."""

    __slots__ = ("_index", "_link")
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = _compared

    def __init__(self, link: Link, index: int) -> None:
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_index", index)

    def _ask(self, op: str, *args: object) -> object:
        link = object.__getattribute__(self, "_link")
        return link.ask(op, object.__getattribute__(self, "_index"), *args)

    def __getattr__(self, name: str) -> object:
        return self._ask("getattr", name)

    def __call__(self, *args: object, **kwargs: object) -> object:
        link = object.__getattribute__(self, "_link")
        return self._ask("call", [link.plain(a) for a in args],
                         [(k, link.plain(v)) for k, v in kwargs.items()])  # fmt: skip

    def __getitem__(self, key: object) -> object:
        return self._ask("getitem", object.__getattribute__(self, "_link").plain(key))

    def __iter__(self):
        return iter(self._ask("iter"))

    def __len__(self) -> int:
        size = self._ask("len")
        if type(size) is not int:
            raise TypeError(
                f"Sandbox.run: the program's len() gave a {type(size).__name__}, not an int; "
                "return an int from __len__"
            )
        return size

    def __hash__(self) -> int:
        return hash(("program object", object.__getattribute__(self, "_index")))

    def __repr__(self) -> str:
        return f"<program object #{object.__getattribute__(self, '_index')}>"


def _own_module(name: str, value: object) -> object:
    """``value``, or for a program object named like a standard module (``math``, ``re``...)
    the checker's own import of that module: a test that leans on the program's ``import
    math`` must not call a stand-in the program put there."""
    if type(value) is Remote and name in getattr(sys, "stdlib_module_names", ()):
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    return value


def check(test: str, link: Link) -> str:
    """Run ``test`` against the program behind ``link``: ``passed``, ``failed ...`` (an
    assertion failed, or the program ended before answering) or ``error ...`` (any other
    exception, the program's included)."""
    try:
        scope = {"__name__": "__main__", "__builtins__": builtins}
        for name, value in link.ask("globals").items():
            if type(name) is str and not hasattr(builtins, name):
                scope[name] = _own_module(name, value)
        exec(compile(test, "test", "exec"), scope)  # noqa: S102 -- the row's own test
    except AssertionError as e:
        return f"failed AssertionError: {e}"[:2000]
    except ProgramGone as e:
        return f"failed {e}"
    except BaseException as e:  # noqa: BLE001 -- any other end of the test fails it
        return f"error {type(e).__name__}: {e}"[:2000]
    return "passed"
