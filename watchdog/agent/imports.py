"""What the server had imported by the time it served: the next standby's preload list.

`torch-watchdog run` (launcher.py) sets TORCH_WATCHDOG_IMPORTS_FILE in its children's
environment, in a private directory of its own. The agent writes there, once, when the
process first answered a watched call: the names of the modules it had imported by then, in
import order, that a standby may import ahead of time: libraries (the standard library and
site-packages: `transformers`, `timm`, `fastapi`), never the server's own code (a module of
the script's directory, `__main__`) nor the agent's (`torch_watchdog.agent.auto` installs it).
The standby imports them while it waits (launcher.child_main), so a released standby skips
what the server's own imports cost (HF GPT-2's script: `transformers`). Stdlib only.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from typing import Iterable, Mapping, Optional

from torch_watchdog import durable

ENV = "TORCH_WATCHDOG_IMPORTS_FILE"
MAX_NAMES = 20_000  # a server with transformers and fastapi: ~3,000


def library_roots() -> tuple[str, ...]:
    """Where libraries live: the standard library and the site-packages directories."""
    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            roots.add(os.path.realpath(sysconfig.get_paths()[key]))
        except (KeyError, OSError):
            pass
    roots.update(os.path.realpath(p) for p in sys.path if p.rstrip(os.sep).endswith(
        ("site-packages", "dist-packages")))
    return tuple(sorted(r.rstrip(os.sep) + os.sep for r in roots))


def preloadable(modules: Mapping[str, object], roots: Iterable[str]) -> list[str]:
    """The names of `modules` (sys.modules, in import order) that are libraries under `roots`
    (or built in), leaving out the server's code and the agent's own."""
    roots = tuple(roots)
    out = []
    for name, mod in list(modules.items()):
        if mod is None or name in ("__main__", "__mp_main__") or \
                name.startswith("torch_watchdog") or not name.isascii():
            continue
        path = getattr(mod, "__file__", None)
        if path is None:
            if name in sys.builtin_module_names:
                out.append(name)
            continue
        try:
            path = os.path.realpath(path)
        except (OSError, ValueError, TypeError):
            continue
        if path.startswith(roots):
            out.append(name)
        if len(out) >= MAX_NAMES:
            break
    return out


def record(path: Optional[str]) -> Optional[str]:
    """Write the list to `path` (atomically: a reader never sees half of it); None, or why
    it was not written."""
    if not path:
        return None
    names = preloadable(sys.modules, library_roots())
    try:
        durable.write_atomic(path, ("\n".join(names) + "\n").encode(), prefix=".imports.",
                             dir_mode=0o700)
        return None
    except OSError as e:
        return f"{path}: {e.strerror or e}"


def read(path: str, limit: int = 4 << 20) -> list[str]:
    """The names a recording holds ([] when there is none, or it is unreadable)."""
    try:
        fd, _ = durable.open_trusted(path)
    except (OSError, durable.Untrusted):
        return []
    try:
        data = os.read(fd, limit)
    except OSError:
        return []
    finally:
        os.close(fd)
    names = data.decode("ascii", "replace").splitlines()
    return [n for n in names if n and all(p.isidentifier() for p in n.split("."))][:MAX_NAMES]
