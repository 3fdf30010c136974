import threading
import time

import pytest
import torch

from torch_watchdog import events
from torch_watchdog.agent import crashes, inflight, settings, shapes, wrapper
from torch_watchdog.agent.wrapper import tls
from torch_watchdog.agent.crashes import is_oom
from torch_watchdog.agent.signature import as_shape, shape_signature
from torch_watchdog.agent.wrapper import watch

# torch.OutOfMemoryError from 2.5; torch.cuda's name for the same class on every version
OutOfMemoryError = torch.cuda.OutOfMemoryError

pytestmark = pytest.mark.usefixtures("hot_path")  # every test on the C and the Python path


@pytest.fixture
def emitted():
    got: list[events.Event] = []
    settings.configure(emit=got.append, stall_ns=20_000_000)
    yield got
    settings.reset()


def test_new_shapes_are_flagged_once(emitted):
    f = watch(lambda x: x * 2, name="double")
    for n in (4, 8, 4, 4, 8, 16):
        assert torch.equal(f(torch.ones(n)), torch.ones(n) * 2)
    new = [e for e in emitted if e.kind == "new_shape"]
    assert [e.shape for e in new] == [[[4]], [[8]], [[16]]]
    assert [e.distinct for e in new] == [1, 2, 3] and all(e.name == "double" for e in new)


def stall_now() -> None:
    """In a watched call: the call is a stall, however short. The hot paths time a call on the
    real monotonic clock (the C one reads CLOCK_MONOTONIC itself: no clock to fake), so the
    threshold comes down to 0 instead of the call sleeping past 20 ms. Calls timed for real:
    tests/integration/test_agent_torch.py::test_new_shapes_and_stalls_through_watch."""
    settings.configure(stall_ns=0)


def test_slow_call_is_a_stall_with_its_cause(emitted):
    def slow(x):
        if x.shape[0] == 3:
            tls.activity, tls.activity_ns = "recompile", time.perf_counter_ns()
            stall_now()
        return x

    f = watch(slow, name="m")
    f(torch.ones(2))
    f(torch.ones(3))
    stalls = [e for e in emitted if e.kind == "stall"]
    assert len(stalls) == 1
    assert stalls[0].shape == [[3]] and stalls[0].new_shape and stalls[0].cause == "recompile"
    assert stalls[0].seconds > 0


def test_stall_cause_is_not_borrowed_from_an_earlier_call(emitted):
    tls.activity, tls.activity_ns = "compile", time.perf_counter_ns()
    f = watch(lambda x: stall_now() or x, name="m")
    f(torch.ones(1))
    (stall,) = [e for e in emitted if e.kind == "stall"]
    assert stall.cause is None


def test_signature_covers_kwargs_and_nesting():
    t = torch.Tensor
    sig = shape_signature((torch.ones(2, 3), 5, [torch.ones(4)]),
                          {"mask": torch.ones(2), "ids": torch.ones(1, 7)}, t)
    assert as_shape(sig) == [[2, 3], [4], [2], [1, 7]]  # keywords in call order
    assert as_shape(torch.ones(2, 2).shape) == [[2, 2]]
    assert as_shape(torch.tensor(1.0).shape) == [[]]


def test_kwargs_calls_are_watched(emitted):
    f = watch(lambda input_ids=None, attention_mask=None: input_ids, name="hf")
    f(input_ids=torch.ones(1, 5), attention_mask=torch.ones(1, 5))
    f(input_ids=torch.ones(1, 6), attention_mask=torch.ones(1, 6))
    assert [e.shape for e in emitted if e.kind == "new_shape"] == [
        [[1, 5], [1, 5]], [[1, 6], [1, 6]]]


def test_exceptions_pass_through_unchanged_and_ooms_are_reported(emitted):
    class Boom(Exception):
        """The application's own error."""

    def fail(x):
        raise Boom("mine")

    def cuda_oom(x):
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ... "
                           "cudaErrorMemoryAllocation")

    with pytest.raises(Boom, match="mine"):
        watch(fail)(torch.ones(1))
    assert not [e for e in emitted if e.kind == "oom"]
    with pytest.raises(RuntimeError):
        watch(cuda_oom)(torch.ones(1))
    (oom,) = [e for e in emitted if e.kind == "oom"]
    assert oom.source == "exception" and "cudaErrorMemoryAllocation" in oom.message


