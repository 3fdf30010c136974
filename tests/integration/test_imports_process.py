"""Importing torch_watchdog and its event schema, in a fresh interpreter, pulls in nothing heavy
(torch, pynvml, prometheus_client, psutil). The import graph: tests/unit/test_imports.py."""
import subprocess
import sys


def test_importing_the_package_and_its_schema_pulls_in_nothing_heavy():
    code = ("import sys, torch_watchdog, torch_watchdog.events; "
            "print(sorted(m for m in ('torch', 'pynvml', 'prometheus_client', 'psutil') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
