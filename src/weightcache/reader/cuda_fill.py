"""Checkpoint bytes into CUDA memory: worker threads, each with ``depth`` copies in flight.

Per file, one way (SafetensorsSource's ``io``):

* ``register``: the segment's page-cache pages are page-locked where they are (a read-only
  cuMemHostRegister of the file's shared mapping) and the GPU copies straight from them; no CPU copy. The
  range is unregistered once its copies are done.
* ``staged``: a CPU copy of the segment out of the page cache into pinned staging memory, then host-to-device
  copies. The source's ``stage_read``: ``native`` (native workers, native_fill.py, copy tiles of the file's
  shared mapping into a few windows that stay in the CPU cache; the one that fills a window queues its DMA),
  ``pipeline`` (the same windows, each copied in turn by torch's intra-op threads), ``memcpy`` (each worker
  from the mapping into its own buffers), ``preadv``.
* ``direct``: as ``staged`` with O_DIRECT reads of the page-aligned range (cold files, no page cache).

A slot (staging buffer or registered range, CUDA event) is reused only after its copies are done. A range
the driver refuses to register falls back to ``staged`` for the rest of that file.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from . import staging
from .filemap import DIRECT_ALIGN, RESIDENT, FileMap, in_memory_fs, open_direct, unmap_later
from .read_plan import ReadPlan, Segment, plan_segments
from .reading import CheckpointError, open_files, read_into, run_workers
from .settings import ReadSettings
from .windows import WindowLoops

log = logging.getLogger(__name__)

WARM_IO = "staged"  # auto: a disk file in the page cache (page-locking it was slower: docs/benchmarks.md)
MEMORY_IO = "staged"  # auto: a file on tmpfs/ramfs (page-locking its pages was slower than copying)
COLD_IO = "direct"  # auto: a file mostly not in the page cache
NATIVE_EARLY = True  # a fill not prepared (prepare_windows) makes its windows on a thread while it plans


class CudaFill(WindowLoops):
    """One fill of CUDA views: a read plan (pieces and slice jobs), read as ``settings`` say. ``prepared``:
    the native loop's windows, made ahead (``staging.prepare_windows``); the fill takes or frees them. ``modes``
    tells afterwards how each file was read."""

    def __init__(self, plan: ReadPlan | None, settings: ReadSettings, views, report: Callable[[int], None], *,
                 device: torch.device | None = None, prepared: staging.EarlyWindows | None = None,
                 files=None):
        self.settings = settings
        self._prepared = prepared
        self.device = device or next(v.device for v in views.values() if v.device.type == "cuda")
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.cu, self.arena = staging.driver()
        self.files = set(files) if files is not None else (plan.files() if plan is not None else set())
        self.modes: dict[Path, str] = {}
        self._modes_lock = threading.Lock()
        self.maps: dict[Path, FileMap] = {}
        self.direct_fds: dict[Path, int] = {}
        self.fds: dict[Path, int] = {}
        self._huge_failed = False
        self._torch_copies = False  # the driver's copy failed once: torch's from then on
        self._early: staging.EarlyWindows | None = None
        self._native_windows = None  # made once per session, reused by every fill
        self._use_native = False  # the window loop is the native one (open decides)
        self._closed = False
        self._bind(plan, views, report)

    def _bind(self, plan: ReadPlan | None, views, report: Callable[[int], None]) -> None:
        """The plan, destinations and progress callback of the next fill."""
        self.plan, self.views, self.report = plan, views, report
        self.pieces, self.slices = (plan.pieces, plan.slices) if plan is not None else ([], [])
        self.ptrs = {n: v.data_ptr() for n, v in views.items()}
        self.__dict__.pop("flat", None)

    # -- set-up -----------------------------------------------------------------------------------

    def _choose_modes(self) -> None:
        io = self.settings.io
        files = sorted(self.files, key=str)
        why_not = staging.register_supported(self.index) if io in ("auto", "register") else ""
        for f in files:
            mode, fm = io, None
            if io in ("auto", "register"):
                try:
                    fm = FileMap(f)
                except OSError as e:
                    raise CheckpointError(f"cannot map checkpoint file {f}: {e}") from e
            if io == "auto":
                mode = MEMORY_IO if in_memory_fs(f) else COLD_IO if fm.resident_fraction() < RESIDENT else WARM_IO
            if mode == "register" and why_not:
                if io == "register":
                    log.warning("cannot register %s for DMA (%s); copying through staging buffers", f.name, why_not)
                mode = "staged"
            if mode == "staged" and self.settings.stage_read != "preadv" and fm is None:
                try:
                    fm = FileMap(f)
                except OSError as e:
                    raise CheckpointError(f"cannot map checkpoint file {f}: {e}") from e
            if mode in ("register", "staged") and fm is not None:
                self.maps[f] = fm  # staged: copied from unless stage_read is "preadv"
            elif fm is not None:
                fm.close()
            if mode == "direct":
                fd = open_direct(f)
                if fd is None:
                    log.info("%s: O_DIRECT not supported here; reading through the page cache", f.name)
                    mode = "staged"
                else:
                    self.direct_fds[f] = fd
            self.modes[f] = mode
        log.debug("fill modes: %s", {f.name: m for f, m in self.modes.items()})

    def _segment_bytes(self, file: Path) -> int:
        if self.modes.get(file) == "register":
            return self.settings.register_bytes
        return self.settings.window_bytes if self._pipelined(file) else self.settings.chunk_bytes

    def _pipelined(self, file: Path) -> bool:
        return self.settings.stage_read in ("pipeline", "native") and self.modes.get(file) == "staged" and file in self.maps

    @functools.cached_property
    def flat(self) -> dict[str, torch.Tensor]:
        """The views as bytes (the workers' copies; the window loops copy by address)."""
        return {n: v.reshape(-1).view(torch.uint8) if v.is_contiguous() else v for n, v in self.views.items()}

    @staticmethod
    def _stage_bytes(items: list, chunk_bytes: int) -> int:
        """The workers' staging buffer size: their largest read (page-aligned for O_DIRECT), at most
        chunk_bytes. Pinned buffers start on a page boundary (torch's pinned allocator, huge pages)."""
        n = DIRECT_ALIGN
        for i in items:
            if isinstance(i, Segment):
                a, b = i.page_range(DIRECT_ALIGN)
                n = max(n, b - a)
            else:
                n = max(n, -(-i.nbytes // DIRECT_ALIGN) * DIRECT_ALIGN)
        return min(n, chunk_bytes)

    def run(self) -> None:
        """One fill of the plan given at construction."""
        try:
            self.open()
            self._fill()
        finally:
            self.close()

    def open(self) -> None:
        """A session over ``files``: modes chosen and files mapped once, the native loop's windows taken (or
        made) once; then ``fill`` as many plans over those files as needed, then ``close``."""
        try:
            self._choose_modes()
            piped_files = {f for f in self.maps if self._pipelined(f)}
            self._use_native = bool(piped_files) and self._native_usable()
            early, self._prepared = self._prepared, None
            if early is not None and (not self._use_native or
                                      early.shape != (self.settings.window_bytes, self.settings.windows, self.index)):
                early.release()  # no native loop, or windows prepared for another one
                early = None
            if self._use_native and early is None and NATIVE_EARLY:
                early = staging.prepare_windows(self.settings, self.index)
            self._early = early
            self.fds = open_files(self.files)
        except BaseException:
            self.close()
            raise

    def fill(self, plan: ReadPlan, views, report: Callable[[int], None]) -> None:
        """One plan of an open session (its files among the session's)."""
        outside = plan.files() - self.files
        if outside:
            raise CheckpointError(f"{sorted(outside)[0]}: not among the files this fill session opened")
        self._bind(plan, views, report)
        self._fill()

    def _fill(self) -> None:
        piped_files = {f for f in self.maps if self._pipelined(f)}
        native = []  # the native loop packs its files' pieces into windows itself
        if self._use_native:
            native = [p for p in self.pieces if p.file in piped_files]
            items = self.plan.work_items(self._segment_bytes, self.settings.order,
                                         [p for p in self.pieces if p.file not in piped_files])
        else:
            items = self.plan.work_items(self._segment_bytes, self.settings.order)
        piped, rest = [], []
        for i in items:
            (piped if isinstance(i, Segment) and i.file in piped_files else rest).append(i)
        self.stage_bytes = self._stage_bytes(rest, self.settings.chunk_bytes)
        if native:
            self._native(native)
        elif piped:
            self._pipeline(piped)
        run_workers(self.settings.threads, rest, self._worker)

    def close(self) -> None:
        if self._prepared is not None:  # never taken: the session failed before it
            self._prepared.release()
            self._prepared = None
        if self._early is not None:
            self._early.release()
            self._early = None
        if self._native_windows is not None:
            unmap_later([self._native_windows])  # unlocking and unmapping: not on the fill's path
            self._native_windows = None
        for fd in [*self.fds.values(), *self.direct_fds.values()]:
            os.close(fd)
        self.fds, self.direct_fds = {}, {}
        if not self._closed:  # the maps stay listed (how each file was read); unmapped once
            self._closed = True
            unmap_later(list(self.maps.values()))

    # -- workers ----------------------------------------------------------------------------------

    def _worker(self, next_item) -> None:
        ctx = self.arena.device_context(self.index) if self.cu is not None else contextlib.nullcontext()
        with ctx, torch.cuda.device(self.device):
            streams = [torch.cuda.Stream(device=self.device) for _ in range(self.settings.streams)]
            slots = [staging.Slot(streams[i % len(streams)]) for i in range(self.settings.depth)]
            ok = False
            try:
                k = 0
                while (item := next_item()) is not None:
                    slot = slots[k]
                    k = (k + 1) % len(slots)
                    slot.drain(self.report)
                    if isinstance(item, Segment):
                        self._segment(item, slot)
                    else:
                        self._slice(item, slot)
                ok = True
            finally:
                for s in slots:
                    try:
                        s.drain(self.report if ok else None)
                    except Exception:
                        if ok:
                            raise
                for s in slots:
                    s.free()

    def _staging(self, slot: staging.Slot) -> torch.Tensor:
        if slot.buf is None:
            if self.settings.hugepages and not self._huge_failed:
                try:
                    slot.buf_owner = staging.HugeStaging(self.stage_bytes)
                    slot.buf = slot.buf_owner.tensor
                except Exception as e:  # noqa: BLE001
                    self._huge_failed = True
                    log.info("huge-page staging buffers unavailable (%s); using pinned memory", e)
            if slot.buf is None:
                slot.buf = self._pinned(self.stage_bytes)
        return slot.buf

    @staticmethod
    def _pinned(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _segment(self, seg: Segment, slot: staging.Slot) -> None:
        mode = self.modes.get(seg.file, "staged")
        if mode == "register":
            if self._register(seg, slot):
                return
            mode = "staged"
        a0, a1 = seg.page_range(DIRECT_ALIGN)
        parts = [seg] if a1 - a0 <= self.stage_bytes else plan_segments(seg.pieces, self.settings.chunk_bytes)
        for i, part in enumerate(parts):
            if i:
                slot.drain(self.report)  # the buffer is free again
            self._staged(part, slot, mode)

    def _staged(self, seg: Segment, slot: staging.Slot, mode: str) -> None:
        buf = self._staging(slot)
        a0, a1 = seg.page_range(DIRECT_ALIGN)
        if mode == "direct" and buf.data_ptr() % DIRECT_ALIGN == 0:
            self._read_direct(seg, a0, a1, buf[: a1 - a0])
            base = a0
        elif (fm := self.maps.get(seg.file)) is not None and self.settings.stage_read != "preadv":
            if seg.end > fm.size:
                raise CheckpointError(f"{seg.file}: unexpected end of file reading tensor {seg.pieces[0].name!r} "
                                      "(truncated checkpoint?)")
            ctypes.memmove(buf.data_ptr(), fm.addr + seg.start, seg.end - seg.start)  # without the GIL
            base = seg.start
        else:
            n = seg.end - seg.start
            read_into(self.fds[seg.file], [(seg.start, memoryview(buf[:n].numpy()))], memoryview(b""), seg.file,
                      seg.pieces[0].name)
            base = seg.start
        self._to_device(seg, buf, base, slot)

    def _to_device(self, seg: Segment, buf: torch.Tensor, base: int, slot: staging.Slot) -> None:
        """Queue each piece's copy from ``buf`` (holding the file from offset ``base``): the driver's copy
        where there are bindings (faster than torch's copy_ from the same pinned memory: docs/benchmarks.md),
        torch's where there are none or they fail before anything was queued."""
        if self.cu is not None and not self._torch_copies and self._driver_copies(seg, buf.data_ptr() - base, slot):
            return
        with torch.cuda.stream(slot.stream):
            for p in seg.pieces:
                o = p.offset - base
                self.flat[p.name][p.dst_offset : p.dst_offset + p.nbytes].copy_(buf[o : o + p.nbytes],
                                                                                  non_blocking=True)
        slot.event.record(slot.stream)
        slot.bytes = seg.nbytes

    def _driver_copies(self, seg: Segment, host_base: int, slot: staging.Slot) -> bool:
        cu = self.cu
        for i, p in enumerate(seg.pieces):
            try:
                err = staging.status(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(self.ptrs[p.name] + p.dst_offset),
                                                   host_base + p.offset, p.nbytes, cu.CUstream(slot.stream.cuda_stream)))
            except Exception as e:  # noqa: BLE001 - an unexpected bindings API: torch copies instead
                if i:
                    raise
                self._torch_copies = True
                log.warning("the driver's copy failed (%s: %s); copying with torch", type(e).__name__, e)
                return False
            if err != cu.CUresult.CUDA_SUCCESS:
                raise CheckpointError(f"{seg.file}: copy of tensor {p.name!r} to the device failed: "
                                      f"{staging.err_name(cu, err)}")
        slot.event.record(slot.stream)
        slot.bytes = seg.nbytes
        return True

    def _read_direct(self, seg: Segment, a0: int, a1: int, buf: torch.Tensor) -> None:
        """O_DIRECT read of [a0, a1) (aligned); the file may end before a1. A short read that leaves the
        offset unaligned finishes through the page cache."""
        fd = self.direct_fds[seg.file]
        mv = memoryview(buf.numpy())
        need, done = seg.end - a0, 0
        while done < need:
            if done % DIRECT_ALIGN:
                read_into(self.fds[seg.file], [(a0 + done, mv[done:need])], memoryview(b""), seg.file,
                          seg.pieces[0].name)
                return
            try:
                n = os.preadv(fd, [mv[done : a1 - a0]], a0 + done)
            except OSError as e:
                raise CheckpointError(f"{seg.file}: O_DIRECT read of tensor {seg.pieces[0].name!r} failed: {e}") from e
            if n == 0:
                raise CheckpointError(f"{seg.file}: unexpected end of file reading tensor {seg.pieces[0].name!r} "
                                      "(truncated checkpoint?)")
            done += n

    def _register(self, seg: Segment, slot: staging.Slot) -> bool:
        """Copy from the page-locked page-cache pages of the segment; False if the driver refused (or the
        bindings failed before any copy was queued): the caller stages the segment instead."""
        cu = self.cu
        fm = self.maps[seg.file]
        p0, p1 = seg.page_range()
        ptr = fm.addr + p0
        try:
            err = staging.status(cu.cuMemHostRegister(ptr, p1 - p0, staging.REGISTER_READ_ONLY))
        except Exception as e:  # noqa: BLE001 - an unexpected bindings API: the plain path still works
            return self._refused(seg, f"{type(e).__name__}: {e}")
        if err != cu.CUresult.CUDA_SUCCESS:
            return self._refused(seg, f"cuMemHostRegister: {staging.err_name(cu, err)}")
        queued = 0
        try:
            stream = cu.CUstream(slot.stream.cuda_stream)
            for p in seg.pieces:
                err = staging.status(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(self.ptrs[p.name] + p.dst_offset),
                                                   fm.addr + p.offset, p.nbytes, stream))
                if err != cu.CUresult.CUDA_SUCCESS:
                    raise CheckpointError(f"{seg.file}: copy of tensor {p.name!r} to the device failed: "
                                          f"{staging.err_name(cu, err)}")
                queued += 1
            slot.event.record(slot.stream)
        except BaseException as e:
            slot.stream.synchronize()
            cu.cuMemHostUnregister(ptr)
            if queued == 0 and isinstance(e, Exception) and not isinstance(e, CheckpointError):
                return self._refused(seg, f"{type(e).__name__}: {e}")
            raise
        slot.bytes = seg.nbytes
        slot.release = lambda: cu.cuMemHostUnregister(ptr)
        return True

    def _refused(self, seg: Segment, why: str) -> bool:
        with self._modes_lock:
            if self.modes.get(seg.file) == "register":
                self.modes[seg.file] = "staged"
                log.warning("cannot register %s for DMA (%s); copying it through staging buffers", seg.file.name, why)
        return False

    def _slice(self, job, slot: staging.Slot) -> None:
        dst = self.views[job.name]
        src = self.plan.read_slice(job)
        rows = self.plan.slice_rows(dst, job)
        if job.nbytes <= self.stage_bytes:
            buf = self._staging(slot)
        else:  # one row larger than a staging buffer: a one-off buffer, finished before it is freed
            buf = self._pinned(job.nbytes)
        stage = buf[: job.nbytes].view(rows.dtype).view(rows.shape)
        stage.copy_(src)
        with torch.cuda.stream(slot.stream):
            rows.copy_(stage, non_blocking=True)
        slot.event.record(slot.stream)
        slot.bytes = job.nbytes
        if buf is not slot.buf:
            slot.drain(self.report)


__all__ = ["COLD_IO", "MEMORY_IO", "WARM_IO", "CudaFill"]
