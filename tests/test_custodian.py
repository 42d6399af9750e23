"""The custodian: a cache outlives its daemon; a replacement serves the same bytes without a load; releasing
(or the holder's death) frees the memory once no engine maps it; a cache whose preload is gone is freed after
its lease; bad input gets a one-line error; a custodian that does not answer is reported, never taken for none."""

from __future__ import annotations

import gc
import logging
import os
import secrets
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
from weightcache.handover import use_credential
from weightcache.key import CacheKey
from weightcache.sockets import custodian_socket_path, socket_name

KEY = CacheKey(model="sample", content_digest="d0")
NAME = socket_name(KEY, "cpu")


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


def register(sockdir, hold_after_exit: float = 600.0) -> CustodianClient:
    """Stand for a preload (this test process): a registered connection whose credential our daemons use."""
    client = CustodianClient.connect(sockdir)
    client.token = secrets.token_hex(32)
    client.register(client.token, hold_after_exit)
    use_credential(custodian_socket_path(sockdir), client.token)
    return client


def stop(client: CustodianClient) -> None:
    pid = client.pid
    try:
        client.stop()
    except WeightCacheError:
        pass
    client.close()
    try:
        wait_for(lambda: gone(pid), 10, "the custodian to exit")
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def registered_custodian(sockdir):
    """A detached custodian process for the socket directory, and our registered connection to it."""
    launch(sockdir)
    client = register(sockdir)
    yield client
    stop(client)


@pytest.fixture
def custodian(sockdir):
    yield from registered_custodian(sockdir)


def custodian_log(sockdir) -> str:
    return (custodian_socket_path(sockdir).parent / "custodian.log").read_text()


def _sock(sockdir, key=KEY):
    return os.path.join(sockdir, socket_name(key, "cpu"))


def held_daemon(sock, key, custodian, tensors=None) -> Daemon:
    d = Daemon(sock, key, custodian=custodian.path)
    d.start()
    if not d.adopt():
        d.load_tensors(sample_tensors() if tensors is None else tensors)
    return d


