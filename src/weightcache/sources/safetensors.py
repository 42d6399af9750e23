"""The raw checkpoint as a FillSource: a Hugging Face safetensors checkpoint, sharded for one tensor-parallel
rank by a TP plan, read by the reader (``weightcache.reader``) straight into the arena's views.

Reads single-file and sharded (``*.safetensors.index.json``) checkpoints. A rank reads only its bytes:
contiguous shards (whole tensors, dim-0 splits) are pieces of the files, read straight into their views (CPU:
``reader/cpu_fill.py``; CUDA: ``reader/cuda_fill.py``); other shards (last-dim splits, dtype casts) are slice
jobs, copied from ``safe_open`` slices over the file's mmap. How it reads: ``ReadSettings``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..dtypes import dtype_name
from ..manifest import TensorMeta
from ..progress import Progress
from ..reader.header import CheckpointEntry, checkpoint_entries, read_header
from ..reader.read_plan import Piece, ReadPlan, SliceJob
from ..reader.reading import CheckpointError
from ..reader.settings import ReadSettings
from . import FillSource
from .tp_plan import ShardSpec, TPPlan, TPPlanError, resolve_plan

log = logging.getLogger(__name__)

AUTO_INSTANTTENSOR = False  # auto reads tmpfs files with InstantTensor: no, our own reader was faster
_REPLICATED = ShardSpec(None, None)


@dataclass
class _Tensor:
    entry: CheckpointEntry
    spec: ShardSpec
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype

    @property
    def out_nbytes(self) -> int:
        return math.prod(self.out_shape) * self.out_dtype.itemsize

    def byte_ranges(self, tp_rank: int, tp_size: int) -> list[tuple[int, int]] | None:
        """Contiguous (file offset, nbytes) pieces of this rank's shard, or None if it is strided."""
        shape, e = self.entry.shape, self.entry
        if self.spec.replicated or tp_size == 1:
            return [(e.start, e.nbytes)]
        d = self.spec.dim
        if math.prod(shape[:d]) != 1:
            return None
        row = math.prod(shape[d + 1 :]) * e.dtype.itemsize
        return [(e.start + a * row, (b - a) * row) for a, b in self.spec.ranges(shape, tp_rank, tp_size)]


