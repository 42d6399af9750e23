"""How checkpoint bytes are planned and read: segments, preadv batches, and the CUDA fill's modes (staged,
register, direct, auto, huge-page staging) run against a stand-in for the CUDA driver that copies on the
CPU and checks every registration (page-aligned, disjoint, unregistered at the end)."""

import contextlib
import ctypes
import dataclasses
import json
import logging
import mmap
import os
import random
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from weightcache.dtypes import parse_dtype
from weightcache.reader import cuda_fill, native_fill
from weightcache.reader.filemap import FileMap, drop_from_page_cache, resident_fraction, wait_unmapped
from weightcache.reader.read_plan import PAGE, Piece, order_segments, plan_segments
from weightcache.reader.reading import CheckpointError, read_into
from weightcache.sources.safetensors import SafetensorsSource

# -- planning ---------------------------------------------------------------------------------------------


def random_pieces(rng, files=2, n=40):
    out = []
    for f in range(files):
        off = rng.randrange(0, 3 * PAGE)
        for i in range(n):
            off += rng.choice([0, 0, 0, 7, PAGE - 1, PAGE, 2 * PAGE + 5, 50_000])  # adjacent, small and big gaps
            size = rng.choice([2, 100, PAGE, 3 * PAGE + 11, 40_000, 200_000])
            out.append(Piece(Path(f"f{f}"), off, size, f"t{f}.{i}", rng.randrange(0, 1000)))
            off += size
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("segment_bytes", [PAGE, 4 * PAGE, 64 * PAGE])
def test_segments_cover_pieces_once_with_disjoint_pages(seed, segment_bytes):
    pieces = random_pieces(random.Random(seed))
    segs = plan_segments(pieces, segment_bytes)
    # every byte of every piece lands exactly once, at the right destination offset
    got = {}
    for s in segs:
        assert s.pieces and s.start == s.pieces[0].offset and s.end == max(p.offset + p.nbytes for p in s.pieces)
        for p in s.pieces:
            assert p.file == s.file
            for k in (0, p.nbytes - 1):
                key = (p.name, p.dst_offset + k)
                assert key not in got
                got[key] = p.offset + k
    for p in pieces:
        assert got[(p.name, p.dst_offset)] == p.offset
        assert got[(p.name, p.dst_offset + p.nbytes - 1)] == p.offset + p.nbytes - 1
    assert sum(s.nbytes for s in segs) == sum(p.nbytes for p in pieces)
    # page-rounded ranges: within one cut of segment_bytes, and disjoint within a file
    for f in {s.file for s in segs}:
        ranges = sorted(s.page_range() for s in segs if s.file == f)
        for a, b in ranges:
            assert b - a <= segment_bytes and a // segment_bytes == (b - 1) // segment_bytes
        for (_, b), (c, _) in zip(ranges, ranges[1:], strict=False):
            assert b <= c


def test_segments_join_adjacent_and_split_far_pieces():
    f = Path("x")
    pieces = [Piece(f, 100, 50, "a", 0), Piece(f, 150, 10, "b", 0), Piece(f, 3 * PAGE, 8, "c", 0)]
    segs = plan_segments(pieces, 16 * PAGE)
    assert [[p.name for p in s.pieces] for s in segs] == [["a", "b"], ["c"]]
    one = plan_segments([Piece(f, PAGE - 10, 3 * PAGE, "big", 5)], 2 * PAGE)
    assert [(p.offset, p.nbytes, p.dst_offset) for s in one for p in s.pieces] == [
        (PAGE - 10, PAGE + 10, 5), (2 * PAGE, 2 * PAGE - 10, PAGE + 15)]
    with pytest.raises(ValueError, match="multiple of 4096"):
        plan_segments(pieces, 5000)


def test_interleave_round_robins_files():
    segs = plan_segments([Piece(Path(f), i * 8 * PAGE, PAGE, f"{f}{i}", 0) for f in "ab" for i in range(3)], PAGE)
    assert [s.pieces[0].name for s in order_segments(segs, "interleave")] == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert [s.pieces[0].name for s in order_segments(segs, "file")] == ["a0", "a1", "a2", "b0", "b1", "b2"]
    with pytest.raises(ValueError, match="order must be"):
        order_segments(segs, "random")


