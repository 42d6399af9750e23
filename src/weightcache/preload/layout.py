"""DP x PP x TP (+EP) rank placement, as vLLM lays ranks out.

Global rank = ``dp_rank * pp * tp + pp_rank * tp + tp_rank``. On a node, the local index of a rank is
its device index. Two ways to span nodes (vLLM's flags in brackets):

* ``nnodes``/``node_rank``/``master_addr`` [--nnodes --node-rank --master-addr]: the ``dp * pp * tp``
  ranks are spread over the nodes, each node holding ``world / nnodes`` consecutive ranks (TP/PP, and
  whole DP replicas when they fit, across nodes).
* ``dp_local``/``dp_rank_start``/``dp_address`` [--data-parallel-size-local --data-parallel-start-rank
  --data-parallel-address]: this node hosts DP ranks ``[dp_rank_start, dp_rank_start + dp_local)``, each
  a whole ``pp * tp`` replica.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace

from ..errors import LayoutError

ROLES = ("main", "draft")


def is_loopback(address: str) -> bool:
    """True for literal loopback addresses and ``localhost`` (no name resolution)."""
    a = address.strip().strip("[]").lower()
    if a in ("localhost", "ip6-localhost", "ip6-loopback") or a.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(a).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Placement:
    """One rank of one role: where it sits in the parallel layout and on which local device."""

    role: str
    dp_rank: int
    pp_rank: int
    tp_rank: int
    ep: bool
    rank: int  # global rank
    world_size: int
    local_index: int  # == device index on this node
    node_rank: int
    device: str  # "cuda:3" or "cpu"
    tp_size: int
    pp_size: int
    dp_size: int

    @property
    def ep_size(self) -> int:
        """Expert-parallel group size (vLLM: EP spans DP x TP); 1 without EP."""
        return self.dp_size * self.tp_size if self.ep else 1

    @property
    def ep_rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank if self.ep else 0

    def name(self) -> str:
        return f"{self.role}-dp{self.dp_rank}-pp{self.pp_rank}-tp{self.tp_rank}"


def _positive(name: str, value, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name} must be a positive integer, got {value!r}; {hint}")
    return value


@dataclass(frozen=True)
class Layout:
    """The whole job's layout plus which part of it this node runs. Validated on construction."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    dp_local: int | None = None
    dp_rank_start: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    dp_address: str | None = None
    dp_rpc_port: int | None = None
    ep: bool = False
    role: str = "main"
    local_devices: int | None = None
    device_type: str = "cuda"

    def __post_init__(self) -> None:
        _positive("tensor parallel size (tp)", self.tp, "pass --tensor-parallel-size N with N >= 1")
        _positive("pipeline parallel size (pp)", self.pp, "pass --pipeline-parallel-size N with N >= 1")
        _positive("data parallel size (dp)", self.dp, "pass --data-parallel-size N with N >= 1")
        _positive("nnodes", self.nnodes, "pass --nnodes N with N >= 1")
        if self.role not in ROLES:
            raise LayoutError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise LayoutError(
                f"node rank {self.node_rank!r} is out of range for {self.nnodes} node(s); "
                f"pass --node-rank between 0 and {self.nnodes - 1}"
            )
        if self.local_devices is not None and (
            not isinstance(self.local_devices, int) or self.local_devices < 0
        ):
            raise LayoutError(f"local device count must be a non-negative integer, got {self.local_devices!r}")
        if self.dp_local is None:
            self._check_spread()
        else:
            self._check_dp_local()
        self._check_addresses()
        n = self.local_size
        if self.local_devices is not None and n > self.local_devices:
            raise LayoutError(
                f"this node would run {n} rank(s) ({self.describe()}, node {self.node_rank} of "
                f"{self.nodes}) but only {self.local_devices} device(s) are visible; use more nodes "
                f"(--nnodes / --data-parallel-size-local), smaller parallel sizes, or more devices "
                f"(check CUDA_VISIBLE_DEVICES)"
            )

    def _check_spread(self) -> None:
        if self.dp_rank_start is not None:
            raise LayoutError(
                "a data parallel start rank needs --data-parallel-size-local (how many DP ranks this node hosts)"
            )
        if self.world_size % self.nnodes:
            raise LayoutError(
                f"{self.world_size} ranks ({self.describe()}) do not divide evenly over {self.nnodes} nodes; "
                f"choose --nnodes dividing dp*pp*tp = {self.world_size}"
            )

    def _check_dp_local(self) -> None:
        dl = self.dp_local
        if isinstance(dl, bool) or not isinstance(dl, int) or dl < 1:
            raise LayoutError(
                f"data parallel size local must be a positive integer, got {dl!r}; a node without local "
                f"DP ranks has nothing to preload"
            )
        if dl > self.dp:
            raise LayoutError(
                f"data parallel size local ({dl}) exceeds the data parallel size ({self.dp}); "
                f"lower --data-parallel-size-local or raise --data-parallel-size"
            )
        start = self.dp_start
        if not isinstance(start, int) or start < 0:
            raise LayoutError(f"data parallel start rank must be a non-negative integer, got {start!r}")
        if start + dl > self.dp:
            raise LayoutError(
                f"this node would host DP ranks {start}..{start + dl - 1} but the data parallel size is "
                f"{self.dp}; lower --data-parallel-start-rank (or --data-parallel-size-local)"
            )
        if self.nnodes > 1:
            if self.nnodes > self.dp:
                raise LayoutError(
                    f"--nnodes {self.nnodes} exceeds the data parallel size {self.dp}: with "
                    f"--data-parallel-size-local every node hosts at least one DP rank"
                )
            expect = -(-self.dp // dl)
            if self.dp_rank_start is None and self.nnodes != expect:
                # start rank derived from the node rank: nodes hold dp_local ranks each
                raise LayoutError(
                    f"--nnodes {self.nnodes} does not match {self.dp} DP ranks at {dl} per node "
                    f"({expect} node(s)); set it to {expect}, or pass --data-parallel-start-rank "
                    f"when nodes host different numbers of DP ranks"
                )

    def _check_addresses(self) -> None:
        nodes = self.nodes
        if nodes > 1 and self.dp_local is None:
            if not self.master_addr:
                raise LayoutError(
                    f"{nodes} nodes need a master address every node can reach; pass --master-addr "
                    f"(the same on every node)"
                )
            if is_loopback(self.master_addr):
                raise LayoutError(
                    f"master address {self.master_addr!r} is a loopback address but the job spans {nodes} "
                    f"nodes; pass --master-addr with node 0's reachable IP or hostname"
                )
        if self.dp_local is not None and self.dp_local < self.dp:
            addr = self.dp_address or self.master_addr
            if not addr:
                raise LayoutError(
                    f"data parallel across {nodes} nodes needs --data-parallel-address (node 0's reachable "
                    f"address, the same on every node)"
                )
        if nodes > 1:
            for flag, addr in (("--data-parallel-address", self.dp_address), ("--master-addr", self.master_addr)):
                if addr and is_loopback(addr):
                    raise LayoutError(
                        f"{flag} {addr!r} is a loopback address but the job spans {nodes} nodes; "
                        f"use node 0's reachable IP or hostname"
                    )

    # -- derived -------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def replica_size(self) -> int:
        return self.pp * self.tp

    @property
    def dp_start(self) -> int:
        if self.dp_local is None:
            return 0
        if self.dp_rank_start is not None:
            return self.dp_rank_start
        return self.node_rank * self.dp_local

    @property
    def nodes(self) -> int:
        """Number of nodes the job spans (pass ``nnodes`` when DP ranks split unevenly over nodes)."""
        if self.dp_local is None or self.nnodes > 1:
            return self.nnodes
        return -(-self.dp // self.dp_local)

    @property
    def this_node(self) -> int:
        if self.dp_local is None or self.nnodes > 1:
            return self.node_rank
        return self.dp_start // self.dp_local

    @property
    def local_size(self) -> int:
        if self.dp_local is None:
            return self.world_size // self.nnodes
        return self.dp_local * self.replica_size

    @property
    def ep_size(self) -> int:
        return self.dp * self.tp if self.ep else 1

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        for n, v, size in (("dp", dp_rank, self.dp), ("pp", pp_rank, self.pp), ("tp", tp_rank, self.tp)):
            if not 0 <= v < size:
                raise LayoutError(f"{n} rank {v} is out of range for {n} size {size}")
        return dp_rank * self.pp * self.tp + pp_rank * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is out of range for world size {self.world_size}")
        dp_rank, rest = divmod(rank, self.replica_size)
        pp_rank, tp_rank = divmod(rest, self.tp)
        return dp_rank, pp_rank, tp_rank

    def local_ranks(self) -> range:
        """Global ranks this node runs, in local-index order."""
        if self.dp_local is None:
            first = self.node_rank * self.local_size
        else:
            first = self.dp_start * self.replica_size
        return range(first, first + self.local_size)

    def placement(self, rank: int) -> Placement:
        dp_rank, pp_rank, tp_rank = self.coords(rank)
        local = self.local_ranks()
        if rank in local:
            local_index = rank - local.start
            node = self.this_node
        else:
            if self.dp_local is None:
                node, local_index = divmod(rank, self.local_size)
            else:
                node, r = divmod(dp_rank, self.dp_local)
                local_index = r * self.replica_size + pp_rank * self.tp + tp_rank
        device = "cpu" if self.device_type == "cpu" else f"{self.device_type}:{local_index}"
        return Placement(
            role=self.role,
            dp_rank=dp_rank,
            pp_rank=pp_rank,
            tp_rank=tp_rank,
            ep=self.ep,
            rank=rank,
            world_size=self.world_size,
            local_index=local_index,
            node_rank=node,
            device=device,
            tp_size=self.tp,
            pp_size=self.pp,
            dp_size=self.dp,
        )

    def placements(self) -> list[Placement]:
        """Every rank of the job, in global-rank order."""
        return [self.placement(r) for r in range(self.world_size)]

    def local_placements(self) -> list[Placement]:
        """The ranks this node runs, in local-index (device) order."""
        return [self.placement(r) for r in self.local_ranks()]

    def describe(self) -> str:
        """Layout string for ``CacheKey.layout``, e.g. ``dp1-pp1-tp2`` (``-ep4`` with expert parallel)."""
        s = f"dp{self.dp}-pp{self.pp}-tp{self.tp}"
        return s + (f"-ep{self.ep_size}" if self.ep else "")

    def draft(self) -> Layout:
        """The same placements for a speculative-decoding draft model (role ``draft``)."""
        return replace(self, role="draft")

    @classmethod
    def from_vllm_args(cls, **kw) -> Layout:
        """Build from vLLM's engine-argument names (``tensor_parallel_size``, ``data_parallel_size_local``, ...)."""
        known = {
            "tensor_parallel_size": "tp",
            "pipeline_parallel_size": "pp",
            "data_parallel_size": "dp",
            "data_parallel_size_local": "dp_local",
            "data_parallel_start_rank": "dp_rank_start",
            "data_parallel_rank": "dp_rank_start",
            "data_parallel_address": "dp_address",
            "data_parallel_rpc_port": "dp_rpc_port",
            "enable_expert_parallel": "ep",
            "nnodes": "nnodes",
            "node_rank": "node_rank",
            "master_addr": "master_addr",
            "master_port": "master_port",
            "role": "role",
            "local_devices": "local_devices",
            "device_type": "device_type",
        }
        unknown = sorted(set(kw) - set(known))
        if unknown:
            raise LayoutError(f"unknown layout argument(s) {unknown}; known: {sorted(known)}")
        if "data_parallel_start_rank" in kw and "data_parallel_rank" in kw:
            if kw["data_parallel_start_rank"] != kw["data_parallel_rank"] and None not in (
                kw["data_parallel_start_rank"], kw["data_parallel_rank"]
            ):
                raise LayoutError("pass only one of data_parallel_start_rank / data_parallel_rank")
        if kw.get("data_parallel_rank") is not None and kw.get("data_parallel_size_local") is None:
            kw["data_parallel_size_local"] = 1  # vLLM: one DP rank per launch (external load balancing)
        args = {}
        for k, v in kw.items():
            if v is not None:
                args[known[k]] = v
        return cls(**args)


class LoopbackLayout(Layout):
    """A Layout whose "nodes" may share one host over loopback (--weight-cache-allow-loopback-nodes)."""

    def _check_addresses(self) -> None:
        if self.nodes > 1 and self.dp_local is None and not self.master_addr:
            raise LayoutError(f"{self.nodes} nodes need --master-addr (the same on every node)")
        if self.dp_local is not None and self.dp_local < self.dp and not (self.dp_address or self.master_addr):
            raise LayoutError(f"data parallel across {self.nodes} nodes needs --data-parallel-address")
