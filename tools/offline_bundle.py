#!/usr/bin/env python3
"""Stage Python packages onto an offline host: resolve, download, extract, strip, compress, split.

    offline_bundle.py build RECIPE.toml [--out DIR] [--cache DIR] [--find-links DIR ...]
    offline_bundle.py resolve RECIPE.toml            # print the plan, build nothing
    offline_bundle.py check-imports RECIPE.toml [--site DIR] [--smoke-python PY] [MODULE ...]

The recipe (TOML) names the target (Python version, platform tags), the top-level requirements, what
the target already has, what never to bring, and files to drop from wheels. Dependencies are resolved
here from each wheel's METADATA with markers evaluated for the target; `pip download --no-deps` only
fetches. The output directory holds one folder per part (p01/, p02/, ...), each with its slice of the
compressed tarball and a copy of manifest.json; tools/offline_unpack.py reassembles them on the target.

Needs Python >= 3.11 (tomllib) and pip (its vendored `packaging` is used when `packaging` is absent).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import email.parser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    sys.exit("offline_bundle.py needs Python >= 3.11 (tomllib)")

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.tags import Tag, compatible_tags, cpython_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import InvalidVersion, Version
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.tags import Tag, compatible_tags, cpython_tags  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[no-redef]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]

MIB = 1 << 20
FORMAT = 1
_print_lock = threading.Lock()


def say(*args) -> None:
    with _print_lock:
        print(*args, flush=True)


TAR_MTIME = 315532800  # 1980-01-01: fixed, so the same inputs give the same bytes


class BundleError(Exception):
    """A problem with the recipe, a wheel or a constraint: reported as one line."""


# ---------------------------------------------------------------------------------------------- target


@dataclass
class Target:
    python: str = "3.12"  # full version if known, e.g. "3.12.3"
    implementation: str = "cp"
    platforms: list[str] = field(default_factory=lambda: ["manylinux_2_28_x86_64"])
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def py_short(self) -> str:
        return ".".join(self.python.split(".")[:2])

    @property
    def py_tuple(self) -> tuple[int, int]:
        major, minor = self.py_short.split(".")
        return int(major), int(minor)

    @property
    def abi(self) -> str:
        return f"{self.implementation}{self.py_tuple[0]}{self.py_tuple[1]}"

    def expanded_platforms(self) -> list[str]:
        """manylinux_2_N means every glibc up to N: pip matches --platform tags exactly, so list them."""
        out: list[str] = []
        for plat in self.platforms:
            m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", plat)
            if not m:
                out.append(plat)
                continue
            major, minor, arch = int(m[1]), int(m[2]), m[3]
            out += [f"manylinux_{major}_{n}_{arch}" for n in range(minor, 4, -1)]
            if major == 2 and minor >= 17:
                out.append(f"manylinux2014_{arch}")
            if major == 2 and minor >= 12:
                out.append(f"manylinux2010_{arch}")
            if major == 2 and minor >= 5:
                out.append(f"manylinux1_{arch}")
        return list(dict.fromkeys(out))

    def tags(self) -> set[Tag]:
        plats = self.expanded_platforms()
        tags = set(cpython_tags(self.py_tuple, platforms=plats))
        tags |= set(compatible_tags(self.py_tuple, self.abi, platforms=plats))
        return tags

    def marker_env(self) -> dict[str, str]:
        full = self.python if self.python.count(".") >= 2 else self.python + ".0"
        env = {
            "python_version": self.py_short,
            "python_full_version": full,
            "implementation_name": "cpython" if self.implementation == "cp" else self.implementation,
            "implementation_version": full,
            "platform_python_implementation": "CPython" if self.implementation == "cp" else "",
            "os_name": "posix",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "platform_machine": _arch_of(self.platforms[0]),
            "platform_release": "",
            "platform_version": "",
        }
        env.update(self.markers)
        return env


def _arch_of(platform: str) -> str:
    for arch in ("x86_64", "aarch64", "ppc64le", "s390x", "arm64"):
        if platform.endswith(arch):
            return arch
    return ""


def applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    """Whether a Requires-Dist line applies on the target for the requested extras of its package."""
    if req.marker is None:
        return True
    for extra in {""} | extras:
        if req.marker.evaluate({**env, "extra": extra}):
            return True
    return False


# ---------------------------------------------------------------------------------------------- recipe


@dataclass
class Recipe:
    path: Path
    name: str
    target: Target
    requirements: list[Requirement]
    constraints: dict[str, SpecifierSet]
    have: dict[str, Version | None]
    exclude: set[str]
    strip: dict[str, list[str]]
    keep: set[str] = field(default_factory=set)  # use the target's version even where a requirement excludes it
    part_mib: float = 60.0
    solo_mib: float = 64.0
    codec: str = "auto"
    level: int | None = None
    entry_modules: list[str] = field(default_factory=list)
    known_missing: set[str] = field(default_factory=set)
    target_modules: set[str] = field(default_factory=set)
    smoke: list[str] = field(default_factory=list)
    stand_ins: list[str] = field(default_factory=list)  # target packages installed here for the smoke import


def parse_req(text: str, where: str) -> Requirement:
    try:
        return Requirement(text)
    except InvalidRequirement as e:
        raise BundleError(f"{where}: bad requirement {text!r}: {e}") from None


def read_have_lines(lines: list[str], where: str) -> dict[str, Version | None]:
    """`pip list --format=freeze` lines (name==version), bare names, `# comments`; `-e`/`@` lines keep the name."""
    have: dict[str, Version | None] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        if " @ " in line:
            line = line.split(" @ ", 1)[0]
        name, _, version = line.partition("==")
        name = name.strip()
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise BundleError(f"{where}: cannot read the package line {raw.strip()!r}")
        try:
            have[canonicalize_name(name)] = Version(version.strip()) if version.strip() else None
        except InvalidVersion:
            raise BundleError(f"{where}: bad version in {raw.strip()!r}") from None
    return have


def load_recipe(path: Path) -> Recipe:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"no recipe at {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise BundleError(f"{path}: not valid TOML: {e}") from None
    known = {"name", "target", "have", "bundle", "strip", "check_imports"}
    unknown = set(data) - known
    if unknown:
        raise BundleError(f"{path}: unknown section(s) {sorted(unknown)}; known: {sorted(known)}")
    t = data.get("target", {})
    target = Target(
        python=str(t.get("python", "3.12")),
        implementation=t.get("implementation", "cp"),
        platforms=list(t.get("platforms", ["manylinux_2_28_x86_64"])),
        markers=dict(t.get("markers", {})),
    )
    b = data.get("bundle", {})
    if not b.get("requirements"):
        raise BundleError(f"{path}: [bundle] requirements is empty")
    reqs = [parse_req(r, f"{path} [bundle] requirements") for r in b["requirements"]]
    constraints: dict[str, SpecifierSet] = defaultdict(SpecifierSet)
    for text in b.get("constraints", []):
        req = parse_req(text, f"{path} [bundle] constraints")
        constraints[canonicalize_name(req.name)] &= req.specifier
    have: dict[str, Version | None] = {}
    h = data.get("have", {})
    for rel in h.get("files", []):
        f = (path.parent / rel).resolve()
        if not f.exists():
            if h.get("optional_files", False):
                continue
            raise BundleError(f"{path}: [have] file {rel} not found at {f}")
        have.update(read_have_lines(f.read_text().splitlines(), str(f)))
    have.update(read_have_lines(list(h.get("packages", [])), f"{path} [have] packages"))
    for name in h.get("keep", []):
        if canonicalize_name(name) not in have:
            raise BundleError(f"{path}: [have] keep names {name}, which the target does not have")
    strip = {canonicalize_name(k) if k != "*" else "*": list(v) for k, v in data.get("strip", {}).items()}
    c = data.get("check_imports", {})
    return Recipe(
        path=path,
        name=data.get("name") or path.stem,
        target=target,
        requirements=reqs,
        constraints=dict(constraints),
        have=have,
        exclude={canonicalize_name(x) for x in b.get("exclude", [])},
        strip=strip,
        part_mib=float(b.get("part_mib", 60)),
        solo_mib=float(b.get("solo_mib", 64)),
        codec=b.get("codec", "auto"),
        level=b.get("level"),
        entry_modules=list(c.get("modules", [])),
        known_missing=set(c.get("known_missing", [])),
        target_modules=set(h.get("modules", [])),
        smoke=list(c.get("smoke", [])),
        stand_ins=list(c.get("stand_ins", [])),
        keep={canonicalize_name(x) for x in h.get("keep", [])},
    )


# ---------------------------------------------------------------------------------------------- wheels


@dataclass
class Wheel:
    path: Path
    name: str  # canonical
    version: Version

    @classmethod
    def from_path(cls, path: Path) -> Wheel:
        name, version, _build, _tags = parse_wheel_filename(path.name)
        return cls(Path(path), canonicalize_name(name), version)

    def dist_info(self, z: zipfile.ZipFile) -> str:
        tops = {n.split("/", 1)[0] for n in z.namelist()}
        infos = [t for t in tops if t.endswith(".dist-info")]
        if len(infos) != 1:
            raise BundleError(f"{self.path.name}: expected one .dist-info folder, found {sorted(infos)}")
        return infos[0]

    def metadata(self) -> email.message.Message:
        with zipfile.ZipFile(self.path) as z:
            text = z.read(f"{self.dist_info(z)}/METADATA").decode("utf-8", "replace")
        return email.parser.Parser().parsestr(text, headersonly=True)

    def requires(self) -> list[Requirement]:
        out = []
        for line in self.metadata().get_all("Requires-Dist") or []:
            out.append(parse_req(line, f"{self.path.name} METADATA"))
        return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MIB):
            h.update(chunk)
    return h.hexdigest()


class Fetcher:
    """Finds a wheel for `name` within `spec` for the target: local folders, the cache, then pip download."""

    def __init__(self, target: Target, cache: Path, find_links: list[Path], refresh: bool = False,
                 log=say):
        self.target = target
        self.cache = cache
        self.find_links = [Path(p) for p in find_links]
        self.tags = target.tags()
        self.log = log
        self.cache.mkdir(parents=True, exist_ok=True)
        self.picks_file = cache / "picks.json"
        self.picks: dict[str, str] = {}
        if self.picks_file.exists() and not refresh:
            self.picks = json.loads(self.picks_file.read_text())

    def _key(self, name: str, spec: SpecifierSet) -> str:
        plats = ",".join(self.target.expanded_platforms())
        return f"{name}|{spec}|{self.target.abi}|{plats}"

    def _local(self, name: str, spec: SpecifierSet) -> Wheel | None:
        best: Wheel | None = None
        for folder in [*self.find_links, self.cache]:
            for p in folder.glob("*.whl") if folder.is_dir() else []:
                try:
                    wname, version, _b, tags = parse_wheel_filename(p.name)
                except Exception:
                    continue
                if canonicalize_name(wname) != name or not (tags & self.tags):
                    continue
                if not spec.contains(version, prereleases=True):
                    continue
                if best is None or version > best.version:
                    best = Wheel(p, name, version)
        return best

    def fetch(self, name: str, spec: SpecifierSet) -> Wheel:
        key = self._key(name, spec)
        cached = self.picks.get(key)
        if cached and (self.cache / cached).exists():
            return Wheel.from_path(self.cache / cached)
        exact = [s for s in spec if s.operator in ("==", "===") and "*" not in s.version]
        if exact:
            local = self._local(name, spec)
            if local is not None:
                return self._remember(key, local)
        wheel = self._pip_download(name, spec)
        return self._remember(key, wheel)

    def _remember(self, key: str, wheel: Wheel) -> Wheel:
        if wheel.path.parent.resolve() != self.cache.resolve():
            dest = self.cache / wheel.path.name
            if not dest.exists():
                tmp = dest.with_suffix(".tmp")
                shutil.copyfile(wheel.path, tmp)
                tmp.replace(dest)
            wheel = Wheel(dest, wheel.name, wheel.version)
        self.picks[key] = wheel.path.name
        return wheel

    def save(self) -> None:
        tmp = self.picks_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.picks, indent=1, sort_keys=True))
        tmp.replace(self.picks_file)

    def _pip_download(self, name: str, spec: SpecifierSet) -> Wheel:
        t = self.target
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", t.py_short, "--implementation", t.implementation,
               "--abi", t.abi, "--abi", "abi3", "--abi", "none", "--progress-bar", "off"]
        for plat in t.expanded_platforms():
            cmd += ["--platform", plat]
        cmd += ["--platform", "any"]
        for link in self.find_links:
            cmd += ["--find-links", str(link)]
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp:
            cmd += ["-d", tmp, f"{name}{spec}"]
            self.log(f"  download {name}{spec}")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
                raise BundleError(f"no wheel of {name}{spec} for {t.abi} on {t.platforms}: {last[0]}")
            got = list(Path(tmp).glob("*.whl"))
            if len(got) != 1:
                raise BundleError(f"pip download {name}{spec} gave {[p.name for p in got]}, expected one wheel")
            dest = self.cache / got[0].name
            shutil.move(str(got[0]), dest)
            return Wheel.from_path(dest)


# ---------------------------------------------------------------------------------------------- resolve


@dataclass
class Decision:
    name: str
    action: str  # "bring" | "have" | "exclude"
    wheel: Wheel | None = None
    have_version: Version | None = None
    spec: SpecifierSet = field(default_factory=SpecifierSet)
    why: list[str] = field(default_factory=list)
    extras: set[str] = field(default_factory=set)
    note: str = ""


class ConflictError(BundleError):
    pass


def resolve(recipe: Recipe, fetch, log=say, max_restarts: int = 50) -> dict[str, Decision]:
    """Walk Requires-Dist from the recipe's requirements, breadth first, one level at a time.

    `fetch(name, spec) -> Wheel` picks the newest wheel within `spec`. A name's specifiers are merged
    from every requirement seen; when a pick stops satisfying them, it is picked again and the walk
    restarts (earlier picks that still fit are kept). No version within the merged range: ConflictError
    naming every requirement on that package.
    """
    env = recipe.target.marker_env()
    picks: dict[str, Wheel] = {}
    for _ in range(max_restarts):
        plan = _walk(recipe, env, picks, fetch, log)
        if plan is not None:
            return plan
    raise BundleError(f"resolution did not settle after {max_restarts} restarts")


def _walk(recipe: Recipe, env, picks: dict[str, Wheel], fetch, log) -> dict[str, Decision] | None:
    plan: dict[str, Decision] = {}
    expanded: dict[str, tuple[Version, frozenset[str]]] = {}
    frontier: list[tuple[Requirement, str]] = [(r, "recipe") for r in recipe.requirements]
    while frontier:
        touched: list[str] = []
        for req, parent in frontier:
            name = canonicalize_name(req.name)
            d = plan.setdefault(name, Decision(name, ""))
            d.spec &= req.specifier
            d.why.append(f"{parent} -> {req}")
            d.extras |= set(req.extras)
            touched.append(name)
        need: dict[str, SpecifierSet] = {}
        for name in dict.fromkeys(touched):
            d = plan[name]
            full = d.spec & recipe.constraints.get(name, SpecifierSet())
            if name in recipe.exclude:
                d.action = "exclude"
                continue
            if name in recipe.have:
                hv = recipe.have[name]
                if hv is None or full.contains(hv, prereleases=True):
                    d.action, d.have_version = "have", hv
                    continue
                if name in recipe.keep:
                    d.action, d.have_version = "have", hv
                    d.note = f"keeping the target's {name} {hv} although {full} is asked for ([have] keep)"
                    continue
                d.note = f"target has {name} {hv}, which does not satisfy {full or 'any'}: bringing ours"
            d.action = "bring"
            pick = picks.get(name)
            if pick is None or not full.contains(pick.version, prereleases=True):
                if name in expanded:
                    picks[name] = _fetch_checked(fetch, d, full)
                    log(f"  {name}: re-picked {picks[name].version} for {full}; restarting the walk")
                    return None
                need[name] = full
        if need:
            with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
                futures = {n: pool.submit(_fetch_checked, fetch, plan[n], s) for n, s in need.items()}
                for n, fut in futures.items():
                    picks[n] = fut.result()
        nxt: list[tuple[Requirement, str]] = []
        for name in dict.fromkeys(touched):
            d = plan[name]
            if d.action != "bring":
                continue
            d.wheel = picks[name]
            state = (d.wheel.version, frozenset(d.extras))
            if expanded.get(name) == state:
                continue
            expanded[name] = state
            for dep in d.wheel.requires():
                if applies(dep, env, d.extras):
                    nxt.append((dep, f"{name} {d.wheel.version}"))
        frontier = nxt
    return plan


def _fetch_checked(fetch, d: Decision, spec: SpecifierSet) -> Wheel:
    try:
        wheel = fetch(d.name, spec)
    except BundleError as e:
        msg = f"{e}\n  requirements on {d.name}: " + "; ".join(d.why)
        parents = [w.split(" -> ", 1)[0] for w in d.why if not w.startswith("recipe")]
        if len(parents) > 1:
            hints = ", ".join(f"'{p.replace(' ', '!=')}'" for p in dict.fromkeys(parents))
            msg += f"\n  an earlier version of one of them may fit: add e.g. {hints} to [bundle] constraints"
        raise ConflictError(msg) from None
    if not spec.contains(wheel.version, prereleases=True):
        raise ConflictError(f"{d.name} {wheel.version} does not satisfy {spec}; requirements: " + "; ".join(d.why))
    return wheel


# ---------------------------------------------------------------------------------------------- strip globs


def expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    out = []
    for alt in m[1].split(","):
        out += expand_braces(pattern[: m.start()] + alt + pattern[m.end():])
    return out


def glob_regex(pattern: str) -> re.Pattern:
    """`**` crosses folders, `*` and `?` do not, `[...]` is a class; `{a,b}` is expanded first."""
    parts = []
    for alt in expand_braces(pattern):
        i, rx = 0, ""
        while i < len(alt):
            c = alt[i]
            if alt.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
                continue
            if alt.startswith("**", i):
                rx += ".*"
                i += 2
                continue
            if c == "*":
                rx += "[^/]*"
            elif c == "?":
                rx += "[^/]"
            elif c == "[":
                j = alt.find("]", i + 1)
                if j < 0:
                    rx += re.escape(c)
                else:
                    body = alt[i + 1:j].replace("\\", "\\\\")
                    rx += "[^" + body[1:] + "]" if body.startswith("!") else "[" + body + "]"
                    i = j
            else:
                rx += re.escape(c)
            i += 1
        parts.append(rx)
    return re.compile("(?:" + "|".join(parts) + r")\Z")


class Stripper:
    def __init__(self, patterns: list[str]):
        self.patterns = patterns
        self.regexes = [glob_regex(p) for p in patterns]
        self.hits = [0] * len(patterns)

    def drops(self, path: str) -> bool:
        hit = False
        for i, rx in enumerate(self.regexes):
            if rx.match(path):
                self.hits[i] += 1
                hit = True
        return hit

    def unused(self) -> list[str]:
        return [p for p, n in zip(self.patterns, self.hits, strict=True) if n == 0]


# ---------------------------------------------------------------------------------------------- site tree


@dataclass
class Installed:
    name: str
    version: str
    wheel: str
    wheel_bytes: int
    wheel_sha256: str
    files: int = 0
    installed_bytes: int = 0
    stripped_files: int = 0
    stripped_bytes: int = 0
    dropped: list[str] = field(default_factory=list)  # scripts/headers/data
    unused_strips: list[str] = field(default_factory=list)


def install_wheel(wheel: Wheel, site: Path, patterns: list[str], owners: dict[str, str], log=say) -> Installed:
    """Unpack a wheel as `pip install --target` would: *.data/purelib|platlib into the root,
    scripts/headers/data dropped; then drop the files matching `patterns` (paths relative to the site)."""
    strip = Stripper(patterns)
    info = Installed(wheel.name, str(wheel.version), wheel.path.name, wheel.path.stat().st_size,
                     sha256_file(wheel.path))
    stripped: set[str] = set()
    with zipfile.ZipFile(wheel.path) as z:
        dist_info = wheel.dist_info(z)
        data_dir = dist_info[: -len(".dist-info")] + ".data"
        record_name = f"{dist_info}/RECORD"
        record = None
        for zi in z.infolist():
            if zi.is_dir():
                continue
            rel = zi.filename
            if rel.startswith(data_dir + "/"):
                scheme, _, rest = rel[len(data_dir) + 1:].partition("/")
                if scheme in ("purelib", "platlib"):
                    rel = rest
                else:
                    info.dropped.append(rel)
                    continue
            if rel == record_name:
                record = z.read(zi).decode("utf-8", "replace")
                continue
            if strip.drops(rel):
                info.stripped_files += 1
                info.stripped_bytes += zi.file_size
                stripped.add(rel)
                continue
            dest = _safe_join(site, rel, wheel.path.name)
            if rel in owners and owners[rel] != wheel.name and not rel.endswith("__init__.py"):
                log(f"  note: {rel} from {wheel.name} replaces the one from {owners[rel]}")
            owners[rel] = wheel.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(zi) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 4 * MIB)
            mode = (zi.external_attr >> 16) & 0o777
            os.chmod(dest, 0o755 if mode & 0o111 else 0o644)
            info.files += 1
            info.installed_bytes += zi.file_size
        if record is not None:
            kept = [ln for ln in record.splitlines() if ln.split(",", 1)[0] not in stripped]
            (site / record_name).parent.mkdir(parents=True, exist_ok=True)
            (site / record_name).write_text("\n".join(kept) + "\n")
            owners[record_name] = wheel.name
    info.unused_strips = strip.unused()
    return info


def _safe_join(root: Path, rel: str, where: str) -> Path:
    if rel.startswith("/") or ".." in rel.split("/") or "\\" in rel:
        raise BundleError(f"{where}: refusing the path {rel!r}")
    return root / rel


def build_site(plan: dict[str, Decision], recipe: Recipe, site: Path, log=say) -> tuple[list[Installed], dict[str, str]]:
    """Install every brought wheel into `site`; returns what was installed and each file's package."""
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    owners: dict[str, str] = {}
    out = []
    everywhere = recipe.strip.get("*", [])
    used_everywhere: set[str] = set()
    for name in sorted(plan):
        d = plan[name]
        if d.action != "bring":
            continue
        own = recipe.strip.get(name, [])
        inst = install_wheel(d.wheel, site, own + everywhere, owners, log)
        used_everywhere |= set(everywhere) - set(inst.unused_strips)
        inst.unused_strips = [p for p in inst.unused_strips if p in own]
        out.append(inst)
    for pat in everywhere:
        if pat not in used_everywhere:
            log(f"  note: strip pattern {pat!r} for every wheel matched nothing")
    for name in recipe.strip:
        if name != "*" and (name not in plan or plan[name].action != "bring"):
            log(f"  warning: [strip] names {name}, which the bundle does not bring")
    return out, owners


