"""tools/offline_bundle.py and tools/offline_unpack.py: resolution, strips, parts, reassembly (no network)."""

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

TOOLS = Path(__file__).resolve().parents[1]
pytest.importorskip("tomllib", reason="the tools need Python >= 3.11")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ob = _load("offline_bundle")
ou = _load("offline_unpack")


def make_wheel(folder: Path, name: str, version: str, requires=(), files=None, data=None, extras=()) -> Path:
    """A minimal wheel: files at the root, `data` as {scheme/path: text} under NAME-VER.data/."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    files = files if files is not None else {f"{name.replace('-', '_')}/__init__.py": "X = 1\n"}
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Provides-Extra: {e}" for e in extras]
    meta += [f"Requires-Dist: {r}" for r in requires]
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
            record.append(f"{rel},,")
        for rel, text in (data or {}).items():
            z.writestr(f"{dist}.data/{rel}", text)
        z.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def recipe(tmp_path, requirements, have=(), exclude=(), constraints=(), strip=None, python="3.12.3"):
    return ob.Recipe(
        path=tmp_path / "r.toml", name="t", target=ob.Target(python=python),
        requirements=[Requirement(r) for r in requirements],
        constraints={k: SpecifierSet(v) for k, v in dict(constraints).items()},
        have=ob.read_have_lines(list(have), "test"), exclude=set(exclude), strip=strip or {},
    )


class FakeIndex:
    """fetch(name, spec): the newest wheel within spec among the wheels made in a folder."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.calls = []

    def add(self, name, version, requires=(), **kw):
        make_wheel(self.folder, name, version, requires, **kw)

    def fetch(self, name, spec):
        self.calls.append((name, str(spec)))
        best = None
        for p in self.folder.glob("*.whl"):
            w = ob.Wheel.from_path(p)
            if w.name == name and spec.contains(w.version, prereleases=True):
                if best is None or w.version > best.version:
                    best = w
        if best is None:
            raise ob.BundleError(f"no wheel of {name}{spec}")
        return best


@pytest.fixture
def index(tmp_path):
    folder = tmp_path / "index"
    folder.mkdir()
    return FakeIndex(folder)


def quiet(*_args):
    pass


# ------------------------------------------------------------------------------------------ markers


def test_markers_are_evaluated_for_the_target_not_this_python():
    env = ob.Target(python="3.12.3", platforms=["manylinux_2_39_x86_64"]).marker_env()
    assert env["python_version"] == "3.12" and env["platform_machine"] == "x86_64"
    assert ob.applies(Requirement('six; python_version > "3.11"'), env, set())
    assert not ob.applies(Requirement('tomli; python_version < "3.11"'), env, set())
    assert not ob.applies(Requirement('pywin32; sys_platform == "win32"'), env, set())
    assert ob.applies(Requirement('llguidance; platform_machine == "x86_64" or platform_machine == "arm64"'), env, set())
    arm = ob.Target(platforms=["manylinux_2_28_aarch64"]).marker_env()
    assert not ob.applies(Requirement('triton; platform_machine == "x86_64"'), arm, set())


def test_extras_apply_only_when_requested():
    env = ob.Target().marker_env()
    req = Requirement('pandas; extra == "bench"')
    assert not ob.applies(req, env, set())
    assert ob.applies(req, env, {"bench"})


