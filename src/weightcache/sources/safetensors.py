"""Fill an arena from a Hugging Face safetensors checkpoint, sharded for one tensor-parallel rank.

Reads single-file and sharded (``*.safetensors.index.json``) checkpoints. A rank reads only its bytes:
contiguous shards (whole tensors, dim-0 splits) are grouped into segments of the files (read_plan.py). Into
CPU memory, a segment is one ``preadv`` straight into the destination tensors. Into CUDA memory
(cuda_fill.py), worker threads either page-lock the file's page-cache pages of a segment and let the GPU
copy from them (``register``), or read the segment into pinned staging buffers, through the page cache
(``staged``) or around it with O_DIRECT (``direct``), several copies in flight per thread. ``auto`` picks per
file: ``register`` for a file in the page cache, ``direct`` for one that is not. Other shards (last-dim
splits, dtype casts) are copied from ``safe_open`` slices over the file's mmap. File reads and copies
release the GIL.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..key import dtype_name
from ..manifest import TensorMeta
from ..progress import Progress
from .read_plan import PAGE, Piece, Segment, order_segments, plan_segments
from .reading import CheckpointError, read_into, run_workers
from .tp_plan import ShardSpec, TPPlan, TPPlanError, resolve_plan

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100 << 20
DEFAULT_CHUNK_BYTES = 16 << 20  # per staging buffer and read (segment), `depth` buffers per thread
DEFAULT_HUGEPAGES = True  # staging in huge pages: 30.8 vs 22.4 GB/s with torch's pinned memory (H200, tmpfs)
DEFAULT_REGISTER_BYTES = 128 << 20  # per page-locked range of a file (io="register")
DEFAULT_THREADS = 16
DEFAULT_DEPTH = 2  # copies in flight per thread
# staged: "native" (native workers tile the cache-resident windows: 48-50 GB/s on the H200, median 48-49,
# against the "pipeline" of torch's intra-op threads, 26-51 across starts of the machine)
STAGE_READS = ("native", "pipeline", "memcpy", "preadv")
DEFAULT_STAGE_READ = "native"
DEFAULT_TILE_BYTES = 2 << 20  # stage_read="native": what a worker copies at a time
DEFAULT_WINDOW_BYTES = 16 << 20
# 4 x 16 MiB: 52.5-52.6 GB/s (median 51.9-52.2) against 6 x 16 MiB's 49.6-49.8 (47.2-48.1) in two runs on an
# H100 host with 105 MiB of L3; more than 96 MiB of windows was slower on the H200 too (docs/benchmarks.md)
DEFAULT_WINDOWS = 4
DEFAULT_NATIVE_THREADS = 12  # at most, and 4 cores left to the driver and the rest (InstantTensor's rule)
AUTO_INSTANTTENSOR = False  # auto reads tmpfs files with InstantTensor: no, since the pipeline beats it
IO_MODES = ("auto", "staged", "register", "direct", "mmap", "instanttensor")
IO_ENV = "WEIGHTCACHE_LOAD_IO"  # the default io mode of a source made without one (e.g. in preload's daemons)
INDEX_NAME = "model.safetensors.index.json"

_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}


_TORCH_DTYPES = {code: dt for code, name in _ST_DTYPES.items()
                 if isinstance(dt := getattr(torch, name, None), torch.dtype)}
_REPLICATED = ShardSpec(None, None)


def _torch_dtype(code: str, file: Path, name: str) -> torch.dtype:
    dt = _TORCH_DTYPES.get(code)
    if dt is None:
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {code!r}, which this torch cannot hold")
    return dt


@dataclass(frozen=True)
class _Entry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, _Entry], dict[str, str]]:
    """Parse a safetensors header: tensor entries with absolute offsets, and the metadata dict."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointError(
                    f"{path}: not a safetensors file or truncated (header length {n}, file size {size})"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from e
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    entries = {}
    dtypes = _TORCH_DTYPES
    for name, info in header.items():
        try:
            code, shape, (b, e) = info["dtype"], tuple(map(int, info["shape"])), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from err
        dtype = dtypes.get(code) or _torch_dtype(code, path, name)
        expect = math.prod(shape) * dtype.itemsize
        if e - b != expect or b < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} occupies {e - b} bytes but shape {list(shape)} of {code} needs {expect}"
            )
        if base + e > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {base + e} but the file has {size} bytes (truncated?)"
            )
        entries[name] = _Entry(name, path, dtype, shape, base + b, e - b)
    return entries, meta