def test_oom_already_seen_by_the_allocator_is_not_reported_twice(emitted):
    def observed_oom(x):
        tls.oom_ns = time.perf_counter_ns()
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(OutOfMemoryError):
        watch(observed_oom)(torch.ones(1))
    assert not [e for e in emitted if e.kind == "oom"]


def test_odd_arguments_never_break_the_call(emitted):
    class Odd:
        shape = [1, 2]  # unhashable

    f = watch(lambda x: "ok", name="odd")
    assert [f(Odd()), f(Odd()), f(5), f("text")] == ["ok"] * 4
    assert watch(lambda *a, **k: "ok")(1, [2], {"k": 3}, key=None) == "ok"
    with pytest.raises(TypeError):  # the caller's own mistake still reaches the caller
        f()


def test_is_oom():
    assert is_oom(OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))


def test_wrapper_is_drop_in():
    model = torch.nn.Linear(3, 2)
    w = watch(model, name="lin")
    assert w.weight is model.weight and w.__wrapped__ is model and w.in_features == 3
    assert watch(w) is w
    assert w(torch.ones(1, 3)).shape == (1, 2)
    with pytest.raises(TypeError):
        watch(42)
    assert watch(model).name == "Linear"


def test_windows_count_calls_without_resetting_the_serving_side(emitted):
    f = watch(lambda x: x, name="w")
    for _ in range(7):
        f(torch.ones(1))
    calls, total_ns, stall_calls, stall_ns, distinct = f.take_window()
    assert (calls, stall_calls, distinct) == (7, 0, 1) and total_ns > 0
    f(torch.ones(2))
    assert f.take_window()[0] == 1
    assert f.calls == 8  # running total untouched


def test_shape_memory_is_capped(emitted):
    settings.configure(max_shapes=3)
    f = watch(lambda x: x, name="cap")
    for n in range(1, 10):
        f(torch.ones(n))
    assert len([e for e in emitted if e.kind == "new_shape"]) == 3
    assert f.take_window()[4] == 3


def test_unwatched_runtime_emits_nothing():
    settings.reset()
    f = watch(lambda x: x, name="quiet")
    f(torch.ones(3))  # no agent installed: runs, records, sends nowhere
    assert f.calls == 1
    assert settings.current.emit is settings._discard


def test_remembered_shapes_are_nothing_for_the_gc_to_track(emitted):
    import gc

    f = watch(lambda *a, **k: 0, name="gc")
    for n in range(1, 200):
        f(torch.empty(0, n))
        f(torch.empty(0, n), mask=torch.empty(n))
        f([torch.empty(n), torch.empty(1, n)])
    # a collection untracks a tuple once its items are untracked (torch.Size: never); a nested
    # key may need a pass per level (the young collections of a server give it those long
    # before it could reach the oldest generation)
    for _ in range(3):
        gc.collect()
    assert len(f._h.keys()) == 3 * 199
    assert not [k for k in f._h.keys() if gc.is_tracked(k)]
    assert f(torch.empty(0, 5)) == 0 and f.take_window()[4] == 3 * 199  # a Size finds its key


def test_new_shape_events_are_rationed_but_every_shape_is_counted(emitted, monkeypatch):
    monkeypatch.setattr(shapes, "NEW_SHAPE_BURST", 5)
    monkeypatch.setattr(shapes, "NEW_SHAPE_PER_S", 0)
    f = watch(lambda x: x, name="burst")
    for n in range(1, 21):
        f(torch.empty(0, n))
    new = [e for e in emitted if e.kind == "new_shape"]
    assert [e.distinct for e in new] == [1, 2, 3, 4, 5]
    assert f.take_window()[4] == 20  # the calls event still counts all 20


def test_crash_on_a_nearly_full_gpu_is_an_oom_decision():
    cudnn = ("RuntimeError: Expected mha_graph.execute(handle, variant_pack, "
             "workspace_ptr.get()).is_good() to be true")
    gib = 1 << 30
    assert crashes.crash_is_oom(cudnn, free=2 * gib, total=141 * gib)  # 1.4 % free
    assert not crashes.crash_is_oom(cudnn, free=40 * gib, total=141 * gib)
    assert crashes.crash_is_oom(cudnn, free=None, total=None)  # the query failed: unknown
    for text in ("RuntimeError: CUDA error: an illegal memory access was encountered",
                 "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling "
                 "cublasGemmEx",
                 "RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR",
                 "AcceleratorError: CUDA error: unspecified launch failure",
                 "RuntimeError: cudaErrorLaunchFailure"):
        assert crashes.crash_is_oom(text, free=0, total=141 * gib), text
    for text in ("RuntimeError: shape '[2, 3]' is invalid for input of size 5",
                 "ValueError: bad prompt", "KeyError: 'cuda'"):
        assert not crashes.crash_is_oom(text, free=0, total=141 * gib), text
        assert not crashes.crash_is_oom(text, free=None, total=None), text