def test_read_into_batches_gaps_overlaps_and_eof(tmp_path):
    data = os.urandom(8 << 20)
    f = tmp_path / "blob"
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    try:
        junk = memoryview(bytearray(2 * PAGE))
        rng = random.Random(1)
        wants, iovs, off = [], [], 0
        for _ in range(1500):  # more buffers than one preadv takes
            off += rng.choice([0, 0, 5, PAGE + 3, 3 * PAGE, -3])  # gaps, a gap past the junk, overlaps
            off = max(off, 0)
            n = rng.randrange(1, 700)
            buf = bytearray(n)
            iovs.append((off, memoryview(buf)))
            wants.append((buf, data[off : off + n]))
            off += n
        read_into(fd, iovs, junk, f, "t")
        assert all(bytes(b) == w for b, w in wants)
        with pytest.raises(CheckpointError, match="unexpected end of file reading tensor 't'"):
            read_into(fd, [(len(data) - 10, memoryview(bytearray(20)))], junk, f, "t")
    finally:
        os.close(fd)


def test_filemap_residency_and_drop(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(64 * PAGE))
    with FileMap(f) as m:
        assert m.size == 64 * PAGE and m.addr % PAGE == 0
        assert bytes((ctypes.c_char * 16).from_address(m.addr)) == f.read_bytes()[:16]
    assert resident_fraction(f) == 1.0  # just written
    drop_from_page_cache(f)
    assert 0.0 <= resident_fraction(f) <= 1.0  # some file systems keep the pages (tmpfs): only sane bounds here
    with pytest.raises(OSError):
        FileMap(tmp_path / "missing")


# -- a small checkpoint in two files ---------------------------------------------------------------------

