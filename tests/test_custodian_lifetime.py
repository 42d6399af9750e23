"""The custodian over time: one that stops answering is reported as such (never as holding nothing), one that
dies is replaced by the preload and the running daemons deposit with the new one, a client that stops reading
holds no one up, and the caches of a preload that is gone are freed after its lease (kept ones are not)."""

from __future__ import annotations

import logging
import os
import signal
import time

import psutil
import pytest
import torch

from procs import memfd_inodes
from test_custodian import (
    KEY,
    NAME,
    _raw,
    _recv,
    _sock,
    custodian_log,
    held_daemon,
    one_block,
    register,
    registered_custodian,
    sealed_memfd,
    wait_for,
)
from weightcache import wire
from weightcache.custodian.client import CustodianClient
from weightcache.custodian.messages import CustodianError, CustodianUnresponsive
from weightcache.sockets import custodian_socket_path


@pytest.fixture
def custodian(sockdir):
    yield from registered_custodian(sockdir)


def test_a_stopped_custodian_is_reported_as_such_never_as_holding_nothing(sockdir, custodian, capsys):
    from weightcache.cli import main
    from weightcache.custodian.client import connect_or_launch
    from weightcache.preload.custody import Custody

    held_daemon(_sock(sockdir), KEY, custodian).close()
    os.kill(custodian.pid, signal.SIGSTOP)
    try:
        for argv in (["release", "--list"], ["release"], ["status"]):
            assert main([*argv, "--socket-dir", str(sockdir), "--timeout", "1"]) == 1, argv
            out = capsys.readouterr()
            err = out.err.strip()
            assert "nothing is held" not in out.out + err and "\n" not in err, argv
            assert f"the custodian (pid {custodian.pid})" in err and "is stopped and does not answer" in err, err
        with pytest.raises(CustodianUnresponsive, match="kill -CONT"):
            connect_or_launch(sockdir, timeout=1.0)  # and never a second custodian beside it
        custody = Custody(sockdir)
        custody.connect_timeout = 1.0
        with pytest.raises(CustodianUnresponsive):
            custody.open()  # the preload refuses to start rather than load a second copy
    finally:
        os.kill(custodian.pid, signal.SIGCONT)
    assert main(["release", "--list", "--socket-dir", str(sockdir)]) == 0
    assert NAME in capsys.readouterr().out
    assert len([p for p in psutil.process_iter(["cmdline"]) if str(sockdir) in " ".join(p.info["cmdline"] or [])
                and "custodian" in " ".join(p.info["cmdline"] or [])]) == 1


def test_a_client_that_stops_reading_holds_no_one_up(sockdir, caplog):
    """A claimer that never reads its (large) answer is dropped after the send deadline; meanwhile everyone
    else is served (nothing is sent under a lock)."""
    from weightcache.custodian.messages import Claim, Hello
    from weightcache.custodian.server import Custodian

    holder = Custodian(custodian_socket_path(sockdir), send_timeout=1.0)
    holder.start()
    try:
        client = register(sockdir)
        key = KEY.replace(extra={"pad": "x" * (4 << 20)})  # a 4 MiB answer: more than a socket buffer takes
        h, k, m = one_block(torch.arange(8, dtype=torch.int32), key)
        fd = sealed_memfd()
        client.deposit(h, k, m, [fd], client.token)
        os.close(fd)
        stalled = _raw(sockdir)
        wire.send_msg(stalled, Hello(protocol=2))
        _recv(stalled)
        with caplog.at_level(logging.WARNING, logger="weightcache.custodian.server"):
            wire.send_msg(stalled, Claim(name=h.name, token=client.token))  # ...and never reads
            time.sleep(0.2)
            other = CustodianClient.connect(sockdir, timeout=2.0)
            assert [x.name for x in other.holdings(timeout=2.0).holdings] == [h.name]
            got = other.claim(h.name, client.token)  # the same answer, to a client that reads it
            assert got is not None and len(got[1]) == 1
            os.close(got[1][0])
            other.close()
            wait_for(lambda: "stopped reading" in caplog.text, 5, "the stalled client to be dropped")
        assert [r.getMessage() for r in caplog.records if "stopped reading" in r.getMessage()] == [
            f"pid {os.getpid()}: stopped reading: a Claimed reply waited 1 s; connection closed"]
        stalled.close()
        client.close()
    finally:
        holder.close()


# ------------------------------------------------------------------------------- leases after the preload

def test_a_gone_preloads_caches_are_freed_after_its_lease(sockdir, custodian, capsys):
    from weightcache.cli import main
    from weightcache.preload.custody import Custody

    base = memfd_inodes()
    preload = register(sockdir, hold_after_exit=1.5)  # another preload, with a short lease
    d = held_daemon(_sock(sockdir), KEY, preload)
    ours = memfd_inodes() - base
    d.close()
    preload.close()  # the preload is gone (SIGKILL looks the same to the custodian)
    wait_for(lambda: custodian.holdings().holdings[0].expires_in is not None, 5, "the countdown")
    (h,) = custodian.holdings().holdings
    assert 0 < h.expires_in <= 1.5 and h.preload == 0 and not h.kept
    assert main(["release", "--list", "--socket-dir", str(sockdir)]) == 0
    assert any(line.startswith(NAME) and line.rstrip().endswith("s") for line in capsys.readouterr().out.splitlines())
    assert main(["status", "--socket-dir", str(sockdir)]) == 0
    assert "1 of a preload that is gone, the next freed in" in capsys.readouterr().out
    watcher = Custody(sockdir)
    watcher.open()
    try:
        info = watcher.info()
        assert info["up"] and info["holdings"][0]["name"] == NAME and 0 < info["next_expiry_s"] <= 1.5
    finally:
        watcher.finish(keep=False)
    wait_for(lambda: custodian.holdings().holdings == [], 10, "the lease to run out")
    assert ours and not ours & memfd_inodes(), "its memory returned"
    assert "has been gone for" in custodian_log(sockdir)


