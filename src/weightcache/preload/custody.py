"""The supervisor's side of the custodian (its policy): start or reach the custodian of the socket
directory, release what it holds under other keys before anything loads, tell whether a group's caches are
all held (then its daemons adopt them), and release or keep the caches when the preload stops."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..custodian.client import CustodianClient, connect_or_launch
from ..errors import WeightCacheError
from ..progress import human_bytes
from ..sockets import custodian_socket_path, remove_if_stale

log = logging.getLogger("weightcache.supervisor")


class Custody:
    """One supervisor's connection to the custodian (None inside when there is none)."""

    def __init__(self, socket_dir: Path):
        self.socket_dir = socket_dir
        self.client: CustodianClient | None = None
        self.lost = False
        self.owned: set[str] = set()  # names (socket file names) our daemons bound: the caches we stand for

    @property
    def socket(self) -> str:
        """The custodian's socket for the daemons ("" without one)."""
        return str(self.client.path) if self.client is not None else ""

    def open(self) -> None:
        try:
            self.client = connect_or_launch(self.socket_dir, client=f"supervisor pid {os.getpid()}")
        except WeightCacheError as e:
            log.warning("no custodian (%s): the weights will not outlive their daemons", e)
            return
        held = self.client.holdings().holdings
        log.info("custodian pid %d holds %d cache(s)%s", self.client.pid, len(held),
                 f" ({human_bytes(sum(h.nbytes for h in held))})" if held else "")

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
            gone = self.client.prune(role, model, keep)
        except WeightCacheError as e:
            log.warning("custodian: %s", e)
            return
        if gone.names:
            log.info("released %d cache(s) of %s held under another key (%s): %s", len(gone.names), model,
                     human_bytes(gone.nbytes), ", ".join(gone.names))
        for name in gone.names:  # the sockets their killed daemons left behind
            remove_if_stale(self.socket_dir / name)

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
        try:
            gone = self.client.release(names)
        except WeightCacheError as e:
            log.warning("custodian: %s", e)
            return
        if gone.names:
            log.info("%s: the custodian holds the weights of some ranks only; released them (%s): every rank "
                     "loads afresh", role, ", ".join(gone.names))

    def check_alive(self) -> None:
        if self.client is not None and not self.lost and self.client.lost():
            self.lost = True
            log.error("the custodian (pid %d) is gone: the weights now live only as long as their daemons",
                      self.client.pid)

    def finish(self, keep: bool) -> None:
        """At the end of the preload: release our caches, or keep them for the next preload (``keep``)."""
        if self.client is None:
            return
        try:
            if not keep:
                gone = self.client.release(sorted(self.owned))
                if gone.names:
                    log.info("released %d cache(s) held by the custodian", len(gone.names))
            else:
                held = {h.name for h in self.client.holdings().holdings} & self.owned
                log.info("the custodian (pid %d) keeps %d cache(s) for the next preload; `weightcache release "
                         "--socket-dir %s` frees them", self.client.pid, len(held), self.socket_dir)
        except WeightCacheError as e:
            log.warning("custodian: %s", e)
        finally:
            self.client.close()
            self.client = None

    def info(self) -> dict:
        if self.client is None or self.lost:
            return {"up": False}
        return {"up": True, "pid": self.client.pid, "socket": str(self.client.path)}
