"""Checkpoint bytes into CPU memory: worker threads, each segment straight into its destinations. Where a
destination lies in an arena block (a memfd), the piece is ``sendfile``d into the block's file at its offset
(the kernel writes whole pages, no faults or zeroing in the daemon); elsewhere one ``preadv`` per segment.
Slice jobs (strided shards, casts) are copied from the CPU tensors the plan's ``read_slice`` makes."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Mapping

import torch

from ..arena.host import block_file_at
from .read_plan import PAGE, Piece, ReadPlan, Segment
from .reading import CheckpointError, open_files, read_into, run_workers
from .settings import ReadSettings

log = logging.getLogger(__name__)


class CpuFill:
    """One fill of CPU views. ``sendfile``: try sendfile into memfd blocks (off once the kernel refuses it;
    ``sendfile_ok`` tells afterwards); ``mode`` tells how it read ("sendfile" or "preadv")."""

    def __init__(self, plan: ReadPlan, settings: ReadSettings, views: Mapping[str, torch.Tensor],
                 report: Callable[[int], None], *, sendfile: bool = True):
        self.plan, self.settings, self.views, self.report = plan, settings, views, report
        self.sendfile_ok = sendfile and hasattr(os, "sendfile")

    @property
    def mode(self) -> str:
        return "sendfile" if self.sendfile_ok else "preadv"

    def run(self) -> None:
        items = self.plan.work_items(lambda f: self.settings.chunk_bytes, self.settings.order)
        fds = open_files({i.file for i in items})
        try:
            run_workers(self.settings.threads, items, lambda next_item: self._worker(fds, next_item))
        finally:
            for fd in fds.values():
                os.close(fd)

    def _worker(self, fds, next_item) -> None:
        junk = memoryview(bytearray(2 * PAGE))  # gap bytes between pieces land here (read, never used)
        flat, writers = {}, {}
        try:
            while (item := next_item()) is not None:
                if isinstance(item, Segment):
                    iovs = []
                    for p in item.pieces:
                        raw = flat.get(p.name)
                        if raw is None:
                            raw = flat[p.name] = self.views[p.name].reshape(-1).view(torch.uint8)
                        dst = raw[p.dst_offset : p.dst_offset + p.nbytes]
                        where = block_file_at(dst.data_ptr(), p.nbytes) if self.sendfile_ok else None
                        if where is None or not self._send(fds[item.file], writers, where, p):
                            iovs.append((p.offset, memoryview(dst.numpy()).cast("B")))
                    read_into(fds[item.file], iovs, junk, item.file, item.pieces[0].name)
                else:
                    src = self.plan.read_slice(item)
                    self.plan.slice_rows(self.views[item.name], item).copy_(src)
                self.report(item.nbytes)
        finally:
            for w in writers.values():
                os.close(w)

    def _send(self, src_fd: int, writers: dict[int, int], where: tuple[int, int], p: Piece) -> bool:
        """sendfile one piece into a block's memfd at its offset; False (and off for good) if refused."""
        block_fd, offset = where
        try:
            w = writers.get(block_fd)
            if w is None:  # a file description of our own: sendfile writes at its position
                w = writers[block_fd] = os.open(f"/proc/self/fd/{block_fd}", os.O_WRONLY | os.O_CLOEXEC)
            os.lseek(w, offset, os.SEEK_SET)
            done = 0
            while done < p.nbytes:
                n = os.sendfile(w, src_fd, p.offset + done, p.nbytes - done)
                if n == 0:
                    raise CheckpointError(f"{p.file}: unexpected end of file reading tensor {p.name!r} "
                                          "(truncated checkpoint?)")
                done += n
            return True
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.EOPNOTSUPP, errno.EACCES, errno.ENOENT):
                log.info("sendfile into the arena refused (%s); reading with preadv", e)
                self.sendfile_ok = False
                return False
            raise CheckpointError(f"{p.file}: read of tensor {p.name!r} failed: {e}") from e
