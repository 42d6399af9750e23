"""A daemon's side of the custodian: deposit a freshly loaded cache (its block fds, key and manifest) so that
it outlives the daemon, and adopt the one held for this socket name instead of loading (a replacement
daemon, a restarted preload). What is adopted is checked: the key field by field, the manifest against its
blocks, the device."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from .arena.adopted import AdoptedBlock
from .custodian.client import CustodianClient
from .custodian.messages import Holding
from .errors import WeightCacheError
from .key import CacheKey, diff
from .manifest import Manifest, validate

log = logging.getLogger("weightcache.daemon")


class Handover:
    """One daemon's connection to the custodian of its socket directory (made on first use). While it is
    open the custodian counts the caches it deposited or claimed as served by this daemon."""

    def __init__(self, custodian: str | Path, name: str):
        self.path = Path(custodian)
        self.name = name  # the daemon's socket file name: what the cache is held under
        self._client: CustodianClient | None = None
        self._unreachable = False

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
        try:
            client.deposit(holding, msgspec.msgpack.encode(key), msgspec.msgpack.encode(manifest), fds)
            return True
        except WeightCacheError as e:
            log.warning("the custodian did not take this rank's cache (%s): it will not outlive this daemon", e)
            return False

    def adopt(self, key: CacheKey, device: str, gpu_uuid: str) -> tuple[Manifest, list[AdoptedBlock]] | None:
        """The cache held under this name, if its key equals ``key`` field by field and it fits this
        daemon's device; None when none is held. One that does not fit is released."""
        client = self.client()
        if client is None:
            return None
        try:
            got = client.claim(self.name)
        except WeightCacheError as e:
            log.warning("custodian: %s; loading afresh", e)
            return None
        if got is None:
            return None
        claimed, fds = got
        try:
            manifest = check_claimed(claimed, len(fds), key, device, gpu_uuid)
            blocks = [AdoptedBlock(fd, spec.nbytes, device) for fd, spec in zip(fds, manifest.blocks, strict=True)]
        except (ValueError, WeightCacheError, msgspec.DecodeError, OSError) as e:
            for fd in fds:
                os.close(fd)
            log.warning("the custodian's cache %s does not fit this daemon (%s): releasing it, loading afresh",
                        self.name, e)
            try:
                client.release([self.name])
            except WeightCacheError:
                pass
            return None
        return manifest, blocks

    def close(self) -> None:
        """Drop the connection: what was deposited stays held for a replacement."""
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
