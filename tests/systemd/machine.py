"""A Debian bookworm container booted with systemd as its PID 1 (systemd-nspawn), with the
project installed from its wheel and the units of systemd/ as shipped.

The root file system (debootstrap, plus two virtualenvs with the runtime dependencies: the
sidecar's, and the server's with the CPU build of torch) is built once and cached, keyed by
what goes into it; each session boots an overlay of it (writes go to a temporary upper
directory, so the cache stays clean), installs this checkout's wheel, and is powered off at
the end. The host needs no systemd: `--register=no --keep-unit` keep machined out of it.

Commands run inside through `nsenter -t <the container's PID 1> -a`: machined (and so
`systemd-run --machine`, `machinectl shell`) is not there with `--register=no`, and nsenter
needs nothing in the container. A command entered that way is in no unit's cgroup.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
# the root file systems are cached here between sessions (TORCH_WATCHDOG_NSPAWN_CACHE)
CACHE = os.environ.get("TORCH_WATCHDOG_NSPAWN_CACHE", "/var/tmp/torch-watchdog-nspawn")
SUITE = "bookworm"
# polkitd needs a logind (libpam-systemd); procps: /bin/kill, which ExecReload= runs
PACKAGES = ["systemd", "systemd-sysv", "dbus", "libpam-systemd", "polkitd", "procps",
            "python3", "python3-venv"]
SIDECAR_DEPS = ["psutil", "prometheus-client", "pyyaml", "structlog", "nvidia-ml-py", "orjson"]
# the server's environment: the agent's torch (CPU build, as the Makefile pins it) and numpy
TORCH = os.environ.get("TORCH", "torch==2.13.0")
SERVER_DEPS = [TORCH, "numpy", *SIDECAR_DEPS]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NSPAWN = ["systemd-nspawn", "--register=no", "--keep-unit", "--quiet"]


def why_not_capable() -> Optional[str]:
    """None where the suite can run: root, debootstrap, systemd-nspawn, nsenter, overlayfs."""
    if os.geteuid() != 0:
        return "needs root (debootstrap, overlay mounts, systemd-nspawn)"
    for tool in ("debootstrap", "systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install debootstrap systemd-container; .ci/run does)"
    with open("/proc/filesystems") as fh:
        if "overlay" not in fh.read():
            return "needs overlayfs in the kernel"
    return None


def apt_mirror() -> str:
    """The Debian mirror apt already uses on this host (never a name written in the repo)."""
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        with open(path) as fh:
            for line in fh:
                if line.startswith("URIs:") and "security" not in line:
                    return line.split()[1]
    if os.path.exists("/etc/apt/sources.list"):
        with open("/etc/apt/sources.list") as fh:
            for line in fh:
                parts = line.split()
                if parts[:1] == ["deb"] and "security" not in line:
                    return next(p for p in parts[1:] if "://" in p)
    raise RuntimeError("no Debian mirror in apt's configuration (/etc/apt/sources.list*)")


def run(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)}: exit {done.returncode}\n"
                           f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done


def build_wheels(into: str) -> str:
    """This checkout's wheel and the runtime dependencies' wheels, from the host's pip (the
    container has no network); returns the project wheel's path."""
    os.makedirs(into, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    run([*pip, "download", "-d", into, *SERVER_DEPS], timeout=600)
    run([*pip, "wheel", "--no-deps", "-w", into, ROOT], timeout=600)
    (wheel,) = glob.glob(os.path.join(into, "torch_compile_watchdog-*.whl"))
    return wheel


def cached_root(wheels: str) -> str:
    """The cached root file system for these packages and dependency wheels; built (under a
    lock: sessions may run side by side) when missing."""
    deps = sorted(os.path.basename(w) for w in glob.glob(os.path.join(wheels, "*.whl"))
                  if not os.path.basename(w).startswith("torch_compile_watchdog-"))
    key = hashlib.sha256(repr((SUITE, PACKAGES, deps, _recipe())).encode()).hexdigest()[:16]
    root = os.path.join(CACHE, f"root-{key}")
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(root):
            for old in glob.glob(os.path.join(CACHE, "root-*")):  # an earlier recipe's
                shutil.rmtree(old, ignore_errors=True)
            building = tempfile.mkdtemp(prefix="building-", dir=CACHE)
            try:
                run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
                     SUITE, building, apt_mirror()], timeout=900)
                nspawn_sh(building, _recipe(), timeout=600, binds={wheels: "/wheels"})
                os.rename(building, root)
            finally:
                shutil.rmtree(building, ignore_errors=True)
    return root


def _recipe() -> str:
    """The virtualenvs of the cached root: /opt/torch-watchdog (the sidecar's, as docs/sidecar.md
    installs it) and /opt/llm (the server's, with torch), dependencies only."""
    pip = "bin/pip install -q --no-index --find-links /wheels"
    return (f"python3 -m venv /opt/torch-watchdog && /opt/torch-watchdog/{pip} "
            f"{shlex.join(SIDECAR_DEPS)} && python3 -m venv /opt/llm && /opt/llm/{pip} "
            f"{shlex.join(SERVER_DEPS)}")


