"""`weightcache` command line: flags, refusals, dispatch, and the status table over real daemons."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from weightcache import publish
from weightcache.cli import UsageError, build_parser, main
from weightcache.key import CacheKey
from weightcache.preload.frontend import (
    LoopbackLayout,
    add_preload_arguments,
    layouts_from_args,
    resolve_ports,
)
from weightcache.preload.layout import Layout
from weightcache.progress import human_bytes, human_duration
from weightcache.status_table import collect, format_table


def parse(*argv):
    import argparse

    return add_preload_arguments(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "model.safetensors").write_bytes(b"\0" * 16)  # never read: every case here fails before loading
    return d


def preload(*argv, capsys):
    code = main(["preload", *map(str, argv)])
    return code, capsys.readouterr().err


def test_vllm_named_flags_parse():
    a = parse("--model", "m", "-tp", "4", "-pp", "2", "-dp", "8", "-dpl", "2", "-dpn", "4", "-dpa", "10.0.0.1",
              "-ep", "--nnodes", "4", "--node-rank", "2", "--master-addr", "10.0.0.1", "--dtype", "bfloat16",
              "--revision", "abc", "--device", "cpu", "--speculative-model", "d",
              "--weight-cache-master-port", "29600", "--weight-cache-draft-master-port", "29700",
              "--weight-cache-health-port", "8080", "--weight-cache-health-host", "0.0.0.0",
              "--weight-cache-socket-dir", "/tmp/x")
    assert (a.tensor_parallel_size, a.pipeline_parallel_size, a.data_parallel_size) == (4, 2, 8)
    assert (a.data_parallel_size_local, a.data_parallel_rank, a.data_parallel_address) == (2, 4, "10.0.0.1")
    assert a.enable_expert_parallel and (a.nnodes, a.node_rank, a.master_addr) == (4, 2, "10.0.0.1")
    assert (a.dtype, a.revision, a.device, a.draft_model) == ("bfloat16", "abc", "cpu", "d")
    assert (a.weight_cache_master_port, a.weight_cache_draft_master_port) == (29600, 29700)
    assert (a.weight_cache_health_port, a.weight_cache_health_host) == (8080, "0.0.0.0")
    assert parse("--draft-model", "x").draft_model == "x"
    assert parse("m").model_pos == "m" and parse("m").engine == "transformers"


@pytest.mark.parametrize("argv, msg", [
    (["-tp", "0"], "0 must be >= 1"),
    (["--weight-cache-master-port", "70000"], "outside 1..65535"),
    (["--weight-cache-master-port", "x"], "is not a port number"),
    (["--weight-cache-health-port", "70000"], "port 70000 is outside 0..65535"),
    (["--weight-cache-health-port", "-1"], "port -1 is outside 0..65535"),
    (["--weight-cache-draft-master-port", "65536"], "port 65536 is outside 1..65535"),
    (["--device", "tpu"], "invalid choice"),
    (["--engine", "nope"], "invalid choice"),
])
def test_bad_flag_values(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["preload", "m", *argv])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_preload_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["preload", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size-local",
                 "--data-parallel-rank", "--data-parallel-address", "--enable-expert-parallel", "--nnodes",
                 "--node-rank", "--master-addr", "--dtype", "--revision", "--device", "--speculative-model",
                 "--weight-cache-socket-dir", "--weight-cache-master-port", "--weight-cache-draft-master-port",
                 "--weight-cache-health-port", "--weight-cache-health-host"):
        assert flag in out, flag


def test_ports():
    one = parse("m")
    assert resolve_ports(one, nodes=1, has_draft=True) == (0, 0), "free ports on one node"
    with pytest.raises(UsageError, match="span 2 nodes: pass --weight-cache-master-port"):
        resolve_ports(one, nodes=2, has_draft=False)
    assert resolve_ports(parse("m", "--weight-cache-master-port", "29600"), nodes=2, has_draft=True) == (29600, 29601)
    both = parse("m", "--weight-cache-master-port", "29600", "--weight-cache-draft-master-port", "29600")
    with pytest.raises(UsageError, match="different rendezvous ports, both are 29600"):
        resolve_ports(both, nodes=1, has_draft=True)
    assert resolve_ports(both, nodes=1, has_draft=False) == (29600, 29600), "no draft group: nothing to clash"
    with pytest.raises(UsageError, match="leaves no port for the draft group"):
        resolve_ports(parse("m", "--weight-cache-master-port", "65535"), nodes=2, has_draft=True)


def test_equal_ports_refused_end_to_end(model_dir, tmp_path, capsys):
    code, err = preload(model_dir, "--draft-model", model_dir, "--device", "cpu", "--weight-cache-socket-dir",
                        tmp_path / "s", "--weight-cache-master-port", "29600",
                        "--weight-cache-draft-master-port", "29600", capsys=capsys)
    assert code == 2 and "different rendezvous ports, both are 29600" in err


def test_layouts_and_refusals():
    main_l, draft_l = layouts_from_args(parse("m", "-tp", "2", "--draft-model", "d"), "cpu", None)
    assert main_l.describe() == "dp1-pp1-tp2" and draft_l.role == "draft" and draft_l.world_size == 2
    _, d1 = layouts_from_args(parse("m", "-tp", "2", "--draft-model", "d", "--draft-tensor-parallel-size", "1"),
                              "cpu", None)
    assert d1.tp == 1
    with pytest.raises(UsageError, match="do not divide evenly over 3 nodes"):
        layouts_from_args(parse("m", "-tp", "2", "--nnodes", "3", "--master-addr", "10.0.0.1"), "cpu", None)
    with pytest.raises(UsageError, match="loopback"):
        layouts_from_args(parse("m", "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"), "cpu", None)
    with pytest.raises(UsageError, match="only 2 device"):
        layouts_from_args(parse("m", "-tp", "4"), "cuda", 2)


def test_loopback_nodes_only_on_request():
    a = parse("m", "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
              "--weight-cache-allow-loopback-nodes")
    lay, _ = layouts_from_args(a, "cpu", None)
    assert isinstance(lay, LoopbackLayout) and lay.this_node == 1 and [p.rank for p in lay.local_placements()] == [1]
    assert lay.master_addr == "127.0.0.1"
    with pytest.raises(Exception, match="need --master-addr"):
        LoopbackLayout(tp=2, nnodes=2, device_type="cpu")
    assert Layout(tp=2, device_type="cpu").describe() == lay.describe()


@pytest.mark.parametrize("extra, msg", [
    (["-pp", "2"], "no pipeline-parallel split"),
    (["-ep"], "spreads the experts over the tensor-parallel ranks"),
    (["--engine", "safetensors", "-ep"], "does not shard experts"),
    (["-tp", "2", "-dp", "2"], "transformers' tensor parallel world is the TP group alone"),
    (["--tp-plan", "{}"], "--tp-plan applies to --engine safetensors"),
    (["--dtype", "float77"], "--dtype: unknown dtype 'float77'"),
    (["--engine", "safetensors", "--tp-plan", "{not json"], "--tp-plan"),
    (["--engine", "safetensors", "--tp-plan", '{"a": 1}'], "--tp-plan must map tensor patterns to styles"),
    (["--speculative-config", "[1]"], "--speculative-config must be a JSON object"),
    (["--speculative-config", '{"model": "/nowhere"}'], "--speculative-model /nowhere: no such file"),
    (["--nnodes", "2", "--master-addr", "10.0.0.1", "-tp", "2"], "pass --weight-cache-master-port"),
])
def test_preload_refuses_clearly(extra, msg, model_dir, tmp_path, capsys):
    code, err = preload(model_dir, "--device", "cpu", "--weight-cache-socket-dir", tmp_path / "s", *extra,
                        capsys=capsys)
    assert code == 2, err
    assert msg in err and "Traceback" not in err


def test_missing_model(tmp_path, capsys):
    code, err = preload("--device", "cpu", capsys=capsys)
    assert code == 2 and "no model: pass --model DIR" in err
    code, err = preload(tmp_path / "nope", "--device", "cpu", capsys=capsys)
    assert code == 2 and "no such file or directory" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_refused_without_cuda(model_dir, capsys):
    code, err = preload(model_dir, "--device", "cuda", capsys=capsys)
    assert code == 2 and "no CUDA device is visible" in err


def test_engine_vllm_and_demo_dispatch(monkeypatch):
    seen = {}
    vllm_preload = types.ModuleType("weightcache.preload.vllm_frontend")
    vllm_preload.main = lambda argv: seen.setdefault("vllm", argv) and 7
    demo = types.ModuleType("weightcache.demo")
    demo.main = lambda argv: seen.setdefault("demo", argv) and 0
    import weightcache
    import weightcache.preload

    monkeypatch.setitem(sys.modules, "weightcache.preload.vllm_frontend", vllm_preload)
    monkeypatch.setattr(weightcache.preload, "vllm_frontend", vllm_preload, raising=False)
    monkeypatch.setitem(sys.modules, "weightcache.demo", demo)
    monkeypatch.setattr(weightcache, "demo", demo, raising=False)
    assert main(["preload", "--engine", "vllm", "--model", "m", "-tp", "2"]) == 7
    assert seen["vllm"] == ["--engine", "vllm", "--model", "m", "-tp", "2"]
    assert main(["preload", "--model", "m", "--engine=vllm"]) == 7
    assert main(["demo", "--restarts", "2"]) == 0
    assert seen["demo"] == ["--restarts", "2"]


def test_top_level_help_and_unknown_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "preload" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2
    assert build_parser().parse_args(["status", "--json"]).json


# --- status ---

def test_status_table_and_json(sockdir, capsys):
    t = {"w": torch.arange(1024, dtype=torch.float32), "b": torch.ones(3)}
    key = CacheKey(model="/models/tiny", content_digest="sha256:aa", rank=1, layout="dp1-pp1-tp2")
    live = publish(t, Path(sockdir) / "main-r1-cpu-0123abcd.sock", key)
    draft = publish(t, Path(sockdir) / "draft-r0-cpu-89abcdef.sock", key.replace(role="draft", rank=0))
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(Path(sockdir) / "main-r0-cpu-deadbeef.sock"))
    stale.close()  # the file stays, nobody listens: what a killed daemon leaves behind
    try:
        rows = collect(sockdir)
        assert [(r["role"], r["rank"], r["state"]) for r in rows] == [
            ("main", 0, "stale"), ("main", 1, "ready"), ("draft", 0, "ready")]
        assert rows[1]["nbytes"] >= 4096 + 12 and rows[1]["ntensors"] == 2 and rows[1]["clients"] == 0
        assert rows[1]["model"] == "/models/tiny" and rows[1]["device"] == "cpu"

        assert main(["status", "--socket-dir", sockdir]) == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert lines[0].split() == ["ROLE", "RANK", "DEVICE", "MODEL", "BYTES", "TENSORS", "CLIENTS", "UPTIME",
                                    "STATE"]
        assert lines[1].split()[:2] == ["main", "0"] and lines[1].split()[-1] == "stale"
        assert lines[2].split()[:4] == ["main", "1", "cpu", "/models/tiny"] and lines[2].split()[-1] == "ready"
        assert "1 stale" in out

        assert main(["status", "--socket-dir", sockdir, "--json"]) == 0
        js = json.loads(capsys.readouterr().out)
        assert [r["state"] for r in js] == ["stale", "ready", "ready"]
        assert js[1]["status"]["key"]["content_digest"] == "sha256:aa"
    finally:
        live.close()
        draft.close()


def test_status_empty_and_missing_dir(sockdir, tmp_path, capsys):
    assert main(["status", "--socket-dir", sockdir]) == 0
    assert "no weight cache daemons in" in capsys.readouterr().out
    assert main(["status", "--socket-dir", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_human_units():
    assert human_bytes(None) == "-" and human_bytes(512) == "512 B" and human_bytes(3 << 30) == "3.0 GiB"
    assert human_duration(5) == "5s" and human_duration(125) == "2m05s" and human_duration(7260) == "2h01m"
    assert human_duration(2 * 86400 + 3600) == "2d01h"
    assert format_table([], "/x") == "no weight cache daemons in /x"



def test_tensor_parallel_needs_a_transformers_plan(tmp_path, capsys):
    """Refused before any daemon starts: transformers has no tensor parallel plan for GPT-2."""
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (d / "model.safetensors").write_bytes(b"\0" * 16)
    code, err = preload(d, "-tp", "2", "--device", "cpu", "--weight-cache-socket-dir", tmp_path / "s", capsys=capsys)
    assert code == 2 and "transformers has no tensor parallel plan for it (base_model_tp_plan is empty)" in err
    code, err = preload(d, "-tp", "2", "-ep", "--device", "cpu", "--weight-cache-socket-dir", tmp_path / "s",
                        capsys=capsys)
    assert code == 2 and "no expert parallel plan" in err and not (tmp_path / "s").exists() or \
        not list((tmp_path / "s").glob("*.sock"))


# --- refused up front, in one line, before any daemon starts ---

@pytest.fixture
def llama_dir(model_dir):
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 512}))
    return model_dir


@pytest.mark.parametrize("tp, msg", [
    (64, "tensor parallel size 64 is larger than the model's 4 attention heads, 2 key/value heads; transformers' "
         "plan splits each over the ranks: use one of 1, 2"),
    (3, "tensor parallel size 3 does not divide the model's 4 attention heads, 2 key/value heads, 128 "
        "intermediate size, 512 vocabulary size"),
    (4, "tensor parallel size 4 is larger than the model's 2 key/value heads;"),
])
def test_tp_size_that_does_not_split_the_model_is_refused(tp, msg, llama_dir, tmp_path, capsys, monkeypatch):
    import weightcache.preload.supervisor as sup

    monkeypatch.setattr(sup.Supervisor, "run", lambda self: pytest.fail("a daemon was about to start"))
    code, err = preload(llama_dir, "-tp", tp, "--device", "cpu", "--weight-cache-socket-dir", tmp_path / "s",
                        capsys=capsys)
    assert code == 2 and msg in err and "Traceback" not in err, err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("config", ["[1, 2, 3]", '"llama"', "7"])
def test_config_json_that_is_not_an_object_is_one_line(config, model_dir, tmp_path, capsys):
    (model_dir / "config.json").write_text(config)
    code, err = preload(model_dir, "--device", "cpu", "--weight-cache-socket-dir", tmp_path / "s", capsys=capsys)
    assert code == 2 and "config.json: not a model config" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    from weightcache.integrations.transformers.engine import key_for_checkpoint

    with pytest.raises(ValueError, match="not a model config"):
        key_for_checkpoint(model_dir)


def test_socket_path_over_the_unix_limit_is_refused_before_anything_starts(model_dir, tmp_path, capsys):
    long_dir = tmp_path / ("d" * 90)
    code, err = preload(model_dir, "-tp", "2", "--device", "cpu", "--weight-cache-socket-dir", long_dir,
                        capsys=capsys)
    assert code == 2 and "over the 107-byte limit of Unix sockets" in err and "Traceback" not in err, err
    assert str(long_dir) in err and not long_dir.exists(), "nothing is left behind"
    with pytest.raises(Exception, match="107-byte limit"):
        publish({"w": torch.ones(2)}, long_dir / "r0.sock", CacheKey(model="m", content_digest="d"))
    assert not long_dir.exists()


def test_master_port_in_use_is_named(model_dir, tmp_path, capsys, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = preload(model_dir, "--device", "cpu", "--weight-cache-socket-dir", tmp_path / "s",
                            "--weight-cache-master-port", port, capsys=capsys)
    assert code != 0
    text = err + caplog.text
    assert f"rendezvous port {port} is already in use on this host: pick another --weight-cache-master-port" in text
    assert "Traceback" not in text and "EADDRINUSE" not in text


def test_socket_dir_on_a_read_only_filesystem_is_refused(model_dir, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    setup = (f"mount -t tmpfs -o mode=700 tmpfs {mnt} && mkdir -m 700 {mnt}/s && mount -o remount,ro {mnt} "
             "|| exit 99; ")
    run = f"exec {sys.executable} -m weightcache.cli preload {model_dir} --device cpu --weight-cache-socket-dir {mnt}/s"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", setup + run], capture_output=True, text=True, env=env,
                          timeout=120)
    if proc.returncode == 99 or proc.stderr.startswith("unshare:"):
        pytest.skip(f"cannot mount a read-only filesystem here: {proc.stderr.strip()}")
    assert proc.returncode == 2, proc.stderr
    assert f"socket directory {mnt}/s is on a read-only filesystem" in proc.stderr
    assert "Traceback" not in proc.stderr and "starting" not in proc.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand a directory to another uid")
def test_status_of_a_socket_dir_of_another_uid_is_one_line(sockdir, capsys):
    os.chown(sockdir, 65534, -1)
    assert main(["status", "--socket-dir", sockdir]) == 2
    err = capsys.readouterr().err
    assert f"socket directory {sockdir} belongs to uid 65534" in err and len(err.strip().splitlines()) == 1


def test_status_of_a_socket_dir_writable_by_others_is_one_line(sockdir, tmp_path, capsys, monkeypatch):
    os.chmod(sockdir, 0o777)
    assert main(["status", "--socket-dir", sockdir]) == 2
    err = capsys.readouterr().err
    assert "writable by others (mode 0o777)" in err and len(err.strip().splitlines()) == 1
    runtime = tmp_path / "run"
    (runtime / "weightcache").mkdir(parents=True)
    os.chmod(runtime / "weightcache", 0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert main(["status"]) == 2  # the default directory too
    err = capsys.readouterr().err
    assert f"{runtime}/weightcache is writable by others" in err and len(err.strip().splitlines()) == 1


# --- the READY line ---

def _child(adopted: bool, seconds: float, nbytes: int = 10**9):
    return types.SimpleNamespace(ready_info={"adopted": adopted, "load_seconds": seconds, "nbytes": nbytes})


def test_ready_line_gives_a_rate_for_a_load_and_a_time_for_a_takeover():
    from weightcache.preload.ready import how_ready

    assert how_ready([_child(False, 2.0), _child(False, 1.0)]) == " loaded in 2.0 s (1.00 GB/s)"
    took = how_ready([_child(True, 0.0016), _child(True, 0.0009)])
    assert took == " taken over from the custodian in 1.6 ms (no load)" and "GB/s" not in took
    both = how_ready([_child(False, 4.0), _child(True, 0.002)])
    assert both == " loaded in 4.0 s (0.25 GB/s), 1 of 2 taken over from the custodian in 2.0 ms (no load)"
    assert how_ready([_child(False, 0.0)]) == ""
