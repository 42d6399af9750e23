"""The warm engine start (`weightcache warm-engine` + `weightcache run`) with a stand-in engine: a small script
that reports what it was given (argv, environment, cwd, fds, session), exits with a code or a signal, or waits
for signals. The warm interpreter imports only a tiny fake package here (not vLLM), so each test is quick."""

from __future__ import annotations

import json
import os
import pty
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from weightcache import wire
from weightcache.sockets import warm_socket_path
from weightcache.warm import client as warm_client
from weightcache.warm import command as commands
from weightcache.warm.messages import PROTOCOL, Check, Refused, Run, reply_decoder

SRC = str(Path(__file__).resolve().parent.parent / "src")
PY = sys.executable
T = 60  # seconds: the bound of every wait here

ENGINE = r'''
import json, os, signal, sys, time
mode = sys.argv[1] if len(sys.argv) > 1 else "report"
if mode == "report":
    extra = {}
    for fd in map(int, os.environ.get("EXTRA_FDS", "").split(",") if os.environ.get("EXTRA_FDS") else []):
        extra[fd] = os.read(fd, 100).decode()
    ign = [s for s in (signal.SIGHUP, signal.SIGUSR2) if signal.getsignal(s) is signal.SIG_IGN]
    mask = os.umask(0); os.umask(mask)
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "foo": os.environ.get("WARM_TEST_FOO"),
                      "path0": sys.path[0], "name": __name__, "file": globals().get("__file__"),
                      "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
                      "stdin": sys.stdin.read(), "tty": [os.isatty(i) for i in range(3)], "extra": extra,
                      "ignored": ign, "umask": mask, "warm": "fakeeng" in sys.modules,
                      "line_buffered": sys.stdout.line_buffering}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "kill":
    os.kill(os.getpid(), int(sys.argv[2]))
elif mode == "crash":
    os.abort()
elif mode == "signals":
    out = sys.argv[2]
    def h(sig, _):
        with open(out, "a") as f:
            f.write(f"{signal.Signals(sig).name}\n")
        sys.exit(40 + sig)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT):
        signal.signal(s, h)
    print("ready", flush=True)
    time.sleep(60)
elif mode == "sleep":
    if len(sys.argv) > 3 and sys.argv[3] == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(sys.argv[2], "w") as f:
        f.write(str(os.getpid()))
    print("ready", flush=True)
    time.sleep(60)
elif mode == "spawn":
    import multiprocessing as mp
    def child(q, code):
        q.put(["fakeeng" in sys.modules, os.getpid()])
        sys.exit(code)
    if __name__ == "__main__":
        if len(sys.argv) > 3:  # as vLLM's API server sets torch's cache directory before it spawns its engine
            os.environ["WARM_TEST_CACHE"] = sys.argv[3]
        elif len(sys.argv) > 2:
            os.environ["WARM_TEST_MODE"] = sys.argv[2]  # the child's imports would see another value
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q, 5))
        p.start()
        warm, pid = q.get(timeout=60)
        p.join(60)
        print(json.dumps({"warm": warm, "exitcode": p.exitcode, "child": pid, "parent": os.getpid()}), flush=True)
'''


@pytest.fixture
def fake_pkg(tmp_path):
    """A tiny installed-looking package the warm interpreter imports: reads WARM_TEST_MODE when imported."""
    site = tmp_path / "site"
    (site / "fakeeng").mkdir(parents=True)
    (site / "fakeeng" / "__init__.py").write_text(
        "import os\nMODE = os.environ.get('WARM_TEST_MODE')\nos.environ.setdefault('WARM_TEST_DEFAULTED', 'd')\n"
        "if os.environ.get('WARM_TEST_CACHE') is None:  # torch's inductor cache_dir()\n"
        "    os.environ['WARM_TEST_CACHE'] = '/tmp/warm-test-cache'\n")
    dist = site / "fakeeng-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeeng\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text("fakeeng\n")
    return site


@pytest.fixture
def engine_script(tmp_path):
    path = tmp_path / "engine.py"
    path.write_text(ENGINE)
    return path


