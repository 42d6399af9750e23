"""Multi-node agreement through a torch.distributed TCPStore.

Node 0's supervisor hosts the store at the master address/port; every node's supervisor joins, publishes
its ranks and its checkpoint stamp (the cache key without the rank), and checks that every node agrees.
Readiness and failures are published the same way, so a failure on one node stops the start on all.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta

from ..errors import WeightCacheError

log = logging.getLogger(__name__)

POLL_S = 0.02
LINGER_S = 10.0  # how long node 0 keeps the store up after a failure so the others can read it


class RendezvousError(WeightCacheError):
    """The nodes of a preload did not agree, one of them failed, or the master could not be reached."""


def stamp_diff(a: Mapping[str, str], b: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(field, a's value, b's value) for every field that differs."""
    return [(k, str(a.get(k, "")), str(b.get(k, ""))) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _port_in_use(port: int) -> bool:
    """Whether a TCP port is taken on this host (the store listens on every address, as torch's does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


class LocalStore:
    """The store calls a single node's rendezvous makes, in process (torch.distributed's TCPStore's methods)."""

    def __init__(self):
        self._data: dict[str, bytes] = {}

    def set(self, key: str, value) -> None:
        self._data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        return self._data[key]

    def add(self, key: str, n: int) -> int:
        v = int(self._data.get(key, b"0")) + n
        self._data[key] = str(v).encode()
        return v

    def check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)


