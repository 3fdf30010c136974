"""watch()'s hot path in C (watchdog/agent/_hotpath.c), the one part of the build that
pyproject.toml cannot declare without a setuptools warning at each install. Optional: where it
cannot be built (no C compiler or Python headers, a free-threaded CPython) the install goes on
and agent/calls.py's Python path serves every call."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("torch_watchdog.agent._hotpath", ["watchdog/agent/_hotpath.c"],
                             optional=True)])
