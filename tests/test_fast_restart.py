"""`weightcache preload` run again as it ran before comes back from its record without the engine: same
arguments, unchanged files, every cache held. The supervisor and its daemons import neither torch, nor
transformers, nor vLLM, and serve the same bytes; anything else takes the full path."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from conftest import DEVICES
from procs import block_digests
from test_restart import sigkill_all
from test_supervisor import SMALL, Preload, gone, stop_custodian
from weightcache.custodian.client import CustodianClient
from weightcache.preload import record
from weightcache.testing.checkpoints import make_llama_checkpoint

pytestmark = pytest.mark.slow
ENGINES = ("torch", "transformers", "vllm")


@pytest.fixture
def ckpt(tmp_path):
    return make_llama_checkpoint(tmp_path / "m", seed=5, **SMALL)


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WEIGHTCACHE_DUMP_MODULES=str(tmp_path / "mods"))
    e.pop("XDG_RUNTIME_DIR", None)
    e.pop("WEIGHTCACHE_NO_FAST_RESTART", None)
    (tmp_path / "mods").mkdir()
    return e


@pytest.fixture
def started(tmp_path):
    out: list[Preload] = []
    yield out
    for p in out:
        p.kill()
        gone(p.descendants(), 5)
    stop_custodian(tmp_path / "s")


def _held_by_nobody(sdir, n) -> None:
    client = CustodianClient.connect(sdir)
    try:
        deadline = time.monotonic() + 10
        while True:
            held = client.holdings().holdings
            if len(held) == n and not any(h.served_by for h in held):
                return
            assert time.monotonic() < deadline, held
            time.sleep(0.05)
    finally:
        client.close()


def _imported(mods: Path) -> dict[str, set[str]]:
    return {f.stem: set(f.read_text().split()) for f in mods.glob("*.modules")}


def _no_engine_imported(mods: Path) -> None:
    for who, names in _imported(mods).items():
        assert not set(ENGINES) & names, f"{who} imported {set(ENGINES) & names}"


def _run_again(args, env, tmp_path: Path, started: list, ranks: int = 1) -> Preload:
    """The same preload again, once the one before is dead and the custodian holds its caches for nobody."""
    _held_by_nobody(tmp_path / "s", ranks)
    for f in (tmp_path / "mods").glob("*"):
        f.unlink()
    again = Preload(args, env, tmp_path, "p2")
    started.append(again)
    again.wait_ready()
    return again


@pytest.mark.parametrize("device", DEVICES)
def test_a_preload_run_again_comes_back_without_the_engine(ckpt, env, tmp_path, started, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    sdir, mods = tmp_path / "s", tmp_path / "mods"
    args = [ckpt, "-tp", n, "--device", device, "--weight-cache-socket-dir", sdir]
    first = Preload(args, env, tmp_path, "p1")
    started.append(first)
    first.wait_ready()
    assert {"torch", "transformers"} <= _imported(mods)["main-r0"], "the first start loads with the engine"
    recs = list(sdir.glob(f"{record.PREFIX}*.json"))
    assert len(recs) == 1
    socks = sorted(str(p) for p in sdir.glob("*.sock"))
    served = {s: block_digests(s) for s in socks}
    sigkill_all(first)
    _held_by_nobody(sdir, n)
    for f in mods.glob("*"):
        f.unlink()

    t0 = time.monotonic()
    again = Preload(args, env, tmp_path, "p2")
    started.append(again)
    again.wait_ready()
    took = time.monotonic() - t0
    assert "restarting from preload-" in again.stderr, again.stderr
    assert set(_imported(mods)) == {"supervisor", *(f"main-r{r}" for r in range(n))}
    _no_engine_imported(mods)
    assert {s: block_digests(s) for s in socks} == served
    print(f"READY {took:.2f} s after the restart began ({device}, {n} rank(s))")
    sigkill_all(again)
    _held_by_nobody(sdir, n)

    # the record names keys the custodian does not hold: the daemons find nothing, the start runs in full
    raw = json.loads(recs[0].read_text())
    for r in raw["groups"][0]["ranks"]:
        r["key"]["revision"] = "other"
    recs[0].write_text(json.dumps(raw))
    for f in mods.glob("*"):
        f.unlink()
    third = Preload(args, env, tmp_path, "p3")
    started.append(third)
    third.wait_ready()
    assert "starting again in full" in third.stderr, third.stderr
    assert "transformers" in _imported(mods)[f"main-r{n - 1}"]
    sigkill_all(third)
    _held_by_nobody(sdir, n)

    # a changed checkpoint file (its mtime put back: ctime still tells): the full path, a fresh load
    cfg = Path(ckpt) / "config.json"
    st = os.stat(cfg)
    cfg.write_text(cfg.read_text())
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns))
    fourth = Preload(args, env, tmp_path, "p4")
    started.append(fourth)
    fourth.wait_ready()
    assert "restarting from preload-" not in fourth.stderr
    assert "changed since this preload last ran" in fourth.stderr, fourth.stderr


def test_other_arguments_take_the_full_path(ckpt, env, tmp_path, started):
    sdir = tmp_path / "s"
    args = [ckpt, "--device", "cpu", "--weight-cache-socket-dir", sdir]
    first = Preload(args, env, tmp_path, "p1")
    started.append(first)
    first.wait_ready()
    sigkill_all(first)
    _held_by_nobody(sdir, 1)
    other = Preload([*args, "--dtype", "float32"], env, tmp_path, "p2")
    started.append(other)
    other.wait_ready()
    assert "restarting from preload-" not in other.stderr
    env2 = dict(env, WEIGHTCACHE_LOAD_IO="mmap")  # another relevant environment: another record
    assert record.record_id([str(a) for a in args], environ=env2) != record.record_id([str(a) for a in args],
                                                                                     environ=env)


@pytest.mark.parametrize("engine", ["transformers", "safetensors"])
def test_the_first_start_leaves_the_engine_to_the_daemons(ckpt, env, tmp_path, started, engine):
    """The front end and the supervisor import no torch and no transformers on a full start, one rank per
    group: the daemons import them in parallel, while the checkpoint is hashed."""
    sdir, mods = tmp_path / "s", tmp_path / "mods"
    first = Preload([ckpt, "--device", "cpu", "--engine", engine, "--weight-cache-socket-dir", sdir], env,
                    tmp_path, "p1")
    started.append(first)
    first.wait_ready()
    imported = _imported(mods)
    assert "torch" in imported["main-r0"], "the daemon loads with torch"
    assert not set(ENGINES) & imported["supervisor"], set(ENGINES) & imported["supervisor"]


def test_the_record_names_the_preload_as_it_started(monkeypatch):
    """An engine imported after the start sets variables of its own (vLLM's, torch's): the record written at
    READY and the restart that looks for it agree on its name all the same."""
    monkeypatch.delenv("VLLM_SOMETHING_SET_BY_THE_ENGINE", raising=False)
    monkeypatch.setattr(record, "_AT_START", {})
    argv = ["/models/m", "--engine", "vllm"]
    record.note_start()
    at_start = record.record_id(argv)
    monkeypatch.setenv("VLLM_SOMETHING_SET_BY_THE_ENGINE", "1")
    assert record.record_id(argv) == at_start
    assert record.record_id(argv, environ=dict(os.environ)) != at_start  # an explicit environment still counts


def _vllm_preload(ckpt, sdir, *extra) -> list:
    return [ckpt, "--engine", "vllm", "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", 256,
            "--weight-cache-socket-dir", sdir, *extra]


def test_a_vllm_preload_starts_without_vllm_and_run_again_comes_back_without_it(ckpt, env, tmp_path, started):
    """A local model on one node: the front end plans the daemons from the flags (each daemon builds vLLM's
    config itself), and the same preload run again comes back from its record."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    sdir, mods = tmp_path / "s", tmp_path / "mods"
    args = _vllm_preload(ckpt, sdir)
    first = Preload(args, env, tmp_path, "p1")
    started.append(first)
    first.wait_ready()
    assert "planned from the flags" in first.stderr, first.stderr
    imported = _imported(mods)
    assert "vllm" in imported["main-r0"]
    assert not set(ENGINES) & imported["supervisor"], set(ENGINES) & imported["supervisor"]
    socks = sorted(str(p) for p in sdir.glob("*.sock"))
    served = {s: block_digests(s) for s in socks}
    sigkill_all(first)
    again = _run_again(args, env, tmp_path, started)
    assert "restarting from preload-" in again.stderr and "starting again in full" not in again.stderr, again.stderr
    _no_engine_imported(mods)
    assert sorted(str(p) for p in sdir.glob("*.sock")) == socks
    assert {s: block_digests(s) for s in socks} == served
    sigkill_all(again)
    _held_by_nobody(sdir, 1)


