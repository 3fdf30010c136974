"""watch()'s added time on a Python without torch: a stand-in tensor whose `.shape` builds a
tuple subclass (as torch.Size is), against another version's timing.py, in the same batches.

Why: the hot path's cost depends on the interpreter (a functools.partial subclass is called
through vectorcall from CPython 3.12 on, not before), and a CPU torch wheel may exist only for
the Python of the project's virtualenv. Figures: added ns over the bare call, and the ratio of
this tree's to the baseline's; `*_splat` calls through `fn(*args, **kwargs)`.

    python3.12 benchmarks/watch_stand_in.py OLD_TIMING_PY [--batches 80] [--calls 2000]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Size(tuple):
    pass


class Tensor:
    __slots__ = ("_dims",)

    def __init__(self, dims: tuple):
        self._dims = dims

    @property
    def shape(self) -> Size:
        return Size(self._dims)


def trivial(x=None, mask=None):
    return x


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("baseline", help="another version's watchdog/agent/timing.py")
    p.add_argument("--batches", type=int, default=80)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    # the package is named torch_watchdog but lives in watchdog/: import it through a link
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    links = tempfile.mkdtemp()
    os.symlink(os.path.join(root, "watchdog"), os.path.join(links, "torch_watchdog"))
    sys.path.insert(0, links)
    from torch_watchdog.agent import wrapper

    old = load(args.baseline, "baseline_timing")
    x = Tensor((1, 128))
    ours, theirs = wrapper.Watched(trivial, "new", Tensor), old.Watched(trivial, "old", Tensor)

    def one(fn, n):
        for _ in range(n):
            fn(x)

    def kw2(fn, n):
        for _ in range(n):
            fn(x=x, mask=x)

    def one_splat(fn, n, a=(x,), k={}):
        for _ in range(n):
            fn(*a, **k)

    def kw2_splat(fn, n, a=(), k={"x": x, "mask": x}):
        for _ in range(n):
            fn(*a, **k)

    print(f"Python {sys.version.split()[0]}, thread CPU time, median of {args.batches} batches")
    for name, run in (("one_tensor", one), ("two_kwargs", kw2), ("one_tensor_splat", one_splat),
                      ("two_kwargs_splat", kw2_splat)):
        times: dict = {"bare": [], "ours": [], "baseline": []}
        for _ in range(args.batches):
            for key, fn in (("bare", trivial), ("ours", ours), ("baseline", theirs)):
                t0 = time.thread_time_ns()
                run(fn, args.calls)
                times[key].append((time.thread_time_ns() - t0) / args.calls)
        bare, new, base = (statistics.median(times[k]) for k in ("bare", "ours", "baseline"))
        print(f"{name:16s}: bare {bare:6.0f} ns, added {new - bare:6.0f} ns, baseline added "
              f"{base - bare:6.0f} ns: {(new - bare) / (base - bare):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
