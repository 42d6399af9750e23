"""The custodian: a cache outlives its daemon; a replacement serves the same bytes without a load; releasing
(or the holder's death) frees the memory once no engine maps it; bad input gets a one-line error."""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import struct
import time

import psutil
import pytest
import torch

import weightcache as wc
from conftest import DEVICES
from procs import bits, block_digests, memfd_inodes, sample_tensors, start_held_daemon
from weightcache import wire
from weightcache.custodian.client import CustodianClient, launch
from weightcache.custodian.messages import CustodianError, Holding
from weightcache.daemon import Daemon
from weightcache.errors import PermissionDenied, ProtocolError, WeightCacheError
from weightcache.key import CacheKey
from weightcache.sockets import custodian_socket_path

KEY = CacheKey(model="sample", content_digest="d0")


def wait_for(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def custodian(sockdir):
    """A detached custodian process for the socket directory, and our connection to it."""
    launch(sockdir)
    client = CustodianClient.connect(sockdir)
    pid = client.pid
    yield client
    try:
        client.stop()
    except WeightCacheError:
        pass
    client.close()
    try:
        wait_for(lambda: gone(pid), 10, "the custodian to exit")
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def _sock(sockdir, name="main-r0-cpu-00000000.sock"):
    return os.path.join(sockdir, name)


def held_daemon(sock, key, custodian, tensors=None) -> Daemon:
    d = Daemon(sock, key, custodian=custodian.path)
    d.start()
    if not d.adopt():
        d.load_tensors(sample_tensors() if tensors is None else tensors)
    return d


@pytest.mark.parametrize("device", DEVICES)
def test_a_replacement_daemon_serves_the_same_bytes_without_a_load(sockdir, custodian, device, caplog):
    sock = _sock(sockdir)
    first, how = start_held_daemon(sock, str(custodian.path), device)
    assert how == "LOADED"
    served = block_digests(sock)
    engine = wc.attach(sock)
    before = {k: bits(v).clone() for k, v in engine.items()}
    with caplog.at_level(logging.WARNING, logger="weightcache.client"):
        first.kill()
        first.wait()
        wait_for(lambda: engine.daemon_lost, what="the engine to notice")
    lost = [r for r in caplog.records if "is gone" in r.getMessage()]
    assert len(lost) == 1 and sock in lost[0].getMessage()
    wait_for(lambda: not custodian.holdings().holdings[0].served_by, what="the custodian to see the death")
    (held,) = custodian.holdings().holdings
    assert held.name == os.path.basename(sock) and held.device == device

    second, how = start_held_daemon(sock, str(custodian.path), device)
    try:
        assert how == "ADOPTED"
        st = wc.query_status(sock)
        assert st.adopted and st.held and st.done == 0 and st.state == "ready"
        assert block_digests(sock) == served
        with wc.attach(sock, expect=KEY) as again:
            for k, v in again.items():
                assert torch.equal(bits(v), before[k]), k
        for k, v in engine.items():  # the engine attached to the first daemon still reads its weights
            assert torch.equal(bits(v), before[k]), k
        (held,) = custodian.holdings().holdings
        assert held.served_by == second.pid and held.handovers == 1
    finally:
        second.kill()
        second.wait()
        engine.close()


def test_release_frees_the_memory_once_no_engine_maps_it(sockdir, custodian, capsys):
    from weightcache.cli import main

    base = memfd_inodes()
    d = held_daemon(_sock(sockdir), KEY, custodian)
    engine = wc.attach(_sock(sockdir))
    ref = bits(engine["embed"]).clone()
    d.close()  # the daemon is gone; the custodian holds the cache
    ours = memfd_inodes() - base
    assert ours and ours <= memfd_inodes([custodian.pid])

    assert main(["release", "--socket-dir", str(sockdir), "--list"]) == 0
    assert "main-r0-cpu-00000000.sock" in capsys.readouterr().out
    assert main(["release", "--socket-dir", str(sockdir)]) == 0
    assert "released 1 cache(s)" in capsys.readouterr().out
    assert custodian.holdings().holdings == []
    assert not ours & memfd_inodes([custodian.pid])
    assert torch.equal(bits(engine["embed"]), ref)  # the engine keeps its mapping
    engine.close()
    del engine
    gc.collect()
    assert not ours & memfd_inodes(), "the memory returns once nothing maps it"


def test_the_holders_death_frees_the_memory_once_no_engine_maps_it(sockdir):
    launch(sockdir)
    client = CustodianClient.connect(sockdir)
    pid = client.pid
    base = memfd_inodes()
    d = held_daemon(_sock(sockdir), KEY, client)
    engine = wc.attach(_sock(sockdir))
    d.close()
    ours = memfd_inodes() - base
    assert ours <= memfd_inodes([pid])
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: gone(pid), what="the custodian to die")
    client.close()
    assert engine["i64"].tolist() == list(range(10))
    engine.close()
    del engine
    gc.collect()
    assert not ours & memfd_inodes()


