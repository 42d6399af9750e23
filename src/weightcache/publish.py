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
    *,
    consume: bool = False,
    **daemon_kwargs,
) -> Daemon:
    """Copy `tensors` into an exportable arena on their device and serve them at `socket`; returns the
    ready Daemon (close() it to stop serving; attached engines keep their views). ``consume=True`` moves
    them instead: each source storage is freed as soon as it is packed (the tensors become empty), so the
    peak stays near 1x their size."""
    if "device" not in daemon_kwargs:
        first = next(iter(tensors.values()), None)
        daemon_kwargs["device"] = first.device if isinstance(first, torch.Tensor) else "cpu"
    daemon = Daemon(socket, key, **daemon_kwargs)
    daemon.start()
    try:
        daemon.load_tensors(tensors, roles, consume=consume)
    except BaseException:
        daemon.close()
        raise
    return daemon
