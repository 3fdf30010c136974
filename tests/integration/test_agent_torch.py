"""The agent inside a process running real torch.compile (CPU): every hook must report, on
every supported torch (2.4 up; `.ci/torch_matrix.sh` runs these on older ones)."""
from __future__ import annotations

import logging
import os
import re
import time

import pytest
import torch
import torch._dynamo

import torch_watchdog.agent as agent_mod
from torch_watchdog import events
from torch_watchdog.agent import crashes, settings, wrapper


class TinyLM(torch.nn.Module):
    """A real (small) transformer block over (batch, seq) token ids."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.TransformerEncoderLayer(dim, 4, 64, batch_first=True, dropout=0.0)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.block(self.emb(ids)))


TORCH = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
# recompile_limit from 2.7 (cache_size_limit, its old name, stays an alias)
LIMIT = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
         else "cache_size_limit")
# a recompile because the sequence grew from 8 to 12 in (1, seq) ids: torch < 2.6 may name the
# stride guard (stride of dim 0 = seq) that it checks before the size guard
GREW_8_TO_12 = re.compile(r"size mismatch at index 1\. expected 8, actual 12"
                          r"|stride mismatch at index 0\. expected 8, actual 12")


def limit_patch(n: int):
    return torch._dynamo.config.patch(**{LIMIT: n})


def ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq))


@pytest.fixture
def agent(collector, short_tmp):
    torch._dynamo.reset()
    a = agent_mod.install(socket_path=collector.path,
                          event_log=os.path.join(short_tmp, "events.jsonl"),
                          tick_s=0.02, heartbeat_s=0.2, stall_threshold_s=0.004)
    assert a is not None
    yield a
    agent_mod.uninstall()
    torch._dynamo.reset()


def test_recompiles_with_reasons_under_inductor(agent, collector):
    model = TinyLM().eval()
    compiled = torch.compile(model, dynamic=False)
    with torch.no_grad():
        for seq in (8, 12, 16):
            out = compiled(ids(1, seq))
            assert out.shape == (1, seq, 64)
    assert collector.wait(lambda c: len(c.of("recompile")) == 2)
    (first,) = collector.of("compile")
    assert first.compile_id == "0/0" and first.seconds > 0
    reasons = [e.reason for e in collector.of("recompile")]
    assert GREW_8_TO_12.search(reasons[0]), reasons[0]
    assert "expected 12, actual 16" in reasons[1]
    assert [e.compile_id for e in collector.of("recompile")] == ["0/1", "0/2"]
    assert agent.errors == 0


def test_recompile_limit_hit_and_eager_fallback(agent, collector):
    model = TinyLM().eval()
    compiled = wrapper.watch(torch.compile(model, dynamic=False, backend="eager"), name="lm")
    with limit_patch(3), torch.no_grad():
        for seq in (4, 5, 6, 7, 8, 9):
            x = ids(1, seq)
            assert torch.allclose(compiled(x), model(x), atol=1e-5)  # still serves
        assert collector.wait(lambda c: len(c.of("recompile_limit")) == 1)
        time.sleep(0.2)
        (hit,) = collector.of("recompile_limit")  # one hit: warning and metrics deduplicated
        assert hit.limit == 3 and re.search(r"(size|stride) mismatch", hit.reason or "")
        assert len(collector.of("compile")) + len(collector.of("recompile")) == 3
        before = len(collector.events)
        # after the limit: new sizes run eager — no compile, no recompile, still correct
        x = ids(1, 11)
        assert torch.allclose(compiled(x), model(x), atol=1e-5)
        time.sleep(0.2)
        assert not [e for e in collector.events[before:] if e.kind in ("compile", "recompile")]
        assert any(e.shape == [[1, 11]] for e in collector.of("new_shape"))


def test_the_recompile_limit_names_the_watched_module_not_torch_s_wrapper_frame(agent,
                                                                              collector):
    """torch.compile of a torch.nn module runs through torch's own frame `inner`
    (external_utils.py): the limit was reported at "inner (external_utils.py:67)"."""
    model = torch.nn.Linear(4, 4).eval()
    compiled = wrapper.watch(torch.compile(model, dynamic=False, backend="eager"), name="proj")
    with limit_patch(2), torch.no_grad():
        for batch in (1, 2, 3, 4, 5):
            compiled(torch.randn(batch, 4))
        assert collector.wait(lambda c: len(c.of("recompile_limit")) == 1)
    (hit,) = collector.of("recompile_limit")
    assert not hit.function.startswith("inner"), hit.function
    if "external_utils" in hit.function:  # the torch versions that compile a module through it
        assert hit.function.startswith("proj (torch's wrapper frame inner (external_utils.py")


def test_graph_break_reason(agent, collector):
    def f(x):
        x = x + 1
        print("", end="")  # a graph break
        return x * 2

    assert torch.equal(torch.compile(f, backend="eager")(torch.ones(3)), torch.full((3,), 4.0))
    assert collector.wait(lambda c: len(c.of("graph_break")) >= 1)
    (brk,) = collector.of("graph_break")
    # the user's line that broke the graph, and the cause: the builtin print (2.4: "builtin:
    # print [...]"; 2.13: "Failed to trace builtin operator: ... builtin operator `print` ...")
    assert brk.location == f"{__file__}:{f.__code__.co_firstlineno + 2}"
    assert "print" in brk.reason and "Encountered graph break" not in brk.reason


def test_new_shapes_and_stalls_through_watch(agent, collector):
    model = wrapper.watch(torch.compile(TinyLM().eval(), dynamic=False, backend="eager"),
                         name="lm")
    with torch.no_grad():
        for seq in (6, 6, 10, 6, 10):
            model(ids(2, seq))
    assert collector.wait(lambda c: len(c.of("new_shape")) == 2)
    assert [e.shape for e in collector.of("new_shape")] == [[[2, 6]], [[2, 10]]]
    # the first call of each shape compiled: a stall, caused by it (a loaded machine may add
    # slow calls of known shapes too; those are stalls without a compile). The threshold is
    # 4 ms (the fixture's): on a fast 2-core VM torch 2.4.1's warm compile of TinyLM took
    # 18.9-20.3 ms, at the 20 ms it had been, and its first call was then no stall
    new_stalls = [s for s in collector.of("stall") if s.new_shape]
    assert [s.shape for s in new_stalls] == [[[2, 6]], [[2, 10]]]
    assert [s.cause for s in new_stalls] == ["compile", "recompile"]
    assert collector.wait(lambda c: sum(e.calls for e in c.of("calls")) == 5)
    assert collector.of("calls")[-1].distinct_shapes == 2


def test_metrics_deque_wrap_does_not_lose_counts(agent, collector):
    torch._dynamo.utils.set_compilation_metrics_limit(2)  # the real cap is 64 (FACTS #5)
    try:
        f = torch.compile(lambda x: x.sin(), dynamic=False, backend="eager")
        with limit_patch(20):
            for n in range(1, 8):
                f(torch.ones(n))
        assert collector.wait(lambda c: len(c.of("recompile")) == 6)
        assert len(torch._dynamo.utils.get_compilation_metrics()) == 2
    finally:
        torch._dynamo.utils.set_compilation_metrics_limit(64)


def test_callbacks_come_back_after_dynamo_reset(agent, collector):
    handler = torch._dynamo.callback.callback_handler
    torch._dynamo.reset()
    assert agent.hooks._cb_start in handler.start_callbacks
    assert agent.hooks._cb_end in handler.end_callbacks
    # with compilation-metrics logging off the callbacks are the only compile source
    with torch._dynamo.config.patch(log_compilation_metrics=False):
        torch.compile(lambda x: x.cos(), backend="eager")(torch.ones(2))
    assert collector.wait(lambda c: len(c.of("compile")) == 1)


def test_hooks_survive_set_logs(agent, collector):
    torch._logging.set_logs(dynamo=logging.ERROR)  # resets every torch logger's level
    try:
        time.sleep(0.2)  # a few agent ticks heal the taps

        def f(x):
            x = x.tan()
            print("", end="")
            return x

        torch.compile(f, backend="eager")(torch.ones(2))
        assert collector.wait(lambda c: len(c.of("graph_break")) >= 1, 3)
    finally:
        torch._logging.set_logs()


def test_malformed_callback_and_log_arguments_never_raise(agent, collector):
    hooks = agent.hooks
    garbage = [None, object(), "CUDAGRAPH_RECORDING", 42,
               type("Args", (), {"callback_trigger": "x", "compile_id": None})()]
    for g in garbage:
        hooks._cb_start(g)
        hooks._cb_end(g)
    lg = logging.getLogger("torch._inductor.cudagraph_trees.__cudagraphs")
    lg.info("Recording cudagraph tree for symint key %s", object())
    lg.info("Recording cudagraph tree for symint key %s")
    logging.getLogger("torch._utils_internal").info("%s", {"not": "metrics"})
    logging.getLogger("torch._utils_internal").info(b"bytes message")
    logging.getLogger("torch._dynamo.convert_frame").warning("torch._dynamo hit config.garbage")
    hooks._on_oom("dev", "x", None, 1)
    assert collector.wait(lambda c: len(c.of("recompile_limit")) == 1)
    # the one parseable record became an event with unknowns as None; nothing raised
    assert collector.of("recompile_limit")[0].limit == getattr(torch._dynamo.config, LIMIT)
    warm = collector.of("cudagraph_record")
    assert [w.key for w in warm] == [None, None]


def test_the_2_15_rerecord_limit_warning_is_a_counted_event_naming_its_graph(agent, collector):
    """torch 2.15's only trace of `cudagraph_dynamic_shape_rerecord_limit` being hit: a
    warning_once on the cudagraphs artifact logger (its text and arguments as 2.15.0's
    cudagraph_trees.py logs them); its settings are in the hello's config where torch has
    them."""
    lg = logging.getLogger("torch._inductor.cudagraph_trees.__cudagraphs")
    lg.warning("[%s] %s graph hit cudagraph_dynamic_shape_rerecord_limit=%s; "
               "already-recorded shapes still replay, new shapes run eager.",
               "0/1", "inference", 16)
    lg.info("[%s] %s graph hit cudagraph_dynamic_shape_rerecord_limit=%s", "0/2", "x", 1)
    assert collector.wait(lambda c: len(c.of("cudagraph_warning")) >= 1, 5)
    (w,) = collector.of("cudagraph_warning")     # the INFO line is no such warning
    assert (w.rerecord_limit, w.graph) == (16, "0/1 inference")
    assert "already-recorded shapes still replay" in w.message
    config = agent.hooks.compile_config()
    triton = torch._inductor.config.triton
    for name in ("cudagraph_dynamic_shape_rerecord_limit",
                 "cudagraph_initial_mempool_allocation_gb"):
        assert config[f"triton.{name}"] == getattr(triton, name, None)


def test_recompile_guard_stops_recompiles(collector, short_tmp):
    torch._dynamo.reset()
    a = agent_mod.install(socket_path=collector.path, tick_s=0.02, recompile_guard_after=2)
    try:
        f = torch.compile(lambda x: x * 3, dynamic=False, backend="eager")
        for n in (1, 2, 3):
            f(torch.ones(n))
        assert collector.wait(lambda c: len(c.of("mitigation")) == 1)
        (m,) = collector.of("mitigation")
        if TORCH < (2, 6):  # no set_stance: the guard says so, recompiles go on
            assert (m.name, m.action) == ("recompile_guard", "unavailable")
            f(torch.ones(4))
            assert collector.wait(lambda c: len(c.of("recompile")) == 3)
            return
        assert (m.name, m.action) == ("recompile_guard", "engaged")
        for n in (4, 5, 6):
            assert torch.equal(f(torch.ones(n)), torch.full((n,), 3.0))
        time.sleep(0.2)
        assert len(collector.of("recompile")) == 2  # none after the guard engaged
    finally:
        agent_mod.uninstall()
        if hasattr(torch.compiler, "set_stance"):
            torch.compiler.set_stance("default")
        torch._dynamo.reset()
    assert a.guard.engaged


def test_graph_budget_eager_mode_routes_novel_shapes(collector):
    torch._dynamo.reset()
    a = agent_mod.install(socket_path=collector.path, tick_s=0.02, graph_budget=2,
                          graph_budget_mode="eager")
    try:
        model = wrapper.watch(torch.compile(TinyLM().eval(), dynamic=False, backend="eager"))
        with torch.no_grad():
            model(ids(1, 4))
            model(ids(1, 5))
            # on a GPU the cudagraph log reports each new size key; here we report two
            a.budget.note_key(4)
            a.budget.note_key(5)
            assert collector.wait(lambda c: len(c.of("mitigation")) == 1)
            compiles = len(collector.of("compile")) + len(collector.of("recompile"))
            out = model(ids(1, 9))  # novel: eager, no recompile
            assert out.shape == (1, 9, 64)
            model(ids(1, 4))  # known: still compiled code
            time.sleep(0.2)
            assert len(collector.of("compile")) + len(collector.of("recompile")) == compiles
    finally:
        agent_mod.uninstall()
        torch._dynamo.reset()
    assert settings.current.route_eager is False


def test_install_is_idempotent_and_uninstall_removes_everything(collector):
    torch._dynamo.reset()
    handler = torch._dynamo.callback.callback_handler
    filters_before = {n: list(logging.getLogger(n).filters) for n in (
        "torch._utils_internal", "torch._dynamo.convert_frame")}
    level_before = logging.getLogger("torch._utils_internal").level
    a = agent_mod.install(socket_path=collector.path)
    assert agent_mod.install(socket_path="/elsewhere") is a
    assert a.hooks._cb_start in handler.start_callbacks
    agent_mod.uninstall()
    agent_mod.uninstall()
    assert a.hooks._cb_start not in handler.start_callbacks
    assert "clear" not in vars(handler)
    for name, before in filters_before.items():
        assert logging.getLogger(name).filters == before
    assert logging.getLogger("torch._utils_internal").level == level_before
    assert agent_mod.current() is None


def test_concurrent_installs_make_one_agent(collector):
    import threading

    torch._dynamo.reset()
    got, barrier = [], threading.Barrier(8)

    def racer():
        barrier.wait()
        got.append(agent_mod.install(socket_path=collector.path))

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(got) == 8 and all(a is got[0] for a in got)
        starts = torch._dynamo.callback.callback_handler.start_callbacks
        assert starts.count(got[0].hooks._cb_start) == 1
        assert len(logging.getLogger("torch._utils_internal").filters) == 1
        assert collector.wait(lambda c: len(c.of("hello")) >= 1)
        time.sleep(0.1)
        assert len(collector.of("hello")) == 1
    finally:
        agent_mod.uninstall()


def test_the_agent_says_hello_at_once_to_a_sidecar_that_restarted(agent, collector):
    """The same hello as its period's (pid, server, watched), then the period runs on from it."""
    from tests.conftest import Collector

    model = wrapper.watch(torch.nn.Linear(4, 4), name="lin")  # noqa: F841 (watched: weak refs)
    assert collector.wait(lambda c: c.of("heartbeat"))
    time.sleep(1.2)  # the path stat'ed at least once: this receiver is the one it knows
    collector.close()
    os.unlink(collector.path)
    new = Collector(collector.path)
    try:
        assert new.wait(lambda c: c.of("hello"), 3)
        (hello,) = new.of("hello")
        assert (hello.pid, hello.server) == (os.getpid(), agent.server)
        assert "lin" in hello.watched
        assert agent._next_hello - time.monotonic() > agent.config.hello_every_s - 5
        assert agent.emitter.receiver_changes == 1
    finally:
        new.close()


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("TORCH_WATCHDOG_ENABLED", "0")
    assert agent_mod.install() is None and agent_mod.current() is None