def _env(site: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARM_TEST", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join([SRC, str(site)])
    env.update(extra)
    return env


class Warm:
    def __init__(self, proc: subprocess.Popen, sockdir: str, env: dict[str, str], log: list[str]):
        self.proc, self.sockdir, self.env, self.log = proc, sockdir, env, log

    @property
    def path(self) -> Path:
        return warm_socket_path(self.sockdir)

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def client(self, *cmd, args=(), env=None, **kw) -> subprocess.Popen:
        argv = [PY, "-m", "weightcache.cli", "run", "--socket-dir", self.sockdir, *args, "--", *cmd]
        return subprocess.Popen(argv, env=env or self.env, **kw)

    def run(self, *cmd, args=(), env=None, input=None, **kw) -> subprocess.CompletedProcess:
        p = self.client(*cmd, args=args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, **kw)
        out, err = p.communicate(input, timeout=T)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def start_warm(sockdir: str, env: dict[str, str], *extra: str, imports=("fakeeng",), timeout: float = T) -> Warm:
    argv = [PY, "-m", "weightcache.cli", "warm-engine", "--socket-dir", sockdir, "--kill-grace", "1", *extra]
    for name in imports:
        argv += ["--import", name]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd="/")
    log: list[str] = []
    ready = threading.Event()

    def pump():
        for line in proc.stderr:
            log.append(line)
            if "READY" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout) or proc.poll() is not None:
        proc.kill()
        raise AssertionError("warm-engine did not start:\n" + "".join(log))
    return Warm(proc, sockdir, env, log)


@pytest.fixture
def warm(sockdir, fake_pkg):
    w = start_warm(sockdir, _env(fake_pkg))
    yield w
    w.proc.terminate()
    try:
        w.proc.wait(T)
    except subprocess.TimeoutExpired:
        w.proc.kill()


def _report(cp: subprocess.CompletedProcess) -> dict:
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout.strip().splitlines()[-1])


def _wait_for(cond, what: str, timeout: float = T):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ------------------------------------------------------------------------------------------- what it runs

def test_argv_env_cwd_stdio_and_session(warm, engine_script, tmp_path):
    cwd = tmp_path / "work"
    cwd.mkdir()
    cp = warm.run(PY, str(engine_script), "report", "a b", "--flag", env={**warm.env, "WARM_TEST_FOO": "bar"},
                  input="from stdin\n", cwd=cwd)
    r = _report(cp)
    assert r["argv"] == [str(engine_script), "report", "a b", "--flag"]
    assert r["cwd"] == str(cwd) and r["foo"] == "bar"
    assert r["path0"] == str(engine_script.parent) and r["name"] == "__main__" and r["file"] == str(engine_script)
    assert r["stdin"] == "from stdin\n" and r["tty"] == [False, False, False] and not r["line_buffered"]
    assert r["warm"], "the engine did not come from the warm interpreter"
    assert r["ppid"] == warm.proc.pid and r["sid"] == r["pid"] == r["pgid"]  # its own session, as a job's
    assert "to stderr" in cp.stderr and f"engine pid {r['pid']} started from the warm interpreter" in cp.stderr


def test_module_and_code_run_as_python_would(warm, tmp_path):
    (tmp_path / "standin_mod.py").write_text("import sys, json\nprint(json.dumps([sys.argv, sys.path[0], "
                                             "__name__, 'fakeeng' in sys.modules]))\n")
    cp = warm.run(PY, "-m", "standin_mod", "x", cwd=tmp_path)
    argv, path0, name, was_warm = json.loads(cp.stdout)
    assert cp.returncode == 0 and argv == [str(tmp_path / "standin_mod.py"), "x"] and path0 == str(tmp_path)
    assert name == "__main__" and was_warm
    cp = warm.run(PY, "-u", "-c", "import sys; print(sys.argv, sys.path[0] == '', sys.stdout.write_through)", "y")
    assert cp.returncode == 0 and cp.stdout.strip() == "['-c', 'y'] True True", cp.stderr


