"""Serve tensors from any process (e.g. a trainer) by starting a daemon in it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from .daemon import Daemon
from .key import CacheKey


def publish(
    tensors: Mapping[str, torch.Tensor],
    socket: str | Path,
    key: CacheKey,
    roles: Mapping[str, str] | None = None,
    **daemon_kwargs,
) -> Daemon:
    """Copy `tensors` into an exportable arena on their device and serve them at `socket`; returns the
    ready Daemon (close() it to stop serving; attached engines keep their views)."""
    if "device" not in daemon_kwargs:
        first = next(iter(tensors.values()), None)
        daemon_kwargs["device"] = first.device if isinstance(first, torch.Tensor) else "cpu"
    daemon = Daemon(socket, key, **daemon_kwargs)
    daemon.start()
    try:
        daemon.load_tensors(tensors, roles)
    except BaseException:
        daemon.close()
        raise
    return daemon