def test_capabilities_on_this_torch(agent, collector):
    assert collector.wait(lambda c: len(c.of("hello")) >= 1)
    caps = collector.of("hello")[0].capabilities
    # what each torch offers (docs/agent.md, "Supported torch versions"): an agent that
    # misdetects one would stay silent or take a path the running torch does not have
    expected = {
        "compile_callbacks": True,
        "compilation_metrics": True,
        "compile_ids": True,
        "guard_failures": True,
        "recompile_reason": TORCH >= (2, 7),
        "fx_cache_fields": TORCH >= (2, 6),
        "set_stance": TORCH >= (2, 6),
        "cudagraph_capture_sizes": TORCH >= (2, 9),
        "cudagraph_recording_callback": TORCH >= (2, 8),
    }
    assert {k: caps[k] for k in expected} == expected
    assert caps["fx_cache_fields"] or caps["fx_cache_counters"]


def test_drop_reports_stay_rare_with_a_log_and_no_sidecar(short_tmp):
    log = os.path.join(short_tmp, "events.jsonl")
    torch._dynamo.reset()
    agent_mod.install(socket_path=os.path.join(short_tmp, "nobody.sock"), event_log=log,
                      tick_s=0.02, heartbeat_s=0.1)
    try:
        deadline = time.monotonic() + 10

        def kinds() -> list[str]:
            with open(log) as f:
                return [events.decode(line).kind for line in f]

        while (not os.path.exists(log) or kinds().count("heartbeat") < 8) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        agent_mod.uninstall()
    got = kinds()
    # every event was lost on the socket, drop reports included; main logged a report per
    # 0.02 s tick (~40 here), now at most one per heartbeat
    assert got.count("heartbeat") >= 8
    assert 1 <= got.count("dropped") <= got.count("heartbeat")


