"""The modules engines import after the warm ones: recorded by each engine, imported by the warm interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightcache.warm import learned
from weightcache.warm.learned import Learner, module_names, record_later

SRC = str(Path(__file__).resolve().parent.parent / "src")
PY = sys.executable
T = 60


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Modules on the import path that this test process has not imported."""
    root = tmp_path / "site"
    (root / "wclearn").mkdir(parents=True)
    (root / "wclearn" / "__init__.py").write_text("")
    (root / "wclearn" / "one.py").write_text("X = 1\n")
    (root / "wclearn" / "two.py").write_text("import os\nY = os.environ.get('WCLEARN_TWO')\n")
    (root / "wclearn" / "broken.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(sys, "path", [""] + [p for p in sys.path if p != ""])  # path[0]: the program's own
    yield root
    for name in [n for n in sys.modules if n == "wclearn" or n.startswith("wclearn.")]:
        del sys.modules[name]


def test_an_engine_records_its_importable_modules_and_not_its_main_or_generated_code(tmp_path, site):
    import wclearn.one  # noqa: F401

    sys.modules["generated_code_xyz"] = type(sys)("generated_code_xyz")  # no spec: not importable by name
    try:
        names = module_names()
    finally:
        del sys.modules["generated_code_xyz"]
    assert {"wclearn", "wclearn.one", "json", "sys"} <= set(names)
    assert "__main__" not in names and "generated_code_xyz" not in names and names == sorted(names)
    where = tmp_path / "learn"
    where.mkdir()
    record_later(where, delays=(0.0,))
    path = where / f"{os.getpid()}.modules"
    end = time.monotonic() + T
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.01)
    assert "wclearn.one" in path.read_text().split()


def test_the_learner_imports_what_was_recorded_keeps_it_and_drops_the_records(tmp_path, site):
    where = tmp_path / "learn"
    first: dict = {}
    lr = Learner(where, first)
    assert not lr.changed() and lr.pending() == []
    (where / "123.modules").write_text("wclearn\nwclearn.two\nwclearn.broken\n__main__\nbad name\njson\n")
    assert lr.changed()
    assert lr.learn()
    assert "wclearn.two" in sys.modules and "wclearn.broken" not in sys.modules
    assert "WCLEARN_TWO" in first  # read while it imported: the identity hears of it
    assert not (where / "123.modules").exists() and not lr.changed()
    kept = (where / learned.KEPT).read_text().split()
    assert "wclearn.two" in kept and "wclearn.broken" not in kept
    (where / "124.modules").write_text("wclearn.broken\n")
    assert lr.changed() and lr.pending() == []  # a failure is not tried again by this interpreter
    again = Learner(where)  # the next warm interpreter starts from what was kept
    del sys.modules["wclearn.two"]
    assert "wclearn.two" in again.pending()


def test_a_learned_module_that_makes_a_cuda_context_is_forgotten(tmp_path, site):
    where = tmp_path / "learn"
    made = []
    lr = Learner(where, cuda_initialized=lambda: bool(made))
    (where / "9.modules").write_text("wclearn.one\n")
    made.append(True)
    assert not lr.learn()
    assert list(where.iterdir()) == [] and not lr.learned


def test_a_learned_module_that_starts_a_thread_is_forgotten(tmp_path, site):
    (site / "wclearn" / "threaded.py").write_text(
        "import threading\nSTOP = threading.Event()\n"
        "threading.Thread(target=STOP.wait, name='wclearn-bg', daemon=True).start()\n")
    where = tmp_path / "learn"
    lr = Learner(where)
    (where / "9.modules").write_text("wclearn.threaded\n")
    try:
        assert not lr.learn()
        assert list(where.iterdir()) == [] and not lr.learned
    finally:
        sys.modules["wclearn.threaded"].STOP.set()


# ----------------------------------------------------------------------------------- with a warm interpreter

ENGINE = r'''
import json, os, sys
had = "wclearn.two" in sys.modules
if sys.argv[1] == "import":
    import wclearn.two
print(json.dumps({"had": had, "two": getattr(sys.modules.get("wclearn.two"), "Y", None)}), flush=True)
'''