def test_manylinux_tag_expands_to_older_glibcs():
    plats = ob.Target(platforms=["manylinux_2_39_x86_64"]).expanded_platforms()
    assert plats[0] == "manylinux_2_39_x86_64"
    assert {"manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(plats)
    assert "manylinux_2_40_x86_64" not in plats


# ------------------------------------------------------------------------------------------ resolve


def test_constraints_from_every_dependent_are_merged(tmp_path, index):
    for v in ("1.0", "1.5", "2.0"):
        index.add("b", v)
    index.add("a", "1.0", ["b>=1.0"])
    index.add("c", "1.0", ["b<2"])
    plan = ob.resolve(recipe(tmp_path, ["a", "c"]), index.fetch, quiet)
    assert plan["b"].action == "bring" and plan["b"].wheel.version == Version("1.5")
    assert len(plan["b"].why) == 2


def test_a_later_constraint_repicks_and_restarts(tmp_path, index):
    # a -> b (newest: 2.0, which needs d); a -> c -> b<2 is only seen one level deeper
    index.add("a", "1.0", ["b", "c"])
    index.add("b", "2.0", ["d"])
    index.add("b", "1.0")
    index.add("c", "1.0", ["e"])
    index.add("e", "1.0", ["b<2"])
    index.add("d", "1.0")
    plan = ob.resolve(recipe(tmp_path, ["a"]), index.fetch, quiet)
    assert plan["b"].wheel.version == Version("1.0")
    assert "d" not in plan  # only b 2.0 wanted it


def test_conflict_names_every_requirement(tmp_path, index):
    index.add("x", "1.0")
    index.add("x", "2.0")
    index.add("a", "1.0", ["x>=2"])
    index.add("c", "1.0", ["x<2"])
    with pytest.raises(ob.ConflictError) as e:
        ob.resolve(recipe(tmp_path, ["a", "c"]), index.fetch, quiet)
    assert "a 1.0 -> x>=2" in str(e.value) and "c 1.0 -> x<2" in str(e.value)
    assert "'a!=1.0', 'c!=1.0' to [bundle] constraints" in str(e.value)


def test_recipe_constraints_narrow_a_dependency(tmp_path, index):
    index.add("x", "1.0")
    index.add("x", "2.0")
    index.add("a", "1.0", ["x"])
    plan = ob.resolve(recipe(tmp_path, ["a"], constraints={"x": "<2"}), index.fetch, quiet)
    assert plan["x"].wheel.version == Version("1.0")


def test_have_excluded_and_markers(tmp_path, index):
    index.add("a", "1.0", ["numpy>=1.25,<2.4", "torch==2.11.0", "big", 'winonly; sys_platform == "win32"',
                           "requests", 'extra-dep; extra == "opt"'], extras=["opt"])
    index.add("numpy", "2.3.5")
    plan = ob.resolve(recipe(tmp_path, ["a"], have=["numpy==2.5.2", "torch==2.11.0+cu130", "requests"],
                             exclude=["big"]), index.fetch, quiet)
    assert plan["torch"].action == "have"  # a local label matches a public pin
    assert plan["requests"].action == "have"  # present, version unknown: trusted
    assert plan["big"].action == "exclude"
    assert plan["numpy"].action == "bring" and "target has numpy 2.5.2" in plan["numpy"].note
    assert "winonly" not in plan and "extra-dep" not in plan
    fetched = {name for name, _ in index.calls}
    assert fetched == {"a", "numpy"}


def test_keep_uses_the_targets_version_and_says_so(tmp_path, index):
    index.add("a", "1.0", ["numpy<2.4"])
    r = recipe(tmp_path, ["a"], have=["numpy==2.5.2"])
    r.keep = {"numpy"}
    plan = ob.resolve(r, index.fetch, quiet)
    assert plan["numpy"].action == "have" and "keeping the target's numpy 2.5.2" in plan["numpy"].note
    assert {name for name, _ in index.calls} == {"a"}


def test_requested_extras_pull_their_dependencies(tmp_path, index):
    index.add("a", "1.0", ["b[fast]"])
    index.add("b", "1.0", ['c; extra == "fast"', 'd; extra == "slow"'], extras=["fast", "slow"])
    index.add("c", "1.0")
    plan = ob.resolve(recipe(tmp_path, ["a"]), index.fetch, quiet)
    assert plan["c"].action == "bring" and "d" not in plan


def test_have_file_reads_pip_freeze():
    have = ob.read_have_lines(["# comment", "Torch==2.11.0+cu130", "numba", "-e git+x#egg=y",
                               "pkg @ file:///x.whl", ""], "f")
    assert have == {"torch": Version("2.11.0+cu130"), "numba": None, "pkg": None}
    with pytest.raises(ob.BundleError, match="bad version"):
        ob.read_have_lines(["x==not a version"], "f")


def test_recipe_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[bundel]\nrequirements = ["x"]\n')
    with pytest.raises(ob.BundleError, match="unknown section"):
        ob.load_recipe(bad)
    bad.write_text("[bundle]\nrequirements = []\n")
    with pytest.raises(ob.BundleError, match="requirements is empty"):
        ob.load_recipe(bad)
    with pytest.raises(ob.BundleError, match="no recipe"):
        ob.load_recipe(tmp_path / "none.toml")


def test_the_vllm_recipe_loads():
    r = ob.load_recipe(TOOLS / "bundles" / "vllm-0.26-h200.toml")
    assert r.target.abi == "cp312" and "flashinfer-python" in r.exclude
    assert r.have["torch"] == Version("2.11.0")
    assert any(str(q) == "vllm==0.26.0" for q in r.requirements)


# ------------------------------------------------------------------------------------------ strips, site


@pytest.mark.parametrize("pattern,path,hit", [
    ("vllm/third_party/fmha_sm100/**", "vllm/third_party/fmha_sm100/a/b.hpp", True),
    ("vllm/third_party/fmha_sm100/**", "vllm/third_party/deep_gemm/a.hpp", False),
    ("vllm/*.so", "vllm/x/_C.so", False),
    ("vllm/*.so", "vllm/_C.so", True),
    ("**/__pycache__/**", "a/b/__pycache__/c.pyc", True),
    ("**/__pycache__/**", "__pycache__/c.pyc", True),
    ("d/_C.cpython-3{10,11,13,14}-*.so", "d/_C.cpython-311-x86_64-linux-gnu.so", True),
    ("d/_C.cpython-3{10,11,13,14}-*.so", "d/_C.cpython-312-x86_64-linux-gnu.so", False),
    ("a/?.py", "a/b.py", True),
    ("a/[!x].py", "a/x.py", False),
])
def test_strip_globs(pattern, path, hit):
    assert bool(ob.glob_regex(pattern).match(path)) is hit


def test_install_maps_data_schemes_and_strips(tmp_path):
    w = make_wheel(tmp_path, "pkg", "1.0",
                   files={"pkg/__init__.py": "", "pkg/big.so": "x" * 100, "pkg/keep.so": "k"},
                   data={"purelib/pkg_extra.py": "E = 1\n", "platlib/pkg/plat.py": "", "scripts/tool": "#!",
                         "headers/h.h": ""})
    site = tmp_path / "site"
    info = ob.install_wheel(ob.Wheel.from_path(w), site, ["pkg/big.so", "pkg/nothing/**"], {}, quiet)
    assert (site / "pkg_extra.py").read_text() == "E = 1\n" and (site / "pkg" / "plat.py").exists()
    assert not (site / "pkg" / "big.so").exists() and (site / "pkg" / "keep.so").exists()
    assert not any("tool" in p.name or p.suffix == ".h" for p in site.rglob("*"))
    assert info.stripped_files == 1 and info.stripped_bytes == 100
    assert info.unused_strips == ["pkg/nothing/**"]
    assert len(info.dropped) == 2
    record = (site / "pkg-1.0.dist-info" / "RECORD").read_text()
    assert "pkg/big.so" not in record and "pkg/keep.so" in record


def test_install_refuses_paths_outside_the_site(tmp_path):
    w = make_wheel(tmp_path, "evil", "1.0", files={"../escape.py": ""})
    with pytest.raises(ob.BundleError, match="refusing the path"):
        ob.install_wheel(ob.Wheel.from_path(w), tmp_path / "site", [], {}, quiet)


def test_codec_choice_prefers_fewer_parts_then_faster_decode(tmp_path):
    C = ob.Compressed
    xz = C("xz", tmp_path, 119 * ob.MIB, 1, decompress_seconds=9)
    zs = C("zstd", tmp_path, 121 * ob.MIB, 1, decompress_seconds=1)
    assert ob.choose_codec([xz, zs], 60 * ob.MIB, 6 * ob.MIB).codec == "xz"  # zstd + its wheel: 3 parts
    assert ob.choose_codec([xz, zs], 70 * ob.MIB, 6 * ob.MIB).codec == "xz"  # 2 each; zstd+wheel 7% larger
    assert ob.choose_codec([xz, zs], 70 * ob.MIB, 1 * ob.MIB).codec == "zstd"  # within 3%: faster decode


# ------------------------------------------------------------------------------------------ build + unpack


def _fake_bundle(tmp_path, part_mib=0.01):
    """A real build (exact pins are served from a local folder: no pip, no network), xz, 3+ parts."""
    wheels = tmp_path / "wheels"
    wheels.mkdir(parents=True)
    noise = random.Random(0).randbytes(30_000).hex()  # incompressible enough to need several 10 KiB parts
    make_wheel(wheels, "app", "1.0", ["lib==2.0"], files={"app/__init__.py": "import lib\n", "app/blob.txt": noise,
                                                            "app/drop/big.bin": "z" * 5000})
    make_wheel(wheels, "lib", "2.0", files={"lib/__init__.py": "VALUE = 42\n"})
    r = tmp_path / "r.toml"
    r.write_text('name = "fake"\n[target]\npython = "3.12.3"\n[bundle]\nrequirements = ["app==1.0"]\n'
                 f'codec = "xz"\nlevel = 1\npart_mib = {part_mib}\nsolo_mib = 0.02\n[strip]\napp = ["app/drop/**"]\n')
    out = tmp_path / "out"
    manifest = ob.build(ob.load_recipe(r), out, tmp_path / "cache", [wheels], log=quiet)
    return out, manifest


def unpack(*args):
    return subprocess.run([sys.executable, str(TOOLS / "offline_unpack.py"), *map(str, args)],
                          capture_output=True, text=True)


def test_parts_round_trip(tmp_path):
    out, m = _fake_bundle(tmp_path)
    assert len(m["parts"]) >= 3 and all(p["bytes"] <= 0.01 * ob.MIB for p in m["parts"])
    assert [p["name"] for p in m["packages"]] == ["app", "lib"]
    assert m["packages"][0]["stripped_files"] == 1
    for p in m["parts"]:  # each part folder can be shipped alone
        assert (out / Path(p["file"]).parent / "manifest.json").exists()
        assert (out / Path(p["file"]).parent / "offline_unpack.py").exists()
    stash, site = tmp_path / "stash", tmp_path / "site"
    for p in m["parts"][:-1]:
        r = unpack("--stash", stash, out / Path(p["file"]).parent)
        assert r.returncode == 0, r.stderr
    r = unpack("--stash", stash, "--extract", site)
    assert r.returncode == 2 and f"missing part {len(m['parts'])} of {len(m['parts'])}" in r.stderr
    assert r.stderr.count("\n") == 1 and not site.exists()
    r = unpack("--stash", stash, out / m["parts"][-1]["file"], "--extract", site)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"export PYTHONPATH={site.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}"
    assert (site / "lib" / "__init__.py").read_text() == "VALUE = 42\n"
    assert not (site / "app" / "drop").exists()
    check = subprocess.run([sys.executable, "-c", "import app, lib; print(lib.VALUE)"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(site)})
    assert check.stdout.strip() == "42"
    # idempotent: the same stash and extract again change nothing
    again = unpack("--stash", stash, out / "p01", "--extract", site)
    assert again.returncode == 0 and "already stashed" in again.stdout and "already extracted" in again.stdout


def test_a_rebuild_takes_unchanged_pieces_from_the_cache(tmp_path):
    out, m = _fake_bundle(tmp_path)
    assert m["pieces"] == ["rest", "app"]  # app (> solo_mib) is a piece of its own
    lines = []
    m2 = ob.build(ob.load_recipe(tmp_path / "r.toml"), out, tmp_path / "cache", [tmp_path / "wheels"],
                  log=lines.append)
    assert m2["archive_sha256"] == m["archive_sha256"]
    assert any("3 of 3 piece(s) from the cache" in line for line in lines)


def test_same_inputs_give_the_same_archive(tmp_path):
    _, m1 = _fake_bundle(tmp_path / "one")
    _, m2 = _fake_bundle(tmp_path / "two")
    assert m1["archive_sha256"] == m2["archive_sha256"]


def test_a_corrupt_part_is_refused_and_leaves_nothing(tmp_path):
    out, m = _fake_bundle(tmp_path)
    bad = tmp_path / "bad" / "p02"
    shutil.copytree(out / "p02", bad)
    part = bad / Path(m["parts"][1]["file"]).name
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    stash = tmp_path / "stash"
    r = unpack("--stash", stash, bad)
    assert r.returncode == 2 and "is corrupt" in r.stderr and r.stderr.count("\n") == 1
    home = next(stash.iterdir())
    assert sorted(p.name for p in home.iterdir()) == ["manifest.json"]


def test_a_part_corrupted_in_the_stash_is_caught_at_extract(tmp_path):
    out, m = _fake_bundle(tmp_path)
    stash = tmp_path / "stash"
    for p in m["parts"]:
        assert unpack("--stash", stash, out / Path(p["file"]).parent).returncode == 0
    stashed = next(stash.iterdir()) / Path(m["parts"][0]["file"]).name
    data = bytearray(stashed.read_bytes())
    data[-1] ^= 1
    stashed.write_bytes(bytes(data))
    r = unpack("--stash", stash, "--extract", tmp_path / "site")
    assert r.returncode == 2 and "stashed part 1" in r.stderr and "corrupt" in r.stderr
    assert not (tmp_path / "site").exists()


def test_unpack_refuses_a_foreign_file_and_a_busy_destination(tmp_path):
    out, m = _fake_bundle(tmp_path)
    stray = out / "p01" / "stray.bin"
    stray.write_bytes(b"x")
    r = unpack("--stash", tmp_path / "stash", stray)
    assert r.returncode == 2 and "is not a part of bundle fake" in r.stderr
    for p in m["parts"]:
        unpack("--stash", tmp_path / "stash", out / Path(p["file"]).parent)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "other").write_text("")
    r = unpack("--stash", tmp_path / "stash", "--extract", busy)
    assert r.returncode == 2 and "not empty" in r.stderr


