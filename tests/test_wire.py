"""Bad input on the wire: every malformed frame gets an error or a closed connection, and the daemon keeps
serving the next good client."""

import os
import socket
import struct
import threading

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weightcache as wc
from weightcache import wire
from weightcache.key import CacheKey
from weightcache.manifest import BlockSpec, Manifest, StorageSpec, TensorSpec

KEY = CacheKey(model="m", content_digest="d")


@pytest.fixture(scope="module")
def served():
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="wc", dir="/tmp")
    path = os.path.join(d, "w.sock")
    daemon = wc.publish({"w": torch.arange(8.0)}, path, KEY, hello_timeout=1.0)
    yield path, daemon
    daemon.close()
    shutil.rmtree(d, ignore_errors=True)


def _raw(path: str, payload: bytes, half_close: bool = True) -> bytes:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5.0)
    s.connect(path)
    try:
        s.sendall(payload)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                c = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not c:
                break
            chunks.append(c)
        return b"".join(chunks)
    finally:
        s.close()


def _reply(data: bytes):
    if len(data) < 4:
        return None
    (n,) = struct.unpack(">I", data[:4])
    return wire.decode(data[4:4 + n])


def _still_serves(path):
    with wc.attach(path, expect=KEY) as att:
        assert torch.equal(att["w"], torch.arange(8.0))


def test_truncated_frame(served):
    path, _ = served
    good = wire.encode(wire.Hello(protocol=wire.PROTOCOL_VERSION))
    reply = _reply(_raw(path, good[:-3]))
    assert isinstance(reply, wire.Error) and reply.code == "protocol" and "closed inside a frame" in reply.message
    _still_serves(path)


def test_oversized_frame_is_refused_without_reading_it(served):
    path, _ = served
    reply = _reply(_raw(path, struct.pack(">I", wire.MAX_FRAME + 1) + b"x" * 100))
    assert isinstance(reply, wire.Error) and "exceeds" in reply.message
    _still_serves(path)


def test_garbage_body(served):
    path, _ = served
    reply = _reply(_raw(path, struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1"))
    assert isinstance(reply, wire.Error) and reply.code == "protocol" and "malformed" in reply.message
    _still_serves(path)


def test_wrong_protocol_version(served):
    path, _ = served
    reply = _reply(_raw(path, wire.encode(wire.Hello(protocol=999)), half_close=False))
    assert isinstance(reply, wire.Error) and reply.code == "version" and "999" in reply.message
    _still_serves(path)


def test_unknown_mode(served):
    path, _ = served
    reply = _reply(_raw(path, wire.encode(wire.Hello(protocol=wire.PROTOCOL_VERSION, mode="steal")), half_close=False))
    assert isinstance(reply, wire.Error) and "steal" in reply.message
    _still_serves(path)


def test_unexpected_message_type(served):
    path, _ = served
    reply = _reply(_raw(path, wire.encode(wire.Pong()), half_close=False))
    assert isinstance(reply, wire.Error) and "unexpected" in reply.message
    _still_serves(path)


def test_pickle_is_not_a_message(served):
    import pickle

    path, _ = served
    body = pickle.dumps({"type": "hello"})
    reply = _reply(_raw(path, struct.pack(">I", len(body)) + body))
    assert isinstance(reply, wire.Error) and reply.code == "protocol"
    _still_serves(path)


def test_client_rejects_oversized_reply():
    a, b = socket.socketpair()
    a.sendall(struct.pack(">I", wire.MAX_FRAME + 10))
    with pytest.raises(wc.ProtocolError, match="exceeds"):
        wire.recv_msg(b)
    a.close()
    b.close()


def test_encoder_caps_frames():
    with pytest.raises(wc.ProtocolError):
        wire.encode(wire.Error(code="x", message="y" * (wire.MAX_FRAME + 1)))


def test_fds_without_marker_are_refused_and_closed():
    a, b = socket.socketpair()
    r, w = os.pipe()
    socket.send_fds(a, [b"X"], [r])
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(wc.ProtocolError):
        wire.recv_fds(b, 1)
    assert len(os.listdir("/proc/self/fd")) == before  # the received duplicate was closed
    for fd in (r, w):
        os.close(fd)
    a.close()
    b.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(served, payload):
    path, daemon = served
    data = _raw(path, payload)
    if data:
        reply = _reply(data)
        assert isinstance(reply, wire.Error | wire.Pong | wire.DaemonStatus | wire.Attached | wire.NotReady)
    assert daemon.state == "ready"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.text(max_size=10), st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=20), st.booleans(), st.none()),
                       max_size=6))
def test_fuzz_wellformed_msgpack_of_wrong_shape(served, obj):
    path, daemon = served
    body = msgspec.msgpack.encode(obj)
    data = _raw(path, struct.pack(">I", len(body)) + body)
    reply = _reply(data)
    assert isinstance(reply, wire.Error)
    assert daemon.state == "ready"


def test_after_fuzzing_a_good_client_still_attaches(served):
    _still_serves(served[0])


def _hostile_daemon(path: str, attached_body: bytes, nfds: int):
    """Answers one Hello with a hand-made Attached frame and `nfds` fds of a small memfd."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve():
        fd = os.memfd_create("wc-hostile")
        try:
            os.ftruncate(fd, 4096)
            conn, _ = listener.accept()
            with conn:
                wire.recv_msg(conn)
                conn.sendall(struct.pack(">I", len(attached_body)) + attached_body)
                wire.send_fds(conn, [fd] * nfds)
                conn.recv(1)  # until the client hangs up
        except OSError:
            pass  # the client hung up first
        finally:
            os.close(fd)
            listener.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def _attached_raw(tensor_fields=None, nfds=1) -> list:
    """An Attached message as plain msgpack data, to be bent out of shape."""
    manifest = Manifest([TensorSpec("w", "float32", [4], [1], 0, 0)], [StorageSpec(0, 0, 16)], [BlockSpec(4096)])
    raw = msgspec.msgpack.decode(wire.encode(wire.Attached(key=KEY, manifest=manifest, nfds=nfds))[4:])
    for i, v in (tensor_fields or {}).items():
        raw["manifest"]["tensors"][0][i] = v
    return raw


@pytest.mark.parametrize(
    ("fields", "nfds", "match"),
    [
        ({3: [-1]}, 1, "malformed"),  # a negative stride
        ({2: [4] * 65, 3: [1] * 65}, 1, "malformed"),  # absurd rank
        ({5: 4096}, 1, "bad manifest"),  # byte offset past its storage
        ({}, 2, "2 block handles for 1 blocks"),
    ],
    ids=["negative-stride", "rank-65", "past-storage", "extra-fds"],
)
def test_client_refuses_a_hostile_manifest_and_keeps_no_fd(sockdir, fields, nfds, match):
    path = os.path.join(sockdir, "hostile.sock")
    body = msgspec.msgpack.encode(_attached_raw(fields, nfds))
    before = set(os.listdir("/proc/self/fd"))
    t = _hostile_daemon(path, body, nfds)
    with pytest.raises(wc.ProtocolError, match=match):
        wc.attach(path, expect=KEY)
    t.join(5)
    assert set(os.listdir("/proc/self/fd")) <= before


def test_attach_leaves_the_garbage_collector_as_it_found_it(served):
    path, _ = served
    import gc

    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            with wc.attach(path, expect=KEY) as att:
                assert torch.equal(att["w"], torch.arange(8.0))
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