def checkpoint_entries(model_dir: str | Path) -> tuple[Path, dict[str, _Entry]]:
    """All tensors of a checkpoint (a .safetensors file, or a directory with or without an index)."""
    path = Path(model_dir)
    if path.is_file():
        if not path.name.endswith(".safetensors"):
            raise CheckpointError(f"{path} is not a .safetensors file")
        return path, read_header(path)[0]
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    index = path / INDEX_NAME
    if not index.is_file():
        others = sorted(path.glob("*.safetensors.index.json"))
        index = others[0] if len(others) == 1 else index
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from e
        entries: dict[str, _Entry] = {}
        headers: dict[str, dict[str, _Entry]] = {}
        for fname in sorted(set(weight_map.values())):
            f = path / fname
            if not f.is_file():
                names = [n for n, v in weight_map.items() if v == fname]
                raise CheckpointError(
                    f"{index} maps {len(names)} tensor(s) (e.g. {names[0]!r}) to {fname}, which is missing "
                    f"from {path}"
                )
            headers[fname] = read_header(f)[0]
        for name, fname in weight_map.items():
            if name not in headers[fname]:
                raise CheckpointError(f"{index} maps tensor {name!r} to {fname}, but that file lacks it")
            entries[name] = headers[fname][name]
        return path, entries
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files (and no {INDEX_NAME}) in {path}")
    entries = {}
    for f in files:
        for name, ent in read_header(f)[0].items():
            if name in entries:
                raise CheckpointError(
                    f"tensor {name!r} is in both {entries[name].file.name} and {f.name} in {path}, "
                    f"and there is no {INDEX_NAME} to say which one counts"
                )
            entries[name] = ent
    return path, entries


@dataclass
class _Tensor:
    entry: _Entry
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


@dataclass
class SliceJob:
    """A row block of a slice copy: rows [r0, r1) along dim 0 of one packed part (``piece``) of a shard."""

    name: str
    nbytes: int  # bytes landing in the destination
    file: Path
    piece: int = 0
    r0: int = 0
    r1: int = 0


