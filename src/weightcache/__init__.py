"""weightcache: keep model weights resident across inference-engine restarts."""

from .client import Attachment, attach, find_socket, query_status, wait_ready
from .daemon import Daemon
from .errors import (
    ArenaOutOfMemory,
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
    "ArenaOutOfMemory", "Attachment", "CacheKey", "Daemon", "DaemonNotReady", "DaemonUnavailable", "KeyMismatch",
    "LayoutError", "PermissionDenied", "ProtocolError", "SocketInUse", "WeightCacheError", "attach",
    "checkpoint_digest", "find_socket", "publish", "query_status", "wait_ready",
]
