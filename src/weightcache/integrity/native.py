"""The digest's chunk sums on the CPU in C (``digest.c``), built with the machine's C compiler on first use and
cached; threads split the chunks. Where it cannot be built, numpy computes them (slower, same numbers)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..native_build import CACHE_ENV, build  # noqa: F401  (CACHE_ENV: where it is built, for tests)
from . import algorithm

log = logging.getLogger("weightcache.integrity")

SOURCE = Path(__file__).with_name("digest.c")
CFLAGS = ("-O3", "-std=c11", "-shared", "-fPIC")
MAX_THREADS = 8
_u64 = ctypes.c_uint64


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not)."""
    lib, why = build(SOURCE, CFLAGS)
    if lib is None:
        return None, why
    lib.wc_digest_sums.restype = None
    lib.wc_digest_sums.argtypes = [ctypes.c_void_p, _u64, _u64, _u64, _u64, ctypes.c_void_p]
    return lib, ""


def chunk_sums(address: int, nbytes: int, chunk_bytes: int, threads: int | None = None) -> np.ndarray:
    """``acc`` of every chunk of the ``nbytes`` readable at ``address`` (host memory that stays mapped for the
    call); threads split the chunks (ctypes lets go of the GIL)."""
    algorithm.check_chunk_bytes(chunk_bytes)
    n = algorithm.chunk_count(nbytes, chunk_bytes)
    acc = np.zeros(n, dtype=np.uint64)
    lib, why = library()
    if lib is None:
        log.debug("native digest unavailable (%s): numpy computes it", why)
        data = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)) if nbytes else np.empty(0, np.uint8)
        for i in range(n):
            acc[i] = algorithm.chunk_sum(data[i * chunk_bytes:(i + 1) * chunk_bytes])
        return acc
    threads = max(1, min(threads or os.cpu_count() or 1, MAX_THREADS, n))
    if threads == 1:
        lib.wc_digest_sums(address, nbytes, chunk_bytes, 0, n, acc.ctypes.data)
        return acc
    per = -(-n // threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="wc-digest") as pool:
        list(pool.map(lambda first: lib.wc_digest_sums(address, nbytes, chunk_bytes, first, min(per, n - first),
                                                       acc.ctypes.data + 8 * first), range(0, n, per)))
    return acc