def test_a_cudnn_crash_on_a_full_gpu_reaches_the_sidecar_as_an_oom(agent, collector,
                                                                   monkeypatch):
    class FullGpu:
        def is_initialized(self):
            return True

        def current_device(self):
            return 0

        def mem_get_info(self, device):
            return 300 << 20, 141 << 30

    def attention(x):
        raise RuntimeError("Expected mha_graph.execute(handle, variant_pack, "
                           "workspace_ptr.get()).is_good() to be true")

    model = wrapper.watch(attention, name="attn")
    monkeypatch.setattr(crashes, "_cuda", FullGpu)  # torch.cuda as a full GPU leaves it
    with pytest.raises(RuntimeError, match="mha_graph"):
        model(torch.ones(1, 8))
    assert collector.wait(lambda c: len(c.of("oom")) == 1)
    (oom,) = collector.of("oom")
    assert (oom.source, oom.device, oom.free_bytes) == ("crash", 0, 300 << 20)
    assert "mha_graph" in oom.message


def test_padding_reaches_the_sidecar_socket_with_its_refusal_and_totals(collector):
    """watch(pad=...) under an installed agent: the plan, the refusal of a model that right
    padding changes, and the per-model totals arrive as events on the socket."""
    from torch_watchdog.agent import pad

    agent_mod.install(socket_path=collector.path, tick_s=0.02, heartbeat_s=0.1)
    try:
        causal = agent_mod.watch(lambda x: x.float().cumsum(1), "causal",
                                 pad=pad.Tokens(buckets=(16,)))
        pooled = agent_mod.watch(lambda x: x.float().mean(1), "pooled",
                                 pad=pad.Tokens(buckets=(16,)))
        for n in (3, 9, 16):
            assert torch.equal(causal(torch.ones(1, n, dtype=torch.long)),
                               torch.arange(1.0, n + 1)[None])
        x = ids(1, 5)
        assert torch.equal(pooled(x), x.float().mean(1))  # refused: the unpadded answer
        assert collector.wait(lambda c: any(e.action == "refused" for e in c.of("mitigation")))
        (refusal,) = [e for e in collector.of("mitigation") if e.action == "refused"]
        assert refusal.model == "pooled" and refusal.error > 0.001
        # totals come with the heartbeats: a heartbeat between two calls sends part of them
        def latest(c):
            return {e.name: e for e in c.of("padding")}
        # (a heartbeat before pooled's call, or between its count and its check's refusal,
        # sends its totals with on=True; the next heartbeat sends on=False: wait for it)
        assert collector.wait(lambda c: {"causal", "pooled"} <= set(latest(c)) and
                              latest(c)["causal"].padding_tokens == (16 - 3) + (16 - 9) and
                              latest(c)["pooled"].calls == 1 and not latest(c)["pooled"].on)
        last = latest(collector)
        assert last["causal"].on and last["causal"].padding_tokens == (16 - 3) + (16 - 9)
        assert not last["pooled"].on
    finally:
        agent_mod.uninstall()