def tree_files(site: Path) -> list[Path]:
    files = [p for p in site.rglob("*") if p.is_file() or p.is_symlink()]
    # similar content side by side compresses better: group by suffix, then by path
    return sorted(files, key=lambda p: (p.suffix, str(p.relative_to(site))))


def plan_pieces(site: Path, owners: dict[str, str], solo_bytes: int) -> list[tuple[str, list[Path]]]:
    """The tar is made of pieces, each compressed on its own and cached by content: a package of at least
    `solo_bytes` (vLLM) is a piece of its own, everything else one piece; so a rebuild that changes
    only the small packages recompresses only them."""
    files = tree_files(site)
    size: dict[str, int] = defaultdict(int)
    for p in files:
        size[owners.get(p.relative_to(site).as_posix(), "")] += p.stat().st_size
    solo = sorted(name for name, n in size.items() if name and n >= solo_bytes)
    rest = [p for p in files if owners.get(p.relative_to(site).as_posix(), "") not in solo]
    pieces = [("rest", rest)] if rest else []
    for name in solo:
        pieces.append((name, [p for p in files if owners.get(p.relative_to(site).as_posix()) == name]))
    return pieces


def write_tar(site: Path, files: list[Path], out: Path, end_marker: bool = True) -> int:
    """A reproducible tar of `files`; without the end marker, tars concatenate into one."""
    with open(out, "wb") as f:
        tar = tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT)
        for p in files:
            ti = tar.gettarinfo(p, arcname=p.relative_to(site).as_posix())
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.mtime = TAR_MTIME
            ti.mode = 0o755 if ti.mode & 0o111 else 0o644
            if ti.isfile():
                with open(p, "rb") as src:
                    tar.addfile(ti, src)
            else:
                tar.addfile(ti)
        end = tar.offset
        tar.close()
        if not end_marker:
            f.truncate(end)
    return out.stat().st_size


