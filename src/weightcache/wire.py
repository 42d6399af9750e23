"""The control protocol: length-prefixed msgpack frames of typed messages over AF_UNIX stream sockets.

Frame = 4-byte big-endian length + msgpack body (a tagged msgspec Struct). Frames are capped in size.
Block file descriptors follow an `Attached` frame in batches, each batch riding on one marker byte with
SCM_RIGHTS. Nothing is ever pickled.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import msgspec

from .errors import DaemonUnavailable, ProtocolError
from .key import CacheKey, FieldDiff
from .manifest import Manifest

PROTOCOL_VERSION = 3  # 2: manifest specs travel as arrays; 3: blocks carry digests, verify requests
MAX_FRAME = 64 << 20  # daemon -> client (a large model's manifest)
MAX_REQUEST_FRAME = 256 << 10  # client -> daemon: a Hello with its key, a status request, a ping
RECV_CHUNK = 64 << 10  # a frame's buffer grows with what has arrived, never ahead of it
FD_BATCH = 250  # below the kernel's SCM_MAX_FD (253)
FD_MARKER = b"F"
ATTACH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_HEADER = struct.Struct(">I")


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    protocol: int
    mode: str = "map"  # "map" | "copy"
    readonly: bool = True
    expect: CacheKey | None = None
    client: str = ""


class Attached(msgspec.Struct, tag="attached", kw_only=True):
    key: CacheKey
    manifest: Manifest
    nfds: int


class NotReady(msgspec.Struct, tag="not_ready", kw_only=True):
    state: str
    done: int = 0
    total: int = 0
    message: str = ""


class Error(msgspec.Struct, tag="error", kw_only=True):
    code: str  # protocol | version | key_mismatch | permission | busy | failed | internal
    message: str
    diffs: list[FieldDiff] = []


class StatusRequest(msgspec.Struct, tag="status"):
    pass


class DaemonStatus(msgspec.Struct, tag="status_reply", kw_only=True):
    state: str
    message: str = ""
    done: int = 0
    total: int = 0
    key: CacheKey
    device: str
    gpu_uuid: str = ""
    pid: int
    nbytes: int = 0
    ntensors: int = 0
    nblocks: int = 0
    clients_attached: int = 0
    attaches_served: int = 0
    attaches_refused: int = 0
    bytes_served: int = 0
    started_at: float
    load_seconds: float = 0.0
    load_bytes_per_second: float = 0.0  # so far while loading; over the whole load once ready
    peak_device_bytes: int = 0  # device memory in use above the daemon's start, at most, while loading (CUDA)
    adopted: bool = False  # taken over from the custodian: no load
    held: bool = False  # the custodian holds a copy: the cache outlives this daemon
    ready_seconds: float = 0.0  # from binding the socket to ready
    attach_seconds_sum: float = 0.0
    attach_seconds_count: int = 0
    attach_seconds_buckets: list[int] = []
    info: dict[str, str] = {}
    phases: dict[str, float] = {}  # seconds the load spent in each phase (reading, building, packing, ...)
    integrity: str = ""  # the algorithm of the digests recorded at load ("": none recorded)
    digest_seconds: float = 0.0  # computing them, after the fill (or verifying them, after an adoption)
    verified_at: float = 0.0  # time.time() of the last re-hash of the resident bytes; 0: never
    verify_seconds: float = 0.0
    verify_result: str = ""  # "" (never) | "ok" | "mismatch" | "error"
    verify_message: str = ""  # what differed (or failed), one line
    verifications: int = 0  # re-hashes done (requests and scrubs)
    scrub_interval: float = 0.0  # seconds between background re-hashes; 0: none


class VerifyRequest(msgspec.Struct, tag="verify"):
    """Re-hash the resident bytes and compare them with the digests recorded at load."""


class BlockMismatch(msgspec.Struct, kw_only=True):
    block: int
    chunks: list[int]  # the chunks whose digest differs
    tensors: list[str]  # the tensors overlapping them; empty: only bytes between tensors differ


class VerifyReport(msgspec.Struct, tag="verify_reply", kw_only=True):
    state: str  # the daemon's
    checked: bool = False  # the resident bytes were hashed
    ok: bool = False
    algorithm: str = ""
    chunk_bytes: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    checked_at: float = 0.0  # time.time()
    mismatches: list[BlockMismatch] = []
    message: str = ""


class Ping(msgspec.Struct, tag="ping"):
    pass


class Pong(msgspec.Struct, tag="pong"):
    pass


Message = (Hello | Attached | NotReady | Error | StatusRequest | DaemonStatus | VerifyRequest | VerifyReport | Ping
           | Pong)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg) -> bytes:
    body = _encoder.encode(msg)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte frame cap")
    return _HEADER.pack(len(body)) + body


def decode(body: bytes, decoder: msgspec.msgpack.Decoder | None = None):
    try:
        return (decoder or _decoder).decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed message: {e}") from None


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Read exactly n bytes. Memory grows with the bytes that arrived (each read asks for at most what is
    held already, or RECV_CHUNK): a header announcing a large frame costs nothing until its body comes."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"frame not complete in time ({got} of {n} bytes)")
            sock.settimeout(left)
        chunk = sock.recv(min(n - got, max(RECV_CHUNK, got)))
        if not chunk:
            if got == 0:
                raise EOFError("peer closed the connection")
            raise ProtocolError(f"connection closed inside a frame ({got} of {n} bytes)")
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def send_msg(sock: socket.socket, msg) -> None:
    sock.sendall(encode(msg))


def send_frame(sock: socket.socket, frame: bytes) -> None:
    """Send a frame made once by encode() (a daemon's Attached reply is the same for every client)."""
    sock.sendall(frame)


def recv_msg(sock: socket.socket, max_frame: int = MAX_FRAME, deadline: float | None = None,
             decoder: msgspec.msgpack.Decoder | None = None):
    """Read one frame, all of it before `deadline` (time.monotonic()) if given; `decoder` decodes another
    protocol's messages over the same framing (the custodian's).

    Raises EOFError on a clean close before a frame, ProtocolError on bad frames, TimeoutError past the deadline.
    """
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the {max_frame}-byte cap")
    return decode(_recv_exact(sock, length, deadline), decoder)


def send_fds(sock: socket.socket, fds: list[int]) -> None:
    for i in range(0, len(fds), FD_BATCH):
        socket.send_fds(sock, [FD_MARKER], fds[i:i + FD_BATCH])


def recv_fds(sock: socket.socket, n: int) -> list[int]:
    fds: list[int] = []
    try:
        while len(fds) < n:
            data, got, flags, _ = socket.recv_fds(sock, 1, min(FD_BATCH, n - len(fds)))
            fds.extend(got)
            if not data:
                raise DaemonUnavailable("daemon closed the connection while sending block handles")
            if data != FD_MARKER or flags & socket.MSG_CTRUNC or not got:
                raise ProtocolError("expected block file descriptors (SCM_RIGHTS) after the manifest")
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        raise
    return fds


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)