def test_stdout_to_a_file_extra_fds_umask_and_ignored_signals(warm, engine_script, tmp_path):
    out = tmp_path / "out.json"
    r_fd, w_fd = os.pipe()
    os.write(w_fd, b"through fd")
    os.close(w_fd)
    env = {**warm.env, "EXTRA_FDS": str(r_fd)}
    with open(out, "w") as f:
        p = warm.client(PY, str(engine_script), "report", env=env, stdin=subprocess.DEVNULL, stdout=f,
                        stderr=subprocess.PIPE, pass_fds=(r_fd,), text=True,
                        preexec_fn=lambda: (os.umask(0o027), signal.signal(signal.SIGHUP, signal.SIG_IGN)))
        _, err = p.communicate(timeout=T)
    os.close(r_fd)
    assert p.returncode == 0, err
    r = json.loads(out.read_text())
    assert r["extra"] == {str(r_fd): "through fd"} and r["umask"] == 0o027 and r["ignored"] == [signal.SIGHUP]
    assert r["warm"]


def test_a_terminal_stays_a_terminal(warm, engine_script):
    master, slave = pty.openpty()
    p = warm.client(PY, str(engine_script), "report", stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    data = b""
    end = time.monotonic() + T
    while b"}" not in data and time.monotonic() < end:
        try:
            data += os.read(master, 65536)
        except OSError:
            break
    p.wait(T)
    os.close(master)
    r = json.loads(data.decode().strip().splitlines()[0])
    assert r["tty"] == [False, True, False] and r["line_buffered"] and r["warm"]


# ------------------------------------------------------------------------------------ exit status, signals

@pytest.mark.parametrize("how, expect", [(("exit", "3"), 3), (("exit", "0"), 0), (("kill", "9"), -9),
                                          (("kill", "15"), -15), (("crash",), -6)])
def test_exit_status_is_the_engines(warm, engine_script, how, expect):
    cp = warm.run(PY, str(engine_script), *how)
    assert cp.returncode == expect, cp.stderr
    assert "started from the warm interpreter" in cp.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT])
