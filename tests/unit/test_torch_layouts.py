"""What each torch release writes for a graph break and a recompile-limit hit (copied from
`TORCH_LOGS=graph_breaks` runs of PyPI's builds), and what the agent makes of it: the user's
file:line and the cause, on every layout; FX-cache numbers with and without per-compile fields.
No torch calls: these hold whatever torch is installed."""
from __future__ import annotations

import collections
import logging
from types import SimpleNamespace

import pytest

from torch_watchdog.agent.hooks import TorchHooks, graph_break_details, is_limit_hit


class Unsupported(Exception):  # torch._dynamo.exc.Unsupported: the 2.4 cause, in exc_info
    def __init__(self, msg: str):
        super().__init__(msg)
        self.msg = msg


V2_4 = ('Graph break: from user code at:\n'
        '  File "/srv/app.py", line 4, in f\n'
        '    print("", end="")\n')
V2_4_EXC = Unsupported("builtin: print [<class 'torch._dynamo.variables.constant."
                       "ConstantVariable'>] True")

V2_6 = ("Graph break in user code at /srv/app.py:4\n"
        "Reason: Unsupported: builtin: print [<class 'torch._dynamo.variables.constant."
        "ConstantVariable'>] True\n"
        "User code traceback:\n"
        '  File "/srv/app.py", line 7, in <module>\n'
        '    torch.compile(f, backend="eager")(torch.ones(3))\n'
        '  File "/srv/app.py", line 4, in f\n'
        '    print("", end="")\n')

V2_13 = ("Graph break in user code at /srv/app.py:4\n"
         "Graph Break Reason: Encountered graph break when attempting to trace CALL: a function "
         "call, e.g. f(x, y):\n"
         "\n"
         "Failed to trace builtin operator\n"
         "  Explanation: Dynamo does not know how to trace builtin operator `print` with "
         "argument types ['str'] (has_kwargs True)\n"
         "  Hint: Avoid calling builtin `print` with argument types ['str']. Consider using an "
         "equivalent alternative function/method to `print`.\n"
         "\n"
         "  Developer debug context: builtin print [<class 'torch._dynamo.variables.constant."
         "ConstantVariable'>] True\n"
         "\n"
         " For more details about this graph break, please visit: https://example.invalid/gb0059\n"
         "\n"
         "User code traceback:\n"
         '  File "/srv/app.py", line 7, in <module>\n'
         '    torch.compile(f, backend="eager")(torch.ones(3))\n'
         '  File "/srv/app.py", line 4, in f\n'
         '    print("", end="")\n')


@pytest.mark.parametrize("text, exc, cause", [
    (V2_4, V2_4_EXC, "Unsupported: builtin: print [<class"),
    (V2_6, None, "Unsupported: builtin: print [<class"),
    (V2_13, None, "Failed to trace builtin operator: Dynamo does not know how to trace builtin "
                  "operator `print`"),
], ids=["2.4", "2.6", "2.13"])
def test_graph_break_names_the_users_line_and_the_cause(text, exc, cause):
    reason, location = graph_break_details(text, exc)
    assert location == "/srv/app.py:4"  # the line that broke, not the caller's line 7
    assert reason.startswith(cause)
    assert "\n" not in reason and "Encountered graph break" not in reason


def test_a_graph_break_without_a_known_layout_still_reports_its_first_line():
    reason, location = graph_break_details("Graph break: something new in torch 3")
    assert (reason, location) == ("Graph break: something new in torch 3", None)


def test_a_2_4_graph_break_skip_names_the_innermost_user_frame_not_torch():
    text = ('Graph break: skip: from user code at:\n'
            '  File "/srv/app.py", line 9, in forward\n'
            '    y = self.block(x)\n'
            '  File "/srv/block.py", line 3, in forward\n'
            '    return x.tolist()\n'
            'Traceback (most recent call last):\n'
            '  File "/venv/torch/_dynamo/symbolic_convert.py", line 499, in wrapper\n')
    assert graph_break_details(text)[1] == "/srv/block.py:3"


@pytest.mark.parametrize("fail_reason, hit", [
    ("cache_size_limit reached", True),                    # 2.4 - 2.6
    ("accumulated_cache_size_limit reached", True),
    ("recompile_limit reached", True),                     # 2.7 - 2.9
    ("Dynamo recompile limit exceeded (recompile_limit=8)", True),  # 2.10+
    ("Unsupported: builtin: print", False),
    ("", False),
    (None, False),
])
def test_limit_hits_under_every_name(fail_reason, hit):
    assert is_limit_hit(fail_reason) is hit


# -- FX-graph cache numbers per compile, with and without per-compile metrics fields ---------
def _metrics_class(fx_fields: bool):
    fields = dict(compile_id=None, co_name="forward", co_filename="/srv/m.py",
                  co_firstlineno=3, cache_size=0, fail_reason=None,
                  entire_frame_compile_time_s=0.5)
    if fx_fields:  # 2.6+
        fields.update(inductor_fx_local_cache_hit_count=None,
                      inductor_fx_local_cache_miss_count=None)
    return type("CompilationMetrics", (), fields)


def _hooks(counters):
    torch = SimpleNamespace(_dynamo=SimpleNamespace(
        utils=SimpleNamespace(counters=counters, guard_failures={}),
        config=SimpleNamespace(cache_size_limit=8)))
    got = []
    hooks = TorchHooks(torch, got.append, on_error=lambda e: got.append(e))
    hooks._fx_seen = hooks._fx_counters()
    return hooks, got


def _record(m):
    return logging.LogRecord("torch._utils_internal", logging.INFO, __file__, 1, "%s", (m,), None)


def test_fx_cache_numbers_from_torchs_counters_before_2_6():
    counters = collections.defaultdict(collections.Counter)
    hooks, got = _hooks(counters)
    cls = _metrics_class(fx_fields=False)
    counters["inductor"]["fxgraph_cache_miss"] += 1  # an Inductor compile that missed
    hooks._on_metrics_record(_record(cls()))
    hooks._on_metrics_record(_record(cls()))  # an eager compile: no counter moved
    counters["inductor"].clear()  # torch._dynamo.reset() on some versions
    counters["inductor"]["fxgraph_cache_hit"] += 1
    hooks._on_metrics_record(_record(cls()))
    assert [(e.fx_cache_hits, e.fx_cache_misses) for e in got] == [(0, 1), (None, None),
                                                                   (1, 0)]


def test_per_compile_fields_win_and_an_eager_compile_takes_no_inductor_hit():
    counters = collections.defaultdict(collections.Counter)
    hooks, got = _hooks(counters)
    cls = _metrics_class(fx_fields=True)
    counters["inductor"]["fxgraph_cache_hit"] += 1
    inductor = cls()
    inductor.inductor_fx_local_cache_hit_count, inductor.inductor_fx_local_cache_miss_count = 1, 0
    hooks._on_metrics_record(_record(inductor))
    hooks._on_metrics_record(_record(cls()))  # eager, after: the counters' hit is not its own
    assert [(e.fx_cache_hits, e.fx_cache_misses) for e in got] == [(1, 0), (None, None)]


def test_2_6_metrics_with_empty_fields_fall_back_to_the_counters():
    counters = collections.defaultdict(collections.Counter)
    hooks, got = _hooks(counters)
    counters["inductor"]["fxgraph_cache_hit"] += 1  # 2.6 counts it; its metrics fields stay None
    hooks._on_metrics_record(_record(_metrics_class(fx_fields=True)()))
    assert [(e.fx_cache_hits, e.fx_cache_misses) for e in got] == [(1, 0)]