def test_hold_after_exit_zero_frees_at_once_and_a_preload_that_comes_back_stops_the_countdown(sockdir, custodian):
    zero = register(sockdir, hold_after_exit=0)
    held_daemon(_sock(sockdir), KEY, zero).close()
    zero.close()
    wait_for(lambda: custodian.holdings().holdings == [], 5, "the cache to be freed at once")

    back = register(sockdir, hold_after_exit=1.0)
    token = back.token
    held_daemon(_sock(sockdir), KEY, back).close()
    back.close()
    wait_for(lambda: custodian.holdings().holdings[0].expires_in is not None, 5, "the countdown")
    again = CustodianClient.connect(sockdir)  # the same preload reconnects (its custodian connection broke)
    assert again.register(token, 1.0).owned == [NAME]
    time.sleep(1.5)
    (h,) = custodian.holdings().holdings
    assert h.expires_in is None and h.preload == os.getpid()
    again.close()


def test_keep_on_stop_keeps_and_release_frees_earlier(sockdir, custodian, capsys):
    from weightcache.cli import main

    preload = register(sockdir, hold_after_exit=0.5)
    held_daemon(_sock(sockdir), KEY, preload).close()
    held_daemon(_sock(sockdir, KEY.replace(rank=1)), KEY.replace(rank=1), preload).close()
    assert preload.keep([NAME], preload.token).names == [NAME]
    with pytest.raises(CustodianError, match="no credential of a running preload"):
        preload.keep([NAME], "f" * 64)
    preload.close()
    time.sleep(1.5)
    (h,) = custodian.holdings().holdings  # the other one's lease ran out
    assert h.name == NAME and h.kept and h.expires_in is None
    assert main(["release", "--list", "--socket-dir", str(sockdir)]) == 0
    assert "kept" in capsys.readouterr().out
    assert main(["release", "--socket-dir", str(sockdir), NAME]) == 0
    assert custodian.holdings().holdings == []


def test_hold_after_exit_flag_takes_seconds_or_zero(capsys):
    import argparse

    from weightcache.preload.options import DEFAULT_HOLD_AFTER_EXIT_S, add_weight_cache_arguments

    p = argparse.ArgumentParser()
    add_weight_cache_arguments(p)
    assert p.parse_args([]).weight_cache_hold_after_exit == DEFAULT_HOLD_AFTER_EXIT_S
    assert p.parse_args(["--weight-cache-hold-after-exit", "0"]).weight_cache_hold_after_exit == 0.0
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            p.parse_args(["--weight-cache-hold-after-exit", bad])
        assert "--weight-cache-hold-after-exit" in capsys.readouterr().err




# ------------------------------------------------------------------------------------------- the preload's side

def test_a_killed_custodian_is_replaced_and_the_running_daemon_deposits_again(sockdir, caplog):
    from weightcache.handover import use_credential
    from weightcache.preload.custody import Custody

    custody = Custody(sockdir)
    custody.open()
    use_credential(custodian_socket_path(sockdir), custody.token)
    d = held_daemon(_sock(sockdir), KEY, custody.client)
    first = custody.client.pid
    try:
        with caplog.at_level(logging.WARNING):
            os.kill(first, signal.SIGKILL)
            wait_for(lambda: custody.info().get("pid") not in (None, first) and custody.info()["up"], 15,
                     "a new custodian")
            fresh = CustodianClient.connect(sockdir)
            wait_for(lambda: [h.name for h in fresh.holdings().holdings] == [NAME], 15, "the daemon's deposit")
        assert custody.restarts == 1 and custody.info()["restarts"] == 1
        (h,) = fresh.holdings().holdings
        assert h.served_by == os.getpid() and h.preload == os.getpid()
        said = caplog.text
        assert f"the custodian (pid {first}) died: the caches only it held are lost" in said
        assert "holds this rank's cache again" in said
        fresh.close()
    finally:
        d.close()
        custody.finish(keep=False)


def test_a_preload_refuses_to_start_beside_a_stopped_custodian(sockdir, custodian, monkeypatch, caplog):
    """One line, a non-zero exit, and no second copy loaded next to the memory the stopped one holds."""
    from weightcache.preload import custody as custody_module
    from weightcache.preload.layout import Layout
    from weightcache.preload.supervisor import Group, Supervisor

    def never(*_a, **_k):
        raise AssertionError("no source may be built")

    monkeypatch.setattr(custody_module, "CONNECT_TIMEOUT_S", 1.0)
    sup = Supervisor([Group(role="main", layout=Layout(device_type="cpu"), make_source=never)], socket_dir=sockdir)
    os.kill(custodian.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.ERROR, logger="weightcache.preload.supervisor"):
            assert sup.run() != 0
    finally:
        os.kill(custodian.pid, signal.SIGCONT)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "is stopped and does not answer" in errors[0] and "\n" not in errors[0], errors
    assert sup.children == []