def test_signals_reach_the_engine(warm, engine_script, tmp_path, sig):
    seen = tmp_path / "seen"
    p = warm.client(PY, str(engine_script), "signals", str(seen), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(sig)
    p.wait(T)
    assert seen.read_text() == f"{signal.Signals(sig).name}\n"
    assert p.returncode == 40 + sig


@pytest.mark.parametrize("stubborn", [False, True])
def test_the_callers_death_kills_the_engine(warm, engine_script, tmp_path, stubborn):
    pidfile = tmp_path / "pid"
    p = warm.client(PY, str(engine_script), "sleep", str(pidfile), *(["stubborn"] if stubborn else []),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    engine = int(pidfile.read_text())
    p.kill()  # SIGKILL: nothing of the client runs any more
    p.wait(T)
    _wait_for(lambda: _gone(engine), "the engine to die with its caller")  # SIGTERM, or SIGKILL after 1 s
    _wait_for(lambda: not any(j for j in warm_client.query(warm.path).jobs), "the server to reap it")


def test_a_crashing_engine_leaves_the_server_usable_and_no_fd_leaks(warm, engine_script, tmp_path):
    assert warm.run(PY, str(engine_script), "exit", "0").returncode == 0  # lazily made things exist now
    before = warm.fd_count()
    for i in range(12):
        how = [("crash",), ("kill", "9"), ("exit", "7"), ("report",)][i % 4]
        cp = warm.run(PY, str(engine_script), *how, input="x")
        assert "started from the warm interpreter" in cp.stderr
    # a client that dies at once, and one that sends garbage
    p = warm.client(PY, str(engine_script), "sleep", str(tmp_path / "pid"), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.kill()
    p.wait(T)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(warm.path))
        s.sendall(b"\x00\x00\x00\x03abc")
        assert isinstance(wire.recv_msg(s, 1 << 20, time.monotonic() + T, reply_decoder), Refused)
    _wait_for(lambda: not warm_client.query(warm.path).jobs, "every engine to be reaped")
    _wait_for(lambda: warm.fd_count() == before, f"the server's fds to return to {before}")
    status = warm_client.query(warm.path)
    assert status.started >= 14 and warm.proc.poll() is None
    assert _report(warm.run(PY, str(engine_script), "report"))["warm"]


def test_spawn_children_come_from_the_warm_interpreter(warm, engine_script):
    r = _report(warm.run(PY, str(engine_script), "spawn"))
    assert r["warm"] and r["exitcode"] == 5 and r["child"] != r["parent"]
    cold = _report(warm.run(PY, str(engine_script), "spawn", args=("--no-spawn",)))
    assert not cold["warm"] and cold["exitcode"] == 5
    cp = warm.run(PY, str(engine_script), "spawn", "other")  # refused for the child: it starts cold, one line
    r = _report(cp)
    assert r["exitcode"] == 5 and not r["warm"]
    lines = [ln for ln in cp.stderr.splitlines() if ln.startswith("weightcache warm spawn:")]
    assert lines and all("WARM_TEST_MODE" in ln for ln in lines), cp.stderr
    # the parent set a variable the warm imports set to the same value when they found it unset: still warm
    cp = warm.run(PY, str(engine_script), "spawn", "-", "/tmp/warm-test-cache")
    assert _report(cp)["warm"] and "weightcache warm spawn:" not in cp.stderr, cp.stderr
    cp = warm.run(PY, str(engine_script), "spawn", "-", "/tmp/elsewhere")
    assert not _report(cp)["warm"] and "WARM_TEST_CACHE" in cp.stderr, cp.stderr


# ----------------------------------------------------------------------------------------- refusals, fallback

def _started_normally(cp: subprocess.CompletedProcess, why: str) -> dict:
    lines = [ln for ln in cp.stderr.splitlines() if ln.startswith("weightcache run:")]
    assert len(lines) == 1 and why in lines[0] and lines[0].endswith("normally"), cp.stderr
    r = _report(cp)
    assert not r["warm"]
    return r


def test_a_different_environment_is_refused(warm, engine_script):
    _started_normally(warm.run(PY, str(engine_script), "report", env={**warm.env, "WARM_TEST_MODE": "1"}),
                      "WARM_TEST_MODE")
    _started_normally(warm.run(PY, str(engine_script), "report", env={**warm.env, "PYTHONHASHSEED": "3"}),
                      "PYTHONHASHSEED")
    # a setdefault's variable may be set to its default; a variable no import read passes through
    r = _report(warm.run(PY, str(engine_script), "report", env={**warm.env, "WARM_TEST_DEFAULTED": "d",
                                                                  "WARM_TEST_FOO": "free"}))
    assert r["warm"] and r["foo"] == "free"
    _started_normally(warm.run(PY, str(engine_script), "report", env={**warm.env, "WARM_TEST_DEFAULTED": "e"}),
                      "WARM_TEST_DEFAULTED")
    # read while unset and then set by the import (torch's cache directory): the same as a setdefault
    assert _report(warm.run(PY, str(engine_script), "report",
                            env={**warm.env, "WARM_TEST_CACHE": "/tmp/warm-test-cache"}))["warm"]
    _started_normally(warm.run(PY, str(engine_script), "report", env={**warm.env, "WARM_TEST_CACHE": "/tmp/x"}),
                      "WARM_TEST_CACHE")


def test_ignore_env_lets_a_variable_differ(sockdir, fake_pkg, engine_script):
    w = start_warm(sockdir, _env(fake_pkg), "--ignore-env", "WARM_TEST_MODE")
    try:
        assert _report(w.run(PY, str(engine_script), "report", env={**w.env, "WARM_TEST_MODE": "1"}))["warm"]
    finally:
        w.proc.terminate()
        w.proc.wait(T)


def test_another_venv_or_python_flags_are_refused(warm, engine_script, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=T)
    r = _started_normally(warm.run(str(venv / "bin" / "python"), str(engine_script), "report"), "venv")
    assert r["ppid"] != warm.proc.pid
    _started_normally(warm.run(PY, "-O", str(engine_script), "report"), "flags -O")


def test_a_changed_package_is_refused(warm, engine_script, fake_pkg):
    meta = fake_pkg / "fakeeng-1.0.dist-info"
    meta.rename(fake_pkg / "fakeeng-2.0.dist-info")
    (fake_pkg / "fakeeng-2.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeeng\n"
                                                                  "Version: 2.0\n")
    _started_normally(warm.run(PY, str(engine_script), "report"), "fakeeng 1.0 was imported")


def test_another_weightcache_version_or_protocol_is_refused(warm):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(warm.path))
        wire.send_msg(s, Check(protocol=PROTOCOL, weightcache="0.0.1", interpreter=PY, env=dict(warm.env)))
        reply = wire.recv_msg(s, 1 << 20, time.monotonic() + T, reply_decoder)
    assert isinstance(reply, Refused) and reply.code == "version" and "0.0.1" in reply.message
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(warm.path))
        wire.send_msg(s, Run(protocol=PROTOCOL + 1, weightcache="0", interpreter=PY, argv=[PY], env={}, cwd="/"))
        reply = wire.recv_msg(s, 1 << 20, time.monotonic() + T, reply_decoder)
    assert isinstance(reply, Refused) and reply.code == "version"
    assert warm_client.check(warm.path, PY, warm.env) == ""