def test_a_held_cache_under_another_key_is_never_served(sockdir, custodian, caplog):
    held_daemon(_sock(sockdir), KEY, custodian).close()
    other = KEY.replace(dtype="bfloat16")
    d = Daemon(_sock(sockdir), other, custodian=custodian.path)  # the same name, as a hash collision would give
    d.start()
    with caplog.at_level(logging.WARNING, logger="weightcache.daemon"):
        assert not d.adopt()
    assert "its key differs: dtype: held '', this daemon 'bfloat16'" in caplog.text
    assert custodian.holdings().holdings == [], "the stale cache is released"
    d.load_tensors({"w": torch.ones(3)})
    with wc.attach(_sock(sockdir), expect=other) as att:
        assert att["w"].tolist() == [1.0, 1.0, 1.0]
    d.close()


def test_prune_releases_only_unserved_caches_of_that_role_and_model(sockdir, custodian):
    live = held_daemon(_sock(sockdir, "main-r0-cpu-aaaaaaaa.sock"), KEY, custodian)
    held_daemon(_sock(sockdir, "main-r1-cpu-bbbbbbbb.sock"), KEY.replace(rank=1), custodian).close()
    held_daemon(_sock(sockdir, "main-r0-cpu-cccccccc.sock"), KEY.replace(model="other"), custodian).close()
    wait_for(lambda: sum(h.served_by == 0 for h in custodian.holdings().holdings) == 2,
             what="the custodian to see the closed daemons go")
    gone_ = custodian.prune("main", "sample", keep=["main-r9-cpu-99999999.sock"])
    assert gone_.names == ["main-r1-cpu-bbbbbbbb.sock"] and gone_.nbytes > 0
    names = sorted(h.name for h in custodian.holdings().holdings)
    assert names == ["main-r0-cpu-aaaaaaaa.sock", "main-r0-cpu-cccccccc.sock"]
    live.close()


