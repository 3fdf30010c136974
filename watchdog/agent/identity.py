"""Which server this process belongs to: the name put in every `hello` (`server`).

A server is a group of processes reloaded together: 8 replicas are 8 servers; a tensor-parallel
job on 8 GPUs, or a gunicorn master and its workers, is one. The sidecar groups processes by
it. In order:
1. `install(server=...)` / `TORCH_WATCHDOG_SERVER` (checked by `check_name`);
2. a Ray Serve replica: `serve:<application>/<deployment>/<rank>`, from Serve's replica
   context (serve.py: the rank is the replica's slot, taken again by its replacement);
3. a rank of a `torch.distributed` job (WORLD_SIZE > 1 in its environment, as torchrun,
   `mp.spawn` launchers and Kubernetes' PyTorchJob set it): the systemd service it runs in,
   else `dist:<MASTER_ADDR>:<MASTER_PORT>` (the job's store, one per job on a host), else
   `torchrun:<TORCHELASTIC_RUN_ID>`. Every rank of the job, whatever its session (torchrun
   starts each rank in a session of its own) and its GPUs: tensor parallel cannot lose a rank;
4. the systemd service the process runs in, from /proc/self/cgroup (`foo.service`), else
   `pgid:<process group>`; then, when CUDA_VISIBLE_DEVICES is set, `/cuda:<its value>`
   (`pgid:7212/cuda:0`). Replicas started by one supervisor with a GPU each are one server per
   GPU set; a master's workers (forked, or spawned by multiprocessing as uvicorn does) inherit
   its environment and its group, so they are its server.
A forked child keeps its master's name (it is resolved once, at install). Stdlib only.
"""
from __future__ import annotations

import hashlib
import os
import sys
from typing import Any, Callable, Mapping, Optional

MAX_NAME_CHARS = 255  # systemd's own bound for a unit name (UNIT_NAME_MAX - 1)
SERVE_PREFIX = "serve:"
CGROUP_FILE = "/proc/self/cgroup"


def check_name(name: str) -> str:
    """An explicit server name, or ValueError with the reason: 1 to 255 printable characters
    (a label in metrics and alerts, and a field of a 64 KiB datagram)."""
    if not isinstance(name, str):
        raise ValueError(f"server: expected a string, got {type(name).__name__}")
    if not name.strip():
        raise ValueError(f"server: expected a name, got {name!r}")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"server: at most {MAX_NAME_CHARS} characters, got {len(name)}")
    if not name.isprintable() or name != name.strip():
        raise ValueError(f"server: expected printable characters without surrounding blanks, "
                         f"got {name!r:.80}")
    return name


def unit_from_path(path: str) -> Optional[str]:
    """The systemd service owning a cgroup path, or None.

    The innermost unit decides: `/system.slice/foo.service/worker` (a delegated sub-group) is
    foo.service; `/user.slice/user-1000.slice/user@1000.service/app.slice/x.service` is x.service
    (a user unit, not the user manager around it); a `.scope` (a login session, a container, a
    terminal tab) is no service even inside user@1000.service; slices and other folders
    (kubepods, docker/<id>) name no unit."""
    for part in reversed([p for p in path.strip().split("/") if p]):
        if part.endswith(".service") and len(part) > len(".service"):
            return part
        if part.endswith(".scope"):
            return None
    return None


def unit_from_cgroup(text: str) -> Optional[str]:
    """The systemd service named in /proc/<pid>/cgroup's content, or None.

    Lines are `id:controllers:path`. cgroup v1 and hybrid hosts have systemd's own tree on the
    `name=systemd` line (on hybrid hosts the `0::` line may be unused, every process at `/`);
    cgroup v2 has only `0::`."""
    v1: Optional[str] = None
    v2: Optional[str] = None
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if "name=systemd" in controllers.split(","):
            v1 = path
        elif hierarchy == "0" and controllers == "":
            v2 = path
    found = v1 if v1 is not None else v2
    return None if found is None else unit_from_path(found)


