"""Exceptions raised by weightcache. Every error says what went wrong and what to do."""

from __future__ import annotations


class WeightCacheError(Exception):
    """Base class of every weightcache error."""


class KeyMismatch(WeightCacheError):
    """The daemon holds weights of another identity than the engine expects."""

    def __init__(self, diffs, socket: str = ""):
        self.diffs = list(diffs)
        self.socket = socket
        lines = [f"  {d.field}: engine expects {d.expected!r}, daemon holds {d.actual!r}" for d in self.diffs]
        where = f" at {socket}" if socket else ""
        super().__init__(
            f"the weight cache{where} holds other weights ({len(self.diffs)} field(s) differ):\n"
            + "\n".join(lines)
        )


class ProtocolError(WeightCacheError):
    """A malformed, oversized or unexpected frame."""


class DaemonNotReady(WeightCacheError):
    def __init__(self, state: str, done: int = 0, total: int = 0, message: str = ""):
        self.state, self.done, self.total = state, done, total
        pct = f" ({100.0 * done / total:.0f}%)" if total else ""
        super().__init__(f"weight cache daemon is {state}{pct}" + (f": {message}" if message else ""))


class DaemonUnavailable(WeightCacheError):
    """No live daemon at the socket (missing, stale, or it went away)."""


class DaemonBusy(DaemonUnavailable):
    """The daemon is alive but refuses new connections for now (too many, or out of file descriptors):
    retry. `attach(wait=...)` retries within its wait."""


class PermissionDenied(WeightCacheError):
    """The daemon refused this peer (uid not allowed)."""


class ArenaOutOfMemory(WeightCacheError, MemoryError):
    """The device (or host) has not enough free memory for the arena."""


class SocketInUse(WeightCacheError):
    """A live daemon already serves this socket path."""


class LayoutError(WeightCacheError, ValueError):
    """An unsupported or inconsistent parallel layout."""
