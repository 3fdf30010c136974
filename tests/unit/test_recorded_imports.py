"""The standby's recorded preload list (agent/imports.py): libraries only, in import order;
never the server's own code nor the agent's; written whole, read back checked."""
import os
import sys
import types

from torch_watchdog.agent import imports


def module(name: str, path=None) -> types.ModuleType:
    m = types.ModuleType(name)
    if path is not None:
        m.__file__ = path
    return m


def test_libraries_are_kept_in_import_order_and_the_servers_code_is_not(tmp_path):
    lib, stdlib, app = tmp_path / "site-packages", tmp_path / "lib", tmp_path / "srv"
    roots = [str(lib) + os.sep, str(stdlib) + os.sep]
    mods = {
        "json": module("json", str(stdlib / "json" / "__init__.py")),
        "transformers": module("transformers", str(lib / "transformers" / "__init__.py")),
        "__main__": module("__main__", str(app / "server.py")),
        "app": module("app", str(app / "app.py")),              # the server's own: loads a model
        "torch_watchdog.agent.auto": module("x", str(lib / "torch_watchdog" / "auto.py")),
        "sys": module("sys"),                                    # built in
        "namespace_pkg": module("namespace_pkg"),                # no file, not built in
        "gone": None,
        "transformers.models.gpt2": module("g", str(lib / "transformers" / "models" / "g.py")),
    }
    assert imports.preloadable(mods, roots) == ["json", "transformers", "sys",
                                                 "transformers.models.gpt2"]


def test_this_interpreters_libraries_are_found():
    names = imports.preloadable(sys.modules, imports.library_roots())
    assert "json" in names and "pytest" in names
    assert not [n for n in names if n.startswith(("torch_watchdog", "tests"))]


def test_a_recording_is_read_back_and_garbage_in_it_is_left_out(tmp_path):
    path = str(tmp_path / "run" / "imports")
    assert imports.record(path) is None
    names = imports.read(path)
    assert "json" in names and "pytest" in names
    assert set(names) <= set(imports.preloadable(sys.modules, imports.library_roots()))
    with open(path, "w") as fh:
        fh.write("json\nos; import evil\n../x\n\nxml.dom\n")
    assert imports.read(path) == ["json", "xml.dom"]
    os.unlink(path)
    os.symlink("/etc/passwd", path)
    assert imports.read(path) == []  # a link is not followed
    assert imports.read(str(tmp_path / "none")) == []