PLAN = {"layers.*.col": "colwise", "layers.*.row": "rowwise"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("fillpaths")
    g = torch.Generator().manual_seed(0)
    files = {"a.safetensors": {}, "b.safetensors": {}}
    for i in range(6):
        part = files["a.safetensors" if i < 3 else "b.safetensors"]
        part[f"model.layers.{i}.col.weight"] = torch.randn(64, 48, generator=g)  # 12 KiB, dim-0 split: pieces
        part[f"model.layers.{i}.row.weight"] = torch.randn(24, 32, generator=g)  # last-dim split: slices
        part[f"model.layers.{i}.norm.weight"] = torch.randn(7, generator=g)  # tiny, unaligned
    files["b.safetensors"]["model.embed.weight"] = torch.randn(300, 64, generator=g)  # 75 KiB > a chunk
    files["b.safetensors"]["model.steps"] = torch.arange(5, dtype=torch.int64)
    weight_map = {}
    for fname, tensors in files.items():
        save_file(tensors, str(d / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def views_for(src):
    return {m.name: torch.empty(m.shape, dtype=parse_dtype(m.dtype)) for m in src.describe()}


def reference(ckpt, tp_rank, tp_size, dtype):
    src = SafetensorsSource(ckpt, tp_rank=tp_rank, tp_size=tp_size, tp_plan=PLAN, dtype=dtype, io="mmap",
                            progress=False)
    v = views_for(src)
    src.fill(v)
    return v


@pytest.mark.parametrize("order", ["file", "interleave"])
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_fill_segments_match_slices(ckpt, order, threads):
    for r in range(2):
        want = reference(ckpt, r, 2, None)
        src = SafetensorsSource(ckpt, tp_rank=r, tp_size=2, tp_plan=PLAN, chunk_bytes=2 * PAGE, order=order,
                                threads=threads, progress=False)
        v = views_for(src)
        got = []
        src.fill(v, got.append)
        assert sum(got) == src.nbytes
        assert all(torch.equal(v[n], want[n]) for n in want)


def arena_views(src):
    from weightcache.arena.host import HostBlock
    from weightcache.manifest import plan_for_metas
    from weightcache.packing import build_views

    manifest = plan_for_metas(src.describe())
    blocks = [HostBlock(b.nbytes) for b in manifest.blocks]
    return blocks, build_views(manifest, [b.tensor for b in blocks])


@pytest.mark.parametrize("refuse", [False, True])
def test_cpu_fill_into_memfd_arena_sends_file_pages(ckpt, monkeypatch, refuse):
    import errno

    calls = []
    real = os.sendfile

    def sendfile(*a):
        calls.append(a)
        if refuse:
            raise OSError(errno.EINVAL, "refused")
        return real(*a)

    monkeypatch.setattr(os, "sendfile", sendfile)
    src = SafetensorsSource(ckpt, tp_rank=1, tp_size=2, tp_plan=PLAN, chunk_bytes=2 * PAGE, progress=False)
    blocks, views = arena_views(src)
    src.fill(views)
    want = reference(ckpt, 1, 2, None)
    assert all(torch.equal(views[n], want[n]) for n in want)
    contiguous = sum(p.nbytes for p in src.plan_reads(views)[0])  # slices (last-dim splits) are copied
    if refuse:  # each fill thread may meet the refusal once before the source stops trying
        assert 1 <= len(calls) <= max(1, src.read.threads)
    else:
        assert sum(a[3] for a in calls) == contiguous
    assert src._sendfile_ok is not refuse
    for b in blocks:
        b.close()


def test_cpu_fill_into_arena_truncated(ckpt, tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    src = SafetensorsSource(d, progress=False)
    blocks, views = arena_views(src)
    os.truncate(d / "b.safetensors", 3 * PAGE)
    with pytest.raises(CheckpointError, match="b.safetensors: unexpected end of file"):
        src.fill(views)
    for b in blocks:
        b.close()


def test_io_from_environment(ckpt, monkeypatch):
    monkeypatch.setenv("WEIGHTCACHE_LOAD_IO", "mmap")
    assert SafetensorsSource(ckpt, progress=False).read.io == "mmap"
    assert SafetensorsSource(ckpt, io="staged", progress=False).read.io == "staged"
    with pytest.raises(ValueError, match="stage_read must be one of"):
        SafetensorsSource(ckpt, stage_read="mmap", progress=False)
    with pytest.raises(ValueError, match="windows must be a positive int"):
        SafetensorsSource(ckpt, windows=0, progress=False)
    with pytest.raises(ValueError, match="window_bytes must be a positive multiple"):
        SafetensorsSource(ckpt, window_bytes=1000, progress=False)
    monkeypatch.setenv("WEIGHTCACHE_LOAD_IO", "fast")
    with pytest.raises(ValueError, match="io must be one of"):
        SafetensorsSource(ckpt, progress=False)


@pytest.mark.parametrize("prefer", [True, False])
@pytest.mark.parametrize("case", ["warm", "cold", "disk", "tp2", "absent", "cpu", "staged"])
def test_auto_reads_with_instanttensor_only_where_it_wins(ckpt, monkeypatch, case, prefer):
    """auto into CUDA memory, where InstantTensor is preferred: it reads for one rank with every file on
    tmpfs, the plain path otherwise (on a disk's page cache InstantTensor reads with O_DIRECT). Where it is
    not preferred (measured slower than the pipeline), the plain path always."""
    from weightcache.reader import filemap
    from weightcache.reader import instanttensor as it_reader
    from weightcache.sources import safetensors as st

    monkeypatch.setattr(st, "AUTO_INSTANTTENSOR", prefer)
    monkeypatch.setattr(it_reader, "available", lambda: case != "absent")
    monkeypatch.setattr(filemap, "in_memory_fs", lambda path: case != "disk")
    if case == "cold":
        monkeypatch.setattr(filemap, "resident_fraction", lambda path, samples=256: 0.0)
    tp = dict(tp_rank=0, tp_size=2, tp_plan=PLAN) if case == "tp2" else {}
    src = SafetensorsSource(ckpt, io="staged" if case == "staged" else "auto", progress=False, **tp)
    want = {"warm": "instanttensor" if prefer else "cuda", "cpu": "cpu"}.get(case, "cuda")
    assert src.reader(cuda=case != "cpu") == want


def test_auto_without_instanttensor_when_a_tensor_is_in_two_files(ckpt, monkeypatch):
    from weightcache.reader import instanttensor as it_reader
    from weightcache.sources import safetensors as st

    monkeypatch.setattr(st, "AUTO_INSTANTTENSOR", True)
    monkeypatch.setattr(it_reader, "available", lambda: True)
    src = SafetensorsSource(ckpt, progress=False)
    monkeypatch.setattr(src, "files_without_duplicates", lambda: (_ for _ in ()).throw(CheckpointError("dup")))
    assert src.reader(cuda=True) == "cuda"


@pytest.mark.parametrize("chosen_by_auto", [True, False])
def test_instanttensor_failure_falls_back_only_under_auto(ckpt, monkeypatch, caplog, chosen_by_auto):
    from weightcache.reader import instanttensor as it_reader

    def half_then_fail(src, views, report):
        report(src.nbytes // 2)
        raise CheckpointError("InstantTensor failed to read: out of memory for its ring buffer")

    monkeypatch.setattr(it_reader, "fill_with_instanttensor", half_then_fail)
    src = SafetensorsSource(ckpt, progress=False)
    got, plain = [], []

    def fallback(report):  # the plain path: every byte again
        plain.append(True)
        for _ in range(4):
            report(src.nbytes // 4)
        report(src.nbytes % 4)

    if not chosen_by_auto:
        with pytest.raises(CheckpointError, match="ring buffer"):
            src.read_with_instanttensor({}, got.append)
        return
    with caplog.at_level(logging.WARNING):
        src.read_with_instanttensor({}, got.append, fallback=fallback)
    assert plain == [True] and sum(got) == src.nbytes  # progress counts each byte once
    assert any("reading with weightcache's own path" in r.getMessage() for r in caplog.records)


def test_instanttensor_needs_cuda_views(ckpt):
    src = SafetensorsSource(ckpt, io="instanttensor", progress=False)
    with pytest.raises(CheckpointError, match="CUDA memory only"):
        src.fill(views_for(src))


# -- the CUDA fill against a stand-in driver ------------------------------------------------------------


class FakeDriver:
    """cuMemHostRegister / cuMemcpyHtoDAsync on the CPU, checking what the real driver would refuse. Copies
    run only when an event recorded after them (or a stream) is synchronized, as late as a real GPU may run
    them: a staging buffer reused or a range unregistered before its copies are done shows as wrong bytes or a
    failed check."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED = 99

    CUstream = staticmethod(lambda handle: handle)
    CUdeviceptr = staticmethod(int)

    def __init__(self, refuse_read_only=False):
        self.refuse = refuse_read_only
        self.live: dict[int, int] = {}
        self.pinned: dict[int, int] = {}  # torch's pinned memory (the stand-in's page-aligned buffers)
        self.lock = threading.Lock()
        self.registrations = self.copies = 0
        self.seq = 0
        self.pending: list[tuple[int, int, int, int]] = []  # (seq, dst, src, n)

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_NOT_SUPPORTED"

    def cuDeviceGet(self, index):
        return 0, index

    def cuDeviceGetAttribute(self, attr, dev):
        return 0, 1

    def cuMemHostRegister(self, ptr, n, flags):
        if self.refuse and flags & 0x08:
            return (801,)
        with self.lock:
            assert ptr % PAGE == 0 and n % PAGE == 0 and n > 0
            assert all(ptr + n <= p or p + m <= ptr for p, m in self.live.items()), "overlapping registration"
            self.live[ptr] = n
            self.registrations += 1
        return (0,)

    def cuMemHostUnregister(self, ptr):
        with self.lock:
            assert not any(self._covers(self.live[ptr], ptr, src, n) for _, _, src, n in self.pending), \
                "unregistered with copies from it pending"
            del self.live[ptr]
        return (0,)

    @staticmethod
    def _covers(size, ptr, src, n):
        return ptr <= src and src + n <= ptr + size

    def _page_locked(self, src, n):
        return any(self._covers(m, p, src, n) for ranges in (self.live, self.pinned) for p, m in ranges.items())

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        with self.lock:
            assert self._page_locked(src, n), "copy from memory that is not page-locked"
            self.copies += 1
            self.seq += 1
            self.pending.append((self.seq, dst, src, n))
        return (0,)

    def mark(self) -> int:
        with self.lock:
            return self.seq

    def flush(self, upto: int | None = None) -> None:
        with self.lock:
            due = [c for c in self.pending if upto is None or c[0] <= upto]
            self.pending = [c for c in self.pending if not (upto is None or c[0] <= upto)]
            for _, dst, src, n in due:
                assert self._page_locked(src, n), "copy ran after its memory was released"
                ctypes.memmove(dst, src, n)


def page_aligned(n):
    return torch.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=torch.uint8)


@pytest.fixture
def fake_cuda(monkeypatch):
    drv = FakeDriver()

    class FakeStream:
        cuda_stream = 0

        def __init__(self, device=None):
            pass

        def synchronize(self):
            drv.flush()

    class FakeEvent:
        seq = 0

        def record(self, stream=None):
            self.seq = drv.mark()

        def synchronize(self):
            drv.flush(self.seq)

    def pinned(n):
        t = page_aligned(n)
        with drv.lock:
            drv.pinned[t.data_ptr()] = max(n, 1)
        return t

    monkeypatch.setattr(cuda_fill.staging, "driver", lambda: (drv, SimpleNamespace(device_context=lambda i: contextlib.nullcontext())))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda_fill.CudaFill, "_pinned", staticmethod(pinned))
    monkeypatch.setattr(native_fill, "USE_DRIVER", False)  # the native loop's copies: host memcpys
    yield drv
    wait_unmapped()
    assert drv.pending == [], "copies left that nothing waited for"
    assert drv.live == {}, "page-locked memory left registered"


def cuda_fill_of(src, views, report):
    """The CUDA fill a source's fill would run: its read plan, its settings, the windows it prepared."""
    return cuda_fill.CudaFill(src.read_plan(views), src.read, views, report, device=torch.device("cuda", 0),
                              prepared=src.take_prepared())


def cuda_fill_run(ckpt, r, dtype=None, **kw):
    kw.setdefault("hugepages", False)  # registrations counted below are the file's own
    src = SafetensorsSource(ckpt, tp_rank=r, tp_size=2, tp_plan=PLAN, dtype=dtype, progress=False, **kw)
    views = views_for(src)
    got = []
    fill = cuda_fill_of(src, views, got.append)
    fill.run()
    wait_unmapped()  # staging areas are released on a thread of their own
    assert sum(got) == src.nbytes
    want = reference(ckpt, r, 2, dtype)
    assert all(torch.equal(views[n], want[n]) for n in want)
    return fill


@pytest.mark.parametrize("io", ["staged", "register", "direct", "auto"])
@pytest.mark.parametrize("kw", [dict(threads=1), dict(threads=3, depth=3, streams=2, order="interleave"),
                                dict(stage_read="memcpy", threads=2), dict(stage_read="preadv", threads=2),
                                dict(stage_read="pipeline", windows=1, window_bytes=PAGE),
                                dict(stage_read="pipeline", windows=2, window_bytes=3 * PAGE),
                                dict(stage_read="native", threads=3, windows=2, window_bytes=3 * PAGE, tile_bytes=PAGE),
                                dict(stage_read="native", threads=1, windows=1, window_bytes=2 * PAGE,
                                     tile_bytes=4 * PAGE)])
def test_cuda_fill_modes(ckpt, fake_cuda, io, kw):
    for r in range(2):
        fill = cuda_fill_run(ckpt, r, io=io, chunk_bytes=2 * PAGE, register_bytes=4 * PAGE, **kw)
        modes = set(fill.modes.values())
        assert modes == {cuda_fill.WARM_IO if io == "auto" else io} or (io == "direct" and modes == {"staged"})
        piped = {f for f in fill.modes if fill._pipelined(f)}
        assert bool(piped) == (fill.settings.stage_read in ("pipeline", "native") and "staged" in modes)
    assert fake_cuda.live == {}  # every registration released
    assert (fake_cuda.registrations > 0) == (io == "register" or (io == "auto" and cuda_fill.WARM_IO == "register"))


def test_cuda_fill_auto_copies_tmpfs_files_through_staging(ckpt, fake_cuda, monkeypatch):
    monkeypatch.setattr(cuda_fill, "in_memory_fs", lambda path: True)
    fill = cuda_fill_run(ckpt, 0, io="auto", threads=2, chunk_bytes=2 * PAGE)
    assert set(fill.modes.values()) == {"staged"} and fake_cuda.registrations == 0


def test_cuda_fill_dtype_cast_and_cold_auto(ckpt, fake_cuda, monkeypatch):
    monkeypatch.setattr(FileMap, "resident_fraction", lambda self, samples=256: 0.0)
    fill = cuda_fill_run(ckpt, 1, dtype=torch.bfloat16, io="auto", chunk_bytes=2 * PAGE)
    assert set(fill.modes.values()) <= {"direct", "staged"}
    assert fake_cuda.registrations == 0


def test_cuda_fill_register_refused_falls_back(ckpt, fake_cuda, caplog):
    fake_cuda.refuse = True
    with caplog.at_level(logging.WARNING, logger="weightcache.reader.cuda_fill"):
        fill = cuda_fill_run(ckpt, 0, io="register", threads=2, chunk_bytes=2 * PAGE, register_bytes=8 * PAGE)
    assert set(fill.modes.values()) == {"staged"} and fake_cuda.registrations == 0
    assert any("cannot register" in r.getMessage() and "CUDA_ERROR_NOT_SUPPORTED" in r.getMessage()
               for r in caplog.records)


def test_cuda_fill_native_unavailable_copies_with_torch(ckpt, fake_cuda, monkeypatch, caplog):
    monkeypatch.setattr(native_fill, "library", lambda: (None, "no C compiler"))
    cuda_fill.staging.native_unavailable.cache_clear()  # said once per process
    with caplog.at_level(logging.WARNING, logger="weightcache.reader.cuda_fill"):
        fill = cuda_fill_run(ckpt, 0, io="staged", stage_read="native", window_bytes=2 * PAGE)
    assert set(fill.modes.values()) == {"staged"}
    assert any("native fill loop cannot be built (no C compiler)" in r.getMessage() for r in caplog.records)


def test_cuda_fill_unexpected_bindings_error_falls_back(ckpt, fake_cuda, monkeypatch):
    def broken(*a):
        raise TypeError("argument 'hStream' has an unexpected type")

    monkeypatch.setattr(fake_cuda, "cuMemcpyHtoDAsync", broken)
    fill = cuda_fill_run(ckpt, 1, io="register", threads=2, chunk_bytes=2 * PAGE, register_bytes=8 * PAGE)
    assert set(fill.modes.values()) == {"staged"} and fake_cuda.live == {}


@pytest.mark.parametrize("stage_read", ["pipeline", "native", "memcpy"])
def test_cuda_fill_huge_page_staging(ckpt, fake_cuda, stage_read):
    cuda_fill_run(ckpt, 0, io="staged", hugepages=True, threads=2, chunk_bytes=2 * PAGE, stage_read=stage_read,
                  window_bytes=2 * PAGE)
    assert fake_cuda.registrations > 0 and fake_cuda.live == {}  # staging buffers registered, then released


@pytest.mark.parametrize("stage_read", ["pipeline", "native", "memcpy", "preadv"])
def test_cuda_fill_truncated_file_releases_everything(ckpt, fake_cuda, tmp_path, stage_read):
    d = tmp_path / "t"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    src = SafetensorsSource(d, tp_rank=0, tp_size=2, tp_plan=PLAN, io="staged", chunk_bytes=2 * PAGE,
                            window_bytes=2 * PAGE, stage_read=stage_read, progress=False)
    views = views_for(src)
    os.truncate(d / "b.safetensors", 3 * PAGE)
    with pytest.raises(CheckpointError, match="b.safetensors"):
        cuda_fill_of(src, views, lambda n: None).run()
    assert fake_cuda.live == {}


def _count_windows(monkeypatch):
    made, closed = [], []
    real = native_fill.Windows

    class Counted(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self.base)

        def close(self):
            if self._map:
                closed.append(self.base)
            super().close()

    monkeypatch.setattr(native_fill, "Windows", Counted)
    return made, closed


def _native_source(ckpt, **kw):
    return SafetensorsSource(ckpt, tp_rank=0, tp_size=2, tp_plan=PLAN, io="staged", stage_read="native",
                             window_bytes=2 * PAGE, windows=2, device="cuda:0", progress=False, **kw)


def test_prepared_windows_are_the_ones_the_fill_uses(ckpt, fake_cuda, monkeypatch):
    made, closed = _count_windows(monkeypatch)
    seen = []
    real_run = native_fill.run
    monkeypatch.setattr(native_fill, "run", lambda plan, base, *a, **k: (seen.append(base),
                                                                                     real_run(plan, base, *a, **k)))
    src = _native_source(ckpt)
    src.prepare()
    views = views_for(src)
    cuda_fill_of(src, views, lambda n: None).run()
    wait_unmapped()
    assert len(made) == 1 and seen == made and closed == made  # made once, before the fill; freed after
    want = reference(ckpt, 0, 2, None)
    assert all(torch.equal(views[n], want[n]) for n in want)


@pytest.mark.parametrize("change", ["windows", "stage_read"])
def test_windows_prepared_for_another_loop_are_freed(ckpt, fake_cuda, monkeypatch, change):
    made, closed = _count_windows(monkeypatch)
    src = _native_source(ckpt)
    src.prepare()
    if change == "windows":
        src.read = dataclasses.replace(src.read, windows=3)  # the fill makes its own
    else:
        src.read = dataclasses.replace(src.read, stage_read="pipeline")  # no native loop reads
    views = views_for(src)
    cuda_fill_of(src, views, lambda n: None).run()
    wait_unmapped()
    assert len(made) == (2 if change == "windows" else 1) and sorted(closed) == sorted(made)
    assert src.take_prepared() is None


def test_windows_prepared_and_not_filled_are_freed(ckpt, fake_cuda, monkeypatch):
    made, closed = _count_windows(monkeypatch)
    src = _native_source(ckpt)
    src.prepare()
    src.prepare()  # once is enough
    src.release()
    wait_unmapped()
    assert len(made) == 1 and closed == made
    src.prepare()
    with pytest.raises(CheckpointError, match="no destination view"):
        src.fill({})  # a fill that fails before it reads frees them too
    wait_unmapped()
    assert len(made) == 2 and sorted(closed) == sorted(made)


def test_prepare_fill_makes_nothing_for_cpu_sources_or_other_readers(ckpt, fake_cuda, monkeypatch):
    made, _ = _count_windows(monkeypatch)
    SafetensorsSource(ckpt, io="staged", stage_read="native", progress=False).prepare()  # a CPU source
    for kw in (dict(stage_read="pipeline"), dict(stage_read="preadv")):
        s = SafetensorsSource(ckpt, io="staged", device="cuda:0", progress=False, **kw)
        s.prepare()
        assert s.take_prepared() is None
    s = SafetensorsSource(ckpt, io="direct", stage_read="native", device="cuda:0", progress=False)
    s.prepare()
    assert s.take_prepared() is None and made == []


@pytest.mark.parametrize("prepared", [False, True])
def test_windows_that_cannot_be_made_are_one_clear_error(ckpt, fake_cuda, monkeypatch, prepared):
    def refuse(*a, **k):
        raise native_fill.NativeFillError(-1, -1)

    monkeypatch.setattr(native_fill, "Windows", refuse)
    src = _native_source(ckpt)
    if prepared:
        src.prepare()
    views = views_for(src)
    with pytest.raises(CheckpointError, match=r"cannot make the fill's 16 KiB of page-locked staging windows: "
                                              r"out of memory"):
        cuda_fill_of(src, views, lambda n: None).run()
    assert src.take_prepared() is None


def test_native_threads_leave_cores_unless_given(tmp_path, monkeypatch):
    from weightcache.sources.safetensors import SafetensorsSource
    from weightcache.testing.checkpoints import make_llama_checkpoint

    ckpt = make_llama_checkpoint(tmp_path / "m", num_layers=1, hidden_size=64, intermediate_size=128, num_heads=4,
                                 num_kv_heads=2, vocab_size=512)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert SafetensorsSource(ckpt, progress=False).read.native_threads == 12
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert SafetensorsSource(ckpt, progress=False).read.native_threads == 1
    assert SafetensorsSource(ckpt, threads=3, progress=False).read.native_threads == 3
