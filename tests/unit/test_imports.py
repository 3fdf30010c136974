"""The package's import graph has no cycles (module-level and function-level imports alike),
and the core imports no I/O (no sources, actions, presenters, daemon). That importing
torch_watchdog pulls in nothing heavy, in a fresh interpreter:
tests/integration/test_imports_process.py."""
import ast
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "watchdog")


def modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith((".py", ".c")):  # .c: an extension module (agent/_hotpath.c)
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-2 if f.endswith(".c")
                                                                     else -3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(["torch_watchdog", *rel])] = os.path.join(folder, f)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        if path.endswith(".c"):
            continue
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level
                                                       + 1] + ([base] if base else []))
                # `from pkg import mod` needs mod; `from pkg import name` needs pkg itself
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                         for a in node.names]
            for name in names:
                if name in mods and name != mod:
                    edges[mod].add(name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    assert cycles(graph()) == []


def room(module: str) -> str:
    """The package a module belongs to, two levels down (`torch_watchdog.sidecar.core` for
    `torch_watchdog.sidecar.core.correlate.memory`); a module at that level is its own room
    (`torch_watchdog.sidecar.config`, `torch_watchdog.events`)."""
    return ".".join(module.split(".")[:3])


def rooms(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, targets in edges.items():
        out.setdefault(room(mod), set()).update(room(t) for t in targets if room(t) != room(mod))
    for targets in list(out.values()):
        for t in targets:
            out.setdefault(t, set())
    return out


def test_no_package_imports_itself_through_others():
    """The sidecar's rooms in pipeline order: sources -> core -> actions -> presenters; a
    source that imports an action (discovery once took the process identity from actions)
    makes two rooms one."""
    assert cycles(rooms(graph())) == []


def test_the_core_reads_no_source_and_acts_on_nothing():
    io = ("torch_watchdog.sidecar.sources", "torch_watchdog.sidecar.actions",
          "torch_watchdog.sidecar.present", "torch_watchdog.sidecar.daemon",
          "torch_watchdog.sidecar.offline", "torch_watchdog.agent")
    bad = {m: sorted(t for t in ts if t.startswith(io))
           for m, ts in graph().items() if m.startswith("torch_watchdog.sidecar.core")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_the_core_reads_the_config_schema_alone():
    """The core decides on config values; reading a file (config.loading) and checking the
    host (config.files) are the daemon's and the CLI's. The package's face loads those two
    only when their names are first asked for."""
    face = "torch_watchdog.sidecar.config"
    bad = {m: sorted(t for t in ts if t.startswith(face) and t != f"{face}.schema")
           for m, ts in graph().items() if m.startswith("torch_watchdog.sidecar.core")}
    assert {m: t for m, t in bad.items() if t} == {}
    from torch_watchdog.sidecar import config
    from torch_watchdog.sidecar.config import files, loading
    assert config.load is loading.load and config.host_problems is files.host_problems
    with pytest.raises(AttributeError, match="no attribute 'lod'"):
        config.lod  # noqa: B018


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_checker_sees_a_cycle_between_packages():
    edges = {"t.s.sources.discovery": {"t.s.actions.identity"},
             "t.s.actions.reloading": {"t.s.sources.discovery"}, "t.s.actions.identity": set()}
    assert cycles(rooms(edges)) == [["t.s.actions", "t.s.sources"]]



def test_the_offline_tools_import_none_of_the_steps_state():
    """replay and report once walked the host model (core/host.py) and the servers'
    correlation and policy states; they read the step's views (core/views.py) now. The
    reads themselves: tests/unit/test_offline_views.py."""
    deep = tuple(f"torch_watchdog.sidecar.core.{m}" for m in ("host", "correlate", "policy"))
    bad = {m: sorted(t for t in ts if t.startswith(deep)) for m, ts in graph().items()
           if m.startswith("torch_watchdog.sidecar.offline")}
    assert {m: t for m, t in bad.items() if t} == {}
