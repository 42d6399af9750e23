"""One daemon process of a preload: source -> key -> socket -> (go) -> load or adopt -> serve; it dies with its supervisor."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ..errors import ArenaOutOfMemory, WeightCacheError
from ..key import CacheKey
from ..sources import Producer
from .layout import Placement

log = logging.getLogger("weightcache.supervisor")

TERM_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long
PR_SET_PDEATHSIG = 1
EXIT_OOM = 3  # a daemon ran out of device or host memory
EXIT_KEY_CHANGED = 4  # a replacement daemon computed another key than its rank agreed on: never restarted
EXIT_NOT_HELD = 5  # a rank that had to take its cache from the custodian found none (a restart from a record)
GO = b"go"  # every node agreed: take the cache from the custodian if it holds it, else load
LOAD = b"load"  # load afresh (some rank of the group has nothing held: its ranks load together)
ADOPT = b"adopt"  # take the cache from the custodian or fail (a rank that cannot load alone)


class _Terminated(BaseException):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, frame):
    # PDEATHSIG and the lifeline both send SIGTERM: a second one must not interrupt the clean-up
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated(signum)


@dataclass(frozen=True)
class ChildSpec:
    """Everything one daemon process needs; pickled to the spawned child."""

    role: str
    placement: Placement
    layout: str
    socket_dir: str
    make_source: Callable
    source_args: dict
    make_key: Callable
    key_args: dict
    supervisor_pid: int
    master_addr: str
    master_port: int
    info: dict
    log_level: int = logging.INFO
    custodian: str = ""  # the custodian's socket: adopt the cache it holds, deposit a fresh load
    custodian_token: str = ""  # the preload's credential with the custodian (travels pickled, never in the env)
    loads_alone: bool = True
    expect_key: CacheKey | None = None  # a replacement daemon must compute exactly this key
    gpu_uuid: str = ""  # known ahead (a restart from the preload's record): no torch needed to name the socket
    preimport: tuple = ()  # modules a load will need, imported from the daemon's start, beside its other work
    scrub_interval: float = 0.0  # seconds between re-hashes of the resident weights (0: none)
    load_early: bool = False  # nothing held could be adopted: load at once, the key made beside the load


class NotHeld(WeightCacheError):
    """This rank's cache had to be taken from the custodian, and it holds none: the preload starts again in full."""


def _preimport(modules: tuple) -> None:
    """Import what a load will need while the supervisor still hashes and the nodes agree (the load waits for
    it: two threads importing one package with circular imports, as transformers has, can see a module half
    made; a daemon that adopts its cache simply never uses them)."""
    import importlib

    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - the load imports it again and says what is wrong
            log.debug("pre-import of %s failed: %s", m, e)


def dump_modules(name: str) -> None:
    """With $WEIGHTCACHE_DUMP_MODULES (a directory), write this process's imported modules there (tests check
    which engines a restart imports)."""
    where = os.environ.get("WEIGHTCACHE_DUMP_MODULES")
    if where:
        with contextlib.suppress(OSError):
            Path(where, f"{name}.modules").write_text("\n".join(sorted(sys.modules)))


def _check_gpu(index: int, expected: str) -> None:
    """The device at ``index`` is the GPU the record names (CUDA_VISIBLE_DEVICES may have changed)."""
    from ..gpus import uuid_of

    actual = uuid_of(index)
    if actual is not None and actual != expected:
        raise NotHeld(f"device {index} is GPU {actual}, the cache is on GPU {expected}")


