"""Name the weights behind a write fault: one line on stderr when an engine writes to read-only weights (CPU).

Attached CPU weights are mapped read-only, so a write to them kills the engine with SIGSEGV. This module
makes that death say why: a SIGSEGV handler that, when the fault address lies in a registered weightcache
mapping, writes one line naming the tensor, its block and the mapping's address range, then lets the
process die exactly as before (core dump, exit status, faulthandler's traceback when that is enabled).

Why a ctypes handler: Python's `signal` module cannot handle SIGSEGV (its C handler only sets a flag and
returns, so the faulting instruction runs again forever), faulthandler prints tracebacks but not the fault
address, and a C extension would need a compiler at install. `sigaction(SA_SIGINFO)` with a ctypes callback
gets the address from `siginfo_t`; the callback writes its line, puts the previous handler back and returns:
the instruction faults again and the previous handler (faulthandler, or the default action) ends the process.
Threads that fault at the same time (a torch kernel runs on several) wait for the first one's line before
the previous handler is back, so no thread ends the process before the line is out.
The callback runs Python code inside a signal handler: it takes the GIL (a torch kernel that faults has
released it) and allocates. That is unsafe in general, acceptable here because the process is dying anyway
and a fault in our read-only weights happens in a plain memory write, never inside the allocator. Set
WEIGHTCACHE_FAULT_HANDLER=0 to keep the handler out of a process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

MAX_REGIONS = 256  # the newest mappings; older ones (their describers hold manifests) are forgotten
ALT_STACK_BYTES = 1 << 20  # the callback runs Python: far more than SIGSTKSZ
_SA_ONSTACK = 0x08000000
_SA_SIGINFO = 0x00000004
_SI_CODE_OFFSET = 8
_SI_ADDR_OFFSET = 16  # int si_signo, si_errno, si_code, then the (8-aligned) union: si_addr on 64-bit Linux


class _Sigaction(ctypes.Structure):
    """glibc's struct sigaction on 64-bit Linux (x86_64 and aarch64 share the layout)."""

    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]


class _StackT(ctypes.Structure):
    _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]


_HANDLER_T = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

_lock = threading.Lock()
_reporting = threading.Lock()  # held while the first faulting thread writes its line
_reported: list[int] = []  # the address of the fault that was named (once per process)
_regions: list[tuple[int, int, Callable[[int], str]]] = []  # (start, end, describe(address))
_installed: bool | None = None
_libc = None
_previous = _Sigaction()
_callback = None  # the ctypes thunk must stay alive as long as it is installed
_alt_stack = None


def _describe(addr: int) -> str | None:
    for start, end, describe in reversed(_regions):
        if start <= addr < end:
            return describe(addr)
    return None


def _on_fault(signum: int, info: int, context: int) -> None:
    try:
        if ctypes.c_int.from_address(info + _SI_CODE_OFFSET).value <= 0:
            _restore()
            signal.raise_signal(signum)  # sent by kill()/raise(), not a fault: delivered to the previous handler next
            return
        addr = ctypes.c_void_p.from_address(info + _SI_ADDR_OFFSET).value or 0
        # Threads that fault at once (a torch kernel on several threads) queue here; the previous handler goes
        # back only once the first one's line is out, so none of them ends the process before it is written.
        with _reporting:
            if not _reported:
                _reported.append(addr)
                try:
                    line = _describe(addr)
                    if line:
                        os.write(2, ("\n" + line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
                finally:
                    _restore()
    except BaseException:  # noqa: BLE001 - nothing may escape a signal handler; the process dies next anyway
        _restore()


def _restore() -> None:
    """The previous handler back: the fault, which happens again on return, ends the process as it would have."""
    try:
        _libc.sigaction(signal.SIGSEGV, ctypes.byref(_previous), None)
    except BaseException:  # noqa: BLE001
        pass


def _ensure_alt_stack() -> None:
    """The callback runs Python; give this thread an alternate signal stack big enough for it (a stack
    overflow fault must not run the handler on the overflowed stack)."""
    global _alt_stack
    current = _StackT()
    if _libc.sigaltstack(None, ctypes.byref(current)) != 0:
        return
    if current.sp and current.size >= ALT_STACK_BYTES and not current.flags & 2:  # 2: SS_DISABLE
        return
    buf = ctypes.create_string_buffer(ALT_STACK_BYTES)
    new = _StackT(ctypes.cast(buf, ctypes.c_void_p), 0, ALT_STACK_BYTES)
    if _libc.sigaltstack(ctypes.byref(new), None) == 0:
        _alt_stack = buf  # kept for the life of the process


def _install() -> bool:
    """Put the handler in front of SIGSEGV's current one (faulthandler's, or the default), once per process.
    (Never again later: a handler installed after ours, such as a faulthandler enabled later, may hand the
    signal back to ours, and ours handing it on to that one again would loop.)"""
    global _libc, _callback, _installed
    if _installed is not None:
        return _installed
    _installed = False
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return False
    if os.environ.get("WEIGHTCACHE_FAULT_HANDLER", "1") in ("0", "false", "no", "off"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        libc.sigaltstack.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _libc, _callback = libc, _HANDLER_T(_on_fault)
        _ensure_alt_stack()
        action = _Sigaction()
        action.handler = ctypes.cast(_callback, ctypes.c_void_p).value
        action.flags = _SA_SIGINFO | _SA_ONSTACK
        if libc.sigaction(signal.SIGSEGV, ctypes.byref(action), ctypes.byref(_previous)) != 0:
            return False
    except (OSError, AttributeError):
        return False
    _installed = True
    return True


def register(start: int, end: int, describe: Callable[[int], str]) -> bool:
    """Name faults in [start, end): `describe(address)` returns the line to print. Regions that overlap a
    new one are dropped (their mapping is gone, the address reused). Returns whether the handler is on."""
    with _lock:
        _regions[:] = [r for r in _regions if r[1] <= start or r[0] >= end][-(MAX_REGIONS - 1):]
        _regions.append((start, end, describe))
        return _install()


def describe(addr: int) -> str | None:
    """The line a fault at `addr` would print (None outside every registered mapping)."""
    return _describe(addr)
