"""weightcache: keep model weights resident across inference-engine restarts.

The public names are imported on first use (PEP 562), so that a process which needs only a part of the
package (the custodian: no torch) does not pay for the rest.
"""

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "Attachment": "weightcache.client", "attach": "weightcache.client", "query_status": "weightcache.client",
    "wait_ready": "weightcache.client", "find_socket": "weightcache.sockets", "Daemon": "weightcache.daemon",
    "load_into": "weightcache.integrations.torch", "publish": "weightcache.publish",
    "CacheKey": "weightcache.key", "checkpoint_digest": "weightcache.digests",
    **{name: "weightcache.errors" for name in (
        "ArenaOutOfMemory", "DaemonBusy", "DaemonNotReady", "DaemonUnavailable", "KeyMismatch", "LayoutError",
        "PermissionDenied", "ProtocolError", "SocketInUse", "WeightCacheError")},
}
_SUBMODULES = ("transformers", "checkpoints", "testing")  # weightcache.transformers.from_pretrained, ...

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    module = _PUBLIC.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_PUBLIC, *_SUBMODULES])
