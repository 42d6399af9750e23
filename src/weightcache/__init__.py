"""weightcache: keep model weights resident across inference-engine restarts."""

from .client import Attachment, attach, find_socket, query_status, wait_ready
from .daemon import Daemon
from .engines.torch import load_into
from .errors import (
    ArenaOutOfMemory,
    DaemonBusy,
    DaemonNotReady,
    DaemonUnavailable,
    KeyMismatch,
    LayoutError,
    PermissionDenied,
    ProtocolError,
    SocketInUse,
    WeightCacheError,
)
from .key import CacheKey, checkpoint_digest
from .publish import publish

__version__ = "0.1.0"

__all__ = [
    "ArenaOutOfMemory", "Attachment", "CacheKey", "Daemon", "DaemonBusy", "DaemonNotReady", "DaemonUnavailable", "KeyMismatch",
    "LayoutError", "PermissionDenied", "ProtocolError", "SocketInUse", "WeightCacheError", "attach",
    "checkpoint_digest", "find_socket", "load_into", "publish", "query_status", "wait_ready",
]


def __getattr__(name):
    if name == "transformers":  # weightcache.transformers.from_pretrained; imports transformers on first use
        import importlib

        return importlib.import_module(f"{__name__}.transformers")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
