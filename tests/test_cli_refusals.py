"""Bad inputs to `weightcache preload` and `weightcache demo`, run as a user runs them (a subprocess): one line
that names what and why, a non-zero exit (2 for usage, 3 for out of memory, 1 otherwise), never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def cli(*argv, timeout: float = 180, env: dict | None = None) -> tuple[int, str]:
    """The command's exit code and output. A preload has no custodian here: one that is not refused as it
    should be leaves nothing behind when its timeout kills it."""
    argv = [*map(str, argv)] + (["--weight-cache-no-custodian"] if argv[0] == "preload" else [])
    proc = subprocess.run([sys.executable, "-m", "weightcache.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env={**ENV, **(env or {})})
    return proc.returncode, proc.stderr + proc.stdout


def st_file(path: Path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    from weightcache.testing.checkpoints import make_llama_checkpoint

    return make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "good")


def variant(good: Path, root: Path, name: str, change) -> Path:
    d = root / name
    shutil.copytree(good, d)
    change(d)
    return d


def _config(**fields):
    def change(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(fields)
        for k in [k for k, v in fields.items() if v is None]:
            del cfg[k]
        (d / "config.json").write_text(json.dumps(cfg))
    return change


def _weights(write):
    def change(d: Path) -> None:
        f = d / "model.safetensors"
        write(f, f.read_bytes())
    return change


def _only(name: str, data: bytes):
    def change(d: Path) -> None:
        (d / "model.safetensors").unlink()
        (d / name).write_bytes(data)
    return change


def _header(header: dict, nbytes: int):
    return _weights(lambda f, _: st_file(f, header, b"\0" * nbytes))


F32 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}

# name, change to the good checkpoint, engine, what the one line says
BEFORE_START = [  # told by the directory's file names: refused before anything starts
    ("GGUF only", _only("model.gguf", b"GGUF" + bytes(64)), "transformers", "convert the GGUF file to safetensors"),
    ("GGUF only", _only("model.gguf", b"GGUF" + bytes(64)), "safetensors", "found *.gguf"),
    (".bin only", _only("pytorch_model.bin", bytes(64)), "safetensors", "no weights --engine safetensors reads"),
    ("no weights", lambda d: (d / "model.safetensors").unlink(), "transformers", "found none"),
    ("no config.json", lambda d: (d / "config.json").unlink(), "transformers", "has no config.json"),
]


@pytest.mark.parametrize("name, change, engine, msg", BEFORE_START, ids=[f"{c[0]}-{c[2]}" for c in BEFORE_START])
def test_bad_checkpoint_refused_before_any_daemon(name, change, engine, msg, good, tmp_path):
    d = variant(good, tmp_path, "m", change)
    code, out = cli("preload", d, "--engine", engine, "--device", "cpu", "--weight-cache-socket-dir", tmp_path / "s")
    assert code == 2, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert out.startswith("weightcache preload: error: main model") and msg in out, out
    assert not (tmp_path / "s").exists(), "refused before anything started"


@pytest.mark.parametrize("flags, msg", [
    (["--weight-cache-start-timeout", "nan"], "'nan' must be a finite number of seconds > 0"),
    (["--weight-cache-start-timeout", "-5"], "'-5' must be a finite number of seconds > 0"),
    (["--weight-cache-rendezvous-timeout", "inf"], "'inf' must be a finite number of seconds > 0"),
    (["--weight-cache-health-host", "0.0.0.0", "--weight-cache-status-details"],
     "--weight-cache-status-details shows process ids and paths: allowed only with a loopback"),
])
def test_bad_weight_cache_flags(flags, msg, good, tmp_path):
    code, out = cli("preload", good, "--device", "cpu", "--weight-cache-socket-dir", tmp_path / "s", *flags)
    assert code == 2 and msg in out and "Traceback" not in out, out


def test_more_cpu_ranks_than_cpus_are_refused(good, tmp_path):
    cpus = len(os.sched_getaffinity(0))
    code, out = cli("preload", good, "--engine", "safetensors", "-dp", cpus + 1, "--device", "cpu",
                    "--weight-cache-socket-dir", tmp_path / "s")
    assert code == 2 and "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert f"would run {cpus + 1} daemon(s) (dp{cpus + 1}-pp1-tp1) on --device cpu but only {cpus} CPU(s)" in out


def _random_bytes(f, raw):
    f.write_bytes(os.urandom(4096))


# The daemon that loads finds these (the front end opens no weight file: a restart served by the custodian
# reads none): exit 1, its failure in one line, no traceback.
IN_THE_DAEMON = [
    ("random bytes", _weights(_random_bytes), "transformers", "not a safetensors file or truncated"),
    ("random bytes", _weights(_random_bytes), "safetensors", "not a safetensors file or truncated"),
    ("truncated", _weights(lambda f, raw: f.write_bytes(raw[: len(raw) // 2])), "safetensors", "(truncated?)"),
    ("header not JSON", _weights(lambda f, raw: f.write_bytes(raw[:8] + b"[" + raw[9:])), "safetensors",
     "corrupt safetensors header"),
    ("empty weights", _weights(lambda f, raw: f.write_bytes(b"")), "transformers", "not a safetensors file (only 0"),
    ("negative shape", _header({"w": {**F32, "shape": [-2, -2]}}, 16), "safetensors",
     "tensor 'w' has a negative dimension in its shape [-2, -2]"),
    ("unknown dtype", _header({"w": {**F32, "dtype": "F99"}}, 16), "safetensors", "dtype 'F99'"),
    ("overlapping tensors", _header({"a": F32, "b": {**F32, "data_offsets": [8, 24]}}, 24), "safetensors",
     "tensors 'a' (bytes"),
    ("config without model_type", _config(model_type=None), "transformers", "Unrecognized model"),
    ("config with a string size", _config(hidden_size="big"), "transformers", "hidden_size"),
    ("weights of another shape", _config(hidden_size=128), "transformers", "ignore_mismatched_sizes"),
    ("a .bin that is no checkpoint", _only("pytorch_model.bin", bytes(range(256)) * 4), "transformers",
     "UnpicklingError: Weights only load failed"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, change, engine, msg", IN_THE_DAEMON, ids=[f"{c[0]}-{c[2]}" for c in IN_THE_DAEMON])
def test_what_the_loading_daemon_finds_fails_in_one_line(name, change, engine, msg, good, tmp_path):
    d = variant(good, tmp_path, "m", change)
    code, out = cli("preload", d, "--engine", engine, "--device", "cpu", "--weight-cache-socket-dir", tmp_path / "s")
    assert code == 1, out
    assert "Traceback" not in out and msg in out, out
    failed = [ln for ln in out.splitlines() if "failed: " in ln and "[main r0] weightcache.supervisor" in ln]
    assert len(failed) == 1 and msg.split(" (")[0] in failed[0], out
    assert "rank 0 (main, cpu) exited with code 1: " in out


@pytest.mark.slow
def test_bad_draft_model_is_named(good, tmp_path):
    draft = variant(good, tmp_path, "d", _weights(_random_bytes))
    code, out = cli("preload", good, "--draft-model", draft, "--device", "cpu", "--weight-cache-socket-dir",
                    tmp_path / "s")
    assert code == 1 and "Traceback" not in out, out
    assert "rank 0 (draft, cpu) exited with code 1: CheckpointError: " in out and str(draft) in out
    assert "leaked semaphore" not in out, "the daemons leave nothing for the resource tracker to warn about"


# --- demo ---

@pytest.mark.parametrize("flags, msg", [
    (["--size-mb", "-1"], "argument --size-mb: -1 must be >= 1"),
    (["--size-mb", "0"], "argument --size-mb: 0 must be >= 1"),
    (["--engines", "0"], "argument --engines: 0 must be >= 1"),
    (["--restarts", "-2"], "argument --restarts: -2 must be >= 1"),
    (["--new-tokens", "0"], "argument --new-tokens: 0 must be >= 1"),
    (["--size-mb", "x"], "'x' is not a size in MB"),
])
def test_demo_flags(flags, msg):
    code, out = cli("demo", "--device", "cpu", *flags)
    assert code == 2 and msg in out and "Traceback" not in out, out


def test_demo_workdir_and_room(tmp_path):
    (tmp_path / "file").write_text("x")
    code, out = cli("demo", "--device", "cpu", "--workdir", tmp_path / "file")
    assert code == 2 and "--workdir" in out and "is not a directory" in out and "Traceback" not in out, out
    code, out = cli("demo", "--device", "cpu", "--size-mb", 1 << 30, "--workdir", tmp_path / "w")
    assert code == 2 and "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert f"--size-mb {1 << 30} needs" in out and "of disk in" in out and "is free" in out
    assert list((tmp_path / "w").iterdir()) == [], "nothing written"


def test_demo_removes_its_files_on_sigterm(tmp_path):
    work = tmp_path / "w"
    proc = subprocess.Popen([sys.executable, "-m", "weightcache.cli", "demo", "--device", "cpu", "--size-mb", "512",
                             "--workdir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not (work / "llama-random-512mb.partial").exists():  # the checkpoint is being written
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err, err
    assert list(work.iterdir()) == [], "no partial checkpoint is left to pass for a whole one"