def _die_with_parent(parent_pid: int, lifeline, go: threading.Event, mode: list) -> None:
    """SIGTERM this process when the supervisor goes away, however it goes. The lifeline pipe also
    carries the supervisor's "go" (every node agreed: load now) and how (GO, LOAD or ADOPT, into `mode`)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)

    def watch():
        try:
            while True:
                msg = lifeline.recv_bytes()
                if msg in (GO, LOAD, ADOPT):
                    mode[:] = [msg]
                    go.set()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(TERM_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="weightcache-lifeline", daemon=True).start()


class LazySource:
    """The group's source, built on first use: a daemon that takes its cache from the custodian never builds
    it (building one may read the checkpoint's headers)."""

    def __init__(self, make: Callable, placement: Placement, args: dict, after: threading.Thread | None = None):
        self._make, self._placement, self._args = make, placement, args
        self._after = after  # the engine's pre-import: never two threads importing one package at once
        self._source = None
        self._lock = threading.Lock()  # the key's thread and the load may both ask for it first

    def get(self):
        with self._lock:
            if self._source is None:
                if self._after is not None and self._after.ident is not None:
                    self._after.join()
                self._source = self._make(self._placement, **self._args)
            return self._source

    def __getattr__(self, name: str):
        return getattr(self.get(), name)


_sending = threading.Lock()  # the key's thread may report while the load does


def _send(conn, kind: str, **fields) -> None:
    try:
        with _sending:
            conn.send_bytes(json.dumps({"kind": kind, **fields}).encode())
    except OSError:
        pass  # the supervisor is gone; the lifeline ends us


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` says memory ran out: ours, Python's, torch's (CUDA, and the CPU allocator's plain
    RuntimeError) or the kernel's ENOMEM."""
    if isinstance(e, (ArenaOutOfMemory, MemoryError)) or type(e).__name__ == "OutOfMemoryError":
        return True
    if isinstance(e, OSError):
        return e.errno == errno.ENOMEM
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)


def _open_the_gpu(index: int) -> None:
    """The driver's start (cuInit), the device's primary context (kept for the process's life) and the
    resident-digest kernel (compiled by NVRTC on a first run, then loaded): made in the background while the
    daemon imports its modules (the driver and NVRTC release the GIL)."""
    with contextlib.suppress(Exception):  # no bindings or no device: the daemon's own calls say why
        from cuda.bindings import driver as cu

        (err,) = cu.cuInit(0)
        if err == cu.CUresult.CUDA_SUCCESS:
            err, dev = cu.cuDeviceGet(index)
            if err == cu.CUresult.CUDA_SUCCESS:
                cu.cuDevicePrimaryCtxRetain(dev)
                from ..integrity.cuda import prepare_kernel

                prepare_kernel(index)


class KeyChanged(ValueError):
    """A replacement daemon computed another key than the rank it replaces."""


def _key_and_path(spec: ChildSpec, source) -> tuple:
    """The rank's key (it waits for the checkpoint's digest) and the socket it is served on."""
    from ..sockets import device_tag, socket_path, tag_of_uuid

    p = spec.placement
    key = spec.make_key(source, p, layout=spec.layout, role=spec.role, **spec.key_args)
    if key.rank != p.rank or key.role != spec.role or key.layout != spec.layout:
        raise ValueError(f"make_key returned rank {key.rank}/{key.role}/{key.layout} for rank {p.rank}/"
                         f"{spec.role}/{spec.layout}")
    if spec.expect_key is not None:
        from ..key import diff

        changed = diff(spec.expect_key, key)
        if changed:
            raise KeyChanged("the weights changed since this rank started (" + ", ".join(
                f"{d.field}: {d.expected!r} -> {d.actual!r}" for d in changed) + "); restart preload")
    tag = tag_of_uuid(spec.gpu_uuid) if p.device.startswith("cuda") and spec.gpu_uuid else device_tag(p.device)
    return key, socket_path(spec.socket_dir, key, tag)


def _quietly(fn: Callable) -> None:
    """Run fn on a thread whose failure is reported by the load that waits for it, not by the thread."""
    with contextlib.suppress(BaseException):
        fn()


def child_main(spec: ChildSpec, conn, lifeline) -> None:
    """One daemon process: source -> key -> socket -> (go) -> load -> serve."""
    if spec.placement.device.startswith("cuda"):
        threading.Thread(target=_open_the_gpu, args=(spec.placement.local_index,), name="wc-open-gpu",
                         daemon=True).start()
    go, mode = threading.Event(), [GO]
    _die_with_parent(spec.supervisor_pid, lifeline, go, mode)
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpgid(0, 0)  # a terminal's Ctrl-C goes to the supervisor alone; it stops the daemons
    p = spec.placement
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{spec.role} r{p.rank}] %(name)s: %(message)s")
    daemon = None
    code = 0
    try:
        from ..daemon import Daemon

        preimport = None
        if spec.preimport:  # the engine's modules, imported while the key waits for the checkpoint's digest
            preimport = threading.Thread(target=_preimport, args=(spec.preimport,), name="wc-preimport",
                                         daemon=True)
            preimport.start()
        if p.device.startswith("cuda") and spec.gpu_uuid:
            _check_gpu(p.local_index, spec.gpu_uuid)
        elif p.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(p.local_index)  # local index == device index
        source = LazySource(spec.make_source, p, spec.source_args, after=preimport)
        info = {"placement": p.name(), "local_index": str(p.local_index), "node_rank": str(p.node_rank),
                **{k: str(v) for k, v in spec.info.items()}}
        if spec.custodian:
            from ..handover import use_credential

            use_credential(spec.custodian, spec.custodian_token)
        daemon = Daemon(None, None, device=p.device, info=info, custodian=spec.custodian or None,
                        gpu_uuid=spec.gpu_uuid or None, scrub_interval=spec.scrub_interval)

        def name_and_start() -> None:
            nonlocal code
            try:
                key, path = _key_and_path(spec, source)
                daemon.name(path, key, start=True, then=lambda: _send(
                    conn, "started", socket=str(path), pid=os.getpid(), key=msgspec.to_builtins(key),
                    gpu_uuid=daemon._gpu_uuid))
            except BaseException as e:
                if isinstance(e, KeyChanged):
                    code = EXIT_KEY_CHANGED
                daemon.cannot_be_named(e)
                raise

        if spec.load_early:  # nothing held could be adopted: the key (the checkpoint's digest) comes meanwhile
            threading.Thread(target=_quietly, args=(name_and_start,), name="wc-key", daemon=True).start()
            how = LOAD
        else:
            name_and_start()
            while not go.wait(0.5):
                pass
            how = mode[0]
        if how != LOAD and daemon.adopt():
            pass  # the custodian held this exact cache: served again without a load
        elif how == ADOPT:
            raise RuntimeError("the custodian holds no cache for this rank, and its source loads only together "
                               "with every rank of its group: restart preload")
        elif isinstance(source.get(), Producer):  # an engine's own loader builds the tensors; sharing kept
            source.get().produce(daemon)
        else:
            daemon.load(source.get())
        dump_modules(f"{spec.role}-r{p.rank}")
        st = daemon.status()
        _send(conn, "ready", nbytes=st.nbytes, ntensors=st.ntensors, load_seconds=st.load_seconds,
              adopted=st.adopted, held=st.held, ready_seconds=st.ready_seconds)
        daemon.serve_forever()
    except _Terminated:
        code = 0
    except BaseException as e:
        code = EXIT_OOM if out_of_memory(e) else EXIT_NOT_HELD if isinstance(e, NotHeld) else (code or 1)
        if isinstance(e, SystemExit) and isinstance(e.code, int) and e.code:
            code = e.code
        message = " ".join(f"{type(e).__name__}: {e}".split())  # one line, whatever the library wrote
        # A bad checkpoint or config is the usual cause, and the message names it: the traceback at DEBUG only
        log.error("failed: %s%s", message, "" if isinstance(e, WeightCacheError) or log.isEnabledFor(
            logging.DEBUG) else " (the traceback at log level DEBUG)")
        log.debug("%s", traceback.format_exc())
        _send(conn, "failed", message=message)
    finally:
        if daemon is not None:
            daemon.close()
    # Skip interpreter finalization: with torch loaded it can hang in garbage collection at exit, and
    # nothing is left to clean up (socket removed, memory returns to the kernel) but multiprocessing's
    # semaphores (tqdm's lock, under transformers' progress bars): unlinked here, or the preload's resource
    # tracker warns of a leaked semaphore when it ends.
    with contextlib.suppress(Exception):
        from multiprocessing import util

        util._run_finalizers(0)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class Child:
    spec: ChildSpec
    proc: mp.Process
    conn: object  # read end of the status pipe
    lifeline: object  # write end; "go" goes through it, closing it (or dying) ends the child
    socket: str = ""
    key: CacheKey | None = None
    state: str = "spawned"  # spawned | started | ready | failed
    message: str = ""
    ready_info: dict = field(default_factory=dict)
    gpu_uuid: str = ""
    replacement: bool = False  # started after READY in place of a daemon that died
    go_sent: bool = False
    announced: bool = False
    reported: bool = False  # its exit was logged
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # the HTTP thread drains too

    @property
    def label(self) -> str:
        p = self.spec.placement
        return f"rank {p.rank} ({self.spec.role}, {p.device})"

    @property
    def exited(self) -> bool:
        return self.proc.exitcode is not None

    def drain(self) -> None:
        with self.lock:
            self._drain()

    def _drain(self) -> None:
        while self.conn is not None:
            try:
                if not self.conn.poll():
                    return
                msg = json.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                self.conn.close()
                self.conn = None
                return
            kind = msg.get("kind")
            if kind == "started":
                self.socket, self.state = msg["socket"], "started"
                self.key = msgspec.convert(msg["key"], CacheKey)
                self.gpu_uuid = msg.get("gpu_uuid", "")
            elif kind == "ready":
                self.state, self.ready_info = "ready", msg
            elif kind == "failed":
                self.state, self.message = "failed", msg.get("message", "")


def exit_code_of(exitcode: int | None) -> int:
    """The supervisor's exit code for a daemon's: a signal N maps to 128+N, a clean 0 during start-up to 1."""
    if exitcode is None:
        return 1
    if exitcode < 0:
        return 128 - exitcode
    return exitcode or 1