# ---------------------------------------------------------------------------------------------- compression


@dataclass
class Compressed:
    codec: str
    path: Path
    bytes: int
    seconds: float
    decompress_seconds: float | None = None
    level: str = ""


def compress_xz(src: Path, dest: Path, level: int | None = None) -> Compressed:
    level = 9 if level is None else level
    t0 = time.perf_counter()
    if shutil.which("xz"):
        # one thread: the stream stays a single block (best ratio) and stdlib lzma reads it
        with open(src, "rb") as fin, open(dest, "wb") as fout:
            subprocess.run(["xz", f"-{level}e", "-T1", "-c"], stdin=fin, stdout=fout, check=True)
    else:
        import lzma

        with open(src, "rb") as fin, lzma.open(dest, "wb", preset=level | lzma.PRESET_EXTREME) as fout:
            shutil.copyfileobj(fin, fout, 16 * MIB)
    return Compressed("xz", dest, dest.stat().st_size, time.perf_counter() - t0, level=f"-{level}e")


ZSTD_WINDOW_LOG = 27  # 128 MiB window; the unpacker allows up to 2 GiB


def compress_zstd(src: Path, dest: Path, level: int | None = None) -> Compressed:
    level = 19 if level is None else level
    t0 = time.perf_counter()
    if shutil.which("zstd"):
        cmd = ["zstd", "-q", "-f", "-T1", f"--long={ZSTD_WINDOW_LOG}", f"-{level}", str(src), "-o", str(dest)]
        if level > 19:
            cmd.insert(1, "--ultra")
        subprocess.run(cmd, check=True)
    else:
        try:
            import zstandard
        except ImportError:
            raise BundleError("zstd needs the zstd program or the zstandard module here") from None
        params = zstandard.ZstdCompressionParameters.from_level(
            level, window_log=ZSTD_WINDOW_LOG, enable_ldm=True)
        with open(src, "rb") as fin, open(dest, "wb") as fout:
            zstandard.ZstdCompressor(compression_params=params).copy_stream(fin, fout)
    return Compressed("zstd", dest, dest.stat().st_size, time.perf_counter() - t0,
                      level=f"-{level} --long={ZSTD_WINDOW_LOG}")


