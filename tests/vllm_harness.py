"""Shared by the vLLM end-to-end tests (CPU and GPU): preloads, engines in their own processes, vLLM's
OpenAI server. Every engine is a real vLLM engine (tests/vllm_runner.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
RUNNER = str(HERE / "vllm_runner.py")
VLLM_FLAGS = ["--dtype", "bfloat16", "--max-model-len", "128"]


def vllm_env(root: Path) -> dict:
    env = dict(os.environ)
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", XDG_CACHE_HOME=str(root / "cache"), PYTHONUNBUFFERED="1")
    return env


def new_work(root: Path, spec_defaults: dict | None = None, **models: str) -> dict:
    """spec_defaults: merged into every engine's spec (an explicit key in a spec wins; None unsets it)."""
    return {"root": root, **models, "env": vllm_env(root), "results": {}, "dirs": [],
            "spec_defaults": dict(spec_defaults or {})}


def cleanup(work: dict) -> None:
    for d in work["dirs"]:
        shutil.rmtree(d, ignore_errors=True)


def sockdir(work, name: str) -> str:
    # Unix socket paths are short: keep the directory out of pytest's long tmp paths.
    d = tempfile.mkdtemp(prefix=f"wcv-{name}-", dir="/tmp")
    os.chmod(d, 0o700)
    work["dirs"].append(d)
    return d


class Preload:
    """`weightcache preload --engine vllm ...` in a subprocess, until READY."""

    def __init__(self, work, model: str, sockdir: str, *flags: str, timeout: float = 300.0,
                 engine_flags=VLLM_FLAGS):
        self.sockdir = sockdir
        self.log = open(work["root"] / f"preload-{Path(sockdir).name}.log", "w+")
        cmd = [sys.executable, "-m", "weightcache.cli", "preload", "--engine", "vllm", model, *engine_flags,
               "--weight-cache-socket-dir", sockdir, *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=work["env"])
        deadline = time.monotonic() + timeout
        self.ready = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            if "READY" in line:
                self.ready = line
                return
        self.stop()
        raise AssertionError(f"preload did not get ready:\n{self.tail()}")

    def sockets(self, role: str = "main") -> list[str]:
        return sorted(str(p) for p in Path(self.sockdir).glob(f"{role}-r*.sock"))

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def run_engine(work, spec: dict, *, env: dict | None = None, timeout: float = 420.0) -> dict:
    spec = {"model": work["tiny"], **work.get("spec_defaults", {}), **spec}
    spec = {k: v for k, v in spec.items() if v is not None}
    r = subprocess.run([sys.executable, RUNNER, json.dumps(spec)], capture_output=True, text=True,
                       env={**work["env"], **(env or {})}, timeout=timeout)
    return result_of(r.stdout, r.stderr)


def result_of(stdout: str, stderr: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["log"] = stdout[-20000:] + stderr[-20000:]
            return res
        if line.startswith("ERROR "):
            err = json.loads(line[6:])
            err["log"] = stderr[-3000:]
            return {"error": err}
    raise AssertionError(f"engine run printed no result:\n{stderr[-4000:]}")


def ok(res: dict) -> dict:
    if "error" in res:
        err = res["error"]
        where = "\n".join(err.get("traceback", "").splitlines()[-12:])
        raise AssertionError(f"{err['type']}: {err['message']}\n{where}\n{err.get('log', '')}")
    return res


def weight_files_opened(res: dict) -> list[str]:
    return [e for e in res["opened"] if e.endswith(".safetensors")]


def draft_spec(work) -> dict:
    return {"method": "draft_model", "model": work["tiny2"], "num_speculative_tokens": 2}


def preload_with_draft(work) -> Preload:
    """The main model plus a draft model group (speculative decoding), as one preload."""
    return Preload(work, work["tiny"], sockdir(work, "main"), "--speculative-config", json.dumps(draft_spec(work)))


def disk_reference(work) -> dict:
    """The reference: the same engine loading from disk (its weight files are seen being opened)."""
    res = ok(run_engine(work, {"watch": [work["tiny"]], "dump": str(work["root"] / "disk.pt")}))
    assert weight_files_opened(res), "the open watcher saw no weight file opened by a disk load"
    return res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(port: int, prompt: str) -> list[int]:
    import httpx

    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def tail(f, n: int = 4000) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-n:]


def openai_server_survives_daemon_kill(work, model: str, expected: list[list[int]], *server_flags: str,
                                       engine_flags=VLLM_FLAGS) -> None:
    """vLLM's OpenAI server with its default multi-process engine (the plugin loads in every process)
    serves from the cache, and keeps serving the same tokens after every daemon and the preload's
    supervisor are SIGKILLed."""
    import httpx

    from weightcache.client import query_status

    sd = sockdir(work, "api")
    pre = Preload(work, model, sd, engine_flags=engine_flags)
    port = free_port()
    env = {**work["env"]}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    log = open(work["root"] / "api.log", "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *engine_flags,
         "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), *server_flags,
         "--load-format", "weightcache", "--model-loader-extra-config", json.dumps({"socket_dir": sd})],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert server.poll() is None, f"server exited:\n{tail(log)}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise AssertionError(f"server not healthy:\n{tail(log)}")
        statuses = [query_status(s) for s in pre.sockets()]
        assert sum(st.clients_attached for st in statuses) == len(statuses)  # each rank's worker attached
        prompts = ("Hello, world", "The quick brown fox")
        before = [complete(port, p) for p in prompts]
        assert before == expected[:2]
        for st in statuses:
            os.kill(st.pid, signal.SIGKILL)  # the daemons holding the arena
        pre.proc.kill()  # and their supervisor
        pre.proc.wait(30)
        assert [complete(port, p) for p in prompts] == before
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        pre.stop()