def test_fallback_when_no_warm_interpreter_runs(sockdir, fake_pkg, engine_script):
    w = Warm(None, sockdir, _env(fake_pkg), [])
    p = w.client(PY, str(engine_script), "report", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True)
    out, err = p.communicate("in", timeout=T)
    r = _started_normally(subprocess.CompletedProcess(p.args, p.returncode, out, err), "no warm engine interpreter")
    assert r["pid"] == p.pid and r["stdin"] == "in"  # exec'd: the same process
    cp = w.run(PY, str(engine_script), "exit", "4", args=("--require-warm",))
    assert cp.returncode == 1 and "no warm engine interpreter" in cp.stderr
    cp = w.run(PY, str(engine_script), "exit", "4")
    assert cp.returncode == 4


def test_the_warm_interpreter_is_found_where_the_engine_finds_its_weights(warm, engine_script):
    """Without --socket-dir, `weightcache run` looks beside the socket_dir the engine's command names."""
    extra = json.dumps({"socket_dir": warm.sockdir})
    for form in (["--model-loader-extra-config", extra], [f"--model-loader-extra-config={extra}"]):
        argv = [PY, "-m", "weightcache.cli", "run", "--require-warm", "--", PY, str(engine_script), "report", *form]
        cp = subprocess.run(argv, env=warm.env, capture_output=True, text=True, timeout=T, input="")
        r = _report(cp)
        assert r["warm"] and r["ppid"] == warm.proc.pid and r["argv"][-len(form):] == form
    cp = subprocess.run([PY, "-m", "weightcache.cli", "run", "--require-warm", "--", PY, str(engine_script),
                         "report", "--model-loader-extra-config", json.dumps({"socket_dir": warm.sockdir + "-x"})],
                        env=warm.env, capture_output=True, text=True, timeout=T)
    assert cp.returncode == 1 and f"{warm.sockdir}-x/warm.ctl does not exist" in cp.stderr


def test_a_stale_or_foreign_socket_is_refused(sockdir, fake_pkg, engine_script):
    w = Warm(None, sockdir, _env(fake_pkg), [])
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(w.path))
    stale.close()  # bound, never listened: nobody answers there
    _started_normally(w.run(PY, str(engine_script), "report"), "stale socket")
    os.unlink(w.path)

    foreign = socket.socket(socket.AF_UNIX)
    foreign.bind(str(w.path))
    foreign.listen(4)

    def answer():
        for _ in range(2):
            conn, _ = foreign.accept()
            conn.recv(1 << 16)
            conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nhello")
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    _started_normally(w.run(PY, str(engine_script), "report"), "not a warm engine interpreter")
    foreign.close()
    os.unlink(w.path)
    w.path.write_text("not a socket")
    _started_normally(w.run(PY, str(engine_script), "report"), "not a socket")


def test_a_non_python_command_starts_normally(warm):
    cp = warm.run("/bin/sh", "-c", "echo $$ plain; exit 3")
    assert cp.returncode == 3 and "plain" in cp.stdout and "is not a Python program" in cp.stderr


