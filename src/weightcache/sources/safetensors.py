"""Fill an arena from a Hugging Face safetensors checkpoint, sharded for one tensor-parallel rank.

Reads single-file and sharded (``*.safetensors.index.json``) checkpoints. A rank reads only its bytes:
contiguous shards (whole tensors, dim-0 splits) are read with ``preadv`` straight into the destination
(CPU) or into pinned staging buffers that several worker threads copy to the GPU on their own CUDA
streams while they read the next chunk; other shards (last-dim splits, dtype casts) are copied from
``safe_open`` slices over the file's mmap. File reads and tensor copies release the GIL.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import WeightCacheError
from ..key import dtype_name
from ..manifest import TensorMeta
from .tp_plan import ShardSpec, TPPlan, TPPlanError, resolve_plan

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100 << 20
DEFAULT_CHUNK_BYTES = 64 << 20  # per staging buffer, two per thread
DEFAULT_THREADS = 16
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


class CheckpointError(WeightCacheError, ValueError):
    """A missing, unreadable or malformed checkpoint file or tensor."""


def _torch_dtype(code: str, file: Path, name: str) -> torch.dtype:
    dt = getattr(torch, _ST_DTYPES.get(code, ""), None)
    if not isinstance(dt, torch.dtype):
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
    for name, info in header.items():
        try:
            code, shape, (b, e) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from err
        dtype = _torch_dtype(code, path, name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        expect = math.prod(shape) * itemsize
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
        return math.prod(self.out_shape) * torch.empty((), dtype=self.out_dtype).element_size()

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
class _Job:
    """One unit of work: a contiguous read, or a row block of a slice copy."""

    name: str
    nbytes: int  # bytes landing in the destination
    file: Path
    offset: int = 0  # contiguous: file offset
    dst_offset: int = 0  # contiguous: byte offset in the destination
    piece: int = -1  # slice copy: which packed part; rows [r0, r1) along dim 0 of that part
    r0: int = 0
    r1: int = 0


class SafetensorsSource:
    """A :class:`~weightcache.sources.Source` over a safetensors checkpoint for one TP rank.

    ``tp_plan``: None/"auto" (transformers' plan for the checkpoint's architecture), "none", a dict of
    pattern -> style (transformers' names; full or base-model-relative patterns), or a TPPlan.
    ``dtype`` casts floating-point tensors. ``io="mmap"`` copies every tensor from the mmap instead of
    reading contiguous shards with ``preadv``.
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
        io: str = "auto",
        name: str | None = None,
    ):
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
        if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        if threads is None:
            threads = min(DEFAULT_THREADS, os.cpu_count() or 1)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, got {chunk_bytes}")
        if io not in ("auto", "mmap"):
            raise ValueError(f"io must be 'auto' or 'mmap', got {io!r}")
        self.model_dir, entries = checkpoint_entries(model_dir)
        self.model_name = name or str(self.model_dir.resolve())
        self.dtype = dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device)
        self.threads = threads
        self.show_progress = progress
        self.chunk_bytes = chunk_bytes
        self.io = io
        self.plan = resolve_plan(self.model_dir, tp_plan) if tp_size > 1 or tp_plan is not None else TPPlan()
        # a plan other than transformers' own changes the bytes: it goes into the key
        self._custom_plan = tp_size > 1 and tp_plan is not None and not (isinstance(tp_plan, str) and tp_plan == "auto")
        self.tensors: dict[str, _Tensor] = {}
        for tname in sorted(entries, key=lambda n: (str(entries[n].file), entries[n].start)):
            e = entries[tname]
            spec = self.plan.spec(tname, e.shape) if tp_size > 1 else ShardSpec(None, None)
            spec.check(f"{e.file.name}: {tname}", e.shape, tp_size)
            out_dtype = dtype if (dtype is not None and e.dtype.is_floating_point) else e.dtype
            self.tensors[tname] = _Tensor(e, spec, spec.shard_shape(e.shape, tp_size), out_dtype)
        self._handles: dict[Path, object] = {}
        self._handles_lock = threading.Lock()

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

    def fill(self, views: Mapping[str, torch.Tensor], progress: Callable[[int], None] | None = None) -> None:
        self._check_views(views)
        cuda = any(views[n].device.type == "cuda" for n in self.tensors)
        jobs = self._jobs(views)
        total = sum(j.nbytes for j in jobs)
        meter = _Progress(total, f"{self.model_dir.name} tp{self.tp_rank}/{self.tp_size}", self.show_progress)
        lock = threading.Lock()

        def report(n: int) -> None:
            with lock:
                meter.update(n)
                if progress is not None:
                    progress(n)

        errors: list[BaseException] = []
        stop = threading.Event()
        queue = iter(jobs)
        qlock = threading.Lock()

        def next_job() -> _Job | None:
            if stop.is_set():
                return None
            with qlock:
                return next(queue, None)

        fds = self._open_files(jobs)

        def worker() -> None:
            try:
                if cuda:
                    self._cuda_worker(views, fds, next_job, report, stage_bytes)
                else:
                    self._cpu_worker(views, fds, next_job, report)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)
                stop.set()

        nthreads = max(1, min(self.threads, len(jobs)))
        stage_bytes = min(self.chunk_bytes, max((j.nbytes for j in jobs), default=1))  # small models: small buffers
        try:
            threads = [threading.Thread(target=worker, name=f"wc-fill-{i}", daemon=True) for i in range(nthreads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for fd in fds.values():
                os.close(fd)
            meter.close()
        if errors:
            raise errors[0]

    # -- planning --------------------------------------------------------------------------------

    def _check_views(self, views: Mapping[str, torch.Tensor]) -> None:
        for name, t in self.tensors.items():
            v = views.get(name)
            if v is None:
                raise CheckpointError(f"no destination view for tensor {name!r} (from {t.entry.file.name})")
            if tuple(v.shape) != t.out_shape or v.dtype != t.out_dtype:
                raise CheckpointError(
                    f"destination view for {name!r} is {v.dtype} {list(v.shape)}, expected "
                    f"{t.out_dtype} {list(t.out_shape)}"
                )
            if v.device.type != self.device.type or (
                self.device.index is not None and v.device.index != self.device.index
            ):
                raise CheckpointError(f"destination view for {name!r} is on {v.device}, source device is {self.device}")

    def _jobs(self, views: Mapping[str, torch.Tensor]) -> list[_Job]:
        jobs = []
        for name, t in self.tensors.items():
            ranges = None
            if self.io == "auto" and t.out_dtype == t.entry.dtype and views[name].is_contiguous():
                ranges = t.byte_ranges(self.tp_rank, self.tp_size)
            if ranges is not None:
                dst = 0
                for off, n in ranges:
                    for a in range(0, n, self.chunk_bytes):
                        m = min(self.chunk_bytes, n - a)
                        jobs.append(_Job(name, m, t.entry.file, offset=off + a, dst_offset=dst + a))
                    dst += n
                continue
            pieces = self._pieces(t)
            for p, shape in enumerate(pieces):
                rows = shape[0] if shape else 1
                row_bytes = (math.prod(shape[1:]) if shape else 1) * t.out_dtype.itemsize
                step = max(1, self.chunk_bytes // max(row_bytes, 1))
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    jobs.append(_Job(name, (r1 - r0) * row_bytes, t.entry.file, piece=p, r0=r0, r1=r1))
        return jobs

    def _pieces(self, t: _Tensor) -> list[tuple[int, ...]]:
        """Shapes of the parts (one per packed split) that make up this rank's shard."""
        if t.spec.replicated or self.tp_size == 1:
            return [t.out_shape]
        d = t.spec.dim
        shape = list(t.out_shape)
        shape[d] //= t.spec.split
        return [tuple(shape)] * t.spec.split

    def _open_files(self, jobs: list[_Job]) -> dict[Path, int]:
        fds = {}
        try:
            for f in {j.file for j in jobs}:
                fds[f] = os.open(f, os.O_RDONLY)
        except OSError as e:
            for fd in fds.values():
                os.close(fd)
            raise CheckpointError(f"cannot open checkpoint file: {e}") from e
        return fds

    # -- reading --------------------------------------------------------------------------------

    def _slice_source(self, name: str, piece: int, r0: int, r1: int) -> torch.Tensor:
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

    def _dst_rows(self, dst: torch.Tensor, job: _Job) -> torch.Tensor:
        t = self.tensors[job.name]
        if t.spec.split > 1 and not t.spec.replicated and self.tp_size > 1:
            d = t.spec.dim
            part = t.out_shape[d] // t.spec.split
            dst = dst.narrow(d, job.piece * part, part)
        if dst.dim() == 0:
            return dst
        return dst[job.r0 : job.r1]

    def _pread(self, fds: dict[Path, int], job: _Job, buf: memoryview) -> None:
        fd = fds[job.file]
        done = 0
        while done < job.nbytes:
            try:
                n = os.preadv(fd, [buf[done:]], job.offset + done)
            except OSError as e:
                raise CheckpointError(f"{job.file}: read of tensor {job.name!r} failed: {e}") from e
            if n == 0:
                raise CheckpointError(
                    f"{job.file}: unexpected end of file reading tensor {job.name!r} (truncated checkpoint?)"
                )
            done += n

    def _cpu_worker(self, views, fds, next_job, report) -> None:
        while (job := next_job()) is not None:
            dst = views[job.name]
            if job.piece < 0:
                raw = dst.reshape(-1).view(torch.uint8)[job.dst_offset : job.dst_offset + job.nbytes]
                self._pread(fds, job, memoryview(raw.numpy()).cast("B"))
            else:
                src = self._slice_source(job.name, job.piece, job.r0, job.r1)
                self._dst_rows(dst, job).copy_(src)
            report(job.nbytes)

    def _cuda_worker(self, views, fds, next_job, report, stage_bytes: int) -> None:
        device = next(v.device for v in views.values() if v.device.type == "cuda")
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device=device)
            bufs = [torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            events = [torch.cuda.Event() for _ in range(2)]
            pending = [0, 0]
            k = 0
            with torch.cuda.stream(stream):
                while (job := next_job()) is not None:
                    events[k].synchronize()  # the H2D that last used this buffer is done
                    if pending[k]:
                        report(pending[k])
                    buf = bufs[k] if job.nbytes <= stage_bytes else torch.empty(
                        job.nbytes, dtype=torch.uint8, pin_memory=True
                    )
                    dst = views[job.name]
                    if job.piece < 0:
                        self._pread(fds, job, memoryview(buf[: job.nbytes].numpy()).cast("B"))
                        flat = dst.reshape(-1).view(torch.uint8)
                        flat[job.dst_offset : job.dst_offset + job.nbytes].copy_(buf[: job.nbytes], non_blocking=True)
                    else:
                        src = self._slice_source(job.name, job.piece, job.r0, job.r1)
                        rows = self._dst_rows(dst, job)
                        stage = buf[: job.nbytes].view(rows.dtype).view(rows.shape)
                        stage.copy_(src)
                        rows.copy_(stage, non_blocking=True)
                    if buf is not bufs[k]:
                        stream.synchronize()  # one-off buffer: finish before it is freed
                        report(job.nbytes)
                        pending[k] = 0
                    else:
                        events[k].record(stream)
                        pending[k] = job.nbytes
                    k ^= 1
            stream.synchronize()
            for n in pending:
                if n:
                    report(n)


class _Progress:
    """A tqdm bar (bytes, rate, ETA) on a TTY, otherwise a log line every few seconds."""

    def __init__(self, total: int, label: str, enabled: bool, interval: float = 5.0):
        self.total, self.label, self.interval = total, label, interval
        self.done = 0
        self.t0 = self.last = time.monotonic()
        self.bar = None
        self.enabled = enabled and total > 0
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=label, dynamic_ncols=True
            )

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._log(now)

    def _log(self, now: float) -> None:
        dt = max(now - self.t0, 1e-9)
        rate = self.done / dt
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        log.info(
            "%s: %.2f / %.2f GB (%.0f%%), %.2f GB/s, ETA %.0fs",
            self.label, self.done / 1e9, self.total / 1e9, 100.0 * self.done / self.total, rate / 1e9, eta,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self._log(time.monotonic())


__all__ = ["SafetensorsSource", "CheckpointError", "TPPlanError", "checkpoint_entries", "read_header"]