COMPRESSORS = {"xz": (compress_xz, ".xz"), "zstd": (compress_zstd, ".zst")}


def compress_pieces(codec: str, level: int | None, pieces: list[Path], dest: Path, cache: Path,
                    workers: int, log=say) -> Compressed:
    """Compress each tar piece (cached under cache/compressed by its digest, codec and level) and
    concatenate them: xz streams and zstd frames both read back as one stream."""
    fn, suffix = COMPRESSORS[codec]
    store = cache / "compressed"
    store.mkdir(parents=True, exist_ok=True)
    level_tag = "d" if level is None else str(level)
    window = f"-w{ZSTD_WINDOW_LOG}" if codec == "zstd" else ""

    def one(piece: Path) -> tuple[Path, bool]:
        key = f"{sha256_file(piece)}-{codec}{level_tag}{window}{suffix}"
        hit = store / key
        if hit.exists():
            return hit, False
        tmp = store / (key + ".tmp")
        fn(piece, tmp, level)
        tmp.replace(hit)
        return hit, True

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:  # each runs in its own process
        done = list(pool.map(one, pieces))
    fresh = sum(1 for _, new in done if new)
    with open(dest, "wb") as out:
        for path, _ in done:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, 16 * MIB)
    if codec == "xz":
        label = f"-{9 if level is None else level}e"
    else:
        label = f"-{19 if level is None else level} --long={ZSTD_WINDOW_LOG}"
    log(f"  {codec} {label}: {len(pieces) - fresh} of {len(pieces)} piece(s) from the cache")
    return Compressed(codec, dest, dest.stat().st_size, time.perf_counter() - t0, level=label)


