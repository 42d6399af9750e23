"""How the reader reads, in one place: the I/O mode, the workers and the staging windows. Measured choices
and the runs behind them are in docs/benchmarks.md ("Load: checkpoint to GPU")."""

from __future__ import annotations

import dataclasses
import os

from .read_plan import PAGE

IO_MODES = ("auto", "staged", "register", "direct", "mmap", "instanttensor")
IO_ENV = "WEIGHTCACHE_LOAD_IO"  # the default io mode where none is given (e.g. in preload's daemons)
STAGE_READS = ("native", "pipeline", "memcpy", "preadv")
ORDERS = ("file", "interleave")
MAX_NATIVE_THREADS = 12  # the native loop's workers at most, with 4 cores left to the driver and the rest
MAX_THREADS = 16
READER_ENV = "WEIGHTCACHE_READER"  # who reads for an engine's own loader: "weightcache" (default) or "engine"
READERS = ("weightcache", "engine")


def reader_choice(choice: str | None = None) -> str:
    """Who reads the checkpoint for an engine's own loader: weightcache's reader or the engine itself."""
    choice = choice or os.environ.get(READER_ENV) or "weightcache"
    if choice not in READERS:
        raise ValueError(f"reader must be one of {', '.join(READERS)}, got {choice!r} (${READER_ENV})")
    return choice


@dataclasses.dataclass(frozen=True)
class ReadSettings:
    """How bytes reach the destination.

    ``io``: ``auto`` (into CPU memory ``sendfile``/``preadv``; into CUDA memory ``staged`` for a file in the
    page cache or on tmpfs, ``direct`` for one that is not), ``register`` (CUDA: page-lock the page-cache
    pages of each ``register_bytes`` range and copy from them; ``staged`` where the driver refuses),
    ``staged`` (CUDA: a CPU copy into page-locked staging memory, then a device copy), ``direct`` (as staged,
    with O_DIRECT reads: cold files), ``mmap`` (every tensor from safetensors' mmap slices) or
    ``instanttensor`` (CUDA, optional extra).

    ``stage_read`` (staged): ``native`` (``native_threads`` native workers copy the file's mapping
    ``tile_bytes`` at a time into ``windows`` windows of ``window_bytes``, small enough to stay in the CPU
    cache, and queue each window's device copies as it fills), ``pipeline`` (one thread walks the windows,
    torch's intra-op threads copy each one), ``memcpy`` or ``preadv`` (each of ``threads`` workers into its
    own ``chunk_bytes`` buffers, ``depth`` copies in flight on ``streams`` CUDA streams). ``order``: "file" or
    "interleave" (round robin over the files). ``hugepages``: staging in transparent huge pages.
    """

    io: str = "auto"
    threads: int = MAX_THREADS
    native_threads: int = MAX_NATIVE_THREADS
    chunk_bytes: int = 16 << 20
    register_bytes: int = 128 << 20
    depth: int = 2
    streams: int = 1
    order: str = "file"
    hugepages: bool = True
    stage_read: str = "native"
    tile_bytes: int = 2 << 20
    window_bytes: int = 16 << 20
    windows: int = 4
    progress: bool = True

    def __post_init__(self):
        for what in ("chunk_bytes", "register_bytes", "window_bytes", "tile_bytes"):
            n = getattr(self, what)
            if not isinstance(n, int) or n < PAGE or n % PAGE:
                raise ValueError(f"{what} must be a positive multiple of {PAGE}, got {n!r}")
        for what in ("threads", "native_threads", "depth", "windows"):
            n = getattr(self, what)
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{what} must be a positive int, got {n!r}")
        if not isinstance(self.streams, int) or not 1 <= self.streams <= self.depth:
            raise ValueError(f"streams must be in [1, depth={self.depth}], got {self.streams!r}")
        if self.io not in IO_MODES:
            raise ValueError(f"io must be one of {', '.join(IO_MODES)}; got {self.io!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be 'file' or 'interleave', got {self.order!r}")
        if self.stage_read not in STAGE_READS:
            raise ValueError(f"stage_read must be one of {', '.join(STAGE_READS)}; got {self.stage_read!r}")

    @classmethod
    def make(cls, *, io: str | None = None, threads: int | None = None, **kw) -> ReadSettings:
        """Settings with this machine's defaults: ``io`` from $WEIGHTCACHE_LOAD_IO (else auto); ``threads``
        given sets both worker counts, else 16 workers at most and, for the native loop, 12 at most with 4
        cores left over."""
        cpus = os.cpu_count() or 1
        if threads is None:
            kw.setdefault("native_threads", max(1, min(MAX_NATIVE_THREADS, cpus - 4)))
            threads = min(MAX_THREADS, cpus)
        else:
            kw.setdefault("native_threads", threads)
        return cls(io=io or os.environ.get(IO_ENV) or "auto", threads=threads, **kw)

    @property
    def window_area_bytes(self) -> int:
        return self.window_bytes * self.windows
