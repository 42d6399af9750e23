"""Low-level reading of checkpoint files: the error a bad or unreadable file raises, ``preadv`` of many
buffers at once, and the worker pool that runs the reads."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import WeightCacheError


class CheckpointError(WeightCacheError, ValueError):
    """A missing, unreadable or malformed checkpoint file or tensor."""


IOV_BATCH = 512  # iovecs per preadv call (the kernel takes at most IOV_MAX = 1024)


def read_into(fd: int, iovs: list[tuple[int, memoryview]], junk: memoryview, file: Path, what: str) -> None:
    """Read each (file offset, buffer) in one pass of preadv calls: buffers in file order, gaps shorter than
    ``junk`` read into it, overlapping or distant pieces in a call of their own. Short reads continue."""
    batch: list[memoryview] = []
    start = cursor = None
    for off, buf in iovs:
        if cursor is not None and (off < cursor or off - cursor > len(junk) or len(batch) >= IOV_BATCH):
            _preadv_full(fd, batch, start, file, what)
            batch, start, cursor = [], None, None
        if cursor is None:
            start = cursor = off
        if off > cursor:
            batch.append(junk[: off - cursor])
        batch.append(buf)
        cursor = off + len(buf)
    if batch:
        _preadv_full(fd, batch, start, file, what)


def _preadv_full(fd: int, bufs: list[memoryview], offset: int, file: Path, what: str) -> None:
    want = sum(len(b) for b in bufs)
    done = 0
    while done < want:
        try:
            n = os.preadv(fd, bufs, offset + done)
        except OSError as e:
            raise CheckpointError(f"{file}: read of tensor {what!r} failed: {e}") from e
        if n == 0:
            raise CheckpointError(f"{file}: unexpected end of file reading tensor {what!r} (truncated checkpoint?)")
        done += n
        while n:  # drop what was filled
            if n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs = bufs[1:]
            else:
                bufs = [bufs[0][n:], *bufs[1:]]
                n = 0


def run_workers(threads: int, items: list, work: Callable[[Callable[[], object]], None]) -> None:
    """Run ``work(next_item)`` in up to ``threads`` threads over a shared queue; the first error stops the
    others (they finish their current item) and is raised here."""
    if not items:
        return
    errors: list[BaseException] = []
    stop = threading.Event()
    queue = iter(items)
    qlock = threading.Lock()

    def next_item():
        if stop.is_set():
            return None
        with qlock:
            return next(queue, None)

    def worker() -> None:
        try:
            work(next_item)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            stop.set()

    n = max(1, min(threads, len(items)))
    pool = [threading.Thread(target=worker, name=f"wc-fill-{i}", daemon=True) for i in range(n)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def open_files(files) -> dict:
    """Read-only descriptors of the files (path -> fd), in path order; all or none."""
    fds = {}
    try:
        for f in sorted(files, key=str):
            fds[f] = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        for fd in fds.values():
            os.close(fd)
        raise CheckpointError(f"cannot open checkpoint file: {e}") from e
    return fds


__all__ = ["CheckpointError", "open_files", "read_into", "run_workers"]
