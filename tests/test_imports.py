"""The package's layering, from its own imports (counting imports inside functions): no cycles; the core
imports no integration, reader, source or preload; an engine half imports no producer and nothing of
preload; and the custodian, the wire and the manifest never import torch. Data flows one way: checkpoint ->
reader -> producer/source -> arena -> daemon -> wire -> client -> engine."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import weightcache

PKG = Path(weightcache.__file__).parent
CORE = {"errors", "key", "digests", "dtypes", "manifest", "packing", "wire", "arena", "daemon", "server", "memwatch", "native_build",
        "integrity", "gpus",
        "handover", "client", "custodian", "sockets", "faults", "progress", "publish"}
ENGINE_HALVES = ("weightcache.integrations.torch", "weightcache.integrations.transformers.engine",
                 "weightcache.integrations.vllm.loader", "weightcache.integrations.vllm.plugin")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: _imports(n, p, known) - {"weightcache"} for n, p in mods.items()}  # the root re-exports lazily


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def _area(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_no_import_cycles_between_modules():
    graph = _graph()
    assert graph["weightcache.cli"], "the import walk found nothing: the test is broken"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_core_imports_no_integration_reader_source_or_preload():
    graph = _graph()
    core = [m for m in graph if _area(m) in CORE]
    assert "weightcache.daemon" in core and "weightcache.custodian.server" in core
    bad = {m: sorted(x for x in _reach(graph, m) if _area(x) not in CORE) for m in core}
    assert not {m: x for m, x in bad.items() if x}


def test_readers_and_sources_import_no_integration_or_preload():
    graph = _graph()
    for m in graph:
        if _area(m) in ("reader", "sources"):
            assert not {x for x in _reach(graph, m) if _area(x) in ("integrations", "preload")}, m
        if _area(m) == "reader":
            assert not {x for x in _reach(graph, m) if _area(x) == "sources"}, m


def test_engine_halves_import_no_producer_and_no_preload():
    graph = _graph()
    for m in ENGINE_HALVES:
        reached = _reach(graph, m)
        assert not {x for x in reached if x.endswith(".producer") or _area(x) in ("preload", "sources", "reader")}, m


def test_integrations_import_no_preload():
    graph = _graph()
    for m in graph:
        if _area(m) == "integrations":
            assert not {x for x in _reach(graph, m) if _area(x) == "preload"}, m


def test_the_layering_checks_can_fail():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _reach({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}


@pytest.mark.parametrize("module", ["weightcache.custodian.server", "weightcache.custodian.client", "weightcache.wire",
                                    "weightcache.manifest", "weightcache.key", "weightcache.sockets"])
def test_torch_free_modules_do_not_import_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"{module} imports torch"