def test_manifest_records_versions_and_digests(tmp_path):
    out, m = _fake_bundle(tmp_path)
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == m
    assert {p["name"]: p["version"] for p in m["packages"]} == {"app": "1.0", "lib": "2.0"}
    for p in m["parts"]:
        assert ou.sha256_file(out / p["file"]) == p["sha256"]


# ------------------------------------------------------------------------------------------ import check


def test_check_imports_follows_eager_imports_only(tmp_path):
    site = tmp_path / "site"
    (site / "pkg" / "sub").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text(
        "import json\nimport requests\nfrom . import sub\nfrom .sub import gone\n"
        "try:\n    import optional_thing\nexcept ImportError:\n    pass\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import typed_only\n"
        "def f():\n    import lazy_thing\n"
        "import contextlib\nwith contextlib.suppress(ImportError):\n    import suppressed_thing\n")
    (site / "pkg" / "sub" / "__init__.py").write_text("import needed_dep\nfrom pkg.sub.mod import x\n")
    (site / "pkg" / "sub" / "mod.py").write_text("import other_dep.deep\nx = 1\n")
    r = ob.check_imports(site, ["pkg"], target_modules={"requests"})
    assert set(r["missing"]) == {"needed_dep", "other_dep"}
    assert "optional_thing" in r["optional"] and "suppressed_thing" in r["optional"]
    assert "lazy_thing" not in r["missing"] and "typed_only" not in r["missing"]
    assert "pkg.sub.gone" not in r["missing_in_bundle"]  # a name in pkg.sub, not a submodule that is gone
    (site / "pkg" / "__init__.py").write_text("from .stripped import kernels\n")
    r = ob.check_imports(site, ["pkg"], target_modules=set())
    assert "pkg.stripped" in r["missing_in_bundle"]