def _env(site: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WCLEARN", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join([SRC, str(site)])
    env.update(extra)
    return env


def _warm_argv(sockdir: Path, *extra: str) -> list[str]:
    return [PY, "-m", "weightcache.cli", "warm-engine", "--socket-dir", str(sockdir), "--kill-grace", "1",
            "--import", "wclearn", *extra]


def _start(sockdir: Path, env: dict, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(_warm_argv(sockdir, *extra), env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd="/")
    line = ""
    for line in proc.stderr:
        if "READY" in line:
            return proc
    raise AssertionError(f"warm-engine did not start: {line}")


def _run(sockdir: Path, env: dict, script: Path, mode: str) -> tuple[dict, str]:
    cp = subprocess.run([PY, "-m", "weightcache.cli", "run", "--socket-dir", str(sockdir), "--", PY, str(script),
                         mode], env=env, capture_output=True, text=True, timeout=T)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout.strip().splitlines()[-1]), cp.stderr


def _engine_in(tmp_path: Path, text: str) -> tuple[Path, Path]:
    """A private socket directory and an engine script."""
    sockdir = tmp_path / "s"
    sockdir.mkdir(mode=0o700)
    script = tmp_path / "engine.py"
    script.write_text(text)
    return sockdir, script


def _wait_for(cond, what: str):
    end = time.monotonic() + T
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_the_next_engine_finds_what_the_last_one_imported(tmp_path, site):
    sockdir, script = _engine_in(tmp_path, ENGINE)
    env = _env(site, WCLEARN_TWO="a")
    warm = _start(sockdir, env)
    kept = sockdir / learned.DIR_NAME / learned.KEPT
    try:
        first, _ = _run(sockdir, env, script, "import")
        assert first == {"had": False, "two": "a"}
        _wait_for(lambda: kept.exists() and "wclearn.two" in kept.read_text().split(), "the warm interpreter to learn")
        second, _ = _run(sockdir, env, script, "check")
        assert second == {"had": True, "two": "a"}
        _, why = _run(sockdir, _env(site, WCLEARN_TWO="b"), script, "check")  # read while it learned
        assert "WCLEARN_TWO" in why and "not used" in why
    finally:
        warm.terminate()
        assert warm.wait(T) == 0
    warm = _start(sockdir, env)  # a successor starts with what was learned
    try:
        third, _ = _run(sockdir, env, script, "check")
        assert third == {"had": True, "two": "a"}
    finally:
        warm.terminate()
        warm.wait(T)


def test_engines_of_a_warm_interpreter_told_not_to_learn_record_nothing(tmp_path, site):
    sockdir, script = _engine_in(tmp_path, ENGINE)
    env = _env(site, WCLEARN_TWO="a")
    warm = _start(sockdir, env, "--no-learn")
    try:
        assert _run(sockdir, env, script, "import")[0] == {"had": False, "two": "a"}
        assert _run(sockdir, env, script, "check")[0]["had"] is False
        assert not (sockdir / learned.DIR_NAME).exists()
    finally:
        warm.terminate()
        warm.wait(T)


def test_a_warm_interpreter_whose_kept_modules_make_a_cuda_context_refuses_to_start_and_forgets_them(tmp_path, site):
    (site / "wccuda.py").write_text("import torch\ntorch.cuda._initialized = True\n")
    sockdir = tmp_path / "s"
    (sockdir / learned.DIR_NAME).mkdir(parents=True, mode=0o700)
    sockdir.chmod(0o700)
    (sockdir / learned.DIR_NAME / learned.KEPT).write_text("wccuda\n")
    cp = subprocess.run(_warm_argv(sockdir), env=_env(site), capture_output=True, text=True, timeout=T)
    assert cp.returncode == 1 and "made a CUDA context or started a thread" in cp.stderr, cp.stderr
    assert list((sockdir / learned.DIR_NAME).iterdir()) == []
    warm = _start(sockdir, _env(site))  # the next start begins without them (READY)
    warm.terminate()
    warm.wait(T)


EXTRA_ENGINE = r'''
import json, sys
had = "wcextra" in sys.modules
import wcextra
print(json.dumps({"had": had}), flush=True)
'''


def test_a_package_it_learned_from_that_changes_on_disk_refuses_engines(tmp_path, site):
    (site / "wcextra").mkdir()
    init = site / "wcextra" / "__init__.py"
    init.write_text("VALUE = 1\n")
    sockdir, script = _engine_in(tmp_path, EXTRA_ENGINE)
    env = _env(site)
    warm = _start(sockdir, env)
    kept = sockdir / learned.DIR_NAME / learned.KEPT
    try:
        assert _run(sockdir, env, script, "x")[0] == {"had": False}
        _wait_for(lambda: kept.exists() and "wcextra" in kept.read_text().split(), "the warm interpreter to learn")
        assert _run(sockdir, env, script, "x")[0] == {"had": True}
        st = init.stat()
        os.utime(init, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # reinstalled
        out, why = _run(sockdir, env, script, "x")
        assert out == {"had": False} and "wcextra" in why and "not used" in why, why
    finally:
        warm.terminate()
        warm.wait(T)
