"""The CUDA fill's window loops (``stage_read`` "native" and "pipeline"): a file's shared mapping copied window
by window into a few page-locked windows small enough to stay in the CPU cache, each window's device copies
queued as it fills. A part of ``CudaFill`` (it uses the fill's maps, plan, settings and device)."""

from __future__ import annotations

import contextlib
import ctypes
import logging

import torch

from . import native_fill, staging
from .filemap import unmap_later
from .read_plan import Piece, Segment, plan_segments
from .reading import CheckpointError

log = logging.getLogger("weightcache.reader.cuda_fill")


def _end(p: Piece) -> int:
    return p.offset + p.nbytes



class WindowLoops:
    # -- the windows (staged, stage_read="native" or "pipeline") --------------------------------------

    @contextlib.contextmanager
    def _on_device(self):
        """This thread in the device's primary context (the driver's calls) and torch's current device."""
        ctx = self.arena.device_context(self.index) if self.cu is not None else contextlib.nullcontext()
        with ctx, torch.cuda.device(self.device):
            yield

    def _window_loads(self, segments: list[Segment]) -> list[Segment]:
        """The segments cut to at most one window each, checked against their files' sizes."""
        w = self.settings.window_bytes
        loads = [part for seg in segments for part in ([seg] if seg.end - seg.start <= w else
                                                        plan_segments(seg.pieces, w))]
        for part in loads:
            if part.end > self.maps[part.file].size:
                raise CheckpointError(f"{part.file}: unexpected end of file reading tensor "
                                      f"{part.pieces[0].name!r} (truncated checkpoint?)")
        return loads

    def _windows(self, stream: torch.cuda.Stream):
        """``windows`` slots on ``stream``, each with its ``window_bytes`` of one page-locked area."""
        w = self.settings.window_bytes
        slots = [staging.Slot(stream) for _ in range(self.settings.windows)]
        owner, area = self._window_area(w * len(slots))
        for k, s in enumerate(slots):
            s.buf = area[k * w : (k + 1) * w]
        return slots, owner

    @staticmethod
    def _close_windows(slots: list[staging.Slot], owner, report) -> None:
        """Every window's copies done (reported if ``report``), then the area freed."""
        try:
            for s in slots:
                try:
                    s.drain(report)
                except Exception:
                    if report is not None:
                        raise
        finally:
            for s in slots:
                s.buf = None
            WindowLoops._release_window_area(owner)

    def _pipeline(self, segments: list[Segment]) -> None:
        """In this thread: each segment copied out of its file's mapping by torch's intra-op threads into the
        next free window, then queued to the device on one stream (stage_read="pipeline", or "native" where
        the native loop cannot be built)."""
        loads = self._window_loads(segments)
        with self._on_device():
            slots, owner = self._windows(torch.cuda.Stream(device=self.device))
            mapped = {f: torch.frombuffer((ctypes.c_ubyte * self.maps[f].size).from_address(self.maps[f].addr),
                                          dtype=torch.uint8) for f in {part.file for part in loads}}
            ok = False
            try:
                for k, part in enumerate(loads):
                    slot = slots[k % len(slots)]
                    slot.drain(self.report)
                    n = part.end - part.start
                    slot.buf[:n].copy_(mapped[part.file][part.start : part.end])
                    self._to_device(part, slot.buf, part.start, slot)
                ok = True
            finally:
                mapped.clear()
                self._close_windows(slots, owner, self.report if ok else None)

    def _native_usable(self) -> bool:
        if self.settings.stage_read != "native":
            return False
        if self.cu is None:
            log.info("stage_read=native needs cuda-bindings; torch's copies instead")
            return False
        lib, why = native_fill.library()
        if lib is None:
            staging.native_unavailable(why)
        return lib is not None

    def _native_plan(self, pieces: list[Piece]) -> tuple[native_fill.Pieces, list[Piece]]:
        """The native loop's plan (file by file, in offset order) and its pieces in that order."""
        for f in {p.file for p in pieces}:
            last = max((p for p in pieces if p.file == f), key=_end)
            if last.offset + last.nbytes > self.maps[f].size:
                raise CheckpointError(f"{f}: unexpected end of file reading tensor {last.name!r} (truncated checkpoint?)")
        return native_fill.plan_pieces(pieces, {f: fm.addr for f, fm in self.maps.items()}, self.ptrs)

    def _native(self, pieces: list[Piece]) -> None:
        w, nwin = self.settings.window_bytes, self.settings.windows
        ctx = staging.context_handle(self.cu, self.arena, self.index)
        plan, ordered = self._native_plan(pieces)
        try:
            if self._native_windows is None:
                early, self._early = self._early, None
                try:
                    self._native_windows = early.take() if early is not None else staging.make_windows(w * nwin, ctx)
                except native_fill.NativeFillError as e:
                    size = f"{w * nwin >> 20} MiB" if w * nwin >= 1 << 20 else f"{w * nwin >> 10} KiB"
                    raise CheckpointError(f"cannot make the fill's {size} of page-locked staging windows: "
                                          f"{self._native_error(e)}") from e
            with self._on_device():
                stream = torch.cuda.Stream(device=self.device)
                native_fill.run(plan, self._native_windows.base, w, nwin, self.settings.native_threads,
                                self.settings.tile_bytes, self.report, ctx=ctx, stream=stream.cuda_stream)
        except native_fill.NativeFillError as e:
            piece = ordered[e.piece] if 0 <= e.piece < len(ordered) else None
            where = f"{piece.file}: copy of tensor {piece.name!r}" if piece else "the fill"
            raise CheckpointError(f"{where} to the device failed: {self._native_error(e)}") from e

    def _native_error(self, e: native_fill.NativeFillError) -> str:
        if e.code > 0:
            return staging.err_name(self.cu, self.cu.CUresult(e.code))
        return {-1: "out of memory", -2: "cannot start threads", -3: "no CUDA driver"}.get(e.code, str(e))

    def _window_area(self, nbytes: int):
        """(what owns the windows' page-locked memory, a uint8 tensor over it)."""
        owner = self._window_memory(nbytes)
        return owner, owner.tensor if isinstance(owner, staging.HugeStaging) else owner

    @staticmethod
    def _release_window_area(owner) -> None:
        if isinstance(owner, staging.HugeStaging):
            unmap_later([owner])  # unregistering and unmapping: not on the fill's path

    def _window_memory(self, nbytes: int):
        if self.settings.hugepages and not self._huge_failed:
            try:
                return staging.HugeStaging(nbytes)
            except Exception as e:  # noqa: BLE001
                self._huge_failed = True
                log.info("huge-page staging buffers unavailable (%s); using pinned memory", e)
        return self._pinned(nbytes)