def test_import_names_of_target_packages():
    assert ob.import_names("PyYAML") == ["yaml", "_yaml"]
    assert ob.import_names("nvidia-cublas") == ["nvidia"]
    assert ob.import_names("typing_extensions") == ["typing_extensions"]


def test_resplit_changes_the_part_size_not_the_archive(tmp_path):
    out, m = _fake_bundle(tmp_path)
    m2 = ob.resplit(out, 0.05, log=quiet)
    assert len(m2["parts"]) < len(m["parts"]) and m2["archive_sha256"] == m["archive_sha256"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"] + [f"p{i:02d}" for i in range(1, len(m2["parts"]) + 1)]
    stash = tmp_path / "stash"
    for p in m2["parts"]:
        assert unpack("--stash", stash, out / Path(p["file"]).parent).returncode == 0
    r = unpack("--stash", stash, "--extract", tmp_path / "site")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "lib" / "__init__.py").exists()


def test_entry_module_patterns_expand_over_the_site(tmp_path):
    site = tmp_path / "site"
    for rel in ("pkg/__init__.py", "pkg/a/__init__.py", "pkg/a/api_router.py", "pkg/b/c/api_router/__init__.py",
                "pkg/b/other.py"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("")
    got = ob.expand_modules(site, ["pkg", "pkg.**.api_router", "pkg.b.*"])
    assert got == ["pkg", "pkg.a.api_router", "pkg.b.c.api_router", "pkg.b.other"]
    with pytest.raises(ob.BundleError, match="matches no module"):
        ob.expand_modules(site, ["pkg.nothing.*"])


def test_parts_of_two_builds_do_not_mix(tmp_path):
    out1, m1 = _fake_bundle(tmp_path / "one")
    r = tmp_path / "one" / "r.toml"
    r.write_text(r.read_text().replace("level = 1", "level = 2"))  # another archive
    out2, m2 = tmp_path / "two", ob.build(ob.load_recipe(r), tmp_path / "two", tmp_path / "one" / "cache",
                                          [tmp_path / "one" / "wheels"], log=quiet)
    assert m1["archive_sha256"] != m2["archive_sha256"]
    stash = tmp_path / "stash"
    unpack("--stash", stash, out1 / "p01")
    unpack("--stash", stash, out2 / "p02")
    r = unpack("--stash", stash, "--extract", tmp_path / "site")
    assert r.returncode == 2 and "several bundles" in r.stderr and "(1/" in r.stderr
    for p in m2["parts"]:
        unpack("--stash", stash, out2 / Path(p["file"]).parent)
    r = unpack("--stash", stash, "--extract", tmp_path / "site")  # the only complete one
    assert r.returncode == 0, r.stderr
