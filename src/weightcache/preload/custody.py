"""The supervisor's side of the custodian (its policy): start or reach the custodian of the socket directory
and register this preload's credential (a secret only its daemons get), release what it holds under other
keys before anything loads, tell whether a group's caches are all held (then its daemons adopt them), watch it
(a custodian that dies is replaced, one that stops answering is reported), and release or keep the caches when
the preload stops. A custodian that does not answer at start is an error: it may hold every cache of the
directory, and loading them a second time next to it could exhaust the memory it holds."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from pathlib import Path

from ..custodian.client import CONNECT_TIMEOUT_S, CustodianClient, connect_or_launch
from ..custodian.messages import CustodianUnresponsive, Holding
from ..errors import WeightCacheError
from ..progress import human_bytes
from ..sockets import custodian_socket_path, remove_if_stale

log = logging.getLogger("weightcache.supervisor")

# A preload that is gone (SIGKILL, OOM kill, a crash) leaves its weights with the custodian this long: enough for
# a supervisor to start it again (systemd at once; Kubernetes after at most a 5-minute crash back-off, plus the
# new preload's own start), short enough that memory no one comes back for returns within minutes.
DEFAULT_HOLD_AFTER_EXIT_S = 600.0

WATCH_PERIOD_S = 1.0
PROBE_TIMEOUT_S = 2.0


class Custody:
    """One supervisor's connection to the custodian (None inside when there is none)."""

    def __init__(self, socket_dir: Path, hold_after_exit: float = DEFAULT_HOLD_AFTER_EXIT_S):
        self.socket_dir = Path(socket_dir)
        self.hold_after_exit = hold_after_exit
        self.token = secrets.token_hex(32)  # this preload's credential: its daemons get it, no one else
        self.client: CustodianClient | None = None
        self.state = "off"  # off | up | unresponsive | gone
        self.restarts = 0  # custodians started in place of one that died
        self.owned: set[str] = set()  # names (socket file names) our daemons bound: the caches we stand for
        self.connect_timeout = CONNECT_TIMEOUT_S
        self._pid = 0
        self._snapshot: list[Holding] = []
        self._snapshot_at = 0.0
        self._probe: CustodianClient | None = None  # a second connection, for watching (never registered)
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None

    @property
    def socket(self) -> str:
        """The custodian's socket for the daemons ("" without one)."""
        return str(custodian_socket_path(self.socket_dir)) if self.state != "off" else ""

    def open(self) -> None:
        """Reach (or start) the custodian and register. Raises CustodianUnresponsive when one does not
        answer; without any custodian the preload runs on (its weights then die with their daemons)."""
        try:
            self._connect(connect_or_launch(self.socket_dir, client=f"supervisor pid {os.getpid()}",
                                            timeout=self.connect_timeout))
        except CustodianUnresponsive:
            raise
        except WeightCacheError as e:
            log.warning("no custodian (%s): the weights will not outlive their daemons", e)
            return
        held = self._snapshot
        log.info("custodian pid %d holds %d cache(s)%s", self._pid, len(held),
                 f" ({human_bytes(sum(h.nbytes for h in held))})" if held else "")
        self._watch = threading.Thread(target=self._watch_loop, name="weightcache-custodian-watch", daemon=True)
        self._watch.start()

    def _connect(self, client: CustodianClient) -> None:
        """Register on `client` and take it as our connection (closed on failure)."""
        try:
            client.register(self.token, self.hold_after_exit)
            held = client.holdings().holdings
        except BaseException:
            client.close()
            raise
        self.client, self._pid, self.state = client, client.pid, "up"
        self._snapshot, self._snapshot_at = held, time.monotonic()

    # -- watching

    def _watch_loop(self) -> None:
        while not self._stop.wait(WATCH_PERIOD_S):
            try:
                self.look()
            except Exception as e:  # never let the watch die silently
                log.error("custodian watch: %s: %s", type(e).__name__, e)

    def look(self) -> None:
        """One look at the custodian (the watch thread's): replace it if it died, report it once if it stops
        answering (and once when it answers again), refresh what it holds."""
        client = self.client
        if client is not None and client.lost():
            client.close()
            self.client = None
            self._close_probe()
        if self.client is None:
            self._reconnect()
            return
        try:
            if self._probe is None:
                self._probe = CustodianClient.connect(self.socket_dir, client=f"supervisor pid {os.getpid()} (watch)",
                                                      timeout=PROBE_TIMEOUT_S)
            held = self._probe.holdings(timeout=PROBE_TIMEOUT_S).holdings
        except CustodianUnresponsive as e:
            self._close_probe()
            self._unresponsive(e)
            return
        except WeightCacheError:
            self._close_probe()
            return  # it is going away: the next look sees our connection closed
        self._answering()
        self._snapshot, self._snapshot_at = held, time.monotonic()

    def _unresponsive(self, e: CustodianUnresponsive) -> None:
        if self.state != "unresponsive":
            log.error("%s", e)
            self.state = "unresponsive"

    def _answering(self) -> None:
        if self.state == "unresponsive":
            log.warning("the custodian (pid %d) answers again", self._pid)
        self.state = "up"

    def _reconnect(self) -> None:
        """Our connection closed: the custodian died (start a new one and register with it), or it does not
        answer (report it), or it answers again (register again: our caches' leases stop)."""
        if self._stop.is_set():
            return
        old, was = self._pid, self.state
        try:
            client = connect_or_launch(self.socket_dir, client=f"supervisor pid {os.getpid()}",
                                       timeout=PROBE_TIMEOUT_S)
        except CustodianUnresponsive as e:
            self._unresponsive(e)
            return
        except WeightCacheError as e:
            if self.state != "gone":
                log.error("the custodian (pid %d) is gone and no new one starts (%s); retrying", old, e)
                self.state = "gone"
            return
        try:
            self._connect(client)
        except WeightCacheError as e:
            log.debug("custodian: %s", e)
            return
        if self._pid != old:
            self.restarts += 1
            log.error("the custodian (pid %d) died: the caches only it held are lost; pid %d runs in its place and "
                      "the running daemons deposit theirs with it again", old, self._pid)
        elif was == "unresponsive":
            log.warning("the custodian (pid %d) answers again", self._pid)

    def _close_probe(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    # -- start-up

    def note_leftovers(self) -> None:
        """Without a custodian of our own, say what one left in this directory still holds."""
        if not custodian_socket_path(self.socket_dir).exists():
            return
        try:
            client = CustodianClient.connect(self.socket_dir, timeout=5.0)
            try:
                held = client.holdings().holdings
            finally:
                client.close()
        except CustodianUnresponsive as e:
            log.warning("%s", e)
            return
        except WeightCacheError:
            return
        if held:
            log.warning("a custodian still holds %d cache(s) (%s) in %s; `weightcache release --socket-dir %s` "
                        "frees them", len(held), human_bytes(sum(h.nbytes for h in held)), self.socket_dir,
                        self.socket_dir)

    def prune(self, role: str, model: str, keep: list[str]) -> None:
        """Release what the custodian holds for this role and model under other keys (other flags, another
        layout, a changed checkpoint) before anything loads: the memory is needed, and it is never served."""
        if self.client is None:
            return
        try:
            gone = self.client.prune(role, model, keep, self.token)
        except WeightCacheError as e:
            log.warning("custodian: %s", e)
            return
        if gone.names:
            log.info("released %d cache(s) of %s held under another key (%s): %s", len(gone.names), model,
                     human_bytes(gone.nbytes), ", ".join(gone.names))
        for name in gone.names:  # the sockets their killed daemons left behind
            remove_if_stale(self.socket_dir / name)

    def holds_nothing(self) -> bool:
        """True when no custodian is up, or the one that is held no cache when we registered."""
        return self.client is None or not self._snapshot

    def holds(self, names: set[str]) -> bool | None:
        """Whether the custodian holds every one of these caches (None: it holds none of them)."""
        if self.client is None:
            return None
        try:
            held = {h.name for h in self.client.holdings().holdings}
        except WeightCacheError:
            return None
        return True if names <= held else (False if names & held else None)

    def release_partial(self, role: str, names: list[str]) -> None:
        """A group held for some ranks only loads afresh on every rank: release what is held."""
        if self.client is None:
            return
        try:
            gone = self.client.release(names)
        except WeightCacheError as e:
            log.warning("custodian: %s", e)
            return
        if gone.names:
            log.info("%s: the custodian holds the weights of some ranks only; released them (%s): every rank "
                     "loads afresh", role, ", ".join(gone.names))

    # -- the end

    def finish(self, keep: bool) -> None:
        """At the end of the preload: release our caches, or keep them for the next preload (``keep``)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.join(PROBE_TIMEOUT_S * 2 + 5)
        self._close_probe()
        if self.client is None:
            if self.state != "off":
                log.warning("no custodian to release this preload's caches with; one that holds them frees them "
                            "%.0f s after this preload is gone", self.hold_after_exit)
            return
        if self.state == "unresponsive":  # no use waiting for it: our connection's close starts the lease
            log.warning("the custodian (pid %d) does not answer: this preload's caches are freed %.0f s after it is "
                        "gone", self._pid, self.hold_after_exit)
            self.client.close()
            self.client = None
            return
        try:
            if not keep:
                gone = self.client.release(sorted(self.owned))
                if gone.names:
                    log.info("released %d cache(s) held by the custodian", len(gone.names))
            else:
                kept = self.client.keep(sorted(self.owned), self.token).names
                log.info("the custodian (pid %d) keeps %d cache(s) for the next preload; `weightcache release "
                         "--socket-dir %s` frees them", self.client.pid, len(kept), self.socket_dir)
        except CustodianUnresponsive as e:
            log.warning("%s; this preload's caches are freed %.0f s after it is gone", e, self.hold_after_exit)
        except WeightCacheError as e:
            log.warning("custodian: %s", e)
        finally:
            self.client.close()
            self.client = None

    def info(self) -> dict:
        """What /status and /metrics show: whether it runs and answers, and what it holds (as of the last
        look, at most a few seconds old), with each cache's remaining lease."""
        if self.state == "off":
            return {"up": False, "state": "off"}
        age = time.monotonic() - self._snapshot_at
        holdings = [{"name": h.name, "model": h.model, "role": h.role, "rank": h.rank, "nbytes": h.nbytes,
                     "served_by": h.served_by, "preload": h.preload, "kept": h.kept,
                     "expires_in": None if h.expires_in is None else max(0.0, h.expires_in - age)}
                    for h in self._snapshot]
        expiring = [h["expires_in"] for h in holdings if h["expires_in"] is not None]
        return {"up": self.state == "up", "state": self.state, "pid": self._pid,
                "socket": str(custodian_socket_path(self.socket_dir)), "restarts": self.restarts,
                "hold_after_exit": self.hold_after_exit, "holdings": holdings,
                "next_expiry_s": min(expiring) if expiring else None}

    def metrics(self) -> list[tuple[str, str, float]]:
        """The custodian's gauges for /metrics: (name, help, value)."""
        info = self.info()
        expiry = info.get("next_expiry_s")
        return [("weightcache_custodian_up", "1 while the custodian that keeps the caches past their daemons runs "
                 "and answers", 1.0 if info["up"] else 0.0),
                ("weightcache_custodian_next_release_seconds", "seconds until the custodian frees the next cache "
                 "whose preload is gone (its lease); -1: none is counting down",
                 -1.0 if expiry is None else float(expiry))]