def test_engine_logs_one_line_when_its_daemon_is_lost(sockdir, caplog):
    sock = _sock(sockdir)
    with caplog.at_level(logging.WARNING, logger="weightcache.client"):
        d = wc.publish({"w": torch.arange(4.0)}, sock, KEY)
        closed_by_us = wc.attach(sock)
        kept = wc.attach(sock)
        closed_by_us.close()
        d.close()
        wait_for(lambda: kept.daemon_lost, what="the engine to notice")
        time.sleep(0.3)  # a second line would come now
        assert kept["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
        d2 = wc.publish({"w": torch.arange(4.0)}, sock, KEY)
        with wc.attach(sock) as fresh:  # a later attach finds the replacement
            assert fresh["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and not fresh.daemon_lost
        d2.close()
    lines = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
    assert len(lines) == 1, lines
    kept.close()


def test_an_engine_that_drops_its_attachment_detaches(sockdir):
    with wc.publish({"w": torch.ones(2)}, _sock(sockdir), KEY) as d:
        att = wc.attach(_sock(sockdir))
        assert d.status().clients_attached == 1
        del att
        gc.collect()
        wait_for(lambda: d.status().clients_attached == 0, what="the detach")


def test_custodian_exits_when_nothing_is_held_and_no_one_is_connected(sockdir):
    launch(sockdir)
    client = CustodianClient.connect(sockdir)
    launch(sockdir)  # a second launch finds it running
    again = CustodianClient.connect(sockdir)
    assert again.pid == client.pid
    again.close()
    client.close()
    wait_for(lambda: gone(client.pid), what="the idle custodian to exit")
    assert not custodian_socket_path(sockdir).exists()


def test_custodian_exits_and_releases_when_its_socket_is_removed(sockdir):
    launch(sockdir)
    client = CustodianClient.connect(sockdir)
    base = memfd_inodes()
    held_daemon(_sock(sockdir), KEY, client).close()
    ours = memfd_inodes() - base
    assert ours
    os.unlink(custodian_socket_path(sockdir))  # e.g. its directory was cleaned up: no one can reach it
    wait_for(lambda: gone(client.pid), what="the unreachable custodian to exit")
    client.close()
    assert not ours & memfd_inodes()


def _raw(sockdir) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(custodian_socket_path(sockdir)))
    return s


def _recv(s):
    from weightcache.custodian.messages import _decoder

    return wire.recv_msg(s, deadline=time.monotonic() + 5, decoder=_decoder)


def test_bad_input_gets_a_one_line_error_and_loses_nothing(sockdir, custodian):
    from weightcache.custodian.messages import Hello

    held_daemon(_sock(sockdir), KEY, custodian).close()

    with pytest.raises(ProtocolError, match="custodian protocol 99 is not supported"):
        s = _raw(sockdir)
        wire.send_msg(s, Hello(protocol=99))
        CustodianClient._recv(s, custodian_socket_path(sockdir), 5)
    s = _raw(sockdir)  # a frame of garbage instead of a hello
    s.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
    reply = _recv(s)
    assert reply.code == "protocol" and "expected a hello" in reply.message
    s = _raw(sockdir)  # the daemons' protocol is not the custodian's
    wire.send_msg(s, wire.Ping())
    assert _recv(s).code == "protocol"

    client = CustodianClient.connect(sockdir)
    fd = os.memfd_create("weightcache-test")
    os.ftruncate(fd, 4096)
    h = Holding(name="main-r0-cpu-11111111.sock", model="m", role="main", rank=0, device="cpu", block_bytes=[4096])
    cases = [
        (h.__class__(**{**_fields(h), "block_bytes": [4096, 4096]}), "1 block fds for 2 block sizes"),
        (h.__class__(**{**_fields(h), "block_bytes": [8192]}), "block 0 is 4096 bytes, its size says 8192"),
        (h.__class__(**{**_fields(h), "name": "../escape"}), "bad cache name '../escape'"),
        (h.__class__(**{**_fields(h), "device": "tpu"}), "unknown device 'tpu'"),
    ]
    for bad, message in cases:
        with pytest.raises(CustodianError, match=message.replace("(", r"\(")) as err:
            client.deposit(bad, b"k", b"m", [fd])
        assert "\n" not in str(err.value)
    assert [x.name for x in client.holdings().holdings] == ["main-r0-cpu-00000000.sock"], "nothing lost"
    with pytest.raises(CustodianError, match="a cache needs 1 to 4096 blocks, not 0"):
        client.deposit(h, b"k", b"m", [])
    client.close()
    os.close(fd)
    assert [x.name for x in custodian.holdings().holdings] == ["main-r0-cpu-00000000.sock"]


def _fields(s) -> dict:
    return {f: getattr(s, f) for f in s.__struct_fields__}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch uid")
def test_another_uid_is_refused(sockdir, custodian):
    os.chmod(sockdir, 0o755)
    os.chmod(custodian_socket_path(sockdir), 0o666)  # let it connect: the custodian itself must refuse it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setuid(65534)
            CustodianClient.connect(sockdir)
            out = "CONNECTED"
        except PermissionDenied as e:
            out = f"DENIED {e}"
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = f"OTHER {type(e).__name__}: {e}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    assert out.startswith("DENIED") and "uid 65534" in out, out


def test_a_missing_custodian_is_a_clear_error(sockdir, capsys):
    from weightcache.cli import main
    from weightcache.errors import DaemonUnavailable

    with pytest.raises(DaemonUnavailable, match="no custodian at"):
        CustodianClient.connect(sockdir)
    assert main(["release", "--socket-dir", str(sockdir)]) == 0
    assert "nothing is held" in capsys.readouterr().out
    d = Daemon(_sock(sockdir), KEY, custodian=custodian_socket_path(sockdir))
    d.start()
    assert not d.adopt()  # no custodian: load as before, with a warning
    d.load_tensors({"w": torch.ones(1)})
    assert d.status().state == "ready" and not d.status().held
    d.close()


def test_release_of_an_unknown_name_is_refused(sockdir, custodian, capsys):
    from weightcache.cli import main

    held_daemon(_sock(sockdir), KEY, custodian).close()
    assert main(["release", "--socket-dir", str(sockdir), "nope.sock"]) == 2
    assert "holds no cache named nope.sock" in capsys.readouterr().err
    assert main(["release", "--socket-dir", str(sockdir), "--stop", "--model", "sample"]) == 2
    assert "--stop releases everything" in capsys.readouterr().err
    assert len(custodian.holdings().holdings) == 1
    assert main(["status", "--socket-dir", str(sockdir)]) == 0
    assert f"custodian pid {custodian.pid} holds 1 cache(s)" in capsys.readouterr().out


@pytest.mark.gpu
def test_cuda_memory_outlives_the_daemon_and_returns_after_release(sockdir, custodian):
    torch.cuda.init()
    free0 = torch.cuda.mem_get_info(0)[0]
    sock = _sock(sockdir)
    first, how = start_held_daemon(sock, str(custodian.path), "cuda", big_mb=1024)
    assert how == "LOADED"
    served = block_digests(sock)
    first.kill()
    first.wait()
    time.sleep(1.0)
    held = free0 - torch.cuda.mem_get_info(0)[0]
    assert held >= 1 << 30, f"the custodian's fds keep the {held / 2**30:.2f} GiB allocated"
    second, how = start_held_daemon(sock, str(custodian.path), "cuda")
    try:
        assert how == "ADOPTED"
        assert block_digests(sock) == served
    finally:
        second.kill()
        second.wait()
    assert custodian.release(everything=True).nbytes >= 1 << 30
    wait_for(lambda: torch.cuda.mem_get_info(0)[0] >= free0 - (256 << 20), 30, "device memory to return")


def test_a_sealed_memfd_is_handed_over_and_served(sockdir, custodian):
    """Write-sealed blocks (no one may write them, not even through /proc) still move between daemons."""
    import fcntl

    import msgspec

    from weightcache.packing import plan_for_tensors

    payload = torch.arange(1024, dtype=torch.int32)
    manifest, _ = plan_for_tensors({"w": payload})
    fd = os.memfd_create("weightcache-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, payload.numpy().tobytes())
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    manifest.blocks[0].nbytes = 4096
    name = "main-r0-cpu-00000000.sock"
    custodian.deposit(Holding(name=name, model=KEY.model, role="main", rank=0, device="cpu", block_bytes=[4096]),
                      msgspec.msgpack.encode(KEY), msgspec.msgpack.encode(manifest), [fd])
    os.close(fd)
    d = Daemon(_sock(sockdir, name), KEY, custodian=custodian.path)
    d.start()
    assert d.adopt()
    with wc.attach(_sock(sockdir, name), expect=KEY) as att:
        assert torch.equal(att["w"], payload)
    d.close()


def test_a_forked_child_leaves_its_parents_watch_alone(sockdir, caplog):
    sock = _sock(sockdir)
    d = wc.publish({"w": torch.arange(4.0)}, sock, KEY)
    att = wc.attach(sock)
    pid = os.fork()
    if pid == 0:  # a child that inherited the attachment attaches and detaches on its own
        try:
            with wc.attach(sock) as mine:
                ok = mine["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
            att.close()  # its copy of the parent's connection: the parent stays attached and watched
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    assert os.waitpid(pid, 0)[1] == 0
    with caplog.at_level(logging.WARNING, logger="weightcache.client"):
        d.close()
        wait_for(lambda: att.daemon_lost, what="the parent to notice")
    assert len([r for r in caplog.records if "is gone" in r.getMessage()]) == 1
    att.close()
