"""The agent never breaks the server: hostile arguments, hostile shapes, failing sinks.

Property-style: every watched call below, over a catalogue of hostile argument objects and
their combinations (positional, keyword, nested, many), must return exactly what the model
returned, and a model that raises must raise the very same exception object, whatever the
bookkeeping around it met.
"""
from __future__ import annotations

import itertools
import logging

import pytest
import torch

from torch_watchdog import events
from torch_watchdog.agent import settings
from torch_watchdog.agent.hooks import LogTap
from torch_watchdog.agent.wrapper import watch

pytestmark = pytest.mark.usefixtures("hot_path")  # on the C and the Python path of watch()

ERRORS = (RuntimeError, KeyError, TypeError, ValueError, AttributeError, IndexError,
          ZeroDivisionError, RecursionError, NotImplementedError)


def _raising_shape(exc_type):
    class ShapeRaises:
        @property
        def shape(self):
            raise exc_type("shape")

    ShapeRaises.__name__ = f"ShapeRaises{exc_type.__name__}"
    return ShapeRaises()


class BadHash:
    def __hash__(self):
        raise RuntimeError("hash")


class CollidesAndRaises:
    """Hashes like the shape (2, 3), then fails the equality check that follows."""

    def __hash__(self):
        return hash((2, 3))

    def __eq__(self, other):
        raise KeyError("eq")


class BadBool:
    def __bool__(self):
        raise RuntimeError("bool")

    def __eq__(self, other):
        return BadBool()

    __hash__ = object.__hash__


class WeirdTuple(tuple):
    def __hash__(self):
        raise ValueError("tuple hash")

    def __iter__(self):
        raise RuntimeError("tuple iter")


def _shape_returning(value):
    class Shaped:
        shape = value

    return Shaped()


class EvilTensor(torch.Tensor):
    """A tensor subclass whose shape cannot be read."""

    @property
    def shape(self):
        raise RuntimeError("evil tensor")


class EvilList(list):
    def __iter__(self):
        raise RuntimeError("list iter")

    def __getitem__(self, i):
        raise RuntimeError("list getitem")


class EvilDict(dict):
    def values(self):
        raise RuntimeError("dict values")


class EvilClass:
    """`isinstance` reads `__class__`: make that raise too."""

    @property
    def __class__(self):
        raise RuntimeError("__class__")


def hostile() -> list:
    objs = [_raising_shape(e) for e in ERRORS]
    objs += [_shape_returning(v) for v in (
        [1, 2], {"a": 1}, {1, 2}, BadHash(), CollidesAndRaises(), BadBool(), WeirdTuple((2, 3)),
        (BadHash(),), ([1],), "shape", None, 10 ** 100, -1, float("nan"), (1.5, 2), object())]
    objs += [torch.ones(2, 3).as_subclass(EvilTensor), EvilList([torch.ones(2)]),
             EvilDict(a=torch.ones(2)), EvilClass(), [torch.ones(2).as_subclass(EvilTensor)],
             {"x": torch.ones(2).as_subclass(EvilTensor)}, (i for i in range(3)),
             [torch.ones(1)] * 10_000, torch.ones(2, 3), 5, "text"]
    return objs


class Sentinel:
    """What the model returns: only this exact object may come back."""


@pytest.fixture(params=["inert", "emitting", "emit_raises"])
def runtime(request):
    got: list[events.Event] = []

    def broken(event):
        raise RuntimeError("emit broke")

    emit = {"inert": settings._discard, "emitting": got.append, "emit_raises": broken}
    # stall_ns=0: every call also takes the slow path (stall events with hostile shapes)
    settings.configure(emit=emit[request.param], stall_ns=0 if request.param != "inert" else
                       50_000_000)
    yield got
    settings.reset()


def _combinations():
    objs = hostile()
    for a in objs:
        yield (a,), {}
        yield (), {"x": a}
        yield (torch.ones(2), a), {"mask": torch.ones(2)}
        yield (), {"input_ids": torch.ones(2), "attention_mask": a}  # two keywords: its own path
        yield (), {"input_ids": a, "attention_mask": torch.ones(2)}
    for a, b in itertools.islice(itertools.permutations(objs, 2), 0, None, 17):
        yield (a, b), {"k": a}
    yield tuple(objs), {f"k{i}": o for i, o in enumerate(objs)}  # many args at once


def test_results_always_come_back_unchanged(runtime):
    out = Sentinel()
    seen_args = []

    def model(*args, **kwargs):
        seen_args.append((args, kwargs))
        return out

    f = watch(model, name="hostile")
    n = 0
    for args, kwargs in _combinations():
        assert f(*args, **kwargs) is out
        got_args, got_kwargs = seen_args[-1]
        assert len(got_args) == len(args) and all(x is y for x, y in zip(got_args, args))
        assert got_kwargs.keys() == kwargs.keys()
        assert all(got_kwargs[k] is v for k, v in kwargs.items())
        n += 1
    assert f.calls == n
    for event in runtime:  # what was reported is valid for the sidecar
        assert events.decode(events.encode(event)) == event


