"""A daemon's verified resident weights: record the digests of a fresh load, verify a cache taken over from the
custodian before serving it, re-hash on request and in a low-priority scrub, and remember the last result
(shown in status; after a mismatch the daemon refuses new attaches)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

from .. import wire
from ..errors import WeightCacheError
from ..manifest import Manifest
from . import algorithm, resident

log = logging.getLogger("weightcache.daemon")

_FAILURES = (WeightCacheError, ValueError, RuntimeError, OSError)


class ResidentGuard:
    def __init__(self, device, chunk_bytes: int = algorithm.DEFAULT_CHUNK_BYTES, scrub_interval: float = 0.0):
        """``chunk_bytes`` 0: record no digests. ``scrub_interval`` seconds between background re-hashes (0:
        none)."""
        self.device = device
        self.chunk_bytes = chunk_bytes and algorithm.check_chunk_bytes(chunk_bytes)
        if (isinstance(scrub_interval, bool) or not isinstance(scrub_interval, (int, float))
                or not math.isfinite(scrub_interval) or scrub_interval < 0):
            raise ValueError(f"scrub interval must be a finite number of seconds >= 0, got {scrub_interval!r}")
        self.scrub_interval = float(scrub_interval)
        self.digest_seconds = 0.0
        self.last = {"verified_at": 0.0, "verify_seconds": 0.0, "verify_result": "", "verify_message": "",
                     "verifications": 0}
        self._lock = threading.Lock()  # one re-hash at a time

    def digests(self, blocks, chunk_bytes: int) -> list:
        """Each block's digests, computed where it lives: over the daemon's own mapping, or (a block taken over
        from the custodian, not mapped here) through a read-only mapping of its fd, without torch."""
        out = []
        for b in blocks:
            tensor = getattr(b, "tensor", None)
            if tensor is not None:
                out.append(resident.block_digests(tensor, chunk_bytes))
            else:
                out.append(resident.fd_digests(b.fd, b.nbytes, self.device, chunk_bytes))
        return out

    def record(self, manifest: Manifest, blocks) -> None:
        """Digest the (sealed) blocks where they live and record the digests in the manifest."""
        if not self.chunk_bytes:
            return
        t0 = time.monotonic()
        resident.record_digests(manifest, self.digests(blocks, self.chunk_bytes), self.chunk_bytes)
        self.digest_seconds = time.monotonic() - t0
        log.info("digests of %.2f GiB recorded (%s, %d KiB chunks) in %.1f ms", manifest.nbytes / 2**30,
                 manifest.integrity, manifest.chunk_bytes >> 10, self.digest_seconds * 1e3)

    def check_adopted(self, manifest: Manifest, blocks, name: str) -> str:
        """Why a cache taken over from the custodian must not be served ("" when its bytes match the digests
        its loader recorded). One that carries no digests is refused unless this daemon records none either."""
        t0, at = time.monotonic(), time.time()
        try:
            if not manifest.integrity and not self.chunk_bytes:
                return ""  # this daemon records no digests either
            if not manifest.integrity:
                return "it carries no digests (this daemon records them: a deposit without them is not trusted)"
            resident.require_digests(manifest)
            bad = resident.compare(manifest, self.digests(blocks, manifest.chunk_bytes))
            why = resident.describe(bad, manifest.chunk_bytes) if bad else ""
        except _FAILURES as e:
            why = f"cannot verify it ({type(e).__name__}: {e})"
        self.digest_seconds = time.monotonic() - t0
        if why:
            return why
        self._note("ok", at, self.digest_seconds, "")
        log.info("the custodian's cache %s matches its digests (verified in %.1f ms)", name, self.digest_seconds * 1e3)
        return ""

    def verify(self, manifest: Manifest | None, blocks, state: str) -> wire.VerifyReport:
        """Re-hash the resident bytes and compare them with the recorded digests."""
        if state != "ready" or manifest is None:
            return wire.VerifyReport(state=state, message=f"the daemon is {state}: nothing to verify yet")
        with self._lock:
            t0, at = time.monotonic(), time.time()
            report = wire.VerifyReport(state=state, algorithm=manifest.integrity, chunk_bytes=manifest.chunk_bytes,
                                       nbytes=manifest.nbytes, checked_at=at)
            try:
                resident.require_digests(manifest)
                bad = resident.compare(manifest, self.digests(blocks, manifest.chunk_bytes))
            except _FAILURES as e:
                report.message = f"cannot verify: {type(e).__name__}: {e}"
                report.seconds = time.monotonic() - t0
                self._note("error", at, report.seconds, report.message)
                log.error("verifying the resident weights failed: %s", report.message)
                return report
            report.seconds = time.monotonic() - t0
            report.checked, report.ok, report.mismatches = True, not bad, bad
            report.message = resident.describe(bad, manifest.chunk_bytes) if bad else ""
            self._note("mismatch" if bad else "ok", at, report.seconds, report.message)
        if bad:
            log.error("the resident weights changed since they were loaded: %s; refusing new attaches", report.message)
        return report

    def refusal(self) -> str:
        """Why no engine may attach any more ("" while the bytes were never found changed)."""
        if self.last["verify_result"] != "mismatch":
            return ""
        return f"its resident weights changed since they were loaded: {self.last['verify_message']}"

    def status(self) -> dict:
        return {"digest_seconds": self.digest_seconds, "scrub_interval": self.scrub_interval, **self.last}

    def start_scrub(self, verify: Callable[[], object], stop: threading.Event) -> None:
        """Call ``verify`` every scrub_interval seconds until ``stop`` is set, at the lowest CPU priority."""
        if self.scrub_interval:
            threading.Thread(target=self._scrub, args=(verify, stop), name="weightcache-scrub", daemon=True).start()

    def _scrub(self, verify, stop: threading.Event) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread (and its helpers) only
        except (OSError, AttributeError):
            pass
        while not stop.wait(self.scrub_interval):
            verify()

    def _note(self, result: str, at: float, seconds: float, message: str) -> None:
        last = dict(self.last, verified_at=at, verify_seconds=seconds, verify_result=result, verify_message=message)
        last["verifications"] += 1
        self.last = last  # replaced whole: status() reads it without a lock