class _FakeCuda:
    """torch.cuda as the failed call leaves it: initialised, `free` of `total` bytes free."""

    def __init__(self, free, total, broken=False):
        self.free, self.total, self.broken, self.asked = free, total, broken, []

    def is_initialized(self):
        return True

    def current_device(self):
        return 0

    def mem_get_info(self, device):
        self.asked.append(device)
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.free, self.total


def _crash(x):
    raise RuntimeError("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get())"
                       ".is_good() to be true")


@pytest.mark.parametrize("free, broken, reported", [(10, False, True), (900, False, False),
                                                    (None, True, True)])
def test_crash_on_a_nearly_full_gpu_is_reported_as_an_oom(emitted, monkeypatch, free, broken,
                                                           reported):
    fake = _FakeCuda(free, 1000, broken)
    monkeypatch.setattr(crashes, "_cuda", lambda: fake)
    f = watch(_crash, name="attn")
    with pytest.raises(RuntimeError, match="mha_graph"):
        f(torch.ones(2))
    ooms = [e for e in emitted if e.kind == "oom"]
    assert fake.asked == [0]
    if reported:
        (oom,) = ooms
        assert oom.source == "crash" and "mha_graph" in oom.message and oom.device == 0
        assert (oom.free_bytes, oom.limit_bytes) == ((10, 1000) if not broken else (None, None))
    else:
        assert ooms == []


def test_crash_check_never_initialises_cuda(emitted):
    assert not torch.cuda.is_initialized()
    with pytest.raises(RuntimeError, match="mha_graph"):
        watch(_crash)(torch.ones(2))
    assert not torch.cuda.is_initialized()
    assert not [e for e in emitted if e.kind == "oom"]  # no GPU of ours was full


def test_shapes_past_the_hot_set_are_remembered_once(emitted, monkeypatch):
    monkeypatch.setattr(shapes, "HOT_SHAPES", 4)
    monkeypatch.setattr(shapes, "COLD_SHARD_SHAPES", 3)
    settings.configure(max_shapes=20)
    f = watch(lambda x: x, name="cold")
    for _ in range(3):  # every shape again: each reported once
        for n in range(1, 31):
            f(torch.empty(0, n))
    new = [e for e in emitted if e.kind == "new_shape"]
    assert [e.shape for e in new] == [[[0, n]] for n in range(1, 21)]  # capped at 20
    assert len(f._h.cold) > 1 and f.take_window()[4] == 20


def test_a_full_shape_memory_gives_young_collections_nothing_to_walk(emitted):
    """65,536 remembered shapes: past the hot set, the shapes live in dicts the GC does not
    track (no collection walks them, so none pauses on them), found again exactly."""
    import gc

    f = watch(lambda x: x, name="many")
    xs = [torch.empty(0, n) for n in range(settings.current.max_shapes)]
    for x in xs:
        f(x)
    h = f._h
    assert h.full and f.take_window()[4] == settings.current.max_shapes
    assert len(h.seen) == shapes.HOT_SHAPES and len(h.cold) > 1
    assert not [d for d in h.cold if gc.is_tracked(d)]  # no full collection was needed
    settled = sum(len(d) for d in h.cold)
    assert settled + len(h.fresh) + len(h.seen) == settings.current.max_shapes
    assert len(h.fresh) < 2000  # what waits for its first collection, not the memory
    assert settled > settings.current.max_shapes - shapes.HOT_SHAPES - 2000
    for x in xs[::97]:  # every shape is known, wherever it is kept
        assert not h.unseen(x.shape)
    assert h.unseen(torch.Size([1, 2, 3]))


