"""Inside a Ray worker process: the blocks of every role of its pool, and the calls on them.

One :class:`Worker` actor per process. It builds blocks, shards those that shard themselves
(``Shardable``: the trainers), runs the calls a worker group sends, shapes the answers so they
travel well, and runs the functions ``WorkerGroup.run_with`` carries. It knows no block class:
everything it relies on is in ``rlblocks.interfaces``.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch
from torch.torch_version import TorchVersion

from rlblocks.base.stacks import serve_stacks
from rlblocks.interfaces import Shardable, dispatch_of
from rlblocks.placement.errors import WorkerError

#: A call as it travels: (method name, positional arguments, keyword arguments).
Call = tuple[str, tuple, dict]
NOOP = "__noop__"  # a rank with nothing to do in a call answers None at once
GETATTR = "__getattr__"  # a plain attribute read, answered by rank 0
LOOPBACK = "127.0.0.1"  # where a local Ray instance and a one-node pool listen
IFF_LOOPBACK = 0x8  # the loopback flag of a network interface (Linux's <net/if.h>)
# torch's libuv store server listens on a socket it is handed only from 2.8 on (pytorch PR
# 150215 added the missing uv_listen); before, only the older (non-libuv) backend does.
LIBUV_TAKES_SOCKET = TorchVersion(torch.__version__) >= "2.8"


class Worker:
    """One worker process (a Ray actor): the blocks of every role of its pool, by role."""

    def __init__(self, pool: str, rank: int, size: int, threads: int) -> None:
        self.pool, self.rank, self.size = pool, rank, size
        torch.set_num_threads(threads)
        self.blocks: dict[str, Any] = {}
        self.node = ray.get_runtime_context().get_node_id()
        self._listener: socket.socket | None = None  # rank 0's rendezvous socket, until used
        self.stacks = serve_stacks()  # a stall report can ask for this process's stacks

    def info(self, host: str | None) -> dict[str, Any]:
        """This worker's IP, Ray node id and process id; rank 0 also opens the listening socket
        of the group's rendezvous store on ``host`` (None: every interface, for a pool that
        spans nodes) and gives its port. The socket is handed to the store as it is, so no other
        process can take the port in between."""
        port = None
        if self.rank == 0:
            self._listener = socket.create_server((host or "", 0))
            port = self._listener.getsockname()[1]
        ip = ray.util.get_node_ip_address()
        return {"ip": ip, "port": port, "node": self.node, "pid": os.getpid(),
                "stacks": self.stacks}  # fmt: skip

    def init_process_group(
        self, address: tuple[str, int], backend: str, timeout: float, *, loopback: bool
    ) -> None:
        """Join the group's ``torch.distributed`` process group (gloo or NCCL) as this worker's
        rank; ``address`` is rank 0's store. ``loopback``: the whole group is on this machine,
        so gloo and NCCL listen on the loopback interface too (unless the user named one)."""
        import torch.distributed as dist

        if loopback:
            for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                os.environ.setdefault(variable, loopback_interface())
        if backend == "nccl":  # Ray shows each worker only its own GPU(s): cuda:0 is ours
            torch.cuda.set_device(0)
        wait = timedelta(seconds=timeout)
        if self.rank == 0:  # the store's server takes over the socket `info` opened
            listener, self._listener = self._listener, None
            assert listener is not None  # rank 0's, opened by info()
            fd = listener.detach()
            store = dist.TCPStore(
                *address, self.size, True, wait, wait_for_workers=False, master_listen_fd=fd,
                use_libuv=LIBUV_TAKES_SOCKET,
            )  # fmt: skip
        else:
            store = dist.TCPStore(*address, self.size, False, wait)
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.size, timeout=wait
        )

    # ------------------------------------------------------------------ blocks
    def build(self, role: str, factory: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Build ``factory(*args, **kwargs)`` for ``role``; a ``Shardable`` block then shards
        itself over the pool's process group. Returns what the driver's handle needs."""

        def make() -> dict[str, Any]:
            self.blocks.pop(role, None)  # rebuilding a role: free the old block first
            block = factory(*args, **kwargs)
            if isinstance(block, Shardable):
                block.shard()  # the block decides what a group of this size means for it
            self.blocks[role] = block
            public = [n for n in dir(block) if not n.startswith("_")]
            kind = type(block)  # methods are the class's callables (a callable attribute, like
            # a model or a tokenizer, is read as an attribute)
            methods = {n: dispatch_of(getattr(kind, n)) for n in public if _is_method(kind, n)}
            if callable(block):
                methods["__call__"] = dispatch_of(type(block).__call__)
            return {
                "type": type(block).__name__,
                "methods": methods,
                "attributes": public,
                "replicas": int(getattr(block, "row_replicas", 1)),  # Shardable
            }

        return self._guard(role, "build", make)

    def call(self, role: str, method: str, args: tuple, kwargs: dict, answer: bool) -> Any:
        """``block.method(*args, **kwargs)``; the answer comes back only where ``answer`` is set
        (an iterator is drained either way: it may take part in collectives)."""
        if method == NOOP:
            return None

        def invoke() -> Any:
            block = self._block(role)
            if method == GETATTR:
                return getattr(block, args[0])
            return portable(getattr(block, method)(*args, **kwargs), keep=answer)

        return self._guard(role, method, invoke)

    def run_with(self, role: str, fn: Callable, other: str | None, relay: bool) -> tuple:
        """``fn(role's block, other)`` where ``other`` is this worker's block of role ``other``,
        or (``other`` None) a :class:`Relay` that records calls when ``relay`` is set and drops
        them otherwise. Returns ``(fn's answer, recorded calls)``."""
        name = getattr(fn, "__name__", "run_with").strip("_")

        def invoke() -> tuple:
            stand_in = Relay(record=relay)
            peer = self._block(other) if other is not None else stand_in
            result = fn(self._block(role), peer)
            return result, stand_in.calls

        return self._guard(role, name, invoke)

    def replay(self, role: str, calls: list[tuple[str, Any]]) -> None:
        """Make the calls a :class:`Relay` recorded, in order, on this worker's ``role`` block."""

        def invoke() -> None:
            block = self._block(role)
            for method, ref in calls:
                args, kwargs = ray.get(ref)
                getattr(block, method)(*args, **kwargs)

        return self._guard(role, "replay", invoke)

    def _block(self, role: str) -> Any:
        if role not in self.blocks:
            raise KeyError(
                f"Worker: no block built for role {role!r} in this worker; build the role first"
            )
        return self.blocks[role]

    def _guard(self, role: str, call: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every error goes back to the driver, with its rank
            raise WorkerError(
                role,
                self.rank,
                self.node[:8],
                call,
                f"{type(e).__name__}: {e}",
                traceback.format_exc(),
            ) from None


class Relay:
    """Stands in for a block that lives elsewhere: records the calls made on it.

    ``model`` is None (no module of the other block is in this process) and
    ``serves_adapters`` False (an adapter file written here is not there), as the ``Handle``
    protocol says. Each call's arguments are moved to the CPU and put in Ray's object store
    once, so every worker of the other pool fetches them from there.
    """

    model = None
    serves_adapters = False

    def __init__(self, *, record: bool) -> None:
        self.record = record
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, method: str) -> Callable[..., None]:
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args: Any, **kwargs: Any) -> None:
            if self.record:
                self.calls.append((method, ray.put((_cpu(args), _cpu(kwargs)))))

        return call


def portable(value: Any, *, keep: bool) -> Any:
    """An answer ready to travel: iterators drained into lists, tensors on the CPU and compact
    (a view would carry its whole storage); None where ``keep`` is False."""
    if isinstance(value, Iterator):
        items = [portable(v, keep=keep) for v in value]
        return items if keep else None
    if not keep:
        return None
    return _cpu(value)


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.untyped_storage().nbytes() != value.numel() * value.element_size():
            value = value.clone()
        return value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_cpu(v) for v in value)
    if isinstance(value, tuple):  # a NamedTuple keeps its type
        return type(value)(*(_cpu(v) for v in value))
    if isinstance(value, list):
        return [_cpu(v) for v in value]
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    return value


def loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS): what
    ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` take to listen on 127.0.0.1 only."""
    for _, name in socket.if_nameindex():
        flags = Path("/sys/class/net", name, "flags")
        if flags.is_file() and int(flags.read_text(), 16) & IFF_LOOPBACK:
            return name
    return "lo0" if sys.platform == "darwin" else "lo"


def _is_method(kind: type, name: str) -> bool:
    return callable(getattr(kind, name, None))
