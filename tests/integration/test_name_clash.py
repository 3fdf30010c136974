"""PyPI's filesystem-events `watchdog` and this project live in one environment, in either
order, and removing one leaves the other working (our import name is `torch_watchdog`)."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
THEIRS = "watchdog==6.0.0"  # pinned: the check is about the name, not a version of theirs

OURS_WORKS = ("import pkgutil, importlib, torch_watchdog as t; "
              "mods = [m.name for m in pkgutil.walk_packages(t.__path__, 'torch_watchdog.')]; "
              "[importlib.import_module(m) for m in mods]; "
              "import torch_watchdog.agent.auto; "
              "assert 'site-packages' in t.__file__, t.__file__; print(len(mods))")
THEIRS_WORKS = ("from watchdog.observers import Observer; "
                "from watchdog.events import FileSystemEventHandler; print('ok')")


def _run(args: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheels")
    ours = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                 str(ROOT)])
    assert ours.returncode == 0, ours.stderr
    theirs = _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                   "--only-binary=:all:", "-d", str(out), THEIRS])
    assert theirs.returncode == 0, theirs.stderr
    return out


def _venv(path: pathlib.Path) -> pathlib.Path:
    """A fresh venv that also sees this test venv's packages (psutil, yaml, torch…) behind its
    own: only the two packages under test are installed into it."""
    # no pip inside (ensurepip costs ~5 s a venv): this venv's pip installs into it (--python)
    assert _run([sys.executable, "-m", "venv", "--without-pip", str(path)]).returncode == 0
    py = path / "bin" / "python"
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    # a path in a .pth file joins sys.path after the venv's own site-packages; the .pth files in
    # it (our editable install's finder) are not run
    pathlib.Path(site.stdout.strip(), "zz_test_deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    return py


def _pip(py: pathlib.Path, *args: str) -> None:
    r = _run([sys.executable, "-m", "pip", "--python", str(py), "-q",
              "--disable-pip-version-check", *args])
    assert r.returncode == 0, r.stderr


def _works(py: pathlib.Path, code: str) -> bool:
    r = _run([str(py), "-c", code], cwd="/")  # not the checkout: its watchdog/ folder is ours
    return r.returncode == 0


@pytest.mark.parametrize("first", ["ours", "theirs"])
def test_both_installed_in_either_order_then_each_removed(tmp_path, wheels, first):
    ours = str(next(wheels.glob("torch_compile_watchdog-*.whl")))
    theirs = str(next(wheels.glob("watchdog-*.whl")))
    order = [ours, theirs] if first == "ours" else [theirs, ours]
    for removed in ("torch-compile-watchdog", "watchdog"):
        py = _venv(tmp_path / f"v-{removed}")
        for wheel in order:
            _pip(py, "install", "--no-deps", "--no-index", wheel)
        assert _works(py, OURS_WORKS) and _works(py, THEIRS_WORKS)
        cli = _run([str(py.parent / "torch-watchdog"), "--version"], cwd="/")
        assert cli.returncode == 0 and "torch-watchdog" in cli.stdout
        _pip(py, "uninstall", "-y", removed)
        if removed == "watchdog":
            assert _works(py, OURS_WORKS) and not _works(py, THEIRS_WORKS)
        else:
            assert _works(py, THEIRS_WORKS) and not _works(py, "import torch_watchdog")
