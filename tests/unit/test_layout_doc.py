"""docs/layout.md names every module of the package (it went stale: the core's list lacked
horizons, labels and views, present/'s lacked units). Issue 53, item 4."""
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def modules() -> list[str]:
    out = []
    for folder, dirs, files in os.walk(os.path.join(ROOT, "watchdog")):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        out += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files
                if (f.endswith(".py") and f != "__init__.py") or f.endswith(".c")]
    return sorted(out)


def test_every_module_is_named_in_the_layout():
    with open(os.path.join(ROOT, "docs", "layout.md")) as fh:
        named = set(re.findall(r"`([\w./]+)`", fh.read()))
    found = modules()
    assert len(found) > 80  # the walk found the package
    missing = [m for m in found if os.path.basename(m) not in named
               and os.path.splitext(os.path.basename(m))[0] not in named]
    assert not missing, f"docs/layout.md does not name {missing}"
