"""The cache outlives its daemon and `weightcache preload` itself, end to end: real daemon processes killed with
SIGKILL, an engine that keeps serving, no checkpoint weight file opened (inotify), the same bytes served."""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import httpx
import pytest
import torch

from conftest import DEVICES
from procs import block_digests, memfd_inodes
from test_supervisor import SMALL, Preload, free_port, gone, stop_custodian
from vllm_runner import OpenWatch
from weightcache.testing.checkpoints import make_llama_checkpoint

pytestmark = pytest.mark.slow

PROMPT = [[1, 17, 42, 99, 7, 250]]
CYCLES = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", seed=3, **SMALL)


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the digest cache, shared with the engine
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.pop("XDG_RUNTIME_DIR", None)
    return e


@pytest.fixture
def preloads():
    started: list[Preload] = []
    yield started
    for p in started:
        p.kill()
        for pid in gone(p.descendants(), 5):
            os.kill(pid, signal.SIGKILL)
    for d in {p.socket_dir for p in started}:
        stop_custodian(d)


def daemons(url: str) -> dict[int, dict]:
    return {d["rank"]: d for d in httpx.get(url + "/status", timeout=10).json()["daemons"]}


def weight_files_opened(events: list[str]) -> list[str]:
    return [e for e in events if e.endswith(".safetensors")]