def _read_cgroup() -> str:
    with open(CGROUP_FILE, encoding="utf-8", errors="replace") as fh:
        return fh.read(64 * 1024)


def _gpus(env: Mapping[str, str]) -> Optional[str]:
    """CUDA_VISIBLE_DEVICES as a name's part, None when unset or empty. A long list of UUIDs
    is hashed so that the name stays within MAX_NAME_CHARS."""
    value = "".join(env.get("CUDA_VISIBLE_DEVICES", "").split())
    if not value:
        return None
    if len(value) > 64 or not value.isprintable():
        return "sha1-" + hashlib.sha1(value.encode("utf-8", "replace")).hexdigest()[:12]
    return value


def distributed_job(env: Mapping[str, str]) -> Optional[str]:
    """The `torch.distributed` job a rank belongs to (`dist:<addr>:<port>`, else
    `torchrun:<run id>`), or None for a process that is no rank of a job of several."""
    try:
        if int(env.get("WORLD_SIZE", "1")) <= 1:
            return None
    except ValueError:
        return None
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if addr and port:
        return _clip(f"dist:{addr}:{port}")
    if run_id and run_id != "none":  # torchrun's default --rdzv-id is "none": no job's own
        return _clip(f"torchrun:{run_id}")
    return None


def _clip(name: str) -> Optional[str]:
    try:
        return check_name(name[:MAX_NAME_CHARS])
    except ValueError:
        return None


def replica_name(context: Any = None) -> Optional[str]:
    """`serve:<application>/<deployment>/<rank>` for `context` (default: this process's
    replica context, if `ray.serve` is loaded and this is a replica), else None: outside a
    replica, or before Serve gave the replica its rank. Never raises."""
    if context is None:
        context = _current_context()
    if context is None:
        return None
    try:
        rank = context.rank
        rank = getattr(rank, "rank", rank)  # a ReplicaRank (its global `rank`), or an int
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            return None
        name = f"{SERVE_PREFIX}{context.app_name}/{context.deployment}/{rank}"
        return check_name(name[:MAX_NAME_CHARS])
    except Exception:
        return None


def _current_context() -> Any:
    serve = sys.modules.get("ray.serve")
    get = getattr(serve, "get_replica_context", None)
    if get is None:
        return None
    try:
        return get()
    except Exception:  # RayServeException: not a replica (a driver that imported ray.serve)
        return None


def server_name(explicit: Optional[str] = None, *,
                env: Optional[Mapping[str, str]] = None,
                read_cgroup: Callable[[], str] = _read_cgroup,
                getpgid: Callable[[int], int] = os.getpgid) -> str:
    """The explicit name, else the rule of the module's docstring. Never raises for the
    automatic part (no /proc, an odd cgroup file, odd variables: the process group)."""
    if explicit:
        return explicit
    replica = replica_name()
    if replica is not None:
        return replica
    env = os.environ if env is None else env
    try:
        unit = unit_from_cgroup(read_cgroup())
        unit = check_name(unit) if unit is not None else None
    except (OSError, ValueError):
        unit = None
    job = distributed_job(env)
    if job is not None:
        return unit or job
    if unit is not None:
        scope = unit
    else:
        try:
            scope = f"pgid:{getpgid(0)}"
        except OSError:
            scope = f"pid:{os.getpid()}"
    gpus = _gpus(env)
    return scope if gpus is None else _clip(f"{scope}/cuda:{gpus}") or scope


def warm_name(server: str, explicit: Optional[str], argv0: str) -> str:
    """The warm bundle's name: one per model, shared by its replicas and restarts: the explicit
    server name, else the systemd service, else the program (`pgid:` and `dist:` names change
    with every start, a GPU part with the replica)."""
    if explicit:
        return explicit
    head = server.split("/", 1)[0]
    if head.endswith(".service"):
        return head
    return os.path.basename(argv0 or "") or "python"