def sealed_memfd(payload: bytes = b"", size: int = 4096, seals: int | None = None) -> int:
    import fcntl

    fd = os.memfd_create("weightcache-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, payload)
    os.ftruncate(fd, size)
    if seals is None:
        seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def one_block(payload: torch.Tensor, key=KEY, size: int = 4096):
    """A holding, encoded key and manifest for `payload` as one block of `size` bytes."""
    import msgspec

    from weightcache import integrity
    from weightcache.packing import plan_for_tensors

    manifest, _ = plan_for_tensors({"w": payload})
    manifest.blocks[0].nbytes = size
    block = torch.zeros(size, dtype=torch.uint8)
    raw = payload.reshape(-1).view(torch.uint8)[:size]
    block[:raw.numel()] = raw
    integrity.record(manifest, [block])  # what a daemon records: an adopter checks the bytes against it
    h = Holding(name=socket_name(key, "cpu"), model=key.model, role=key.role, rank=key.rank, device="cpu",
                block_bytes=[size])
    return h, msgspec.msgpack.encode(key), msgspec.msgpack.encode(manifest)


# ---------------------------------------------------------------------------------------------- handover

@pytest.mark.parametrize("device", DEVICES)
def test_a_replacement_daemon_serves_the_same_bytes_without_a_load(sockdir, custodian, device, caplog):
    sock = _sock(sockdir) if device == "cpu" else os.path.join(sockdir, socket_name(KEY, "0" * 8))
    first, how = start_held_daemon(sock, str(custodian.path), device, token=custodian.token)
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
    assert held.preload == os.getpid() and held.expires_in is None, "its preload runs: no countdown"

    second, how = start_held_daemon(sock, str(custodian.path), device, token=custodian.token)
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
    out = capsys.readouterr().out
    assert NAME in out and f"pid {os.getpid()}" in out, "FREED IN names the preload that runs"
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
    client = register(sockdir)
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


@pytest.mark.parametrize("change", [{"dtype": "bfloat16"}, {"content_digest": "d1"}], ids=["dtype", "digest"])
def test_a_held_cache_under_another_key_is_never_served(sockdir, custodian, caplog, change):
    """The key is the only identity: a checkpoint whose digest changed (rewritten in place) is never served
    from the old cache, even under the same name (as a hash collision would give)."""
    held_daemon(_sock(sockdir), KEY, custodian).close()
    other = KEY.replace(**change)
    d = Daemon(_sock(sockdir), other, custodian=custodian.path)
    d.start()
    with caplog.at_level(logging.WARNING, logger="weightcache.daemon"):
        assert not d.adopt()
    (field, value), = change.items()
    assert f"its key differs: {field}: held {getattr(KEY, field)!r}, this daemon {value!r}" in caplog.text
    assert custodian.holdings().holdings == [], "the stale cache is released"
    d.load_tensors({"w": torch.ones(3)})
    with wc.attach(_sock(sockdir), expect=other) as att:
        assert att["w"].tolist() == [1.0, 1.0, 1.0]
    assert custodian.holdings().holdings == [], "a key that is not its name's is never held"
    d.close()


def test_prune_releases_only_unserved_caches_of_that_role_and_model(sockdir, custodian):
    live = held_daemon(_sock(sockdir), KEY, custodian)
    held_daemon(_sock(sockdir, KEY.replace(rank=1)), KEY.replace(rank=1), custodian).close()
    held_daemon(_sock(sockdir, KEY.replace(model="other")), KEY.replace(model="other"), custodian).close()
    wait_for(lambda: sum(h.served_by == 0 for h in custodian.holdings().holdings) == 2,
             what="the custodian to see the closed daemons go")
    gone_ = custodian.prune("main", "sample", keep=["main-r9-cpu-99999999.sock"], token=custodian.token)
    assert gone_.names == [socket_name(KEY.replace(rank=1), "cpu")] and gone_.nbytes > 0
    names = sorted(h.name for h in custodian.holdings().holdings)
    assert names == sorted([NAME, socket_name(KEY.replace(model="other"), "cpu")])
    live.close()


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
    client = register(sockdir)
    base = memfd_inodes()
    held_daemon(_sock(sockdir), KEY, client).close()
    ours = memfd_inodes() - base
    assert ours
    os.unlink(custodian_socket_path(sockdir))  # e.g. its directory was cleaned up: no one can reach it
    wait_for(lambda: gone(client.pid), what="the unreachable custodian to exit")
    client.close()
    assert not ours & memfd_inodes()


def test_the_custodian_imports_no_torch_and_stays_small(sockdir, custodian):
    d = held_daemon(_sock(sockdir), KEY, custodian)
    with open(f"/proc/{custodian.pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{custodian.pid}/maps") as f:
        maps = f.read()
    d.close()
    assert "libtorch" not in maps and "libc10" not in maps
    assert rss_kb <= 40 << 10, f"the custodian takes {rss_kb / 1024:.1f} MiB resident"


# --------------------------------------------------------------------------------------------- bad input

def _raw(sockdir) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(custodian_socket_path(sockdir)))
    return s


def _recv(s):
    from weightcache.custodian.messages import _decoder

    return wire.recv_msg(s, deadline=time.monotonic() + 5, decoder=_decoder)


def _fields(s) -> dict:
    return {f: getattr(s, f) for f in s.__struct_fields__}


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

    key = KEY.replace(rank=3)
    h, k, m = one_block(torch.arange(8, dtype=torch.int32), key)
    fd = sealed_memfd()
    cases = [
        (Holding(**{**_fields(h), "block_bytes": [4096, 4096]}), k, m, "its manifest's blocks [4096] are not"),
        (Holding(**{**_fields(h), "name": "../escape"}), k, m, "'../escape' is not a daemon's socket name"),
        (Holding(**{**_fields(h), "device": "tpu"}), k, m, "device 'tpu' does not fit the name"),
        (Holding(**{**_fields(h), "name": NAME}), k, m, "its key hashes to"),
        (h, b"k", m, "its key does not decode"),
        (h, k, b"m", "its manifest does not decode"),
    ]
    client = CustodianClient.connect(sockdir)
    for bad, key_bytes, manifest_bytes, message in cases:
        with pytest.raises(CustodianError, match=message.replace("[", r"\[").replace("(", r"\(")) as err:
            client.deposit(bad, key_bytes, manifest_bytes, [fd], custodian.token)
        assert "\n" not in str(err.value)
    assert [x.name for x in client.holdings().holdings] == [NAME], "nothing lost"
    with pytest.raises(CustodianError, match="a cache needs 1 to 4096 blocks, not 0"):
        client.deposit(h, k, m, [], custodian.token)
    client.close()
    os.close(fd)
    assert [x.name for x in custodian.holdings().holdings] == [NAME]