def test_a_flag_vllm_does_not_know_fails_the_preload_in_one_line(ckpt, env, tmp_path, started):
    """Planned from the flags, the preload leaves vLLM's flags to its daemons: vLLM's parser names the bad one."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    bad = Preload(_vllm_preload(ckpt, tmp_path / "s2", "--no-such-vllm-flag", "3", "--weight-cache-no-custodian"),
                  env, tmp_path, "p2")
    started.append(bad)
    assert bad.proc.wait(120) != 0
    lines = [ln for ln in bad.stderr.splitlines() if "unrecognized arguments: --no-such-vllm-flag 3" in ln]
    assert lines and "exited with code" in lines[-1], bad.stderr[-3000:]
    assert not list((tmp_path / "s2").glob("*.sock"))


def test_a_warm_engine_preload_run_again_keeps_its_warm_interpreter(ckpt, env, tmp_path, started):
    """--warm-engine is remembered: the preload run again reuses the warm interpreter that outlived it (without
    importing an engine) and retires it at its own orderly stop."""
    import signal

    from test_supervisor import gone
    from weightcache.errors import WeightCacheError
    from weightcache.sockets import warm_socket_path
    from weightcache.warm import client as warm_client

    sdir, mods = tmp_path / "s", tmp_path / "mods"
    args = [ckpt, "--device", "cpu", "--weight-cache-socket-dir", sdir, "--warm-engine"]
    first = Preload(args, env, tmp_path, "p1")
    started.append(first)
    first.wait_ready()
    path = warm_socket_path(sdir)
    deadline = time.monotonic() + 240  # it imports vLLM, torch and transformers, then listens
    while True:
        try:
            warm_pid = warm_client.query(path).pid
            break
        except (WeightCacheError, OSError):
            assert time.monotonic() < deadline, first.stderr
            time.sleep(0.2)
    pids = [first.proc.pid, *(p for p in first.descendants() if p != warm_pid)]
    for pid in pids:  # the preload dies; its warm interpreter (a session of its own) lives on
        os.kill(pid, signal.SIGKILL)
    first.wait()
    assert gone(pids) == []
    again = _run_again(args, env, tmp_path, started)
    assert "restarting from preload-" in again.stderr and f"pid {warm_pid} at {path} is reused" in again.stderr, \
        again.stderr
    _no_engine_imported(mods)
    again.proc.send_signal(signal.SIGTERM)
    assert again.wait(60) == 0
    assert gone([warm_pid], 30) == [], "the orderly stop retires the warm interpreter"
