"""vLLM end to end on CPU, really running vLLM: `weightcache preload --engine vllm` daemons and engines started
with `--load-format weightcache`, compared with the same engines loading from disk.

Each engine runs in its own process (tests/vllm_runner.py; in-process engine core for speed, except the
OpenAI server test, which runs vLLM's default multi-process engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from vllm_harness import (  # noqa: E402
    RUNNER,
    Preload,
    cleanup,
    disk_reference,
    draft_spec,
    new_work,
    ok,
    openai_server_survives_daemon_kill,
    preload_with_draft,
    result_of,
    run_engine,
    sockdir,
    tail,
    weight_files_opened,
)
from weightcache.client import query_status
from weightcache.integrations.model_state import parity
from weightcache.testing.checkpoints import make_llama_checkpoint, make_moe_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# head_dim 64: vLLM's CPU attention has no kernel for smaller heads.
SHAPE = dict(hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, num_layers=2, vocab_size=512,
             dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    w = new_work(root, tiny=str(make_llama_checkpoint(root / "tiny", seed=0, **SHAPE)),
                 tiny2=str(make_llama_checkpoint(root / "tiny2", seed=1, **SHAPE)))
    yield w
    cleanup(w)


@pytest.fixture(scope="module")
def daemons(work):
    p = preload_with_draft(work)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def disk(work):
    return disk_reference(work)


def attach_extra(daemons, **kw) -> dict:
    return {"socket_dir": daemons.sockdir, **kw}


def test_attach_generates_the_disk_tokens_restarts_and_never_opens_weights(work, daemons, disk):
    first = ok(run_engine(work, {"load_format": "weightcache", "extra": attach_extra(daemons),
                                 "watch": [work["tiny"]], "dump": str(work["root"] / "attach.pt"),
                                 "external_memory": True}))
    assert first["attached"] and first["tokens"] == disk["tokens"]
    assert weight_files_opened(first) == [], first["opened"]
    # the loader's get_external_weight_memory(): exactly the bytes the main daemon maps for this key
    assert first["external_memory"] == query_status(daemons.sockets("main")[0]).nbytes > 0
    # parity: every tensor reachable from the model, plus each CPU kernel's output on a fixed input
    diffs = parity(torch.load(work["root"] / "disk.pt"), torch.load(work["root"] / "attach.pt"))
    assert diffs == []
    for _ in range(2):  # restarts: same tokens each time
        again = ok(run_engine(work, {"load_format": "weightcache", "extra": attach_extra(daemons)}))
        assert again["attached"] and again["tokens"] == disk["tokens"]
    st = query_status(daemons.sockets("main")[0])
    assert st.attaches_served >= 3 and st.clients_attached == 0  # engines that exited detached


def test_draft_model_attaches_from_the_draft_group(work, daemons, disk):
    spec = draft_spec(work)
    draft_sock = daemons.sockets("draft")
    assert len(draft_sock) == 1
    served = query_status(draft_sock[0]).attaches_served
    ref = ok(run_engine(work, {"speculative_config": spec, "dump": str(work["root"] / "spec-disk.pt")}))
    res = ok(run_engine(work, {"load_format": "weightcache", "extra": attach_extra(daemons),
                               "speculative_config": spec, "watch": [work["tiny"], work["tiny2"]],
                               "dump": str(work["root"] / "spec-attach.pt"), "external_memory": True}))
    assert res["attached"] and res["draft_attached"]
    assert res["tokens"] == ref["tokens"] == disk["tokens"]  # greedy speculative decoding is lossless
    assert weight_files_opened(res) == []
    assert query_status(draft_sock[0]).attaches_served == served + 1
    main_bytes = query_status(daemons.sockets("main")[0]).nbytes
    assert res["external_memory"] == main_bytes + query_status(draft_sock[0]).nbytes
    a, b = torch.load(work["root"] / "spec-disk.pt"), torch.load(work["root"] / "spec-attach.pt")
    assert any(k.startswith("drafter.") for k in a)
    assert parity(a, b) == []


@pytest.mark.parametrize("change, field", [
    ({"dtype": "float32"}, "dtype: engine expects 'float32', daemon holds 'bfloat16'"),
    ({"model": "tiny2"}, "content_digest: engine expects"),
])
def test_mismatched_engine_is_refused_field_by_field(work, daemons, change, field):
    spec = {"load_format": "weightcache", "extra": attach_extra(daemons)}
    if "model" in change:
        spec["model"] = work[change["model"]]
    else:
        spec.update(change)
    res = run_engine(work, spec)
    assert "error" in res, "a mismatched engine was served"
    assert field in res["error"]["message"] or field in res["error"]["log"], res["error"]


def test_no_daemon_fails_naming_the_socket_unless_fallback(work, disk):
    empty = sockdir(work, "empty")
    res = run_engine(work, {"load_format": "weightcache", "extra": {"socket_dir": empty}})
    assert "error" in res
    text = res["error"]["message"] + res["error"]["log"]
    assert f"Tried {empty}/main-r0-cpu-" in text and "weightcache preload --engine vllm" in text
    res = ok(run_engine(work, {"load_format": "weightcache", "extra": {"socket_dir": empty, "fallback": True},
                               "watch": [work["tiny"]]}))
    assert not res["attached"] and res["tokens"] == disk["tokens"]
    assert weight_files_opened(res)  # it did load from disk


def test_fallback_on_mismatch_loads_from_disk(work, daemons):
    # another checkpoint than the daemon holds: refused by key, loaded from disk, still correct
    res = ok(run_engine(work, {"model": work["tiny2"], "load_format": "weightcache",
                               "extra": attach_extra(daemons, fallback=True)}))
    ref = ok(run_engine(work, {"model": work["tiny2"]}))
    assert not res["attached"] and res["tokens"] == ref["tokens"]
    work["results"]["tiny2_tokens"] = ref["tokens"]


def test_in_place_weight_reload(work, daemons, disk):
    # mode=copy: vLLM's reload_weights rebinds through the parameters' weight_loader attributes
    res = ok(run_engine(work, {"load_format": "weightcache", "extra": attach_extra(daemons, mode="copy"),
                               "reload": {"weights_path": work["tiny2"]}, "external_memory": True}))
    assert res["attached"] and res["tokens"] == disk["tokens"]
    assert res["external_memory"] == 0  # a private copy is the engine's own memory
    assert res["reload"] == "ok"
    tiny2 = work["results"].get("tiny2_tokens") or ok(run_engine(work, {"model": work["tiny2"]}))["tokens"]
    assert res["tokens_after_reload"] == tiny2
    # mode=map: the mapping is read-only, so the reload is refused before anything changes
    res = ok(run_engine(work, {"load_format": "weightcache", "extra": attach_extra(daemons), "reload": {}}))
    assert "mode" in res["reload"] and "copy" in res["reload"] and res["reload"].startswith("WeightCacheError")
    assert res["tokens_after_reload"] == disk["tokens"]


def test_engine_waits_while_the_daemon_loads(work, daemons, disk):
    """A daemon that is still loading: the engine waits (bounded, progress in vLLM's log) instead of loading
    a second copy from disk, and attaches once the daemon is ready."""
    from weightcache import attach
    from weightcache.daemon import Daemon
    from weightcache.sockets import socket_path

    with attach(daemons.sockets("main")[0], mode="copy") as att:  # the weights, to publish again later
        tensors, roles, key = dict(att.tensors), dict(att.roles), att.key
    sd = sockdir(work, "wait")
    d = Daemon(socket_path(sd, key, "cpu"), key)
    d.start()  # listening, state "loading"
    try:
        res = run_engine(work, {"load_format": "weightcache", "extra": {"socket_dir": sd, "wait": 2}})
        assert "error" in res and "loading" in res["error"]["message"], res
        log = open(work["root"] / "wait-engine.log", "w+")
        spec = {"model": work["tiny"], "load_format": "weightcache", "extra": {"socket_dir": sd, "wait": 300},
                "watch": [work["tiny"]]}
        proc = subprocess.Popen([sys.executable, RUNNER, json.dumps(spec)], stdout=log, stderr=subprocess.STDOUT,
                                text=True, env=work["env"])  # vLLM logs to stdout
        deadline = time.monotonic() + 300
        while "is loading; waiting up to 300 s" not in tail(log, 100_000):
            assert proc.poll() is None and time.monotonic() < deadline, tail(log)
            time.sleep(0.2)
        d.load_tensors(tensors, roles)
        proc.wait(timeout=300)
        res = ok(result_of(tail(log, 1_000_000), tail(log)))
        assert res["attached"] and res["tokens"] == disk["tokens"]
        assert weight_files_opened(res) == []
        assert d.status().attaches_served == 1
    finally:
        d.close()


def test_openai_server_keeps_serving_when_the_daemon_is_killed(work, disk):
    openai_server_survives_daemon_kill(work, work["tiny"], disk["tokens"], "--enforce-eager",
                                       "--gpu-memory-utilization", "0.3")


def test_tensor_parallel_2(work, disk):
    """TP=2 on vLLM's CPU backend (gloo; one core per rank): the preload's two daemons form their own
    group, each engine worker attaches its rank, byte-identical to the disk load's shards."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on the CPU backend needs two cores")
    sd = sockdir(work, "tp2")
    pre = Preload(work, work["tiny"], sd, "--tensor-parallel-size", "2")
    try:
        assert len(pre.sockets()) == 2 and "dp1-pp1-tp2" in pre.ready
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
        ref = ok(run_engine(work, {"tp": 2, "dump": str(work["root"] / "tp2-disk.pt")}, env=env))
        res = ok(run_engine(work, {"tp": 2, "load_format": "weightcache", "extra": {"socket_dir": sd},
                                   "watch": [work["tiny"]], "dump": str(work["root"] / "tp2-attach.pt")}, env=env))
        assert res["tokens"] == ref["tokens"]
        assert weight_files_opened(res) == []
        for rank in (0, 1):
            a = torch.load(work["root"] / f"tp2-disk.pt.rank{rank}")
            b = torch.load(work["root"] / f"tp2-attach.pt.rank{rank}")
            assert a["model.embed_tokens.weight"].shape[0] == 256  # a shard, not the whole table
            assert parity(a, b) == []
        assert all(query_status(s).attaches_served == 1 for s in pre.sockets())
        # a TP=1 engine against the TP=2 daemons: refused by layout
        bad = run_engine(work, {"load_format": "weightcache", "extra": {"socket_dir": sd}})
        assert "error" in bad
        assert "layout: engine expects 'dp1-pp1-tp1', daemon holds 'dp1-pp1-tp2'" in (
            bad["error"]["message"] + bad["error"]["log"])
    finally:
        pre.stop()


def test_moe_model_attaches_with_kernels_rebuilt_from_the_cache(work):
    """A Qwen3-MoE-shaped model: the daemon captures the experts after vLLM's post-processing; the engine
    rebuilds vLLM's MoE kernel objects from the attached weights (never shipped, never re-quantized)."""
    moe = str(make_moe_checkpoint(work["root"] / "moe", "qwen3_moe"))
    sd = sockdir(work, "moe")
    pre = Preload(work, moe, sd)
    try:
        ref = ok(run_engine(work, {"model": moe, "dump": str(work["root"] / "moe-disk.pt")}))
        res = ok(run_engine(work, {"model": moe, "load_format": "weightcache", "extra": {"socket_dir": sd},
                                   "watch": [moe], "dump": str(work["root"] / "moe-attach.pt")}))
        assert res["attached"] and res["tokens"] == ref["tokens"]
        assert weight_files_opened(res) == []
        a, b = torch.load(work["root"] / "moe-disk.pt"), torch.load(work["root"] / "moe-attach.pt")
        assert any(".experts." in k and "w13" in k for k in a)
        assert parity(a, b) == []
    finally:
        pre.stop()