def nspawn_sh(root: str, script: str, timeout: float, binds: Optional[dict] = None) -> str:
    """Run a shell script in `root` as a plain (not booted) container."""
    bind = [f"--bind-ro={src}:{dst}" for src, dst in (binds or {}).items()]
    return run([*NSPAWN, "-D", root, *bind, "--pipe", "/bin/sh", "-ec", script],
               timeout=timeout).stdout


class Machine:
    """A booted container: `sh()` runs a command inside, as root, in all its namespaces."""

    def __init__(self, base: str, wheels: str):
        self.session = tempfile.mkdtemp(prefix="session-", dir=CACHE)
        self.root = os.path.join(self.session, "merged")
        for d in ("upper", "work", "merged"):
            os.makedirs(os.path.join(self.session, d))
        run(["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={base},upperdir={self.session}/upper,workdir={self.session}/work",
             self.root], timeout=30)
        self.console_path = os.path.join(self.session, "console.log")
        self.proc: Optional[subprocess.Popen] = None
        self.leader: Optional[int] = None
        self.wheels = wheels

    def install(self, files: dict[str, str], script: str) -> None:
        """Before boot: files (container path -> text, mode 0644), then a setup script run
        inside with the wheels at /wheels."""
        for path, text in files.items():
            dest = os.path.join(self.root, path.lstrip("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "w") as fh:
                fh.write(text)
            os.chmod(dest, 0o644)
        nspawn_sh(self.root, script, timeout=300, binds={self.wheels: "/wheels"})

    def boot(self, timeout: float = 90) -> None:
        reap_orphans()
        console = open(self.console_path, "w")
        # a private network: the sidecar's port and the server's stay off the host's
        self.proc = subprocess.Popen([*NSPAWN, "-D", self.root, "-b", "--console=pipe",
                                      "--private-network", f"--machine=tw{os.getpid()}"],
                                     stdin=subprocess.DEVNULL, stdout=console,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while self.leader is None and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited {self.proc.returncode}:\n"
                                   f"{self.console()}")
            self.leader = _child_named(self.proc.pid, "systemd")
            time.sleep(0.2)
        if self.leader is None:
            raise RuntimeError(f"no systemd in the container after {timeout} s:\n{self.console()}")
        state = ""
        while time.monotonic() < deadline:
            state = self.sh("systemctl is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.3)
        if state != "running":
            raise RuntimeError(f"the container's systemd is {state!r}:\n"
                               + self.sh("systemctl --failed --no-pager; journalctl -b "
                                         "--no-pager | tail -80", check=False).stdout)

    def sh(self, script: str, check: bool = True, timeout: float = 60,
           input: Optional[str] = None) -> subprocess.CompletedProcess:
        """A shell script inside the container, as root, with a clean environment."""
        assert self.leader is not None
        done = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "env", "-i",
                               f"PATH={PATH}", "LANG=C.UTF-8", "/bin/sh", "-c", script],
                              capture_output=True, text=True, timeout=timeout, input=input)
        if check and done.returncode != 0:
            raise AssertionError(f"in the container: {script}\nexit {done.returncode}\n"
                                 f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done

    def write(self, path: str, text: str, mode: str = "0644") -> None:
        """A file inside the running container (also under its /run)."""
        q = shlex.quote(path)
        self.sh(f"mkdir -p $(dirname {q}) && cat > {q} && chmod {mode} {q}", input=text)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.sh(f"systemctl show {shlex.quote(unit)} "
                      + " ".join(f"-p {p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str, lines: int = 80) -> str:
        return self.sh(f"journalctl -b -u {shlex.quote(unit)} --no-pager -n {lines}",
                       check=False).stdout

    def console(self) -> str:
        with open(self.console_path, errors="replace") as fh:
            return fh.read()[-6000:]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nspawn: an orderly poweroff of the container
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        subprocess.run(["umount", "-l", self.root], capture_output=True, timeout=30)
        shutil.rmtree(self.session, ignore_errors=True)


def reap_orphans() -> list[int]:
    """Power off the containers that an interrupted run left behind (`--machine=tw<pid>` whose
    pytest is gone): a second booted container answers the first one's tests. Returns their
    nspawn pids."""
    reaped = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"systemd-nspawn"):
            continue
        owner = next((a[len(b"--machine=tw"):] for a in argv if a.startswith(b"--machine=tw")),
                     b"")
        if owner.isdigit() and not os.path.exists(f"/proc/{int(owner)}"):
            pid = int(cmdline.split("/")[2])
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)  # an orderly poweroff, as close() does
                reaped.append(pid)
    for pid in reaped:
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
    return reaped


def _child_named(pid: int, comm: str) -> Optional[int]:
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(task) as fh:
                children = fh.read().split()
            for child in children:
                with open(f"/proc/{child}/comm") as fh:
                    if fh.read().strip() == comm:
                        return int(child)
        except OSError:
            continue
    return None