@pytest.mark.skipif(not hasattr(torch._inductor.config.triton, "cudagraph_capture_sizes"),
                    reason="cudagraph_capture_sizes needs torch >= 2.9")
def test_a_graph_budget_met_on_one_serving_thread_holds_on_every_thread():
    """torch keeps a config setting per thread (2.13: a ContextVar): the budget met on one
    serving thread must stop recordings on the others and on threads started later."""
    import threading

    from torch_watchdog.agent.mitigation import GraphBudget

    triton = torch._inductor.config.triton
    said: list = []
    budget = GraphBudget(torch, 2, "auto", said.append)
    seen: dict = {}
    try:
        t = threading.Thread(target=lambda: (budget.note_key(4), budget.note_key(5)))
        t.start()
        t.join()
        later = threading.Thread(target=lambda: seen.update(later=triton.cudagraph_capture_sizes))
        later.start()
        later.join()
        for sizes in (triton.cudagraph_capture_sizes, seen["later"]):
            assert sizes is not None and 4 in sizes and 5 in sizes and 6 not in sizes
        assert [(m.name, m.action) for m in said] == [("graph_budget", "engaged")]
    finally:
        budget.release()
    assert triton.cudagraph_capture_sizes is None


def test_a_freeze_is_restated_to_a_new_sidecar_and_a_budget_is_not():
    from torch_watchdog.agent.mitigation import GraphBudget

    said: list = []
    budget = GraphBudget(torch, 1, "auto", said.append)
    try:
        budget.note_key(4)          # the user's own budget: not the sidecar's to be told of
        budget.restate()
        assert [(m.name, m.action) for m in said] == [("graph_budget", "engaged")]
    finally:
        budget.release()
    said.clear()
    budget = GraphBudget(torch, 0, "auto", said.append)
    try:
        budget.note_key(4)
        budget.note_key(5)
        budget.freeze()
        budget.restate()
        assert [(m.name, m.action) for m in said] == [("freeze", "engaged")] * 2
        assert said[1].detail.startswith("still stopped at 2 sizes")
        budget.unfreeze()
        budget.restate()            # released: nothing to restate
        assert [m.action for m in said] == ["engaged", "engaged", "released"]
    finally:
        budget.release()
