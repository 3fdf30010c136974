"""A server's label: the `server` of its metrics and alerts, stable across its restarts and
reloads, and never shared by two servers of the host (pure).

A server's name (core/host.py) is what its config or its agents say. Most names stay over
restarts: a configured one (`servers:`), an explicit one (`install(server=...)`,
`TORCH_WATCHDOG_SERVER`), a Ray Serve replica's (`serve:<app>/<deployment>/<rank>`), a systemd
service's. The automatic names `pgid:N`, `pid:N`, `dist:<addr>:<port>` and `torchrun:<id>`
change with each start, so a dashboard's series would break at every reload: their label is
the server's program instead (its script, `python -m`'s module, or a launcher with its app:
`app.py`, `uvicorn main:app`), from the agent's `hello.argv`, with the rest of the name kept
(`app.py/cuda:0` for `pgid:7212/cuda:0`).

A label, once given, stays with its server (through the host's renames: a reload's new process
group is the same Server). Two servers that would have the same label (two copies of one
script) are told apart by a suffix, `#2`, `#3`, …, given in a fixed order: servers with a live
process first, then those whose name is their label (configured, explicit), then by name. A
server whose processes are all gone gives its exact label up to a new live server asking for
it: the same program started again outside its supervisor.
"""
from __future__ import annotations

import posixpath
from typing import AbstractSet, Mapping, Optional

from torch_watchdog import events
from torch_watchdog.sidecar.core.host import Host, all_gone

MAX_LABEL_CHARS = 255  # the agent's own bound for a server name (agent/identity.py)
# programs that serve an app named by an argument (`uvicorn main:app`): the app is the server
LAUNCHERS = frozenset({"uvicorn", "gunicorn", "hypercorn", "granian", "daphne", "waitress-serve"})
NO_SCRIPT = "python"  # `python -c`, an interactive interpreter


def program(argv: str) -> str:
    """The program of a command line as `sys.argv` joined by spaces (the agent's
    `hello.argv`): the script's file name, `python -m`'s module, a launcher with its app, or
    `python` when there is none (`python -c`, an interactive interpreter)."""
    words = argv.split()
    if not words or words[0].startswith("-"):  # "-c" or "" : no script
        return NO_SCRIPT
    path = words[0]
    name = posixpath.basename(path)
    if name in ("__main__.py", "__init__.py"):  # `python -m pkg`: sys.argv[0] is its file
        name = posixpath.basename(posixpath.dirname(path)) or name
    if name in LAUNCHERS:
        app = next((w for w in words[1:] if ":" in w and not w.startswith("-")), None)
        return f"{name} {app}" if app else name
    return name


def base(name: str, argv: Optional[str]) -> str:
    """The label `name` asks for: itself when it stays over restarts, else its program with the
    rest of the name (`/cuda:…`, `@uid:…`); the name itself while no argv is known (an agent
    older than `argv`, a pid heard before its hello)."""
    if events.per_start(name) is None or not argv:
        return name
    head, sep, rest = name.partition("/")
    uid = head[head.index("@uid:"):] if "@uid:" in head else ""
    return (program(argv) + uid + sep + rest)[:MAX_LABEL_CHARS]


def _asks(label: str, wanted: str) -> bool:
    """`label` is one `wanted` gives: itself or itself with a suffix."""
    if label == wanted:
        return True
    head, sep, n = label.rpartition("#")
    return bool(sep) and head == wanted and n.isdigit()


def assign(wanted: Mapping[str, str], held: Mapping[str, Optional[str]],
           live: AbstractSet[str]) -> dict[str, str]:
    """Server name -> its label, every label different. `wanted`: each server's base; `held`:
    the label it had (None: none yet); `live`: the servers with a live process. A held label
    is kept while it is still one of its base; a gone server's is taken over by a live server
    without a label asking for exactly it."""
    # a name that is its own label (configured, explicit) before a derived one
    order = sorted(wanted, key=lambda n: (n not in live, wanted[n] != n, n))
    asked = {wanted[n] for n in live if n in wanted and held.get(n) is None}
    taken: dict[str, str] = {}  # label -> server
    for n in order:
        label = held.get(n)
        if label is None or not _asks(label, wanted[n]) or label in taken:
            continue
        if n in live or label not in asked:
            taken[label] = n
    out = {n: label for label, n in taken.items()}
    for n in order:
        if n in out:
            continue
        label, i = wanted[n], 2
        while label in taken:
            label, i = f"{wanted[n]}#{i}", i + 1
        taken[label] = n
        out[n] = label
    return out


def relabel(host: Host) -> None:
    """Give every server of `host` its label (Server.label), after a sample: new servers get
    one, a renamed one keeps its own."""
    servers = host.servers.values()
    wanted = {s.name: base(s.name, s.argv) for s in servers}
    held = {s.name: s.label for s in servers}
    if all(label is not None and _asks(label, wanted[n]) for n, label in held.items()) and \
            len(set(held.values())) == len(held):
        return  # the common poll: nothing new
    live = {s.name for s in servers if s.pids and not all_gone(host, s)}
    for name, label in assign(wanted, held, live).items():
        host.servers[name].label = label