def time_decompress(c: Compressed) -> float:
    """Seconds to decompress here with what the target will use (stdlib lzma; zstd program/module)."""
    t0 = time.perf_counter()
    if c.codec == "xz":
        import lzma

        with lzma.open(c.path, "rb") as f:
            while f.read(16 * MIB):
                pass
    else:
        subprocess.run(["zstd", "-q", "-d", f"--long={ZSTD_WINDOW_LOG}", "-c", str(c.path)],
                       stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def choose_codec(candidates: list[Compressed], part_bytes: int, zstd_extra: int) -> Compressed:
    """Fewest parts first (each part is one transfer); then, within 3% of the smallest, the faster decode."""

    def parts(c: Compressed) -> int:
        extra = zstd_extra if c.codec == "zstd" else 0
        return -(-(c.bytes + extra) // part_bytes)

    def total(c: Compressed) -> int:
        return c.bytes + (zstd_extra if c.codec == "zstd" else 0)

    fewest = min(parts(c) for c in candidates)
    pool = [c for c in candidates if parts(c) == fewest]
    smallest = min(total(c) for c in pool)
    close = [c for c in pool if total(c) <= smallest * 1.03]
    return min(close, key=lambda c: (c.decompress_seconds or 0.0, total(c)))


# ---------------------------------------------------------------------------------------------- parts


def split_parts(archive: Path, out: Path, part_bytes: int, first_part_reserved: int = 0) -> list[dict]:
    """Cut `archive` into out/pNN/<archive>.NNN, each at most part_bytes (the first leaves room for
    `first_part_reserved` bytes of other files)."""
    if part_bytes <= first_part_reserved:
        raise BundleError(f"parts of {part_bytes} bytes leave no room after {first_part_reserved} bytes")
    parts = []
    with open(archive, "rb") as f:
        index = 1
        while True:
            size = part_bytes - (first_part_reserved if index == 1 else 0)
            h = hashlib.sha256()
            rel = f"p{index:02d}/{archive.name}.{index:03d}"
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            n = 0
            with open(dest, "wb") as w:
                while n < size:
                    chunk = f.read(min(4 * MIB, size - n))
                    if not chunk:
                        break
                    w.write(chunk)
                    h.update(chunk)
                    n += len(chunk)
            if n == 0 and index > 1:
                dest.unlink()
                dest.parent.rmdir()
                break
            parts.append({"index": index, "file": rel, "bytes": n, "sha256": h.hexdigest()})
            if n < size:
                break
            index += 1
    return parts


# ---------------------------------------------------------------------------------------------- build


def build(recipe: Recipe, out: Path, cache: Path, find_links: list[Path], refresh: bool = False,
          codec: str | None = None, part_mib: float | None = None, log=say) -> dict:
    t_start = time.perf_counter()
    fetcher = Fetcher(recipe.target, cache, find_links, refresh, log)
    log(f"resolving {len(recipe.requirements)} requirement(s) for {recipe.target.abi} {recipe.target.platforms}")
    try:
        plan = resolve(recipe, fetcher.fetch, log)
    finally:
        fetcher.save()
    report_plan(plan, log)
    work = out.parent / (out.name + ".work")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    site = work / "site"
    log(f"extracting into {site}")
    installed, owners = build_site(plan, recipe, site, log)
    for inst in installed:
        for pat in inst.unused_strips:
            log(f"  warning: strip pattern {pat!r} for {inst.name} matched nothing")
    pieces = plan_pieces(site, owners, int(recipe.solo_mib * MIB))
    tars = []
    for i, (name, files) in enumerate(pieces):
        tars.append(work / f"piece-{i:02d}-{name}.tar")
        write_tar(site, files, tars[-1], end_marker=False)
    tars.append(work / "piece-end.tar")
    write_tar(site, [], tars[-1], end_marker=True)
    tar_bytes = sum(t.stat().st_size for t in tars)
    n_files = sum(len(files) for _, files in pieces)
    log(f"tar: {tar_bytes / MIB:.1f} MiB, {n_files} files, pieces: "
        + ", ".join(f"{name} {t.stat().st_size / MIB:.1f} MiB" for (name, _), t in zip(pieces, tars, strict=False)))

    codec = codec or recipe.codec
    part_bytes = int((part_mib or recipe.part_mib) * MIB)
    zstd_wheel: Wheel | None = None
    if codec in ("auto", "zstd"):
        zstd_wheel = fetcher.fetch("zstandard", SpecifierSet())
        fetcher.save()
    codecs = {"auto": ["xz", "zstd"], "xz": ["xz"], "zstd": ["zstd"]}.get(codec)
    if codecs is None:
        raise BundleError(f"unknown codec {codec!r}: auto, xz or zstd")
    workers = min(len(tars), os.cpu_count() or 1)
    candidates = []
    for c in codecs:
        level = recipe.level if codec == c else None
        dest = work / f"{recipe.name}.tar{COMPRESSORS[c][1]}"
        candidates.append(compress_pieces(c, level, tars, dest, cache, workers, log))
    for c in candidates:
        c.decompress_seconds = time_decompress(c)
        log(f"  {c.codec} {c.level}: {c.bytes / MIB:.1f} MiB ({c.bytes / tar_bytes:.1%}), "
            f"compress {c.seconds:.0f} s, decompress here {c.decompress_seconds:.1f} s")
    zstd_extra = zstd_wheel.path.stat().st_size if zstd_wheel else 0
    chosen = choose_codec(candidates, part_bytes, zstd_extra)
    log(f"chosen: {chosen.codec}")

    manifest = {
        "format": FORMAT,
        "name": recipe.name,
        "recipe": recipe.path.name,
        "target": {"python": recipe.target.python, "abi": recipe.target.abi,
                   "platforms": recipe.target.platforms},
        "codec": chosen.codec,
        "zstd_window_log": ZSTD_WINDOW_LOG if chosen.codec == "zstd" else None,
        "archive": chosen.path.name,
        "archive_bytes": chosen.bytes,
        "archive_sha256": sha256_file(chosen.path),
        "tar_bytes": tar_bytes,
        "files": n_files,
        "pieces": [name for name, _ in pieces],
        "parts": [],
        "aux": [],
        "compression": {c.codec: {"bytes": c.bytes, "level": c.level, "compress_s": round(c.seconds, 1),
                                  "decompress_s_here": round(c.decompress_seconds or 0, 2)}
                        for c in candidates},
        "packages": [vars(i) for i in installed],
        "have": {n: str(d.have_version) if d.have_version else None
                 for n, d in sorted(plan.items()) if d.action == "have"},
        "excluded": sorted(n for n, d in plan.items() if d.action == "exclude"),
        "over_have": [d.note for n, d in sorted(plan.items()) if d.note],
        "why": {n: d.why for n, d in sorted(plan.items())},
    }
    zstd_file = zstd_wheel.path if chosen.codec == "zstd" and zstd_wheel else None
    write_bundle(out, chosen.path, manifest, part_bytes, zstd_file, log)
    shutil.rmtree(work)
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return manifest


def write_bundle(out: Path, archive: Path, manifest: dict, part_bytes: int, zstd_wheel: Path | None,
                 log=say) -> dict:
    """(Re)write `out`: the archive cut into pNN/ folders, each with the manifest and the unpacker."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    manifest["aux"] = []
    reserved = 0
    if zstd_wheel is not None:
        (out / "p01").mkdir()
        shutil.copyfile(zstd_wheel, out / "p01" / zstd_wheel.name)
        size = zstd_wheel.stat().st_size
        manifest["aux"].append({"file": f"p01/{zstd_wheel.name}", "bytes": size,
                                "sha256": sha256_file(zstd_wheel), "role": "zstandard"})
        reserved = size + 64 * 1024
    manifest["parts"] = split_parts(archive, out, part_bytes, reserved)
    text = json.dumps(manifest, indent=1)
    (out / "manifest.json").write_text(text)
    unpack_src = Path(__file__).with_name("offline_unpack.py")
    for p in manifest["parts"]:
        part_dir = out / Path(p["file"]).parent
        (part_dir / "manifest.json").write_text(text)
        if unpack_src.exists():
            shutil.copyfile(unpack_src, part_dir / "offline_unpack.py")
    aux = manifest["aux"]
    log(f"{len(manifest['parts'])} part(s) in {out}: "
        + ", ".join(f"{p['file']} {p['bytes'] / MIB:.1f} MiB" for p in manifest["parts"])
        + (f" (+ {aux[0]['file']} {aux[0]['bytes'] / MIB:.1f} MiB)" if aux else ""))
    return manifest


def resplit(out: Path, part_mib: float, log=say) -> dict:
    """Cut a built bundle into parts of another size, without compressing again."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except FileNotFoundError:
        raise BundleError(f"no bundle at {out} (no manifest.json)") from None
    work = out.parent / (out.name + ".resplit")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    try:
        archive = work / manifest["archive"]
        h = hashlib.sha256()
        with open(archive, "wb") as w:
            for p in manifest["parts"]:
                data = (out / p["file"]).read_bytes()
                if hashlib.sha256(data).hexdigest() != p["sha256"]:
                    raise BundleError(f"{out / p['file']} is corrupt: rebuild the bundle")
                h.update(data)
                w.write(data)
        if h.hexdigest() != manifest["archive_sha256"]:
            raise BundleError("the reassembled archive's sha256 differs from the manifest's")
        zstd_wheel = None
        for a in manifest.get("aux", []):
            zstd_wheel = work / Path(a["file"]).name
            shutil.copyfile(out / a["file"], zstd_wheel)
        return write_bundle(out, archive, manifest, int(part_mib * MIB), zstd_wheel, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report_plan(plan: dict[str, Decision], log=say) -> None:
    bring = [d for d in plan.values() if d.action == "bring"]
    have = [d for d in plan.values() if d.action == "have"]
    excl = [d for d in plan.values() if d.action == "exclude"]
    log(f"bring {len(bring)}: " + ", ".join(f"{d.name}=={d.wheel.version}" for d in sorted(bring, key=lambda d: d.name)))
    log(f"on the target {len(have)}: " + ", ".join(sorted(d.name for d in have)))
    log(f"excluded {len(excl)}:")
    for d in sorted(excl, key=lambda d: d.name):
        wanted = sorted({w.split(" -> ", 1)[0].split(" ")[0] for w in d.why})
        log(f"  {d.name} (wanted by {', '.join(wanted)})")
    for d in plan.values():
        if d.note:
            log(f"  {d.note}")


# ---------------------------------------------------------------------------------------------- check imports

# distribution name -> import names, where they differ from the name with '-' -> '_'
IMPORT_NAMES = {
    "absl-py": ["absl"], "attrs": ["attr", "attrs"], "beautifulsoup4": ["bs4"], "cuda-bindings": ["cuda"],
    "cuda-core": ["cuda"], "cuda-python": ["cuda"], "cupy-cuda13x": ["cupy", "cupyx", "cupy_backends"],
    "hf-xet": ["hf_xet"], "huggingface-hub": ["huggingface_hub"], "markdown-it-py": ["markdown_it"],
    "nvidia-ml-py": ["pynvml"], "opencv-python-headless": ["cv2"], "opencv-python": ["cv2"],
    "pillow": ["PIL"], "protobuf": ["google"], "py-cpuinfo": ["cpuinfo"], "pyyaml": ["yaml", "_yaml"],
    "python-dateutil": ["dateutil"], "pyzmq": ["zmq"], "scikit-learn": ["sklearn"],
    "scikit-image": ["skimage"], "setuptools": ["setuptools", "pkg_resources", "_distutils_hack"],
    "typing-extensions": ["typing_extensions"], "pytorch-lightning": ["pytorch_lightning"],
    "lightning-utilities": ["lightning_utilities"], "jax-cuda13-plugin": ["jax_cuda13_plugin"],
    "jax-cuda13-pjrt": ["jax_plugins"], "msgpack": ["msgpack"], "nvidia-nvtx": ["nvtx"],
    "torch": ["torch", "torchgen", "functorch"], "triton": ["triton"], "grpcio": ["grpc"],
    "tensorboard-data-server": ["tensorboard_data_server"], "pyre-extensions": ["pyre_extensions"],
    "typing-inspect": ["typing_inspect"], "mypy-extensions": ["mypy_extensions"], "pyarrow": ["pyarrow"],
    "llvmlite": ["llvmlite"], "pybind11": ["pybind11"], "pyproject-hooks": ["pyproject_hooks"],
}


def import_names(dist: str) -> list[str]:
    dist = canonicalize_name(dist)
    if dist in IMPORT_NAMES:
        return IMPORT_NAMES[dist]
    if dist.startswith("nvidia-"):
        return ["nvidia"]
    return [dist.replace("-", "_")]


def site_top_modules(site: Path) -> set[str]:
    names = set()
    for p in site.iterdir():
        if p.is_dir() and not p.name.endswith((".dist-info", ".data")) and p.name != "__pycache__":
            names.add(p.name)
        elif p.suffix == ".py":
            names.add(p.stem)
        elif p.suffix == ".so":
            names.add(p.name.split(".", 1)[0])
    return names


def top_level_owners(site: Path) -> dict[str, str]:
    """top-level module -> distribution, from each dist-info's RECORD."""
    owners: dict[str, str] = {}
    for record in site.glob("*.dist-info/RECORD"):
        dist = record.parent.name[: -len(".dist-info")].rsplit("-", 1)[0]
        for line in record.read_text(errors="replace").splitlines():
            top = line.split(",", 1)[0].split("/", 1)[0]
            if top and not top.endswith((".dist-info", ".data")) and top != "__pycache__":
                owners[top.split(".", 1)[0] if top.endswith((".py", ".so")) else top] = canonicalize_name(dist)
    return owners


@dataclass
class ImportUse:
    module: str  # what is imported
    by: str  # the importing module
    kind: str  # "eager" | "guarded" (inside try) | "conditional" (inside if)


def module_imports(source: str, module: str, is_package: bool) -> list[ImportUse]:
    """Imports run when the module is imported: module level, also inside module-level try/if/with;
    never inside functions or classes' methods, or under `if TYPE_CHECKING`."""
    tree = ast.parse(source)
    pkg = module if is_package else module.rpartition(".")[0]
    uses: list[ImportUse] = []

    def absolute(level: int, mod: str | None) -> str:
        if level == 0:
            return mod or ""
        base = pkg.split(".")
        if level > 1:
            base = base[: len(base) - (level - 1)]
        return ".".join([*base, mod] if mod else base)

    def visit(stmts, kind: str) -> None:
        for s in stmts:
            if isinstance(s, ast.Import):
                uses.extend(ImportUse(a.name, module, kind) for a in s.names)
            elif isinstance(s, ast.ImportFrom):
                base = absolute(s.level, s.module)
                uses.append(ImportUse(base, module, kind))
                for a in s.names:
                    if a.name != "*":
                        uses.append(ImportUse(f"{base}.{a.name}", module, kind + "?"))
            elif isinstance(s, ast.Try | ast.TryStar):
                visit(s.body, "guarded")
                for h in s.handlers:
                    visit(h.body, "guarded")
                visit(s.orelse, "guarded" if kind == "eager" else kind)
                visit(s.finalbody, kind)
            elif isinstance(s, ast.If):
                test = ast.unparse(s.test)
                if "TYPE_CHECKING" in test:
                    visit(s.orelse, kind)
                    continue
                sub = "conditional" if kind == "eager" else kind
                visit(s.body, sub)
                visit(s.orelse, sub)
            elif isinstance(s, ast.With):  # `with suppress(ImportError):` guards like a try
                guard = any("suppress" in ast.unparse(item.context_expr) for item in s.items)
                visit(s.body, "guarded" if guard and kind == "eager" else kind)
            elif isinstance(s, ast.ClassDef):
                visit(s.body, kind)

    visit(tree.body, "eager")
    return uses


class ModuleFinder:
    def __init__(self, roots: list[Path]):
        self.roots = roots

    def find(self, module: str) -> tuple[Path, bool] | None:
        rel = Path(*module.split("."))
        for root in self.roots:
            pkg_init = root / rel / "__init__.py"
            if pkg_init.is_file():
                return pkg_init, True
            mod = root / rel.with_suffix(".py")
            if mod.is_file():
                return mod, False
            if (root / rel).is_dir():
                return root / rel, True  # namespace package
        return None  # an extension module (no source to walk) or absent

    def exists(self, module: str) -> bool:
        rel = Path(*module.split("."))
        for root in self.roots:
            if (root / rel).is_dir() or (root / rel.with_suffix(".py")).is_file():
                return True
            parent = root / rel.parent
            if parent.is_dir() and (any(parent.glob(rel.name + ".*.so")) or (parent / (rel.name + ".so")).exists()):
                return True
        return False


def expand_modules(site: Path, patterns: list[str]) -> list[str]:
    """Entry modules; one with `*` (`vllm.entrypoints.**.api_router`) names every module it matches."""
    out: list[str] = []
    for pat in patterns:
        if "*" not in pat:
            out.append(pat)
            continue
        top = pat.split(".", 1)[0]
        rx = glob_regex(pat.replace(".", "/"))
        found = []
        for f in sorted((site / top).rglob("*.py")) if (site / top).is_dir() else []:
            rel = f.relative_to(site).with_suffix("")
            mod = rel.parent if rel.name == "__init__" else rel
            if rx.match(mod.as_posix()):
                found.append(".".join(mod.parts))
        if not found:
            raise BundleError(f"the entry module pattern {pat!r} matches no module in {site}")
        out += found
    return list(dict.fromkeys(out))


def check_imports(site: Path, entry_modules: list[str], target_modules: set[str],
                  known_missing: set[str] = frozenset()) -> dict:
    """Follow eager imports from the entry modules through the bundle's sources; collect the
    top-level modules they need that are neither in the bundle, the stdlib nor on the target."""
    bundle_tops = site_top_modules(site)
    finder = ModuleFinder([site])
    stdlib = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | {"__future__"}
    seen: set[str] = set()
    queue: list[tuple[str, str, str]] = [(m, "(entry)", "eager") for m in entry_modules]
    missing: dict[str, list[str]] = defaultdict(list)  # top -> examples
    missing_internal: dict[str, list[str]] = defaultdict(list)
    soft: dict[str, list[str]] = defaultdict(list)
    walked = 0
    reached: set[str] = set()  # top-level bundle modules that an eager import runs
    while queue:
        mod, by, kind = queue.pop()
        if kind.endswith("?"):  # `from pkg import name`: a submodule or just a name
            if not finder.exists(mod):
                continue
            kind = kind[:-1]
        top = mod.split(".")[0]
        if not top:
            continue
        if top in stdlib:
            continue
        if top not in bundle_tops:
            if top in target_modules or top in known_missing:
                continue
            (missing if kind == "eager" else soft)[top].append(f"{by} ({kind})")
            continue
        # inside the bundle: walk each package on the way (importing a.b.c runs a, a.b, a.b.c)
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            key = name if kind == "eager" else name + "#soft"
            if name in seen or key in seen:
                continue
            found = finder.find(name)
            if found is None:
                if not finder.exists(name):
                    (missing_internal if kind == "eager" else soft)[name].append(f"{by} ({kind})")
                seen.add(key)
                break
            path, is_pkg = found
            seen.add(key)
            if kind == "eager":
                seen.add(name)
                reached.add(parts[0])
            if path.is_dir():
                continue
            walked += 1
            try:
                uses = module_imports(path.read_text(encoding="utf-8", errors="replace"), name, is_pkg)
            except SyntaxError as e:
                missing_internal[name].append(f"syntax error: {e}")
                continue
            for u in uses:
                child_kind = u.kind if kind == "eager" else ("guarded" if u.kind.startswith("guarded") else "conditional") + ("?" if u.kind.endswith("?") else "")
                queue.append((u.module, name, child_kind))
    owners = top_level_owners(site)
    unreached = sorted({owners.get(t, t) for t in bundle_tops} - {owners.get(t, t) for t in reached})
    return {
        "walked_modules": walked,
        "unreached": unreached,
        "missing": {k: sorted(set(v))[:5] for k, v in sorted(missing.items())},
        "missing_in_bundle": {k: sorted(set(v))[:5] for k, v in sorted(missing_internal.items())},
        "optional": {k: sorted(set(v))[:3] for k, v in sorted(soft.items())},
    }


def install_stand_ins(recipe: Recipe, fetcher: Fetcher, dest: Path) -> Path:
    """The target's own packages that the smoke import needs (typing_extensions, click, ...), at the
    target's versions where known, unpacked beside the bundle (never into it)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in recipe.stand_ins:
        cname = canonicalize_name(name)
        version = recipe.have.get(cname)
        spec = SpecifierSet(f"=={version.public}") if version is not None else SpecifierSet()
        install_wheel(fetcher.fetch(cname, spec), dest, [], {}, log=lambda *_: None)
    fetcher.save()
    return dest


def smoke_import(python: str, paths: list[Path], modules: list[str]) -> tuple[bool, str]:
    code = ("import importlib, sys\nbad = []\nfor m in sys.argv[1:]:\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except Exception as e:\n        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
            "print('\\n'.join(bad) or 'all imported'); sys.exit(1 if bad else 0)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    proc = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, env=env)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def extract_for_check(out: Path, dest: Path) -> Path:
    """Unpack a built bundle here, afresh, with the target's own unpacker, for the import check."""
    unpack = Path(__file__).with_name("offline_unpack.py")
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except FileNotFoundError:
        raise BundleError(f"no bundle at {out} (no manifest.json)") from None
    stash = dest.parent / (dest.name + ".stash")
    for old in (stash, dest):
        if old.exists():
            shutil.rmtree(old)
    cmds = [["--stash", str(stash), *(str(out / p["file"]) for p in manifest["parts"])],
            ["--stash", str(stash), "--extract", str(dest)]]
    for cmd in cmds:
        proc = subprocess.run([sys.executable, str(unpack), *cmd], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BundleError(f"unpacking {out} failed: {proc.stderr.strip()}")
    shutil.rmtree(stash)
    return dest


# ---------------------------------------------------------------------------------------------- cli


def target_import_names(recipe: Recipe) -> set[str]:
    names = set(recipe.target_modules)
    for dist in recipe.have:
        names.update(import_names(dist))
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="offline_bundle.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    default_cache = Path(os.environ.get("OFFLINE_BUNDLE_CACHE", Path.home() / ".cache" / "offline-bundle"))
    for name in ("build", "resolve"):
        p = sub.add_parser(name)
        p.add_argument("recipe", type=Path)
        p.add_argument("--cache", type=Path, default=default_cache, help="wheel cache (default %(default)s)")
        p.add_argument("--find-links", type=Path, action="append", default=[],
                       help="a folder of wheels to use before downloading (repeatable)")
        p.add_argument("--refresh", action="store_true", help="forget earlier picks; ask the index again")
        if name == "build":
            p.add_argument("--out", type=Path, required=True)
            p.add_argument("--codec", choices=["auto", "xz", "zstd"], default=None)
            p.add_argument("--part-mib", type=float, default=None)
    p = sub.add_parser("resplit", help="cut a built bundle into parts of another size (no recompression)")
    p.add_argument("out", type=Path)
    p.add_argument("--part-mib", type=float, required=True)
    p = sub.add_parser("check-imports")
    p.add_argument("recipe", type=Path)
    p.add_argument("--site", type=Path, help="an extracted site tree")
    p.add_argument("--out", type=Path, help="a built bundle to extract first (into OUT.check/)")
    p.add_argument("--smoke-python", help="a Python of the target's version to import the recipe's smoke modules")
    p.add_argument("--cache", type=Path, default=default_cache, help="wheel cache for the smoke stand-ins")
    p.add_argument("modules", nargs="*", help="entry modules (default: the recipe's [check_imports] modules)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "resplit":
            resplit(args.out, args.part_mib)
            return 0
        recipe = load_recipe(args.recipe)
        if args.cmd == "resolve":
            fetcher = Fetcher(recipe.target, args.cache, args.find_links, args.refresh)
            try:
                report_plan(resolve(recipe, fetcher.fetch))
            finally:
                fetcher.save()
            return 0
        if args.cmd == "build":
            build(recipe, args.out, args.cache, args.find_links, args.refresh, args.codec, args.part_mib)
            return 0
        site = args.site
        if site is None:
            if args.out is None:
                raise BundleError("check-imports needs --site DIR or --out BUNDLE_DIR")
            site = extract_for_check(args.out, args.out.parent / (args.out.name + ".check"))
        entries = expand_modules(site, args.modules or recipe.entry_modules)
        result = check_imports(site, entries, target_import_names(recipe), recipe.known_missing)
        print(f"walked {result['walked_modules']} modules from {len(entries)} entry module(s)")
        print("bundled, but no entry module imports it eagerly: " + (", ".join(result["unreached"]) or "none"))
        for top, where in result["optional"].items():
            print(f"  optional (guarded/conditional): {top}  <- {where[0]}")
        for mod, where in result["missing_in_bundle"].items():
            print(f"  MISSING in the bundle (stripped?): {mod}  <- {', '.join(where)}")
        for top, where in result["missing"].items():
            print(f"  MISSING on the target and in the bundle: {top}  <- {', '.join(where)}")
        ok = not result["missing"] and not result["missing_in_bundle"]
        if args.smoke_python and recipe.smoke:
            paths = [site]
            if recipe.stand_ins:
                fetcher = Fetcher(recipe.target, args.cache, [])
                paths.append(install_stand_ins(recipe, fetcher, site.parent / (site.name + ".stand-ins")))
            good, text = smoke_import(args.smoke_python, paths, recipe.smoke)
            print(f"smoke import with {args.smoke_python}: {text}")
            ok = ok and good
        print("import check: " + ("ok" if ok else "FAILED"))
        return 0 if ok else 1
    except BundleError as e:
        print(f"offline_bundle: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
