"""No import cycles among the agent's modules (watchdog/agent/*), counting function-level imports.

    python tests/unit/test_agent_imports.py     # prints every import edge and the cycles found
"""
from __future__ import annotations

import ast
import os
import sys

AGENT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "watchdog", "agent")
PACKAGE = "torch_watchdog.agent"


def modules() -> dict[str, str]:
    """{module name: path} of every Python module of the agent (the package's __init__ too)."""
    out = {}
    for name in sorted(os.listdir(AGENT)):
        if name.endswith(".py"):
            stem = name[:-3]
            out[PACKAGE if stem == "__init__" else f"{PACKAGE}.{stem}"] = os.path.join(AGENT, name)
    return out


def submodules() -> set[str]:
    """Names importable from the package as modules: .py files and C extensions (_hotpath)."""
    return {f"{PACKAGE}.{name.split('.')[0]}" for name in os.listdir(AGENT)
            if name.endswith((".py", ".c")) and not name.startswith("__init__")}


def imports(path: str, own: str, subs: set[str]) -> set[str]:
    """The agent modules that `own` imports anywhere in its file (module level, in functions,
    under `if`), as module names; `from torch_watchdog.agent import x` names the submodule x
    where there is one, else the package itself."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_package = own == PACKAGE
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                parts = (own if is_package else own.rsplit(".", 1)[0]).split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = []
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in subs else base)
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                if target != own:
                    out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    subs = submodules()
    return {name: imports(path, name, subs) for name, path in modules().items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components that hold a cycle (Tarjan), each as a sorted list:
    more than one module, or one that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_read():
    edges = graph()
    assert f"{PACKAGE}.pad" in edges and f"{PACKAGE}.hooks" in edges
    assert edges[f"{PACKAGE}.auto"] == {PACKAGE}  # `from torch_watchdog.agent import install`


def test_no_import_cycles_among_agent_modules():
    assert cycles(graph()) == []


def main() -> int:
    edges = graph()
    short = len(PACKAGE) + 1
    for name in sorted(edges):
        print(f"{name[short:] or '__init__':12s} -> "
              f"{', '.join(sorted(t[short:] or '__init__' for t in edges[name])) or '-'}")
    found = cycles(edges)
    print(f"{len(found)} import cycle(s)" + "".join(
        "\n  " + " <-> ".join(m[short:] or "__init__" for m in c) for c in found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