class SafetensorsSource:
    """A :class:`~weightcache.sources.Source` over a safetensors checkpoint for one TP rank.

    ``tp_plan``: None/"auto" (transformers' plan for the checkpoint's architecture), "none", a dict of
    pattern -> style (transformers' names; full or base-model-relative patterns), or a TPPlan.
    ``dtype`` casts floating-point tensors.

    How bytes reach the destination (``io``; default: $WEIGHTCACHE_LOAD_IO, else "auto"):

    * ``auto``: into CPU memory, ``sendfile``/``preadv`` into the destination; into CUDA memory per file
      ``staged`` for a file in the page cache (tmpfs or disk), ``direct`` for one that is not
    * ``register`` (CUDA): page-lock the page-cache pages of each ``register_bytes`` range (read-only
      cuMemHostRegister) and copy from them; falls back to ``staged`` where the driver refuses
    * ``staged`` (CUDA): a CPU copy into pinned staging memory, then copy. ``stage_read``: "native" (the
      default: ``threads`` native workers, without ``threads`` 12 and 4 cores left, copy the file's mapping
      ``tile_bytes`` at a time into ``windows`` windows of ``window_bytes``, small enough to stay in the CPU
      cache, and queue each window's device copies as it fills; built with the machine's C compiler on first
      use, the pipeline where it cannot be), "pipeline" (one thread walks the windows, torch's intra-op
      threads copy each one), "memcpy" (each worker copies from the mapping into its own ``chunk_bytes``
      buffers) or "preadv" (each worker reads into them)
    * ``direct`` (CUDA): as ``staged`` with O_DIRECT reads (around the page cache: cold files)
    * ``mmap``: copy every tensor from the safetensors mmap slices
    * ``instanttensor`` (CUDA, optional extra): InstantTensor reads, weightcache copies into the views

    ``threads`` workers, each with ``depth`` copies in flight on ``streams`` CUDA streams (1..depth);
    ``order`` "file" or "interleave" (round robin over the files; the native loop reads file after file); ``hugepages`` puts staging buffers in
    transparent huge pages (registered with CUDA) instead of torch's pinned memory (the default: faster on
    the H200, docs/benchmarks.md; where the kernel has none, pinned memory).
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
        threads: int | None = None,
        progress: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        io: str | None = None,
        name: str | None = None,
        register_bytes: int = DEFAULT_REGISTER_BYTES,
        depth: int = DEFAULT_DEPTH,
        streams: int = 1,
        order: str = "file",
        hugepages: bool = DEFAULT_HUGEPAGES,
        stage_read: str = DEFAULT_STAGE_READ,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        windows: int = DEFAULT_WINDOWS,
        tile_bytes: int = DEFAULT_TILE_BYTES,
    ):
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
        if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        cpus = os.cpu_count() or 1
        self.native_threads = threads if threads is not None else max(1, min(DEFAULT_NATIVE_THREADS, cpus - 4))
        if threads is None:
            threads = min(DEFAULT_THREADS, cpus)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        for what, n in (("chunk_bytes", chunk_bytes), ("register_bytes", register_bytes),
                        ("window_bytes", window_bytes), ("tile_bytes", tile_bytes)):
            if not isinstance(n, int) or n < PAGE or n % PAGE:
                raise ValueError(f"{what} must be a positive multiple of {PAGE}, got {n!r}")
        if io is None:
            io = os.environ.get(IO_ENV) or "auto"
        if io not in IO_MODES:
            raise ValueError(f"io must be one of {', '.join(IO_MODES)}; got {io!r}")
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive int, got {depth!r}")
        if not isinstance(streams, int) or not 1 <= streams <= depth:
            raise ValueError(f"streams must be in [1, depth={depth}], got {streams!r}")
        if order not in ("file", "interleave"):
            raise ValueError(f"order must be 'file' or 'interleave', got {order!r}")
        if stage_read not in STAGE_READS:
            raise ValueError(f"stage_read must be one of {', '.join(STAGE_READS)}; got {stage_read!r}")
        if not isinstance(windows, int) or windows < 1:
            raise ValueError(f"windows must be a positive int, got {windows!r}")
        self.model_dir, entries = checkpoint_entries(model_dir)
        self.model_name = name or str(self.model_dir.resolve())
        self.dtype = dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device)
        self.threads = threads
        self.show_progress = progress
        self.chunk_bytes = chunk_bytes
        self.register_bytes = register_bytes
        self.io = io
        self.depth, self.streams, self.order, self.hugepages = depth, streams, order, hugepages
        self.stage_read, self.window_bytes, self.windows = stage_read, window_bytes, windows
        self.tile_bytes = tile_bytes
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
        self._sendfile_ok = hasattr(os, "sendfile")
        self.last_modes: dict[str, str] = {}  # file name -> how the last fill read it (diagnostics, benchmarks)
        self._prepared = None  # the next CUDA fill's windows, being made (prepare_fill)

    # -- Source protocol --------------------------------------------------------------------------

    def describe(self) -> list[TensorMeta]:
        return [TensorMeta(n, dtype_name(t.out_dtype), list(t.out_shape)) for n, t in self.tensors.items()]

    def key_fields(self) -> dict[str, str]:
        from ..key import checkpoint_digest

        floats = sorted({dtype_name(t.out_dtype) for t in self.tensors.values() if t.out_dtype.is_floating_point})
        fields = {
            "model": self.model_name,
            "content_digest": checkpoint_digest(self.model_dir),
            "dtype": dtype_name(self.dtype) if self.dtype is not None else "+".join(floats),
        }
        if self._custom_plan:
            from ..key import config_digest

            fields["tp_plan"] = config_digest(self.plan.plan)
        return fields

    @property
    def nbytes(self) -> int:
        return sum(t.out_nbytes for t in self.tensors.values())

    def prepare_fill(self) -> None:
        """Before the destinations exist: start making the page-locked windows that the next CUDA fill stages
        through, on a thread of their own, so that it overlaps the arena's allocation (Daemon.load calls
        this). That fill takes them; ``release_prepared`` frees them where no fill follows."""
        if self._prepared is None and self.device.type == "cuda" and self.io in ("auto", "staged"):
            from .cuda_fill import prepare_windows

            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._prepared = prepare_windows(self, index)

    def take_prepared(self):
        """What prepare_fill started (or None), now the caller's."""
        prepared, self._prepared = self._prepared, None
        return prepared

    def release_prepared(self) -> None:
        prepared = self.take_prepared()
        if prepared is not None:
            prepared.release()

    def fill(self, views: Mapping[str, torch.Tensor], progress: Callable[[int], None] | None = None) -> None:
        try:
            self._fill(views, progress)
        finally:
            self.release_prepared()  # where this fill did not take them

    def _fill(self, views: Mapping[str, torch.Tensor], progress: Callable[[int], None] | None) -> None:
        self._check_views(views)
        cuda = any(views[n].device.type == "cuda" for n in self.tensors)
        if self.io == "instanttensor" and not cuda:
            raise CheckpointError("io='instanttensor' loads into CUDA memory only; this source fills CPU views")
        pieces, slices = self.plan_reads(views)
        total = sum(p.nbytes for p in pieces) + sum(j.nbytes for j in slices)
        meter = Progress(total, f"{self.model_dir.name} tp{self.tp_rank}/{self.tp_size}", self.show_progress, log)
        lock = threading.Lock()

        def report(n: int) -> None:
            with lock:
                meter.update(n)
                if progress is not None:
                    progress(n)

        def plain_cuda(rep: Callable[[int], None]) -> None:
            from .cuda_fill import CudaFill

            CudaFill(self, views, pieces, slices, rep).run()

        try:
            if self.reader(cuda) == "instanttensor":
                self.read_with_instanttensor(views, report, fallback=plain_cuda if self.io == "auto" else None)
            elif cuda:
                plain_cuda(report)
            else:
                self._run_cpu(views, self.work_items(pieces, slices, lambda f: self.chunk_bytes), report)
                how = "sendfile" if self._sendfile_ok else "preadv"
                self.last_modes = {f.name: how for f in {p.file for p in pieces}}
        finally:
            meter.close()

    def read_with_instanttensor(self, views: Mapping[str, torch.Tensor], report: Callable[[int], None],
                                fallback: Callable[[Callable[[int], None]], None] | None = None) -> None:
        """InstantTensor reads; where ``auto`` chose it (``fallback`` given) and it fails, the plain path reads
        everything again, its progress counted from where InstantTensor's stopped."""
        from .instanttensor import fill_with_instanttensor

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
        and in memory. Page-cached files of a disk it reads with O_DIRECT (measured 25x slower than ours)."""
        if self.io == "instanttensor":
            return "instanttensor"
        if not cuda:
            return "cpu"
        if self.io != "auto" or self.tp_size != 1 or not AUTO_INSTANTTENSOR:
            return "cuda"
        from .filemap import RESIDENT, in_memory_fs, resident_fraction
        from .instanttensor import available

        if not available():
            return "cuda"
        try:
            files = self.files_without_duplicates()
            warm = all(in_memory_fs(f) and resident_fraction(f) >= RESIDENT for f in files)
        except (CheckpointError, OSError):
            return "cuda"
        return "instanttensor" if warm else "cuda"

    def work_items(self, pieces: list[Piece], slices: list[SliceJob],
                   segment_bytes: Callable[[Path], int]) -> list[Segment | SliceJob]:
        """Segments (contiguous reads of at most ``segment_bytes(file)``, in ``order``), then slice jobs."""
        by_size: dict[int, list[Piece]] = {}
        for p in pieces:
            by_size.setdefault(segment_bytes(p.file), []).append(p)
        segments = [s for size, group in by_size.items() for s in plan_segments(group, size)]
        segments.sort(key=lambda s: (str(s.file), s.start))
        return [*order_segments(segments, self.order), *slices]

    def _run_cpu(self, views, items: list, report: Callable[[int], None]) -> None:
        fds = self.open_files({i.file for i in items})
        try:
            run_workers(self.threads, items, lambda next_item: self._cpu_worker(views, fds, next_item, report))
        finally:
            for fd in fds.values():
                os.close(fd)

    # -- planning --------------------------------------------------------------------------------

    def files_without_duplicates(self) -> list[Path]:
        """The files this rank reads; refuses a tensor name that two of them hold (for readers that take
        whole files and cannot tell which copy the index means)."""
        files = sorted({t.entry.file for t in self.tensors.values()}, key=str)
        seen: dict[str, str] = {}
        for f in files:
            for name in read_header(f)[0]:
                if name in self.tensors and name in seen:
                    raise CheckpointError(f"tensor {name!r} is in both {seen[name]} and {f.name}; io={self.io!r} "
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

    def plan_reads(self, views: Mapping[str, torch.Tensor]) -> tuple[list[Piece], list[SliceJob]]:
        """Contiguous pieces (read straight from the file) and row-block slice copies (strided shards, casts)."""
        pieces: list[Piece] = []
        slices: list[SliceJob] = []
        for name, t in self.tensors.items():
            ranges = None
            if self.io != "mmap" and t.out_dtype == t.entry.dtype and views[name].is_contiguous():
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
                step = max(1, self.chunk_bytes // max(row_bytes, 1))
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    slices.append(SliceJob(name, (r1 - r0) * row_bytes, t.entry.file, piece=p, r0=r0, r1=r1))
        return pieces, slices

    def _pieces(self, t: _Tensor) -> list[tuple[int, ...]]:
        """Shapes of the parts (one per packed split) that make up this rank's shard."""
        if t.spec.replicated or self.tp_size == 1:
            return [t.out_shape]
        d = t.spec.dim
        shape = list(t.out_shape)
        shape[d] //= t.spec.split
        return [tuple(shape)] * t.spec.split

    def open_files(self, files) -> dict[Path, int]:
        fds = {}
        try:
            for f in sorted(files, key=str):
                fds[f] = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            for fd in fds.values():
                os.close(fd)
            raise CheckpointError(f"cannot open checkpoint file: {e}") from e
        return fds

    # -- reading --------------------------------------------------------------------------------

    def slice_source(self, name: str, piece: int, r0: int, r1: int) -> torch.Tensor:
        """A CPU tensor (view over the file's mmap where safetensors allows) of rows r0:r1 of one piece."""
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

    def _cpu_worker(self, views, fds, next_item, report) -> None:
        """Segments go straight into the destination: through the arena block's memfd (sendfile: the kernel
        writes whole pages, no faults or zeroing here) where the view lies in one, else preadv into it."""
        from ..arena.host import block_file_at

        junk = memoryview(bytearray(2 * PAGE))  # gap bytes between pieces land here (read, never used)
        flat, writers = {}, {}
        try:
            while (item := next_item()) is not None:
                if isinstance(item, Segment):
                    iovs = []
                    for p in item.pieces:
                        raw = flat.get(p.name)
                        if raw is None:
                            raw = flat[p.name] = views[p.name].reshape(-1).view(torch.uint8)
                        dst = raw[p.dst_offset : p.dst_offset + p.nbytes]
                        where = block_file_at(dst.data_ptr(), p.nbytes) if self._sendfile_ok else None
                        if where is None or not self._send(fds[item.file], writers, where, p):
                            iovs.append((p.offset, memoryview(dst.numpy()).cast("B")))
                    read_into(fds[item.file], iovs, junk, item.file, item.pieces[0].name)
                    report(item.nbytes)
                else:
                    src = self.slice_source(item.name, item.piece, item.r0, item.r1)
                    self.dst_rows(views[item.name], item).copy_(src)
                    report(item.nbytes)
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
                self._sendfile_ok = False
                return False
            raise CheckpointError(f"{p.file}: read of tensor {p.name!r} failed: {e}") from e


__all__ = ["SafetensorsSource", "CheckpointError", "TPPlanError", "checkpoint_entries", "read_header"]