def test_retire_stops_accepting_and_waits_for_running_engines(warm, engine_script, tmp_path):
    pidfile = tmp_path / "pid"
    p = warm.client(PY, str(engine_script), "sleep", str(pidfile), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True)
    assert p.stdout.readline().strip() == "ready"
    assert warm_client.retire(warm.path) == 1
    assert not warm.path.exists() and warm.proc.poll() is None  # it waits for its engine
    os.kill(int(pidfile.read_text()), signal.SIGTERM)
    assert p.wait(T) == -signal.SIGTERM
    assert warm.proc.wait(T) == 0


def test_an_import_that_creates_a_cuda_context_is_refused(sockdir, fake_pkg):
    (fake_pkg / "cudamaker.py").write_text("import torch\ntorch.cuda._initialized = True\n")
    argv = [PY, "-m", "weightcache.cli", "warm-engine", "--socket-dir", sockdir, "--import", "cudamaker"]
    cp = subprocess.run(argv, env=_env(fake_pkg), capture_output=True, text=True, timeout=T)
    assert cp.returncode == 1 and "created a CUDA context" in cp.stderr
    assert not warm_socket_path(sockdir).exists()


# ---------------------------------------------------------------------------------------- command lines

def _script(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    p.chmod(0o755)
    return p


def test_command_lines_resolve_as_python_would(tmp_path):
    env = {"PATH": f"{tmp_path}:{os.path.dirname(PY)}:/usr/bin:/bin"}
    cmd = commands.resolve(["python", "-uBX", "dev", "-m", "pkg.mod", "-x"], env, "/")
    assert (cmd.kind, cmd.target, cmd.args, cmd.flags) == ("module", "pkg.mod", ["-x"], ["-u", "-B", "-Xdev"])
    assert cmd.fixed_flags == ["-Xdev"] and os.path.dirname(cmd.interpreter) == os.path.dirname(PY)
    _script(tmp_path, "vllm", f"#!{PY}\nfrom vllm.entrypoints.cli.main import main\n")
    cmd = commands.resolve(["vllm", "serve", "m"], env, "/")
    assert (cmd.interpreter, cmd.kind, cmd.target, cmd.args) == (PY, "script", str(tmp_path / "vllm"), ["serve", "m"])
    _script(tmp_path, "long", f"#!/bin/sh\n'''exec' \"{PY}\" \"$0\" \"$@\"\n' '''\nprint(1)\n")
    assert commands.resolve(["long"], env, "/").interpreter == PY
    _script(tmp_path, "envpy", "#!/usr/bin/env python3\nprint(1)\n")
    assert commands.is_python_name(commands.resolve(["envpy"], env, "/").interpreter)
    _script(tmp_path, "flagged", f"#!{PY} -s\nprint(1)\n")
    assert commands.resolve(["flagged"], env, "/").fixed_flags == ["-s"]
    cmd = commands.resolve([PY, "-c", "print(1)", "a"], env, "/")
    assert (cmd.kind, cmd.target, cmd.args) == ("code", "print(1)", ["a"])
    for bad, why in ((["/bin/sh", "-c", "x"], "not a Python program"), (["nope-not-here"], "not found"),
                     ([PY], "interactive"), ([PY, "-"], "stdin"), ([PY, "-m"], "needs an argument"),
                     ([PY, "--help"], "not supported"), ([PY, "-V"], "not an engine")):
        with pytest.raises(commands.NotPython, match=why):
            commands.resolve(bad, env, "/")


# ----------------------------------------------------------------------------------------- preload's handle

def _model_dir(path: Path, arch: str, model_type: str) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type}))
    return path


def test_the_warm_interpreter_imports_the_models_modules_too(sockdir, fake_pkg, tmp_path):
    model = _model_dir(tmp_path / "m", "Qwen3ForCausalLM", "qwen3")
    w = start_warm(sockdir, _env(fake_pkg), "--model", str(model), "--model", str(tmp_path / "no-such-model"),
                   imports=("transformers",))
    try:
        names = {m.name for m in warm_client.query(w.path).modules}
        assert "transformers.models.qwen3.modeling_qwen3" in names
        assert not any(n.startswith("transformers.models.llama.modeling") for n in names)
    finally:
        w.proc.terminate()
        w.proc.wait(T)