def test_bad_frames_get_one_log_line_each_and_no_traceback(sockdir, custodian):
    """Each bad frame, cut-off deposit or unexpected message costs the custodian one log line."""
    from weightcache.custodian.messages import Deposit, Hello, Welcome

    h, k, m = one_block(torch.arange(8, dtype=torch.int32))
    hello = wire.encode(Hello(protocol=2))
    cases = [
        struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # garbage instead of a hello
        hello + struct.pack(">I", 4) + b"\x92\x01\x02\x03",  # garbage after it
        hello + wire.encode(Deposit(holding=h, key=k, manifest=m, nfds=2)),  # its fds never follow
        hello + wire.encode(Deposit(holding=h, key=k, manifest=m, nfds=0)),
        hello + wire.encode(Welcome(protocol=2, pid=1, started_at=0.0)),  # not a request
        hello + struct.pack(">I", 1 << 30),  # a frame past the cap
        hello + struct.pack(">I", 100) + b"\x00" * 10,  # cut off
    ]
    before = custodian_log(sockdir).count("\n")
    for frame in cases:
        s = _raw(sockdir)
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)
        with pytest.raises((EOFError, OSError, ProtocolError)):
            while True:
                _recv(s)  # its answers, then the close
        s.close()
    assert custodian.holdings().holdings == []
    wait_for(lambda: custodian_log(sockdir).count("\n") - before >= len(cases), 5, "the log lines")
    time.sleep(0.3)
    new = custodian_log(sockdir).splitlines()[before:]
    assert "Traceback" not in "\n".join(new)
    assert len(new) == len(cases), new
    assert all(" WARNING " in line for line in new), new


def test_release_refuses_a_directory_others_can_write_and_a_plain_file(tmp_path, capsys):
    from weightcache.cli import main

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    plain = tmp_path / "plain"
    plain.write_text("")
    for path, why in ((shared, "writable by others"), (plain, "is not a directory")):
        assert main(["release", "--socket-dir", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and "\n" not in err, err
    assert main(["release", "--socket-dir", str(tmp_path / "missing")]) == 0
    assert "nothing is held" in capsys.readouterr().out


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


# ----------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_cuda_memory_outlives_the_daemon_and_returns_after_release(sockdir, custodian):
    torch.cuda.init()
    free0 = torch.cuda.mem_get_info(0)[0]
    from weightcache.sockets import device_tag

    sock = os.path.join(sockdir, socket_name(KEY, device_tag("cuda:0")))
    first, how = start_held_daemon(sock, str(custodian.path), "cuda", big_mb=1024, token=custodian.token)
    assert how == "LOADED"
    served = block_digests(sock)
    first.kill()
    first.wait()
    time.sleep(1.0)
    held = free0 - torch.cuda.mem_get_info(0)[0]
    assert held >= 1 << 30, f"the custodian's fds keep the {held / 2**30:.2f} GiB allocated"
    second, how = start_held_daemon(sock, str(custodian.path), "cuda", token=custodian.token)
    try:
        assert how == "ADOPTED"
        assert block_digests(sock) == served
    finally:
        second.kill()
        second.wait()
    assert custodian.release(everything=True).nbytes >= 1 << 30
    wait_for(lambda: torch.cuda.mem_get_info(0)[0] >= free0 - (256 << 20), 30, "device memory to return")


def test_a_sealed_memfd_is_handed_over_and_served(sockdir, custodian):
    """Write-sealed blocks (no one may write them, not even through /proc) move between daemons."""
    payload = torch.arange(1024, dtype=torch.int32)
    h, k, m = one_block(payload)
    fd = sealed_memfd(payload.numpy().tobytes())
    custodian.deposit(h, k, m, [fd], custodian.token)
    os.close(fd)
    d = Daemon(_sock(sockdir), KEY, custodian=custodian.path)
    d.start()
    assert d.adopt()
    with wc.attach(_sock(sockdir), expect=KEY) as att:
        assert torch.equal(att["w"], payload)
    d.close()


# ------------------------------------------------------------------------------- engines and lost daemons

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
