"""The native copy loop on the CPU: its "device copies" are host memcpys, everything else as on a GPU."""

from __future__ import annotations

import ctypes
import random
import threading

import pytest
import torch

from weightcache.reader import native_fill

lib, why = native_fill.library()
pytestmark = pytest.mark.skipif(lib is None, reason=f"native fill loop unavailable: {why}")


def plan(src: torch.Tensor, dst: torch.Tensor, seed: int, gaps: bool):
    """Random pieces over ``src`` in order (some larger than a window; with ``gaps``, runs of bytes between
    them that are read or skipped, not kept), landing in ``dst`` in a shuffled order."""
    rng = random.Random(seed)
    spans, off = [], 0
    while off < src.numel():
        n = min(rng.choice([1, 7, 100, 4096, 5000, 40_000, 200_000]), src.numel() - off)
        if not (gaps and rng.random() < 0.2):
            spans.append((off, n))
        off += n
    placed = list(range(len(spans)))
    rng.shuffle(placed)
    at, out = {}, 0
    for k in placed:
        at[k] = out
        out += spans[k][1]
    pieces = [(src.data_ptr() + a, dst.data_ptr() + at[k], n) for k, (a, n) in enumerate(spans)]
    want = torch.zeros_like(dst)
    for k, (a, n) in enumerate(spans):
        want[at[k] : at[k] + n] = src[a : a + n]
    return pieces, want, out


@pytest.mark.parametrize("threads,nwin,tile,window", [(1, 1, 4096, 1 << 16), (4, 2, 1000, 1 << 15),
                                                      (8, 3, 1 << 12, 1 << 16), (3, 5, 1 << 20, 1 << 14)])