class Rendezvous:
    """One daemon group's (role's) view of the cluster; one store per group, on its own port."""

    def __init__(self, *, group: str, master_addr: str, master_port: int, nnodes: int, node_rank: int,
                 timeout: float = 300.0, local: bool = False):
        if nnodes < 1 or not 0 <= node_rank < nnodes:
            raise RendezvousError(f"node rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
        if node_rank > 0 and not master_port:
            raise RendezvousError("a master port is required to join node 0's store from another node")
        self.group, self.master_addr, self.nnodes, self.node_rank = group, master_addr, nnodes, node_rank
        self.port = int(master_port or 0)
        self.timeout = float(timeout)
        self.store = None
        self._prefix = f"weightcache/{group}/"
        self._linger = False  # the start failed: node 0 keeps the store up until the others read why
        self._stamps: dict[int, dict[str, str]] = {}
        self._seen = False
        self.all_held = False  # after agree(): every node's custodian holds all its ranks' caches
        # one node and no daemon that meets its peers through the store: an in-process store (no torch)
        self.local = local and nnodes == 1

    @property
    def is_master(self) -> bool:
        return self.node_rank == 0

    def _k(self, name: str) -> str:
        return self._prefix + name

    def start(self) -> int:
        """Host (node 0) or reach the store. Returns the port (the real one when 0 was asked)."""
        if self.local:
            self.store = LocalStore()
            return self.port
        import torch.distributed as dist

        where = f"{self.master_addr}:{self.port}"
        if not self.is_master:
            self._await_master(where)
        elif self.port and _port_in_use(self.port):
            raise RendezvousError(f"[{self.group}] rendezvous port {self.port} is already in use on this host: "
                                  "pick another --weight-cache-master-port")
        try:
            self.store = dist.TCPStore(
                self.master_addr, self.port, None, self.is_master,
                timeout=timedelta(seconds=self.timeout), wait_for_workers=False,
            )
        except Exception as e:  # DistNetworkError / DistStoreError / RuntimeError
            if self.is_master:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RendezvousError(
                    f"[{self.group}] node 0 cannot listen on port {self.port}: {first} "
                    "(is the port in use? pick another --weight-cache-master-port)") from e
            raise RendezvousError(
                f"[{self.group}] node {self.node_rank} cannot reach the master at {where} within "
                f"{self.timeout:.0f} s: {e} (is node 0 running preload with the same --master-addr and port?)"
            ) from e
        self.port = int(self.store.port)
        return self.port

    def _await_master(self, where: str) -> None:
        """Wait for node 0's store to listen, in Python, so that signals stay responsive meanwhile."""
        deadline = time.monotonic() + self.timeout
        last = None
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.master_addr, self.port), timeout=1.0).close()
                return
            except OSError as e:
                if last is None:
                    log.info("[%s] node %d: waiting for node 0's store at %s", self.group, self.node_rank, where)
                last = e
                time.sleep(0.1)
        raise RendezvousError(
            f"[{self.group}] node {self.node_rank} cannot reach the master at {where} within {self.timeout:.0f} s: "
            f"{last} (is node 0 running preload with the same --master-addr and port?)")

    # --- store helpers that turn a vanished master into a clear error ---
    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            raise RendezvousError(
                f"[{self.group}] lost contact with the master (node 0 at {self.master_addr}:{self.port}): {e}; "
                "node 0 failed or exited") from e

    def _get(self, name: str):
        return json.loads(self._call(self.store.get, self._k(name)))

    def _set(self, name: str, value) -> None:
        self._call(self.store.set, self._k(name), json.dumps(value))

    def _check(self, names: list[str]) -> bool:
        return bool(self._call(self.store.check, [self._k(n) for n in names]))

    def _raise_if_failed(self) -> None:
        if self._call(self.store.add, self._k("nfailed"), 0) <= 0:
            return
        msgs = []
        for n in range(self.nnodes):
            if self._check([f"failed/{n}"]):
                msgs.append(f"node {n}: {self._get(f'failed/{n}')}")
        self._linger = True
        raise RendezvousError(f"[{self.group}] the start failed on another node:\n  " + "\n  ".join(msgs))

    def _wait_for(self, names: list[str], what: str, deadline: float, on_poll=None) -> None:
        while True:
            if on_poll is not None:
                on_poll()
            self._raise_if_failed()
            missing = [n for n in names if not self._check([n])]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"[{self.group}] timed out after {self.timeout:.0f} s waiting for {what}: "
                    f"missing {', '.join(missing)} (is every node running preload with the same "
                    f"--master-addr {self.master_addr} and master port {self.port}?)")
            time.sleep(POLL_S)

    # --- protocol ---
    def agree(self, stamp: Mapping[str, str], ranks: Iterable[int], world_size: int | None = None,
              on_poll=None, held: bool = False) -> dict[int, dict[str, str]]:
        """Publish this node's stamp and ranks, wait for every node, and check that they agree. `held`: this
        node's custodian holds the caches of all its ranks; `all_held` is then whether every node's does.

        `on_poll()` runs while waiting (e.g. to notice a local daemon dying); what it raises propagates."""
        assert self.store is not None, "start() first"
        ranks = sorted(int(r) for r in ranks)
        stamp = {k: str(v) for k, v in stamp.items()}
        if self._call(self.store.add, self._k(f"joined/{self.node_rank}"), 1) > 1:
            self.fail(f"two supervisors started with --node-rank {self.node_rank}")
            raise RendezvousError(
                f"[{self.group}] another supervisor already joined as node {self.node_rank}: "
                "every node needs its own --node-rank")
        self._set(f"stamp/{self.node_rank}", stamp)
        self._set(f"ranks/{self.node_rank}", ranks)
        self._set(f"held/{self.node_rank}", bool(held))
        deadline = time.monotonic() + self.timeout
        names = [f"{what}/{n}" for what in ("stamp", "ranks", "held") for n in range(self.nnodes)]
        self._wait_for(names, "every node to join", deadline, on_poll)
        stamps = {n: self._get(f"stamp/{n}") for n in range(self.nnodes)}
        node_ranks = {n: self._get(f"ranks/{n}") for n in range(self.nnodes)}
        problems = []
        for n in range(1, self.nnodes):
            d = stamp_diff(stamps[0], stamps[n])
            if d:
                fields = "\n".join(f"    {f}: node 0 has {a!r}, node {n} has {b!r}" for f, a, b in d)
                problems.append(f"node {n}'s checkpoint stamp differs from node 0's "
                                f"({', '.join(f for f, _, _ in d)}):\n{fields}")
        owner: dict[int, int] = {}
        for n, rs in node_ranks.items():
            for r in rs:
                if r in owner:
                    problems.append(f"rank {r} is claimed by node {owner[r]} and node {n}")
                owner.setdefault(r, n)
        if world_size is not None:
            missing = sorted(set(range(world_size)) - set(owner))
            if missing:
                problems.append(f"no node holds rank(s) {missing} of a world of {world_size}")
        if problems:
            # Every node computes the same verdict; nobody waits for the others to report it.
            self._linger = True
            raise RendezvousError(f"[{self.group}] the nodes disagree:\n  " + "\n  ".join(problems))
        self._stamps = stamps
        self.all_held = all(self._get(f"held/{n}") for n in range(self.nnodes))
        return stamps

    def fail(self, message: str) -> None:
        """Tell every node that this node's start failed (best effort)."""
        self._linger = True
        if self.store is None:
            return
        try:
            self.store.set(self._k(f"failed/{self.node_rank}"), json.dumps(message))
            self.store.add(self._k("nfailed"), 1)
        except Exception as e:  # the master may be gone already
            log.debug("could not publish the failure: %s", e)

    def mark_ready(self, info: Mapping | None = None) -> None:
        self._set(f"ready/{self.node_rank}", dict(info or {}))

    def poll_ready(self) -> bool:
        """True once every node is ready and (on node 0) every node has seen it; raises if one failed."""
        self._raise_if_failed()
        if not self._check([f"ready/{n}" for n in range(self.nnodes)]):
            return False
        if not self.is_master:
            if not self._seen:
                self._call(self.store.add, self._k("seen_ready"), 1)
                self._seen = True
            return True
        # Node 0 hosts the store: it may exit only after every node has read the verdict.
        return self._call(self.store.add, self._k("seen_ready"), 0) >= self.nnodes - 1

    def wait_ready(self, timeout: float | None = None) -> dict[int, dict]:
        """Block until every node is ready (cluster-wide readiness) or one failed."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self.poll_ready():
            if time.monotonic() > deadline:
                missing = [n for n in range(self.nnodes) if not self._check([f"ready/{n}"])]
                raise RendezvousError(f"[{self.group}] timed out after {self.timeout:.0f} s waiting for every "
                                      f"node to be ready (not ready: node(s) {missing})")
            time.sleep(POLL_S)
        return {n: self._get(f"ready/{n}") for n in range(self.nnodes)}

    def cluster_state(self) -> dict[str, object]:
        """Which nodes joined, are ready, failed (for /status)."""
        if self.store is None:
            return {}
        try:
            out = {"nnodes": self.nnodes, "node_rank": self.node_rank, "ready": [], "failed": {}}
            for n in range(self.nnodes):
                if self.store.check([self._k(f"ready/{n}")]):
                    out["ready"].append(n)
                if self.store.check([self._k(f"failed/{n}")]):
                    out["failed"][n] = json.loads(self.store.get(self._k(f"failed/{n}")))
            return out
        except Exception as e:
            return {"nnodes": self.nnodes, "node_rank": self.node_rank, "error": str(e)}

    def close(self) -> None:
        store, self.store = self.store, None
        if store is None:
            return
        try:
            if self.is_master and self._linger and self.nnodes > 1:
                # Keep the store up (a while) until every other node has read the verdict.
                deadline = time.monotonic() + LINGER_S
                while time.monotonic() < deadline and store.add(self._k("left"), 0) < self.nnodes - 1:
                    time.sleep(POLL_S)
            elif not self.is_master:
                store.add(self._k("left"), 1)
        except Exception as e:
            log.debug("rendezvous close: %s", e)
        del store
