"""What the custodian holds and for whom: the caches (block fds, key, manifest, who serves them), the preloads
that are running (their credentials), and the lease of each cache whose preload is gone. One lock guards it
all; nothing here sends, receives or blocks (the server does its I/O outside the lock)."""

from __future__ import annotations

import contextlib
import hmac
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import msgspec

from .messages import Holding


class Entry:
    def __init__(self, holding: Holding, key: bytes, manifest: bytes, fds: list[int], owner: str):
        self.holding, self.key, self.manifest, self.fds = holding, key, manifest, fds
        self.owner = owner  # the credential of the preload it belongs to
        self.lease: socket.socket | None = None  # the connection of the daemon serving it
        self.expires_at: float | None = None  # time.monotonic() when it is freed (its preload is gone)
        self.gone_since = 0.0  # when its preload went away

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


@dataclass
class Preload:
    """A running preload: its supervisor's pid and connection(s), and how long its caches outlive it."""

    pid: int
    hold_after_exit: float
    conns: set = field(default_factory=set)


@dataclass
class Dropped:
    """What a closed connection leaves behind, for the log: caches no daemon serves now, a preload gone."""

    orphans: list[Entry] = field(default_factory=list)
    preload: Preload | None = None
    leased: list[Entry] = field(default_factory=list)  # its caches, now counting down
    freed: list[Entry] = field(default_factory=list)  # its caches, freed at once (hold 0); to be closed


class Store:
    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._preloads: dict[str, Preload] = {}  # credential -> running preload

    # -- preloads

    def register(self, conn: socket.socket, pid: int, token: str, hold_after_exit: float) -> list[str] | str:
        """Names held for this credential (their countdown stops), or why it is refused."""
        with self._lock:
            known = self._find(token)
            if known is not None and known.pid != pid:
                return f"that credential belongs to the running preload pid {known.pid}"
            if known is None:
                known = self._preloads[token] = Preload(pid, hold_after_exit)
            known.hold_after_exit = hold_after_exit
            known.conns.add(conn)
            owned = [e for e in self._entries.values() if e.owner == token]
            for e in owned:
                e.expires_at = None
            return sorted(e.holding.name for e in owned)

    def preload_for(self, token: str) -> Preload | None:
        with self._lock:
            return self._find(token)

    def _find(self, token: str) -> Preload | None:
        if not token:
            return None
        for known, p in self._preloads.items():
            if hmac.compare_digest(known, token):
                return p
        return None

    def drop(self, conn: socket.socket) -> Dropped:
        """A connection closed: its daemon's caches wait for a replacement; a preload whose last connection
        this was is gone, and its caches (unless kept) are freed after its lease."""
        out = Dropped()
        now = time.monotonic()
        with self._lock:
            for e in self._entries.values():
                if e.lease is conn:
                    e.lease, e.holding.served_by = None, 0
                    out.orphans.append(e)
            for token, p in list(self._preloads.items()):
                if conn not in p.conns:
                    continue
                p.conns.discard(conn)
                if p.conns:
                    continue
                del self._preloads[token]
                out.preload = p
                for name, e in list(self._entries.items()):
                    if e.owner != token or e.holding.kept:
                        continue
                    e.gone_since = now
                    if p.hold_after_exit <= 0:
                        out.freed.append(self._entries.pop(name))
                    else:
                        e.expires_at = now + p.hold_after_exit
                        out.leased.append(e)
        return out

    # -- caches

    def put(self, entry: Entry, conn: socket.socket) -> tuple[Entry | None, str]:
        """Hold `entry`, served by `conn`: (the entry it replaced, ""), or (None, why it is refused)."""
        with self._lock:
            if self._find(entry.owner) is None:
                return None, f"{entry.holding.name}: its preload is gone"
            old = self._entries.get(entry.holding.name)
            if old is not None and old.owner != entry.owner and self._find(old.owner) is not None:
                return None, (f"{entry.holding.name} is held for the running preload pid "
                              f"{self._find(old.owner).pid}")
            entry.lease = conn
            self._entries[entry.holding.name] = entry
            return old, ""

    def lend(self, name: str) -> tuple[Entry, Holding, list[int]] | None:
        """The entry under `name`, a copy of its holding and duplicates of its fds (the caller sends and
        closes them: a release meanwhile cannot close what is being sent)."""
        with self._lock:
            e = self._entries.get(name)
            if e is None:
                return None
            dups: list[int] = []
            try:
                for fd in e.fds:
                    dups.append(os.dup(fd))
            except OSError:
                for fd in dups:
                    os.close(fd)
                raise
            return e, msgspec.structs.replace(e.holding), dups

    def claimed(self, e: Entry, conn: socket.socket, pid: int, token: str) -> int:
        """The claimer got `e`: it serves it now, for its preload. Returns who served it before (0: none)."""
        with self._lock:
            previous = e.holding.served_by
            p = self._find(token)
            if self._entries.get(e.holding.name) is e and p is not None:
                e.lease, e.holding.served_by = conn, pid
                e.holding.handovers += 1
                e.owner, e.expires_at, e.holding.kept, e.holding.preload = token, None, False, p.pid
            return previous

    def keep(self, names: list[str], token: str) -> list[str]:
        with self._lock:
            kept = [n for n in names if n in self._entries and self._entries[n].owner == token]
            for n in kept:
                self._entries[n].holding.kept, self._entries[n].expires_at = True, None
            return kept

    def take(self, names=None, *, everything: bool = False) -> list[Entry]:
        """Remove and return these entries (all with ``everything``); the caller closes them."""
        with self._lock:
            chosen = list(self._entries) if everything else [n for n in names or () if n in self._entries]
            return [self._entries.pop(n) for n in chosen]

    def stale(self, role: str, model: str, keep: list[str], token: str) -> list[str]:
        """Caches of this role and model outside `keep` that no daemon serves and no other running preload
        stands for."""
        keep_set = set(keep)
        with self._lock:
            return [n for n, e in self._entries.items()
                    if e.holding.role == role and e.holding.model == model and n not in keep_set and e.lease is None
                    and (e.owner == token or self._find(e.owner) is None)]

    def expired(self, now: float | None = None) -> list[Entry]:
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [n for n, e in self._entries.items() if e.expires_at is not None and e.expires_at <= now]
            return [self._entries.pop(n) for n in gone]

    def holdings(self) -> list[Holding]:
        now = time.monotonic()
        with self._lock:
            out = []
            for e in self._entries.values():
                p = self._find(e.owner)
                out.append(msgspec.structs.replace(
                    e.holding, preload=p.pid if p is not None else 0,
                    expires_in=None if e.expires_at is None else max(0.0, e.expires_at - now)))
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
