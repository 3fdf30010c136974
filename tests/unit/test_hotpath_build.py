"""The install built watch()'s C hot path (test_timing.py runs every test on it and on the
Python path; where it is missing those runs skip, and this test says why)."""
import functools

import pytest
import torch  # noqa: F401  (watch() needs it)

from torch_watchdog import pure_python
from torch_watchdog.agent.wrapper import watch


def test_the_c_hot_path_is_built_here():
    """`pip install -e .` builds _hotpath.c (optional: without a compiler the install goes on);
    here, with gcc and the Python headers, a silent failure would leave the slower path."""
    if pure_python():
        pytest.skip("TORCH_WATCHDOG_PURE_PYTHON is set")
    from torch_watchdog.agent import _hotpath  # an ImportError here: not built

    f = watch(lambda x: x, name="m")
    assert isinstance(functools.partial.__dict__["func"].__get__(f), _hotpath.Hot)
