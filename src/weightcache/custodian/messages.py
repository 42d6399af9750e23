"""The custodian's typed messages (msgspec, in wire's framing); keys and manifests travel as opaque bytes."""

from __future__ import annotations

import msgspec

from ..errors import WeightCacheError

PROTOCOL = 2  # 2: preloads register a credential; deposits and claims carry it; leases
MAX_FRAME = 64 << 20  # a deposit carries a whole manifest
MAX_BLOCKS = 4096  # per cache


class CustodianError(WeightCacheError):
    """The custodian refused a request or cannot be reached."""


class CustodianUnresponsive(CustodianError):
    """A custodian listens but does not answer (stopped, or stuck): what it holds is unknown, not nothing."""

    def __init__(self, message: str, pid: int = 0):
        super().__init__(message)
        self.pid = pid


class Holding(msgspec.Struct, kw_only=True):
    """One cache the custodian holds, as listed (keys and manifests stay opaque)."""

    name: str  # the daemon's socket file name: role, rank, device and key hash
    model: str
    role: str
    rank: int
    device: str  # "cpu" | "cuda"
    gpu_uuid: str = ""
    block_bytes: list[int]
    deposited_at: float = 0.0
    deposited_by: int = 0  # pid
    served_by: int = 0  # pid of the daemon serving it now; 0: none (held for a replacement)
    handovers: int = 0  # times a replacement daemon took it
    preload: int = 0  # pid of the preload (supervisor) it belongs to while that preload runs; 0: none
    kept: bool = False  # its preload stopped with --weight-cache-keep-on-stop: held until released
    expires_in: float | None = None  # seconds until it is freed (its preload is gone); None: not counting down

    @property
    def nbytes(self) -> int:
        return sum(self.block_bytes)


class Hello(msgspec.Struct, tag="c_hello", kw_only=True):
    protocol: int
    client: str = ""


class Welcome(msgspec.Struct, tag="c_welcome", kw_only=True):
    protocol: int
    pid: int
    started_at: float


class Register(msgspec.Struct, tag="c_register", kw_only=True):
    """A preload's supervisor: its credential (a secret it hands its daemons alone) and how long its caches
    stay held once it is gone. While this connection is open the preload counts as running."""

    token: str
    hold_after_exit: float


class Registered(msgspec.Struct, tag="c_registered", kw_only=True):
    owned: list[str] = []  # caches already held for this credential (a supervisor that reconnected)


class Deposit(msgspec.Struct, tag="c_deposit", kw_only=True):
    """Hold these blocks (the fds follow); the connection then serves them until it closes."""

    holding: Holding
    key: bytes
    manifest: bytes
    nfds: int
    token: str = ""


class Held(msgspec.Struct, tag="c_held", kw_only=True):
    holding: Holding
    replaced: bool = False


class Claim(msgspec.Struct, tag="c_claim", kw_only=True):
    """The cache held under `name`, if any; the connection then serves it until it closes."""

    name: str
    token: str = ""


class Claimed(msgspec.Struct, tag="c_claimed", kw_only=True):
    holding: Holding
    key: bytes
    manifest: bytes
    nfds: int


class Miss(msgspec.Struct, tag="c_miss", kw_only=True):
    name: str


class Keep(msgspec.Struct, tag="c_keep", kw_only=True):
    """Hold these caches of the credential's preload until they are released (no lease once it is gone)."""

    names: list[str] = []
    token: str = ""


class Kept(msgspec.Struct, tag="c_kept", kw_only=True):
    names: list[str] = []


class Release(msgspec.Struct, tag="c_release", kw_only=True):
    names: list[str] = []
    everything: bool = False


class Prune(msgspec.Struct, tag="c_prune", kw_only=True):
    """Release the caches of `role` and `model` other than `keep` that no live daemon serves and no other
    running preload stands for (stale flags, another layout or a changed checkpoint of the same model)."""

    role: str
    model: str
    keep: list[str] = []
    token: str = ""


class Released(msgspec.Struct, tag="c_released", kw_only=True):
    names: list[str] = []
    nbytes: int = 0


class ListHoldings(msgspec.Struct, tag="c_list"):
    pass


class Holdings(msgspec.Struct, tag="c_holdings", kw_only=True):
    pid: int
    started_at: float
    holdings: list[Holding] = []


class Stop(msgspec.Struct, tag="c_stop"):
    """Release everything and exit."""


class Error(msgspec.Struct, tag="c_error", kw_only=True):
    code: str  # protocol | version | permission | refused | bad_request | busy | internal
    message: str


Message = (Hello | Welcome | Register | Registered | Deposit | Held | Claim | Claimed | Miss | Keep | Kept | Release
           | Prune | Released | ListHoldings | Holdings | Stop | Error)
_decoder = msgspec.msgpack.Decoder(Message)
