"""A daemon's side of the custodian: deposit a freshly loaded cache (its block fds, key and manifest) so that
it outlives the daemon, and adopt the one held for this socket name instead of loading (a replacement
daemon, a restarted preload). What is adopted is checked before it is served: the key field by field (the only
identity: a cache whose key differs in any field, the checkpoint's digest included, is never served), the
manifest against its blocks and the device, and every block (arena/adopted.py: seals and size of a memfd, a
CUDA handle's device and size). A refused cache is released and the daemon loads afresh.

Deposits and claims carry the credential of the daemon's preload (``use_credential``: the supervisor hands it
to its daemons through their spawn arguments, never the environment). When the custodian dies, the daemon
deposits its cache again with the one its supervisor starts in its place."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

import msgspec

from .arena.adopted import AdoptedBlock, check_blocks, cuda_index_of
from .custodian.client import CustodianClient
from .custodian.messages import Holding
from .errors import DaemonUnavailable, WeightCacheError
from .key import CacheKey, diff
from .manifest import Manifest, validate
from .sockets import custodian_socket_path

log = logging.getLogger("weightcache.daemon")

WATCH_PERIOD_S = 1.0  # how often a daemon looks whether its custodian is still there
REDEPOSIT_CONNECT_S = 2.0

_credentials: dict[str, str] = {}


def _where(custodian: str | Path) -> str:
    path = Path(custodian)
    if path.is_dir():
        path = custodian_socket_path(path)
    return os.path.abspath(path)


def use_credential(custodian: str | Path, token: str) -> None:
    """The credential this process's daemons show the custodian at `custodian` (their preload's)."""
    _credentials[_where(custodian)] = token


class Handover:
    """One daemon's connection to the custodian of its socket directory (made on first use). While it is
    open the custodian counts the caches it deposited or claimed as served by this daemon."""

    def __init__(self, custodian: str | Path, name: str):
        self.path = Path(custodian)
        self.name = name  # the daemon's socket file name: what the cache is held under
        self._client: CustodianClient | None = None
        self._unreachable = False
        self._held: tuple[Holding, bytes, bytes, list[int]] | None = None  # to deposit again (our own dups)
        self._lock = threading.Lock()  # the dups: never closed while a deposit sends them
        self._closed = threading.Event()
        self._watch: threading.Thread | None = None

    @property
    def token(self) -> str:
        return _credentials.get(_where(self.path), "")

    def client(self) -> CustodianClient | None:
        if self._client is None and not self._unreachable:
            try:
                self._client = CustodianClient.connect(self.path, client=f"daemon {self.name}")
            except WeightCacheError as e:
                log.warning("no custodian (%s): this rank's cache will not outlive its daemon", e)
                self._unreachable = True
        return self._client

    def deposit(self, key: CacheKey, manifest: Manifest, fds: list[int], *, device: str, gpu_uuid: str) -> bool:
        """Hand the custodian duplicates of the blocks' fds; True once it holds them."""
        client = self.client()
        if client is None:
            return False
        holding = Holding(name=self.name, model=key.model, role=key.role, rank=key.rank, device=device,
                          gpu_uuid=gpu_uuid, block_bytes=[b.nbytes for b in manifest.blocks])
        encoded_key, encoded_manifest = msgspec.msgpack.encode(key), msgspec.msgpack.encode(manifest)
        try:
            client.deposit(holding, encoded_key, encoded_manifest, fds, self.token)
        except WeightCacheError as e:
            log.warning("the custodian did not take this rank's cache (%s): it will not outlive this daemon", e)
            return False
        self._remember(holding, encoded_key, encoded_manifest, fds)
        return True

    def adopt(self, key: CacheKey, device: str, gpu_uuid: str) -> tuple[Manifest, list[AdoptedBlock]] | None:
        """The cache held under this name, if its key equals ``key`` field by field, it fits this daemon's
        device and every block passes its check; None when none is held. One that is refused is released."""
        client = self.client()
        if client is None:
            return None
        try:
            got = client.claim(self.name, self.token)
        except WeightCacheError as e:
            log.warning("custodian: %s; loading afresh", e)
            return None
        if got is None:
            return None
        claimed, fds = got
        try:
            manifest = check_claimed(claimed, len(fds), key, device, gpu_uuid)
            sizes = [spec.nbytes for spec in manifest.blocks]
            check_blocks(fds, sizes, device, cuda_index_of(gpu_uuid) if device == "cuda" else None)
            blocks = [AdoptedBlock(fd, n, device) for fd, n in zip(fds, sizes, strict=True)]
        except (ValueError, WeightCacheError, msgspec.DecodeError, OSError) as e:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            log.warning("refused the custodian's cache %s (%s): releasing it, loading afresh", self.name, e)
            with contextlib.suppress(WeightCacheError):
                client.release([self.name])
            return None
        self._remember(claimed.holding, claimed.key, claimed.manifest, fds)
        return manifest, blocks

    # -- the custodian may die: deposit again with its replacement

    def _remember(self, holding: Holding, key: bytes, manifest: bytes, fds: list[int]) -> None:
        dups: list[int] = []
        try:
            for fd in fds:
                dups.append(os.dup(fd))
        except OSError as e:
            for fd in dups:
                os.close(fd)
            log.debug("cannot keep descriptors to deposit again (%s)", e)
            return
        with self._lock:
            self._held = (holding, key, manifest, dups)
        if self._watch is None:
            self._watch = threading.Thread(target=self._watch_custodian, name="weightcache-custody", daemon=True)
            self._watch.start()

    def _watch_custodian(self) -> None:
        while not self._closed.wait(WATCH_PERIOD_S):
            client = self._client
            if client is not None and not client.lost():
                continue
            if client is not None:
                log.warning("the custodian (pid %d) is gone: this rank's cache is deposited again once a new one "
                            "runs", client.pid)
                client.close()
                self._client = None
            self._deposit_again()

    def _deposit_again(self) -> None:
        try:
            client = CustodianClient.connect(self.path, client=f"daemon {self.name}", timeout=REDEPOSIT_CONNECT_S)
        except DaemonUnavailable:
            return  # none yet: the supervisor starts one
        except WeightCacheError as e:
            log.debug("custodian: %s", e)
            return
        with self._lock:
            if self._closed.is_set() or self._held is None:
                client.close()
                return
            holding, key, manifest, fds = self._held
            try:
                client.deposit(holding, key, manifest, fds, self.token)
            except WeightCacheError as e:  # its supervisor has not registered with it yet: try again
                log.debug("the new custodian did not take this rank's cache yet (%s)", e)
                client.close()
                return
        self._client = client
        log.warning("the custodian (pid %d) holds this rank's cache again", client.pid)

    def close(self) -> None:
        """Drop the connection: what was deposited stays held for a replacement."""
        self._closed.set()
        with self._lock:
            if self._held is not None:
                for fd in self._held[3]:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                self._held = None
            if self._client is not None:
                self._client.close()
                self._client = None


def check_claimed(claimed, nfds: int, key: CacheKey, device: str, gpu_uuid: str) -> Manifest:
    """The claimed cache's manifest, once its key, blocks and device are what this daemon serves."""
    held_key = msgspec.msgpack.decode(claimed.key, type=CacheKey)
    diffs = diff(key, held_key)
    if diffs:
        raise ValueError("its key differs: " + ", ".join(
            f"{d.field}: held {d.actual!r}, this daemon {d.expected!r}" for d in diffs))
    manifest = msgspec.msgpack.decode(claimed.manifest, type=Manifest)
    validate(manifest)
    if nfds != len(manifest.blocks) or [b.nbytes for b in manifest.blocks] != claimed.holding.block_bytes:
        raise ValueError(f"{nfds} block fds for {len(manifest.blocks)} blocks")
    if manifest.device != device or manifest.gpu_uuid != gpu_uuid:
        raise ValueError(f"held on {manifest.device} {manifest.gpu_uuid}, this daemon serves {device} {gpu_uuid}")
    return manifest