def test_cold_keys_with_one_hash_are_told_apart(monkeypatch):
    import gc

    monkeypatch.setattr(shapes, "HOT_SHAPES", 1)
    h = shapes._Hot(lambda x: x, torch.Tensor)
    assert hash((-1, 5)) == hash((-2, 5))  # hash(-1) == hash(-2) in CPython
    h.add((7,))  # the hot set
    h.add((-1, 5))
    assert not h.unseen((-1, 5)) and h.unseen((-2, 5))
    h.add((-2, 5))
    gc.collect()  # untracks both; the next add moves them to the cold dicts
    h.add((8,))
    assert not h.fresh & {(-1, 5), (-2, 5)}
    assert sum(len(d) for d in h.cold) + len(h.fresh) == 3
    assert not h.unseen((-1, 5)) and not h.unseen((-2, 5)) and h.unseen((-3, 5))
    assert h.count == 4


def test_with_the_gc_disabled_every_shape_is_still_remembered(emitted, monkeypatch):
    import gc

    monkeypatch.setattr(shapes, "HOT_SHAPES", 4)
    f = watch(lambda x: x, name="nogc")
    gc.disable()
    try:
        for _ in range(2):
            for n in range(1, 41):
                f(torch.empty(0, n))
    finally:
        gc.enable()
    assert len([e for e in emitted if e.kind == "new_shape"]) == 40
    assert f.take_window()[4] == 40 and len(f._h.fresh) == 36  # nothing untracked them


def test_the_hooks_see_the_shape_of_the_call_in_progress_and_none_between_calls():
    seen = []
    inner = watch(lambda m: seen.append(("inner", inflight.current_shape())) or m, name="inner")

    def outer(x, mask=None):
        seen.append(("outer", inflight.current_shape()))
        inner(torch.ones(5))  # a watched model inside a watched model: the innermost call
        seen.append(("after inner", inflight.current_shape()))
        return x

    f = watch(outer, name="outer")
    f(torch.ones(2, 3))
    f(x=torch.ones(4), mask=torch.ones(4, 1))
    assert inflight.current_shape() is None
    assert seen == [("outer", (2, 3)), ("inner", (5,)), ("after inner", (2, 3)),
                    ("outer", ((4,), (4, 1))), ("inner", (5,)), ("after inner", ((4,), (4, 1)))]


def test_another_thread_sees_a_call_in_progress(emitted):
    import threading

    entered, release = threading.Event(), threading.Event()
    f = watch(lambda x: entered.set() or release.wait(10) and x, name="slow")
    t = threading.Thread(target=f, args=(torch.ones(7, 2),))
    t.start()
    try:
        assert entered.wait(10)
        assert inflight.current_shape() == (7, 2)  # what drain's in_flight() reads
    finally:
        release.set()
        t.join(10)
    assert inflight.current_shape() is None


def test_partial_attribute_names_are_the_models():
    class Model:
        args, func, keywords = "model args", "model func", "model keywords"

        def __call__(self, x):
            return x

    f = watch(Model(), name="m")
    assert (f.args, f.func, f.keywords) == ("model args", "model func", "model keywords")
    with pytest.raises(AttributeError):
        watch(lambda x: x, name="plain").args  # a function has none: neither has its wrapper


def test_new_shapes_queued_for_later_make_the_same_events():
    import gc

    from torch_watchdog.agent.emitter import LATER

    def calls(f):
        f(torch.ones(2, 3))
        f(torch.ones(()))
        f(x=torch.ones(4), mask=torch.ones(4, 1))
        f(torch.ones(1), [torch.ones(2), torch.ones(3)], None)

    eager, later = [], []
    try:
        settings.configure(emit=eager.append)
        calls(watch(lambda *a, **k: None, name="m"))
        settings.configure(emit=eager.append, emit_later=later.append)
        calls(watch(lambda *a, **k: None, name="m"))
    finally:
        settings.reset()
    gc.collect()
    assert not [item for item in later if gc.is_tracked(item)]
    built = [LATER[item[0]](*item[1:]) for item in later]
    strip = [(e.name, e.shape, e.distinct) for e in eager]
    assert [(e.name, e.shape, e.distinct) for e in built] == strip
    assert strip[0][1] == [[2, 3]] and strip[1][1] == [[]] and strip[3][1] == [[1], [2], [3]]