class SafetensorsSource(FillSource):
    """A :class:`~weightcache.sources.FillSource` over a safetensors checkpoint for one TP rank.

    ``tp_plan``: None/"auto" (transformers' plan for the checkpoint's architecture), "none", a dict of
    pattern -> style (transformers' names; full or base-model-relative patterns), or a TPPlan.
    ``dtype`` casts floating-point tensors. ``read``: how it reads (``ReadSettings``); or its fields as
    keywords (``io="staged"``, ``threads=8``, ...), with this machine's defaults for the rest.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_plan: Mapping[str, str] | TPPlan | str | None = None,
        device: str | torch.device = "cpu",
        name: str | None = None,
        read: ReadSettings | None = None,
        **reading,
    ):
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
        if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        if read is not None and reading:
            raise TypeError(f"pass read= or its fields, not both ({', '.join(reading)})")
        try:
            self.read = read if read is not None else ReadSettings.make(**reading)
        except TypeError as e:
            raise TypeError(f"SafetensorsSource: {e}") from None
        self.model_dir, entries = checkpoint_entries(model_dir)
        self.model_name = name or str(self.model_dir.resolve())
        self.dtype = dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device)
        self.plan = resolve_plan(self.model_dir, tp_plan) if tp_size > 1 or tp_plan is not None else TPPlan()
        # a plan other than transformers' own changes the bytes: it goes into the key
        self._custom_plan = tp_size > 1 and tp_plan is not None and not (isinstance(tp_plan, str) and tp_plan == "auto")
        self.tensors: dict[str, _Tensor] = {}
        files = {f: str(f) for f in {e.file for e in entries.values()}}
        for tname in sorted(entries, key=lambda n: (files[entries[n].file], entries[n].start)):
            e = entries[tname]
            if tp_size > 1:
                spec = self.plan.spec(tname, e.shape)
                spec.check(f"{e.file.name}: {tname}", e.shape, tp_size)
                shape = spec.shard_shape(e.shape, tp_size)
            else:
                spec, shape = _REPLICATED, e.shape
            out_dtype = dtype if (dtype is not None and e.dtype.is_floating_point) else e.dtype
            self.tensors[tname] = _Tensor(e, spec, shape, out_dtype)
        self._handles: dict[Path, object] = {}
        self._handles_lock = threading.Lock()
        self._sendfile_ok = True  # until the kernel refuses sendfile into the arena
        self.last_modes: dict[str, str] = {}  # file name -> how the last fill read it (diagnostics, benchmarks)
        self._prepared = None  # the next CUDA fill's windows, being made (prepare)

    # -- Source protocol --------------------------------------------------------------------------

    def describe(self) -> list[TensorMeta]:
        return [TensorMeta(n, dtype_name(t.out_dtype), list(t.out_shape)) for n, t in self.tensors.items()]

    def key_fields(self) -> dict[str, str]:
        from ..digests import checkpoint_digest

        floats = sorted({dtype_name(t.out_dtype) for t in self.tensors.values() if t.out_dtype.is_floating_point})
        fields = {
            "model": self.model_name,
            "content_digest": checkpoint_digest(self.model_dir),
            "dtype": dtype_name(self.dtype) if self.dtype is not None else "+".join(floats),
        }
        if self._custom_plan:
            from ..digests import config_digest

            fields["tp_plan"] = config_digest(self.plan.plan)
        return fields

    @property
    def nbytes(self) -> int:
        return sum(t.out_nbytes for t in self.tensors.values())

    def prepare(self) -> None:
        """Before the destinations exist: start making the page-locked windows that the next CUDA fill stages
        through, on a thread of their own, so that it overlaps the arena's allocation (Daemon.load calls
        this). That fill takes them; ``release`` frees them where no fill follows."""
        if self._prepared is None and self.device.type == "cuda" and self.read.io in ("auto", "staged"):
            from ..reader.staging import prepare_windows

            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._prepared = prepare_windows(self.read, index)

    def take_prepared(self):
        """What prepare started (or None), now the caller's."""
        prepared, self._prepared = self._prepared, None
        return prepared

    def release(self) -> None:
        prepared = self.take_prepared()
        if prepared is not None:
            prepared.release()

    def fill(self, views: Mapping[str, torch.Tensor], progress: Callable[[int], None] | None = None) -> None:
        try:
            self._fill(views, progress)
        finally:
            self.release()  # where this fill did not take them

    def _fill(self, views: Mapping[str, torch.Tensor], progress: Callable[[int], None] | None) -> None:
        self._check_views(views)
        cuda = any(views[n].device.type == "cuda" for n in self.tensors)
        if self.read.io == "instanttensor" and not cuda:
            raise CheckpointError("io='instanttensor' loads into CUDA memory only; this source fills CPU views")
        plan = self.read_plan(views)
        meter = Progress(plan.nbytes, f"{self.model_dir.name} tp{self.tp_rank}/{self.tp_size}", self.read.progress,
                         log)
        lock = threading.Lock()

        def report(n: int) -> None:
            with lock:
                meter.update(n)
                if progress is not None:
                    progress(n)

        def plain_cuda(rep: Callable[[int], None]) -> None:
            from ..reader.cuda_fill import CudaFill

            fill = CudaFill(plan, self.read, views, rep, prepared=self.take_prepared())
            try:
                fill.run()
            finally:
                self.last_modes = {f.name: m for f, m in fill.modes.items()}

        try:
            if self.reader(cuda) == "instanttensor":
                self.read_with_instanttensor(views, report, fallback=plain_cuda if self.read.io == "auto" else None)
            elif cuda:
                plain_cuda(report)
            else:
                from ..reader.cpu_fill import CpuFill

                fill = CpuFill(plan, self.read, views, report, sendfile=self._sendfile_ok)
                try:
                    fill.run()
                finally:
                    self._sendfile_ok = fill.sendfile_ok
                self.last_modes = {f.name: fill.mode for f in {p.file for p in plan.pieces}}
        finally:
            meter.close()

    def read_with_instanttensor(self, views: Mapping[str, torch.Tensor], report: Callable[[int], None],
                                fallback: Callable[[Callable[[int], None]], None] | None = None) -> None:
        """InstantTensor reads; where ``auto`` chose it (``fallback`` given) and it fails, the plain path reads
        everything again, its progress counted from where InstantTensor's stopped."""
        from ..reader.instanttensor import fill_with_instanttensor

        sent = 0

        def counted(n: int) -> None:
            nonlocal sent
            sent += n
            report(n)

        try:
            fill_with_instanttensor(self, views, counted)
        except CheckpointError as e:
            if fallback is None:
                raise
            log.warning("%s: InstantTensor failed (%s); reading with weightcache's own path", self.model_dir.name, e)
            skip = sent

            def rest(n: int) -> None:
                nonlocal skip
                k = min(skip, n)
                skip -= k
                if n > k:
                    report(n - k)

            fallback(rest)
            return
        self.last_modes = {f.name: "instanttensor" for f in {t.entry.file for t in self.tensors.values()}}

    def reader(self, cuda: bool) -> str:
        """What reads the files: "instanttensor", "cuda" (CudaFill) or "cpu". ``auto`` into CUDA memory takes
        InstantTensor only where ``AUTO_INSTANTTENSOR`` says it was measured faster than the plain path
        (docs/benchmarks.md) and it is installed: one rank (it reads whole tensors), every file on tmpfs/ramfs
        and in memory. Page-cached files of a disk it reads with O_DIRECT (much slower than ours: docs/benchmarks.md)."""
        if self.read.io == "instanttensor":
            return "instanttensor"
        if not cuda:
            return "cpu"
        if self.read.io != "auto" or self.tp_size != 1 or not AUTO_INSTANTTENSOR:
            return "cuda"
        from ..reader.filemap import RESIDENT, in_memory_fs, resident_fraction
        from ..reader.instanttensor import available

        if not available():
            return "cuda"
        try:
            files = self.files_without_duplicates()
            warm = all(in_memory_fs(f) and resident_fraction(f) >= RESIDENT for f in files)
        except (CheckpointError, OSError):
            return "cuda"
        return "instanttensor" if warm else "cuda"

    # -- planning --------------------------------------------------------------------------------

    def files_without_duplicates(self) -> list[Path]:
        """The files this rank reads; refuses a tensor name that two of them hold (for readers that take
        whole files and cannot tell which copy the index means)."""
        files = sorted({t.entry.file for t in self.tensors.values()}, key=str)
        seen: dict[str, str] = {}
        for f in files:
            for name in read_header(f)[0]:
                if name in self.tensors and name in seen:
                    raise CheckpointError(f"tensor {name!r} is in both {seen[name]} and {f.name}; io={self.read.io!r} "
                                          "reads whole files and cannot tell which one the index means")
                seen[name] = f.name
        return files

    def _check_views(self, views: Mapping[str, torch.Tensor]) -> None:
        kind, index = self.device.type, self.device.index
        for name, t in self.tensors.items():
            v = views.get(name)
            if v is None:
                raise CheckpointError(f"no destination view for tensor {name!r} (from {t.entry.file.name})")
            if v.shape != t.out_shape or v.dtype != t.out_dtype:
                raise CheckpointError(
                    f"destination view for {name!r} is {v.dtype} {list(v.shape)}, expected "
                    f"{t.out_dtype} {list(t.out_shape)}"
                )
            where = v.device
            if where.type != kind or (index is not None and where.index != index):
                raise CheckpointError(f"destination view for {name!r} is on {v.device}, source device is {self.device}")

    def read_plan(self, views: Mapping[str, torch.Tensor]) -> ReadPlan:
        """Contiguous pieces (read straight from the file) and row-block slice copies (strided shards, casts)."""
        pieces: list[Piece] = []
        slices: list[SliceJob] = []
        for name, t in self.tensors.items():
            ranges = None
            if self.read.io != "mmap" and t.out_dtype == t.entry.dtype and views[name].is_contiguous():
                ranges = t.byte_ranges(self.tp_rank, self.tp_size)
            if ranges is not None:
                dst = 0
                for off, n in ranges:
                    pieces.append(Piece(t.entry.file, off, n, name, dst))
                    dst += n
                continue
            for p, shape in enumerate(self._pieces(t)):
                rows = shape[0] if shape else 1
                row_bytes = (math.prod(shape[1:]) if shape else 1) * t.out_dtype.itemsize
                step = max(1, self.read.chunk_bytes // max(row_bytes, 1))
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    slices.append(SliceJob(name, (r1 - r0) * row_bytes, t.entry.file, piece=p, r0=r0, r1=r1))
        return ReadPlan(pieces, slices, self.slice_source, self.dst_rows)

    def plan_reads(self, views: Mapping[str, torch.Tensor]) -> tuple[list[Piece], list[SliceJob]]:
        plan = self.read_plan(views)
        return plan.pieces, plan.slices

    def _pieces(self, t: _Tensor) -> list[tuple[int, ...]]:
        """Shapes of the parts (one per packed split) that make up this rank's shard."""
        if t.spec.replicated or self.tp_size == 1:
            return [t.out_shape]
        d = t.spec.dim
        shape = list(t.out_shape)
        shape[d] //= t.spec.split
        return [tuple(shape)] * t.spec.split

    # -- reading --------------------------------------------------------------------------------

    def slice_source(self, job: SliceJob) -> torch.Tensor:
        """A CPU tensor (view over the file's mmap where safetensors allows) of the job's rows of one piece."""
        name, piece, r0, r1 = job.name, job.piece, job.r0, job.r1
        t = self.tensors[name]
        h = self._handle(t.entry.file)
        try:
            sl = h.get_slice(name)
            shape = t.entry.shape
            if not shape:
                return h.get_tensor(name)
            idx = [slice(None)] * len(shape)
            if t.spec.replicated or self.tp_size == 1:
                idx[0] = slice(r0, r1)
            else:
                d = t.spec.dim
                a, b = t.spec.ranges(shape, self.tp_rank, self.tp_size)[piece]
                if d == 0:
                    idx[0] = slice(a + r0, a + r1)
                else:
                    idx[0] = slice(r0, r1)
                    idx[d] = slice(a, b)
            return sl[tuple(idx)]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{t.entry.file}: cannot read tensor {name!r}: {e}") from e

    def _handle(self, file: Path):
        with self._handles_lock:
            h = self._handles.get(file)
            if h is None:
                from safetensors import safe_open

                try:
                    h = safe_open(str(file), framework="pt", device="cpu")
                except Exception as e:
                    raise CheckpointError(f"{file}: cannot open with safetensors: {e}") from e
                self._handles[file] = h
            return h

    def dst_rows(self, dst: torch.Tensor, job: SliceJob) -> torch.Tensor:
        t = self.tensors[job.name]
        if t.spec.split > 1 and not t.spec.replicated and self.tp_size > 1:
            d = t.spec.dim
            part = t.out_shape[d] // t.spec.split
            dst = dst.narrow(d, job.piece * part, part)
        if dst.dim() == 0:
            return dst
        return dst[job.r0 : job.r1]


__all__ = ["CheckpointEntry", "CheckpointError", "SafetensorsSource", "TPPlanError", "checkpoint_entries",
           "read_header"]