def sigkill_all(p: Preload) -> None:
    """SIGKILL the supervisor and every daemon at once (an upgrade, an OOM-kill of the whole group)."""
    pids = [p.proc.pid, *p.descendants()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    p.wait()
    assert gone(pids) == []


@pytest.mark.parametrize("device", DEVICES)
def test_ten_daemon_kills_while_an_engine_keeps_serving(ckpt, env, tmp_path, preloads, device, caplog):
    import weightcache.transformers as wct

    sdir, port = tmp_path / "s", free_port()
    p = Preload([ckpt, "--device", device, "--weight-cache-socket-dir", sdir, "--weight-cache-health-port", port,
                 "--weight-cache-status-details"], env, tmp_path)
    preloads.append(p)
    p.wait_ready()
    url = f"http://127.0.0.1:{port}"
    engine = wct.from_pretrained(ckpt, device=device, socket_dir=sdir, fallback=False)
    assert engine._weightcache_source == "attach"
    ids = torch.tensor(PROMPT, device=device)
    with torch.no_grad():
        logits = engine(ids).logits.clone()
    sock = daemons(url)[0]["socket"]
    served = block_digests(sock)
    watch = OpenWatch([str(ckpt)])
    with caplog.at_level(logging.WARNING, logger="weightcache.client"):
        for cycle in range(1, CYCLES + 1):
            victim = daemons(url)[0]["pid"]
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while True:  # the replacement is ready when /health is 200 again with another pid
                healthy = httpx.get(url + "/health").status_code == 200
                d = daemons(url)[0]
                if healthy and d["pid"] != victim and (d["status"] or {}).get("state") == "ready":
                    break
                assert time.monotonic() < deadline, p.stderr
                time.sleep(0.05)
            assert d["restarts"] == cycle and d["status"]["adopted"] and d["status"]["held"]
            assert d["status"]["done"] == 0, "no load phase"
            assert block_digests(sock) == served, f"cycle {cycle}: other bytes served"
            with torch.no_grad():
                assert torch.equal(engine(ids).logits, logits), f"cycle {cycle}: the engine's logits changed"
        events = watch.events()
    assert weight_files_opened(events) == [], events
    metrics = httpx.get(url + "/metrics").text
    assert re.search(rf'weightcache_daemon_restarts_total\{{[^}}]*rank="0"[^}}]*\}} {CYCLES}\.0', metrics), metrics
    assert p.stderr.count("is back (replacement") == CYCLES
    lost = [r for r in caplog.records if "is gone" in r.getMessage()]
    assert len(lost) == 1, "the engine logs its daemon's loss once"
    assert engine._weightcache_attachment.daemon_lost


@pytest.mark.parametrize("device", DEVICES)
def test_preload_comes_back_after_sigkill_without_reading_the_checkpoint(ckpt, env, tmp_path, preloads, device,
                                                                       capsys):
    from weightcache.cli import main
    from weightcache.custodian.client import CustodianClient

    sdir = tmp_path / "s"
    n = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    args = [ckpt, "-tp", n, "--device", device, "--weight-cache-socket-dir", sdir, "--weight-cache-status-details"]
    first = Preload([*args, "--weight-cache-health-port", port := free_port()], env, tmp_path, "p1")
    preloads.append(first)
    first.wait_ready()
    url = f"http://127.0.0.1:{port}"
    socks = {r: d["socket"] for r, d in daemons(url).items()}
    served = {r: block_digests(s) for r, s in socks.items()}
    sigkill_all(first)

    custodian = CustodianClient.connect(sdir)
    deadline = time.monotonic() + 10
    while True:  # until it has seen the daemons' deaths
        held = custodian.holdings().holdings
        if not any(h.served_by for h in held):
            break
        assert time.monotonic() < deadline, held
        time.sleep(0.05)
    assert sorted(os.path.join(sdir, h.name) for h in held) == sorted(socks.values())
    old = memfd_inodes([custodian.pid]) if device == "cpu" else set()

    watch = OpenWatch([str(ckpt)])
    again = Preload([*args, "--weight-cache-health-port", port := free_port()], env, tmp_path, "p2")
    preloads.append(again)
    line = again.wait_ready()
    assert "taken over from the custodian in" in line and "GB/s" not in line, line  # no rate for no load
    assert weight_files_opened(watch.events()) == []
    assert f"{n} of {n} daemon(s) took their weights from the custodian" in again.stderr
    url = f"http://127.0.0.1:{port}"
    now = daemons(url)
    assert all(d["status"]["adopted"] and d["status"]["done"] == 0 for d in now.values())
    assert {r: block_digests(d["socket"]) for r, d in now.items()} == served
    sigkill_all(again)

    if n > 1:  # ranks of a group may load only together (vLLM's process group): all of them adopt, or none
        assert main(["release", "--socket-dir", str(sdir), os.path.basename(socks[1])]) == 0
        partly = Preload(args, env, tmp_path, "p3")
        preloads.append(partly)
        partly.wait_ready()
        assert "the custodian holds the weights of some ranks only; released them" in partly.stderr, partly.stderr
        assert "took their weights from the custodian" not in partly.stderr
        assert weight_files_opened(watch.events())
        sigkill_all(partly)
        if device == "cpu":
            assert old and not old & memfd_inodes(), "the first load's memory is freed"
            old = memfd_inodes([custodian.pid])

    # other flags: the held caches are released (never served under another key) and the model loads afresh
    third = Preload([ckpt, "--device", device, "--weight-cache-socket-dir", sdir, "--dtype", "bfloat16",
                     "--weight-cache-keep-on-stop"], env, tmp_path, "p4")
    preloads.append(third)
    third.wait_ready()
    assert weight_files_opened(watch.events()), "a fresh load reads the checkpoint"
    assert re.search(rf"released {n} cache\(s\) of \S+ held under another key", third.stderr), third.stderr
    held = custodian.holdings().holdings
    assert len(held) == 1 and not {h.name for h in held} & {os.path.basename(s) for s in socks.values()}
    if device == "cpu":
        assert old and not old & memfd_inodes(), "the old memory is freed"
        new = memfd_inodes([custodian.pid])
    custodian.close()

    third.proc.send_signal(signal.SIGTERM)  # --weight-cache-keep-on-stop: the custodian keeps them
    assert third.wait() == 0, third.stderr
    assert "keeps 1 cache(s) for the next preload" in third.stderr
    capsys.readouterr()
    assert main(["release", "--socket-dir", str(sdir)]) == 0
    assert "released 1 cache(s)" in capsys.readouterr().out
    if device == "cpu":
        deadline = time.monotonic() + 20
        while new & memfd_inodes():
            assert time.monotonic() < deadline, "released memory must return"
            time.sleep(0.1)


def test_a_rank_that_cannot_load_alone_is_not_replaced_by_a_lone_load(ckpt, tmp_path, monkeypatch, capsys):
    from weightcache.preload.frontend import checkpoint_source
    from weightcache.preload.layout import Layout
    from weightcache.preload.supervisor import Group, Supervisor

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sdir = tmp_path / "s"
    sup = Supervisor([Group(role="main", layout=Layout(device_type="cpu"), make_source=checkpoint_source,
                            source_args={"path": str(ckpt)}, loads_alone=False)], socket_dir=sdir)
    try:
        sup.start()
        (child,) = sup.children
        sup.custodian.release(everything=True)  # its cache is gone: a replacement would have to load alone
        os.kill(child.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not (sup.children[0].message or "").startswith("RuntimeError: the custodian holds no cache"):
            assert time.monotonic() < deadline
            sup.hold_once()
        assert "loads only together with every rank of its group" in sup.children[0].message
    finally:
        sup.shutdown()


def test_a_rank_whose_checkpoint_changed_is_not_replaced(tmp_path, monkeypatch, caplog):
    """Never serve a stale key: after READY, a replacement must build the key its rank agreed on."""
    import shutil

    from weightcache.preload.child import EXIT_KEY_CHANGED
    from weightcache.preload.frontend import checkpoint_source
    from weightcache.preload.layout import Layout
    from weightcache.preload.supervisor import Group, Supervisor

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tmp_path / "m"
    shutil.copytree(make_llama_checkpoint(tmp_path / "orig", seed=4, **SMALL), model)
    sup = Supervisor([Group(role="main", layout=Layout(device_type="cpu"), make_source=checkpoint_source,
                            source_args={"path": str(model)})], socket_dir=tmp_path / "s")
    try:
        sup.start()
        (child,) = sup.children
        make_llama_checkpoint(model, seed=5, **SMALL)  # new weights under the same path
        os.kill(child.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        with caplog.at_level(logging.ERROR, logger="weightcache.preload.supervisor"):
            while "is not replaced: its weights changed on disk" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                assert sup.hold_once() is None or sup.children[0].proc.exitcode == EXIT_KEY_CHANGED
        assert "content_digest" in sup.children[0].message
    finally:
        sup.shutdown()
