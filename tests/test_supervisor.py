"""`weightcache preload` end to end on CPU: real daemon processes, real sockets, loopback only."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from weightcache.errors import ArenaOutOfMemory
from weightcache.manifest import TensorMeta
from weightcache.preload.layout import Layout
from weightcache.sources import FillSource
from weightcache.testing.checkpoints import make_llama_checkpoint

pytestmark = pytest.mark.slow

SMALL = dict(hidden_size=64, num_layers=1, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=512)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "a": make_llama_checkpoint(root / "a", seed=0, **SMALL),
        "b": make_llama_checkpoint(root / "b", seed=1, **SMALL),
        "sharded": make_llama_checkpoint(root / "sharded", seed=2, max_shard_bytes=100_000, **SMALL),
    }


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    e.update(XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.pop("XDG_RUNTIME_DIR", None)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gone(pids, timeout=15.0) -> list[int]:
    """Wait until none of `pids` runs (zombies count as gone); returns those still running."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


class Preload:
    """A `weightcache preload` process; its stdout lines are collected by a thread."""

    def __init__(self, args, env, tmp_path: Path, name: str = "preload"):
        args = list(args)
        self.socket_dir = args[args.index("--weight-cache-socket-dir") + 1] if "--weight-cache-socket-dir" in args else None
        self.err_path = tmp_path / f"{name}.stderr"
        self._err = open(self.err_path, "w")
        cmd = [sys.executable, "-m", "weightcache.cli", "preload", *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.out.append(line)
            self.lines.put(line)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_ready(self, timeout=180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    pytest.fail(f"preload exited with {self.proc.returncode} before READY:\n{self.stderr}")
                continue
            if line.startswith("weightcache READY"):
                return line
        pytest.fail(f"no READY line within {timeout} s:\n{self.stderr}")

    def descendants(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def wait(self, timeout=60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._err.close()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()


def stop_custodian(socket_dir) -> None:
    """Stop the custodian a test's preload left holding caches (it outlives the preload by design)."""
    from weightcache.custodian.client import CustodianClient
    from weightcache.errors import WeightCacheError

    try:
        client = CustodianClient.connect(socket_dir, timeout=5)
    except WeightCacheError:
        return
    pid = client.pid
    try:
        client.stop()
    except WeightCacheError:
        pass
    client.close()
    for left in gone([pid], 10):
        os.kill(left, signal.SIGKILL)


@pytest.fixture
def preloads():
    started: list[Preload] = []
    yield started
    for p in started:
        pids = p.descendants()
        p.kill()
        for pid in gone(pids, 5):
            os.kill(pid, signal.SIGKILL)
    for d in {p.socket_dir for p in started if p.socket_dir}:
        stop_custodian(d)


def sockets(d) -> list[str]:
    return sorted(p.name for p in Path(d).glob("*.sock"))


def test_health_metrics_status_and_sigterm(ckpts, env, tmp_path, preloads):
    sdir, port = tmp_path / "s", free_port()
    p = Preload([ckpts["a"], "-tp", "2", "--device", "cpu", "--weight-cache-socket-dir", sdir,
                 "--weight-cache-health-port", port, "--weight-cache-status-details"], env, tmp_path)
    preloads.append(p)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # the health server comes up before the daemons
        try:
            first = httpx.get(url + "/health", timeout=5)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline and p.proc.poll() is None, p.stderr
            time.sleep(0.05)
    assert first.status_code == 503, first.text

    line = p.wait_ready()
    assert "node 0/1" in line and "2 rank(s) x 1 role(s)" in line and str(sdir) in line
    assert f"health http://127.0.0.1:{port}/health" in line
    assert httpx.get(url + "/health").status_code == 200
    metrics = httpx.get(url + "/metrics").text
    for rank in (0, 1):
        assert re.search(rf'weightcache_bytes\{{[^}}]*rank="{rank}"[^}}]*\}} [1-9]', metrics), metrics
        assert re.search(rf'weightcache_daemon_ready\{{[^}}]*rank="{rank}"[^}}]*\}} 1\.0', metrics)
    assert "weightcache_attach_seconds_bucket" in metrics and "weightcache_load_duration_seconds" in metrics
    status = httpx.get(url + "/status").json()
    assert status["healthy"] and status["nnodes"] == 1 and len(status["daemons"]) == 2
    assert {d["status"]["key"]["layout"] for d in status["daemons"]} == {"dp1-pp1-tp2"}

    table = subprocess.run([sys.executable, "-m", "weightcache.cli", "status", "--socket-dir", str(sdir)],
                           capture_output=True, text=True, env=env, timeout=60)
    assert table.returncode == 0, table.stderr
    rows = [ln.split() for ln in table.stdout.splitlines() if ln.startswith("main")]
    assert [(r[0], r[1], r[2], r[-1]) for r in rows] == [("main", "0", "cpu", "ready"), ("main", "1", "cpu", "ready")]

    # a daemon killed after READY is replaced by one that takes its weights from the custodian
    assert all(d["status"]["held"] for d in status["daemons"])
    victim = next(d["pid"] for d in status["daemons"] if d["rank"] == 1)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (r := httpx.get(url + "/health")).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "main rank 1:" in r.text  # unreachable, exited, then starting
    while (r := httpx.get(url + "/health")).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)
    after = {d["rank"]: d for d in httpx.get(url + "/status").json()["daemons"]}
    assert after[1]["pid"] != victim and after[1]["restarts"] == 1 and after[1]["status"]["adopted"]
    assert not after[0]["status"]["adopted"] and after[0]["restarts"] == 0
    metrics = httpx.get(url + "/metrics").text
    assert re.search(r'weightcache_daemon_restarts_total\{[^}]*rank="1"[^}]*\} 1\.0', metrics), metrics
    assert re.search(r'weightcache_daemon_adopted\{[^}]*rank="1"[^}]*\} 1\.0', metrics)
    assert "weightcache_custodian_up 1.0" in metrics
    assert "rank 1 (main, cpu) exited with code -9 after it was ready" in p.stderr
    assert "rank 1 (main, cpu) is back (replacement 1" in p.stderr

    pids = p.descendants()
    p.proc.send_signal(signal.SIGTERM)
    assert p.wait() == 0, p.stderr
    assert gone(pids) == []
    assert sockets(sdir) == [], "every socket removed, the killed daemon's too"
    assert "released 2 cache(s) held by the custodian" in p.stderr
    assert not (sdir / "custodian.ctl").exists() or gone([status["custodian"]["pid"]]) == []
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)


def test_a_first_load_runs_while_the_checkpoint_is_hashed(ckpts, env, tmp_path, preloads):
    """Nothing is held to take over: the daemons load at once and their keys (the checkpoint's digest) come
    meanwhile. Here another hasher's lock holds the digest back, so the load ends first and waits for it."""
    import fcntl

    sdir = tmp_path / "s"
    lock = os.open(ckpts["a"], os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as another process hashing these files holds it
    try:
        p = Preload([ckpts["a"], "-tp", "2", "--device", "cpu", "--weight-cache-socket-dir", sdir], env, tmp_path)
        preloads.append(p)
        deadline = time.monotonic() + 120
        while p.stderr.count("loaded; waiting for the checkpoint's digest") < 2:
            assert time.monotonic() < deadline and p.proc.poll() is None, p.stderr
            time.sleep(0.1)
        assert "main: nothing held to take over: loading while the checkpoint is hashed" in p.stderr
        assert not p.out and sockets(sdir) == [], "no socket, no READY before the key is known"
        time.sleep(2.0)
    finally:
        os.close(lock)
    line = p.wait_ready()
    assert "2 rank(s) x 1 role(s)" in line
    from weightcache.client import query_status

    for name in sockets(sdir):
        if name.startswith("main-"):
            st = query_status(sdir / name)
            assert st.state == "ready" and st.held and st.phases["key wait"] >= 1.5
            assert st.load_seconds < st.phases["key wait"], "the wait for the key is not the load's time"

    # run again beside the custodian's caches: no early load, the caches are taken over
    pids = p.descendants()
    p.proc.send_signal(signal.SIGKILL)
    p.wait()
    gone(pids)
    again = Preload([ckpts["a"], "-tp", "2", "--device", "cpu", "--weight-cache-socket-dir", sdir], env, tmp_path,
                    name="again")
    preloads.append(again)
    again.wait_ready()
    assert "loading while the checkpoint is hashed" not in again.stderr
    assert "took their weights from the custodian" in again.stderr


def test_draft_group_and_sigkilled_supervisor_leaves_no_orphans(ckpts, env, tmp_path, preloads):
    sdir = tmp_path / "s"
    p = Preload([ckpts["a"], "--draft-model", ckpts["b"], "--device", "cpu", "--weight-cache-socket-dir", sdir,
                 "--weight-cache-health-port", 0, "--weight-cache-status-details"], env, tmp_path)
    preloads.append(p)
    line = p.wait_ready()
    assert "1 rank(s) x 2 role(s)" in line and "main: rank 0" in line and "draft: rank 0" in line
    names = sockets(sdir)
    assert len(names) == 2 and names[0].startswith("draft-r0-cpu-") and names[1].startswith("main-r0-cpu-")
    port = int(re.search(r"health http://127\.0\.0\.1:(\d+)/health", line).group(1))
    status = httpx.get(f"http://127.0.0.1:{port}/status").json()
    groups = {g["role"]: g for g in status["groups"]}
    # one node, each rank loads alone: the groups meet in process, no store listens on a port
    assert groups["main"]["master_port"] == groups["draft"]["master_port"] == 0
    keys = {d["role"]: d["status"]["key"] for d in status["daemons"]}
    assert keys["main"]["content_digest"] != keys["draft"]["content_digest"]
    assert keys["draft"]["role"] == "draft"

    daemons = [d["pid"] for d in status["daemons"]]
    all_pids = p.descendants()
    assert set(daemons) <= set(all_pids)
    p.proc.send_signal(signal.SIGKILL)
    p.wait()
    assert gone(all_pids) == [], "daemons must die with their supervisor"
    assert sockets(sdir) == [], "daemons remove their sockets when their supervisor dies"
    from weightcache.custodian.client import CustodianClient

    client = CustodianClient.connect(sdir)  # ...and the custodian keeps their weights for the next preload
    assert sorted(h.role for h in client.holdings().holdings) == ["draft", "main"]
    client.close()


def test_bad_file_fails_every_rank(ckpts, env, tmp_path, preloads):
    bad = tmp_path / "bad"
    shutil.copytree(ckpts["a"], bad)
    f = bad / "model.safetensors"
    os.truncate(f, f.stat().st_size - 1000)
    sdir = tmp_path / "s"
    p = Preload([bad, "--engine", "safetensors", "-tp", "2", "--device", "cpu", "--weight-cache-socket-dir", sdir],
                env, tmp_path)
    preloads.append(p)
    rc = p.wait(120)
    err = p.stderr
    assert rc == 1, err
    # Both ranks read the bad file; whichever fails first stops the other (both when they fail together).
    m = re.search(r"node 0/1: ([12]) of 2 daemon\(s\) failed during start-up \(rank ([01](?:,1)?)\)", err)
    assert m, err
    for rank in m.group(2).split(","):
        assert f"rank {rank} (main, cpu) exited with code 1: CheckpointError" in err
    assert "truncated" in err
    assert "Traceback" not in err, "the daemons say what is wrong in one line"
    assert not p.out, "no READY line"
    assert gone(p.descendants()) == [] and sockets(sdir) == []


def test_missing_tensor_fails_clearly(ckpts, env, tmp_path, preloads):
    bad = tmp_path / "missing"
    shutil.copytree(ckpts["sharded"], bad)
    index = bad / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    meta["weight_map"]["model.layers.0.mlp.extra_proj.weight"] = sorted(set(meta["weight_map"].values()))[0]
    index.write_text(json.dumps(meta))
    sdir = tmp_path / "s"
    p = Preload([bad, "--engine", "safetensors", "--device", "cpu", "--weight-cache-socket-dir", sdir], env, tmp_path)
    preloads.append(p)
    rc = p.wait(120)
    err = p.stderr
    assert rc == 1, err
    assert "1 of 1 daemon(s) failed during start-up (rank 0)" in err
    assert "model.layers.0.mlp.extra_proj.weight" in err and "lacks it" in err
    assert sockets(sdir) == []


# --- a rank that runs out of memory: its source asks for more than the host has ---

class _Oversized(FillSource):
    def __init__(self, inner):
        self.inner = inner

    def describe(self):
        return [*self.inner.describe(), TensorMeta("oversized", "uint8", [1 << 50])]

    def fill(self, views, progress):
        raise AssertionError("an arena this large cannot exist")

    def key_fields(self):
        return self.inner.key_fields()


def oversized_on(placement, *, oom_rank: int, **kw):
    from weightcache.preload.frontend import checkpoint_source

    src = checkpoint_source(placement, **kw)
    return _Oversized(src) if placement.rank == oom_rank else src


def test_out_of_memory_on_one_rank_stops_all(ckpts, tmp_path, monkeypatch, caplog):
    from weightcache.preload.child import EXIT_OOM
    from weightcache.preload.supervisor import Group, Supervisor

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sdir = tmp_path / "s"
    group = Group(role="main", layout=Layout(tp=2, device_type="cpu"), make_source=oversized_on,
                  source_args={"path": str(ckpts["a"]), "oom_rank": 1})
    sup = Supervisor([group], socket_dir=sdir)
    t0 = time.monotonic()
    with caplog.at_level("ERROR", logger="weightcache.preload.supervisor"):
        code = sup.run()
    assert code == EXIT_OOM
    msg = caplog.text
    assert "1 of 2 daemon(s) failed during start-up (rank 1)" in msg, msg
    assert f"rank 1 (main, cpu) exited with code {EXIT_OOM}: {ArenaOutOfMemory.__name__}" in msg
    assert all(c.proc.exitcode is not None for c in sup.children)
    assert sockets(sdir) == []
    assert time.monotonic() - t0 < 120


def test_a_daemons_source_is_built_only_after_its_engine_pre_import_is_done():
    """A pre-import on one thread and the load's imports on another can see a module of one package half made
    (transformers: `cannot import name 'DistributedConfig'`): the source waits for the pre-import."""
    from weightcache.preload.child import LazySource

    done = threading.Event()
    pre = threading.Thread(target=lambda: (time.sleep(0.3), done.set()))
    pre.start()
    seen = []
    source = LazySource(lambda placement, **kw: seen.append(done.is_set()) or kw, None, {"path": "x"}, after=pre)
    assert source.get() == {"path": "x"} and seen == [True]
    assert source.get() == {"path": "x"} and seen == [True]  # built once
    unstarted = LazySource(lambda placement, **kw: kw, None, {}, after=threading.Thread())
    assert unstarted.get() == {}


# --- two nodes on one host, over loopback ---

def _node(ckpt, rank, port, sdir, env, tmp_path, dp=False):
    """Node `rank` of two: TP 2 across the nodes, or (dp=True) DP 2 with one replica per node."""
    split = (["-dp", "2", "-dpl", "1", "-dpn", rank, "--data-parallel-address", "127.0.0.1"] if dp else
             ["-tp", "2", "--nnodes", "2", "--node-rank", rank, "--master-addr", "127.0.0.1"])
    return Preload([ckpt, *split, "--weight-cache-master-port", port, "--weight-cache-allow-loopback-nodes",
                    "--device", "cpu", "--weight-cache-socket-dir", sdir, "--weight-cache-rendezvous-timeout", "120"],
                   env, tmp_path, name=f"node{rank}")


def test_two_nodes_on_loopback_come_up(ckpts, env, tmp_path, preloads):
    port = free_port()
    nodes = [_node(ckpts["a"], r, port, tmp_path / f"s{r}", env, tmp_path) for r in (0, 1)]
    preloads.extend(nodes)
    lines = [n.wait_ready() for n in nodes]
    assert "node 0/2" in lines[0] and "main: rank 0 of 2 (dp1-pp1-tp2)" in lines[0]
    assert "node 1/2" in lines[1] and "main: rank 1 of 2 (dp1-pp1-tp2)" in lines[1]
    assert [n[:7] for n in sockets(tmp_path / "s0")] == ["main-r0"]
    assert [n[:7] for n in sockets(tmp_path / "s1")] == ["main-r1"]
    pids = nodes[0].descendants() + nodes[1].descendants()
    nodes[1].proc.send_signal(signal.SIGINT)  # Ctrl-C
    nodes[0].proc.send_signal(signal.SIGTERM)
    assert [n.wait() for n in nodes] == [0, 0], [n.stderr for n in nodes]
    assert gone(pids) == []
    assert sockets(tmp_path / "s0") == sockets(tmp_path / "s1") == []


def test_node_with_another_checkpoint_fails_both(ckpts, env, tmp_path, preloads):
    port = free_port()
    nodes = [_node(ckpts[c], r, port, tmp_path / f"s{r}", env, tmp_path, dp=True) for r, c in ((0, "a"), (1, "b"))]
    preloads.extend(nodes)
    codes = [n.wait(180) for n in nodes]
    for n, code in zip(nodes, codes, strict=True):
        err = n.stderr
        assert code != 0, err
        assert "node 1's checkpoint stamp differs from node 0's (content_digest)" in err, err
        assert "content_digest: node 0 has 'blake3:" in err
        assert not n.out
    assert sockets(tmp_path / "s0") == [] and sockets(tmp_path / "s1") == []


def test_supervisor_stops_when_every_daemon_is_gone(ckpts, tmp_path, monkeypatch, capsys):
    from weightcache.preload.frontend import checkpoint_source
    from weightcache.preload.supervisor import Group, Supervisor

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sdir = tmp_path / "s"
    sup = Supervisor([Group(role="main", layout=Layout(device_type="cpu"), make_source=checkpoint_source,
                            source_args={"path": str(ckpts["a"])})], socket_dir=sdir, restart=False,
                     custodian=False)
    try:
        sup.start()
        out = capsys.readouterr().out
        assert "weightcache READY node 0/1: 1 rank(s) x 1 role(s)" in out
        assert re.search(r" loaded in \d+\.\d s \(\d+\.\d\d GB/s\), sockets in ", out), out
        (child,) = sup.children
        os.kill(child.proc.pid, signal.SIGKILL)
        assert sup.hold() == 128 + signal.SIGKILL
    finally:
        sup.shutdown()
    assert sockets(sdir) == [], "the killed daemon's socket is removed"
    assert not (sdir / "custodian.ctl").exists(), "custodian=False starts none"


def test_a_node_waiting_for_node_0_stops_promptly(ckpts, env, tmp_path, preloads):
    p = _node(ckpts["a"], 1, free_port(), tmp_path / "s1", env, tmp_path)
    preloads.append(p)
    deadline = time.monotonic() + 120
    while "waiting for node 0's store" not in p.stderr:
        assert p.proc.poll() is None and time.monotonic() < deadline, p.stderr
        time.sleep(0.1)
    t0 = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0, p.stderr
    assert time.monotonic() - t0 < 10


@pytest.mark.gpu
def test_preload_on_cuda_serves_the_transformers_engine(ckpts, env, tmp_path, preloads):
    import torch

    from weightcache.integrations.transformers import engine as wct

    sdir = tmp_path / "s"
    p = Preload([ckpts["a"], "--device", "cuda", "--weight-cache-socket-dir", sdir], env, tmp_path)
    preloads.append(p)
    assert "on cuda:0" in p.wait_ready()
    model = wct.from_pretrained(ckpts["a"], device="cuda", socket_dir=sdir, fallback=False)
    assert model._weightcache_source == "attach"
    assert next(model.parameters()).device == torch.device("cuda", 0)
    del model
    p.proc.send_signal(signal.SIGTERM)
    assert p.wait() == 0, p.stderr
    assert sockets(sdir) == []