def test_two_keyword_arguments_reach_the_model_as_they_came(emitted):
    f = watch(lambda **k: k, name="kw")
    x, m = torch.ones(2), torch.ones(3)
    assert list(f(x=x, mask=m).items()) == [("x", x), ("mask", m)]
    assert list(f(mask=m, x=x).items()) == [("mask", m), ("x", x)]  # in the call's order
    f(a=torch.ones(4), b=[torch.ones(5), torch.ones(6)])
    f(x=torch.ones(2), mask=torch.ones(3))  # back to the first names: still known
    f(x=torch.ones(2), mask=torch.ones(7))
    assert list(f(**{"input-ids": x, "class": m})) == ["input-ids", "class"]  # no identifiers
    new = [e.shape for e in emitted if e.kind == "new_shape"]
    # the signature is in the call's order, as for any other call
    assert new == [[[2], [3]], [[3], [2]], [[4], [5], [6]], [[2], [7]]]
    assert f.calls == 6 and f.take_window()[4] == 4


def test_a_failing_call_with_two_keywords_raises_what_the_model_raised(emitted):
    boom = ValueError("bad mask")

    def model(input_ids, attention_mask):
        raise boom

    f = watch(model, name="kw")
    with pytest.raises(ValueError) as caught:
        f(input_ids=torch.ones(2), attention_mask=torch.ones(2))
    assert caught.value is boom and f.calls == 1
    with pytest.raises(TypeError):  # a wrong name is the model's TypeError, as unwatched
        f(input_ids=torch.ones(2), mask=torch.ones(2))


def test_a_copied_or_pickled_watched_model_is_watched_on_its_own():
    import copy
    import pickle

    f = watch(torch.nn.Identity(), name="ident")
    f(torch.ones(2))
    for other in (copy.copy(f), copy.deepcopy(f), pickle.loads(pickle.dumps(f))):
        assert isinstance(other, wrapper.Watched) and other.name == "ident"
        x = torch.ones(3)
        assert other(x) is x and other.calls == 1 and other.take_window()[4] == 1
    assert f.calls == 1  # the copies count their own calls
    assert copy.copy(f)._h.fn is f._h.fn and copy.deepcopy(f)._h.fn is not f._h.fn


def test_attributes_are_the_models_and_cannot_be_set_on_the_wrapper():
    model = torch.nn.Linear(2, 2)
    f = watch(model, name="lin")
    assert f.weight is model.weight and vars(f) is vars(model)
    with pytest.raises(AttributeError):
        f.anything = 1
    with pytest.raises(AttributeError):
        f.weight = None  # as before: the wrapper has no attributes of its own to set


def _in_progress(seen, tag):
    return lambda *a, **k: seen.append((tag, inflight.current_shape())) or (a or [None])[0]


def test_nested_calls_on_both_paths_see_the_innermost_shape(hot_path):
    seen = []
    one = watch(_in_progress(seen, "one"), name="one")  # model(x): the C path, where built
    several = watch(_in_progress(seen, "several"), name="several")  # model(x, k): Python's

    def outer_one(x):
        seen.append(("outer_one", inflight.current_shape()))
        several(torch.ones(3), 7)
        seen.append(("back", inflight.current_shape()))
        return x

    def outer_several(x, k):
        seen.append(("outer_several", inflight.current_shape()))
        one(torch.ones(5))
        seen.append(("back", inflight.current_shape()))
        return x

    watch(outer_one, name="a")(torch.ones(2))
    watch(outer_several, name="b")(torch.ones(4), 1)
    three, four = (torch.Size([3]), None), (torch.Size([4]), None)
    assert seen == [("outer_one", (2,)), ("several", three), ("back", (2,)),
                    ("outer_several", four), ("one", (5,)), ("back", four)]
    assert inflight.current_shape() is None and not inflight.calls_in_flight()


@pytest.mark.parametrize("args, kwargs", [((torch.ones(7, 2),), {}),
                                          ((), {"x": torch.ones(7, 2), "m": torch.ones(1)}),
                                          ((torch.ones(7, 2), "text"), {})])
def test_calls_in_flight_on_another_thread_are_counted(args, kwargs):
    entered, release = threading.Event(), threading.Event()
    f = watch(lambda *a, **k: entered.set() or release.wait(10), name="slow")
    t = threading.Thread(target=f, args=args, kwargs=kwargs)
    t.start()
    try:
        assert entered.wait(10)
        assert inflight.calls_in_flight()
        assert inflight.current_shape() is not None
    finally:
        release.set()
        t.join(10)
    assert not inflight.calls_in_flight()