def test_a_models_modules_are_vllms_and_transformers_for_its_architecture(tmp_path):
    pytest.importorskip("vllm")
    import transformers  # noqa: F401
    import vllm  # noqa: F401

    from weightcache.warm.models import model_modules

    moe = _model_dir(tmp_path / "moe", "Qwen3MoeForCausalLM", "qwen3_moe")
    assert model_modules(moe) == ["vllm.model_executor.models.qwen3_moe",
                                  "transformers.models.qwen3_moe.modeling_qwen3_moe"]
    odd = _model_dir(tmp_path / "odd", "NoSuchArchitecture", "no-such type")
    assert model_modules(odd) == [] and model_modules(tmp_path / "missing") == []


def test_the_preload_service_starts_reuses_and_retires(sockdir, fake_pkg, monkeypatch):
    from weightcache.warm import service

    env = _env(fake_pkg)
    monkeypatch.setattr(service, "initial_environ", lambda: dict(env))
    first = service.WarmService(sockdir, imports=["fakeeng"])
    first.start()
    path = warm_socket_path(sockdir)
    _wait_for(lambda: path.exists() and warm_client.check(path, PY, env) == "", "the warm interpreter")
    pid = warm_client.query(path).pid
    assert pid == first.proc.pid
    second = service.WarmService(sockdir, imports=["fakeeng"])
    second.start()  # fits: reused, nothing started
    assert second.proc is None and second.reused_pid == pid and second.info()["up"]
    env["WARM_TEST_MODE"] = "other"  # read when fakeeng was imported: the running one no longer fits
    third = service.WarmService(sockdir, imports=["fakeeng"])
    third.start()
    assert first.proc.wait(T) == 0  # retired
    _wait_for(lambda: path.exists() and warm_client.query(path).pid == third.proc.pid, "the replacement")
    third.stop()
    assert third.proc.wait(T) == 0 and not path.exists()


# ---------------------------------------------------------------------------------------------------- GPU

CUDA_ENGINE = r'''
import json, os, sys
import torch
def use_cuda():
    x = torch.ones(1 << 20, device="cuda")
    return [float(x.sum()), torch.cuda.device_count(), torch.cuda.get_device_name(0)]
if __name__ == "__main__":
    import multiprocessing as mp
    mine = use_cuda()
    with mp.get_context("spawn").Pool(1) as pool:
        child = pool.apply(use_cuda)
    print(json.dumps({"mine": mine, "child": child, "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}))
'''


@pytest.mark.gpu
def test_engines_started_warm_use_cuda_and_so_do_their_spawn_children(sockdir, tmp_path):
    script = tmp_path / "cuda_engine.py"
    script.write_text(CUDA_ENGINE)
    w = start_warm(sockdir, _env(tmp_path), imports=("torch",))
    try:
        r = _report(w.run(PY, str(script), env={**w.env, "CUDA_VISIBLE_DEVICES": "0"}))
        assert r["mine"][:2] == [float(1 << 20), 1] and r["child"][:2] == [float(1 << 20), 1]
        assert r["cvd"] == "0" and warm_client.query(w.path).started >= 2  # the Pool's worker came warm too
    finally:
        w.proc.terminate()
        w.proc.wait(T)


@pytest.mark.gpu
def test_the_default_imports_make_no_cuda_context(sockdir, tmp_path):
    pytest.importorskip("vllm")
    w = start_warm(sockdir, _env(tmp_path), imports=(), timeout=600)  # vLLM, torch, transformers
    try:
        status = warm_client.query(w.path)
        assert {m.name for m in status.modules} >= {"vllm", "torch", "transformers"}
        cp = w.run(PY, "-c", "import torch; print(torch.cuda.is_initialized(), torch.ones(1, device='cuda').item())")
        assert cp.returncode == 0 and cp.stdout.split() == ["False", "1.0"], cp.stderr
    finally:
        w.proc.terminate()
        w.proc.wait(T)


def test_the_client_and_preloads_handle_import_no_engine():
    code = ("import sys, weightcache.warm.client, weightcache.warm.service, weightcache.warm.launcher; "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=T, env=_env(Path("/nonexistent")))
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
