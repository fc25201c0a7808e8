"""Errors that come back from worker processes, naming the role, the rank and the node."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """An exception raised inside a worker; ``remote_traceback`` is the worker's own traceback."""

    def __init__(
        self, role: str, rank: int, node: str, call: str, error: str, remote_traceback: str
    ) -> None:
        self.role, self.rank, self.node, self.call = role, rank, node, call
        self.error, self.remote_traceback = error, remote_traceback
        super().__init__(self._message())

    def _message(self) -> str:
        return (
            f"{self.role} worker rank {self.rank} (node {self.node}) failed in {self.call}: "
            f"{self.error}\n\nTraceback in the worker:\n{self.remote_traceback}"
        )

    def __reduce__(self):  # picklable across processes, with every field
        args = (self.role, self.rank, self.node, self.call, self.error, self.remote_traceback)
        return (type(self), args)


class WorkerDied(WorkerError):
    """A worker process ended (killed, out of memory, crashed) while a call was running."""

    def __init__(self, role: str, rank: int, node: str, call: str, error: str) -> None:
        super().__init__(role, rank, node, call, error, "(the process is gone)")

    def _message(self) -> str:
        return (
            f"{self.role} worker rank {self.rank} (node {self.node}) died during {self.call}: "
            f"{self.error} The other workers of its pool were stopped; build its blocks again."
        )

    def __reduce__(self):
        return (type(self), (self.role, self.rank, self.node, self.call, self.error))


class PoolBroken(RuntimeError):
    """A pool's workers were stopped after a failure; its blocks must be built again."""