def test_the_models_own_exceptions_come_back_the_same_object(runtime):
    class Mine(Exception):
        pass

    for args, kwargs in _combinations():
        for exc in (Mine("mine"), RuntimeError("CUDA error: out of memory"),
                    RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"), KeyError("k"),
                    KeyboardInterrupt()):
            def model(*a, **k):
                raise exc

            with pytest.raises(type(exc)) as info:
                watch(model, name="raises")(*args, **kwargs)
            assert info.value is exc


def test_generators_are_not_consumed(runtime):
    f = watch(lambda g, *, h=None: (sum(g), sum(h)), name="gen")
    assert f((i for i in range(4)), h=(i for i in range(3))) == (6, 3)


def test_a_torch_function_mode_that_hijacks_shape(runtime):
    class Hijack(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "__get__" or "shape" in repr(func):
                raise RuntimeError("hijacked shape")
            return func(*args, **(kwargs or {}))

    f = watch(lambda x, y=None: "ok", name="mode")
    with Hijack():
        assert f(torch.ones(2)) == "ok"
        assert f(torch.ones(2), y=torch.ones(3)) == "ok"


def test_a_torch_function_mode_whose_shape_is_hostile(runtime):
    """`.shape` of a real tensor answering objects that fail the known-shape checks (equality
    with the last shape, hashing, truth value), on the one-tensor and the keyword paths."""
    values = [BadBool(), BadHash(), CollidesAndRaises(), WeirdTuple((2, 3)), [2, 3],
              torch.Size([2, 3]), (2, 3)]
    answer = iter(itertools.cycle(values))

    class HostileShape(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func == torch.Tensor.shape.__get__:  # reading `.shape`
                return next(answer)
            return func(*args, **(kwargs or {}))

    out = Sentinel()
    f = watch(lambda x=None, mask=None: out, name="hostile-shape")
    x = torch.ones(2, 3)
    with HostileShape():
        for _ in range(3 * len(values)):
            assert f(x) is out
            assert f(x=x, mask=x) is out
    assert f.calls == 6 * len(values)
    for key in f._h.keys():
        assert key in ((2, 3), ((2, 3), (2, 3))), key


def test_routing_to_eager_with_hostile_shapes(runtime):
    class Compiled:
        def __init__(self):
            self._orig_mod = lambda *a, **k: "eager"

        def __call__(self, *a, **k):
            return "compiled"

    settings.configure(route_eager=True)
    f = watch(Compiled(), name="routed")
    for args, kwargs in itertools.islice(_combinations(), 0, None, 5):
        assert f(*args, **kwargs) in ("eager", "compiled")
    assert f(torch.ones(7, 7)) == "eager"  # novel: routed
    settings.configure(route_eager=False)
    assert f(torch.ones(7, 7)) == "compiled"


def test_hostile_shapes_do_not_become_remembered_shapes(runtime):
    f = watch(lambda *a, **k: None, name="mem")
    for args, kwargs in _combinations():
        f(*args, **kwargs)
    for key in f._h.keys():  # only tuples of ints (and None), nothing the GC tracks
        stack = [key]
        while stack:
            item = stack.pop()
            if type(item) is tuple:
                stack.extend(item)
            else:
                assert item is None or type(item) is int, key


# -- logging filters ------------------------------------------------------------------------
class _Odd:
    def __ge__(self, other):
        raise TypeError("no order")


@pytest.mark.parametrize("fn_raises", [False, True])
@pytest.mark.parametrize("on_error_raises", [False, True])
def test_log_filter_never_raises_and_keeps_the_verdict(fn_raises, on_error_raises):
    def fn(record):
        if fn_raises:
            raise RuntimeError("tap broke")

    def on_error(e):
        if on_error_raises:
            raise RuntimeError("on_error broke")

    name = f"tw.chaos.{fn_raises}.{on_error_raises}"
    logger = logging.getLogger(name)
    logger.setLevel(logging.WARNING)
    tap = LogTap(name, logging.DEBUG, fn, on_error)
    tap.attach()
    try:
        info = logger.makeRecord(name, logging.INFO, __file__, 1, "m", (), None)
        warn = logger.makeRecord(name, logging.WARNING, __file__, 1, "m", (), None)
        assert tap.filter(info) is False  # below the level the app set: hidden, as before
        assert tap.filter(warn) is True
        odd = logger.makeRecord(name, logging.WARNING, __file__, 1, "m", (), None)
        odd.levelno = _Odd()  # a hand-made record whose level cannot be compared
        assert tap.filter(odd) is True  # what no filter of ours would have said
        del odd.levelno
        assert tap.filter(odd) is True
        logger.warning("through logging itself %s", 1)  # nothing raised
        logger.info("hidden %s", 1)
    finally:
        tap.detach()