@pytest.mark.parametrize("gaps", [False, True])
def test_native_loop_delivers_every_piece(threads, nwin, tile, window, gaps):
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    dst = torch.zeros(3 << 20, dtype=torch.uint8)
    windows = torch.empty(nwin * window, dtype=torch.uint8)
    pieces, want, total = plan(src, dst, seed=threads * 7 + nwin, gaps=gaps)
    got = []
    native_fill.run(pieces, windows.data_ptr(), window, nwin, threads, tile, got.append, cuda=False)
    assert torch.equal(dst, want)
    assert sum(got) == total
    assert native_fill.last_stats["loads"] >= -(-total // window)


def test_native_loop_packs_pieces_into_windows():
    w, page = 1 << 16, 4096
    buf = torch.randint(0, 256, (32 * w,), dtype=torch.uint8)
    dst = torch.zeros_like(buf)
    base = buf.data_ptr() + (-buf.data_ptr()) % w  # the loop cuts where the address is a multiple of w
    d = dst.data_ptr()
    pieces = [(base + k * 1024, d + k * 1024, 1024) for k in range(32)]  # one window, packed
    pieces.append((base + 32 * 1024 + 100, d + 40 * 1024, 50))  # starts within the next page: the same one
    pieces.append((base + 32 * 1024 + 3 * page, d + 41 * 1024, 50))  # past the next page: a new one
    pieces.append((base + w, d + w, 3 * w))  # three windows
    pieces.append((base + 5 * w, d + 5 * w, 50))  # a new one
    pieces.append((base + 5 * w + 50, d + 6 * w, 50, 1))  # adjacent, in another file: a new one
    windows = torch.empty(2 * w, dtype=torch.uint8)
    got = []
    native_fill.run(pieces, windows.data_ptr(), w, 2, 3, page, got.append, cuda=False)
    assert native_fill.last_stats["loads"] == 1 + 1 + 3 + 1 + 1
    assert sum(got) == 32 * 1024 + 3 * w + 4 * 50
    for s, t, n, *_ in pieces:
        a, b = s - buf.data_ptr(), t - d
        assert torch.equal(dst[b : b + n], buf[a : a + n]), (a, n)


@pytest.mark.parametrize("bad", [dict(nwin=0), dict(threads=0), dict(tile=0), dict(window_bytes=0)])
def test_native_loop_refuses_bad_sizes(bad):
    buf = torch.zeros(1 << 12, dtype=torch.uint8)
    kw = dict(window_bytes=1 << 12, nwin=1, threads=1, tile=1 << 12) | bad
    with pytest.raises(ValueError, match="must be a positive int"):
        native_fill.run([], buf.data_ptr(), kw["window_bytes"], kw["nwin"], kw["threads"], kw["tile"], lambda n: None,
                        cuda=False)


def test_native_loop_without_a_driver_says_so():
    if native_fill.library()[0].wc_fill_open_driver() == 0:
        pytest.skip("this machine has a CUDA driver")
    buf = torch.zeros(1 << 12, dtype=torch.uint8)
    with pytest.raises(native_fill.NativeFillError) as e:
        native_fill.run([(buf.data_ptr(), buf.data_ptr(), 1 << 12)], buf.data_ptr(), 1 << 12, 1, 1, 1 << 12,
                        lambda n: None, cuda=True)
    assert e.value.code == -3


def test_library_built_once_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv(native_fill.CACHE_ENV, str(tmp_path))
    native_fill.library.cache_clear()
    try:
        got, why = native_fill.library()
        assert got is not None, why
        assert [p.name for p in tmp_path.iterdir()] == [native_fill.built_name()]
        monkeypatch.setenv("CC", "/nonexistent/cc")  # built already: no compiler needed
        native_fill.library.cache_clear()
        assert native_fill.library()[0] is not None
        monkeypatch.setenv(native_fill.CACHE_ENV, str(tmp_path / "fresh"))
        native_fill.library.cache_clear()
        none, why = native_fill.library()
        assert none is None and "nonexistent" in why
    finally:
        native_fill.library.cache_clear()



def test_native_loop_finishes_before_a_failing_report_returns():
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    windows = torch.empty(2 << 16, dtype=torch.uint8)
    pieces = [(src.data_ptr() + a, dst.data_ptr() + a, 1 << 16) for a in range(0, 1 << 20, 1 << 16)]

    def report(n):
        raise RuntimeError("progress sink gone")

    with pytest.raises(RuntimeError, match="progress sink gone"):
        native_fill.run(pieces, windows.data_ptr(), 1 << 16, 2, 4, 4096, report, cuda=False)
    assert not any(t.name == "wc-fill-native" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_windows_are_aligned_writable_and_freed_once(threads):
    w = native_fill.Windows(6 << 20, lock=False, threads=threads)
    assert w.base % (2 << 20) == 0 and set(w.seconds) == {"map", "fault", "lock"}
    area = (ctypes.c_ubyte * w.nbytes).from_address(w.base)
    assert bytes(area[:4096]) == bytes(4096)  # faulted in, zeroed
    ctypes.memset(w.base, 7, w.nbytes)
    assert area[0] == area[w.nbytes - 1] == 7
    del area
    w.close()
    w.close()  # a second close is a no-op


@pytest.mark.parametrize("nbytes", [16 << 10, (6 << 20) + (12 << 10)])
@pytest.mark.parametrize("threads", [0, 1, 3, 100])
def test_windows_are_faulted_in_before_use(nbytes, threads):
    from weightcache.reader.filemap import PAGE, _libc

    w = native_fill.Windows(nbytes, lock=False, threads=threads)
    try:
        pages = -(-nbytes // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        assert _libc.mincore(ctypes.c_void_p(w.base), nbytes, vec) == 0
        assert all(v & 1 for v in vec)  # every page resident: the fill does not fault them in
    finally:
        w.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_windows_refuse_a_bad_size(bad):
    with pytest.raises(ValueError, match="windows of"):
        native_fill.Windows(bad, lock=False)


def test_native_loop_reports_its_timeline():
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    windows = torch.empty(2 << 16, dtype=torch.uint8)
    pieces, want, total = plan(src, dst, seed=3, gaps=False)
    native_fill.run(pieces, windows.data_ptr(), 1 << 16, 2, 3, 1 << 12, lambda n: None, cuda=False)
    assert torch.equal(dst, want)
    st = native_fill.last_stats
    assert set(st) == set(native_fill.STATS) and st["loads"] >= 4 << 20 >> 16
    assert 0 < st["first_queued"] <= st["last_queued"] <= st["joined"] <= st["synced"]
    assert st["copying"] > 0


@pytest.mark.parametrize("flag", ["SKIP_HOST_COPY", "SKIP_DEVICE_COPY"])
def test_native_loop_can_leave_one_side_out(flag):
    src = torch.randint(1, 256, (1 << 20,), dtype=torch.uint8)  # no zero byte
    dst = torch.zeros_like(src)
    windows = torch.zeros(2 << 16, dtype=torch.uint8)
    pieces, _, total = plan(src, dst, seed=5, gaps=False)
    got = []
    native_fill.run(pieces, windows.data_ptr(), 1 << 16, 2, 2, 1 << 12, got.append, cuda=False,
                    flags=getattr(native_fill, flag))
    assert sum(got) == total  # every window still comes free and is counted
    if flag == "SKIP_DEVICE_COPY":
        assert not dst.any() and windows.any()  # read from the file, never delivered
    else:
        assert not dst.any() and not windows.any()  # delivered windows that nothing was read into
