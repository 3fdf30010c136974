"""The agent's opt-in padding (agent/pad/): exact for a causal model under a real
torch.compile, refused for a model that right padding changes, outputs sliced back whatever
their container, a plan that only grows, lengths above the plan served as they come."""
import collections
import contextlib
import dataclasses
import random
import time
import weakref
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_watchdog import buckets, events
from torch_watchdog.agent import pad, settings, watch
from torch_watchdog.agent.wrapper import Watched

VOCAB = 53


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, causal=True):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A causal transformer: logits at each position depend on that position and before."""

    def __init__(self, d: int = 32, layers: int = 2, heads: int = 2, max_len: int = 128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def hidden(self, ids, causal=True):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x, causal)
        return self.ln(x)

    def forward(self, ids):
        return self.head(self.hidden(ids))


class MeanPool(TinyGPT):
    """An encoder pooled over every position, with no mask: padding changes its output."""

    def forward(self, ids):
        return self.hidden(ids, causal=False).mean(dim=1)


@pytest.fixture
def emitted():
    got: list[events.Event] = []
    settings.configure(emit=got.append)
    yield got
    settings.reset()


def ids(n: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, n))


def seen(model) -> set:
    """The input shapes the watched (compiled) model itself was called with."""
    inner = model.__wrapped__
    assert isinstance(inner, Watched)
    return {k[0] if isinstance(k, tuple) and k and isinstance(k[0], tuple) else k
            for k in inner._h.keys()}


# -- a real torch.compile ------------------------------------------------------------------
def test_causal_model_padded_by_the_agent_equals_unpadded_and_compiles_two_buckets(emitted):
    torch.manual_seed(0)
    eager = TinyGPT().eval()
    model = watch(torch.compile(eager), "gpt", pad=pad.Tokens(value=0, buckets=(32, 64)))
    lengths = [5, 20, 32, 40, 64, 7, 63]
    with torch.inference_mode():
        for n in lengths:
            x = ids(n)
            out = model(x)
            assert out.shape == (1, n, VOCAB)
            torch.testing.assert_close(out, eager(x), rtol=1e-4, atol=1e-5)
    # the compiled model only ever saw the two buckets: two graphs instead of six lengths
    assert seen(model) == {(1, 32), (1, 64)}
    # a check per bucket at its first call (5, 40), and one at the bucket's most padding (1, 33)
    assert model.on and model.checks == 4 and model.max_error["float32"] < 1e-4
    stats = model.stats()
    assert stats.real_tokens == sum(lengths)
    assert stats.padding_tokens == (32 - 5) + (32 - 20) + (64 - 40) + (32 - 7) + (64 - 63)
    assert stats.recordings_saved == len(set(lengths)) - 2
    assert not [e for e in emitted if e.kind == "mitigation"]


def test_padding_that_changes_the_result_turns_itself_off_with_the_error(emitted):
    torch.manual_seed(0)
    eager = MeanPool().eval()
    model = watch(torch.compile(eager), "pooled", pad=pad.Tokens(buckets=(32,)))
    with torch.inference_mode():
        x = ids(20)
        out = model(x)  # padded to 32, checked, refused: the caller gets the unpadded answer
        torch.testing.assert_close(out, eager(x), rtol=1e-4, atol=1e-5)
        y = ids(12)
        torch.testing.assert_close(model(y), eager(y), rtol=1e-4, atol=1e-5)
    assert not model.on
    (event,) = [e for e in emitted if e.kind == "mitigation"]
    assert (event.name, event.action, event.model) == ("padding", "refused", "pooled")
    assert event.error > pad.TOLERANCE[torch.float32]
    assert "length 20 padded to 32" in event.detail
    # after the refusal the model runs unpadded: it was called with (1, 12) itself
    assert (1, 12) in seen(model)
    assert events.decode(events.encode(event)) == event


# -- outputs of every shape, on plain callables (no compile needed) ---------------------------
class Pair(NamedTuple):
    logits: torch.Tensor
    pooled: torch.Tensor


class FakeModelOutput(collections.OrderedDict):
    """transformers' ModelOutput, as far as padding sees it: a dict with to_tuple(), built
    from keywords, None fields left out."""

    def __init__(self, **fields):
        super().__init__((k, v) for k, v in fields.items() if v is not None)

    def to_tuple(self):
        return tuple(self.values())


WIDTH = 16  # a pooled width equal to a bucket: it must not be sliced


def outputs(kind: str):
    def model(x, attention_mask=None):
        logits = x.float().unsqueeze(-1).expand(*x.shape, 3) + 0.5   # (1, n, 3)
        pooled = torch.full((1, WIDTH), float(x.shape[1] > 0))       # (1, 16), no length
        cache = x.float().view(1, 1, -1, 1).expand(1, 2, x.shape[1], 4)  # length on dim 2
        if kind == "tensor":
            return logits
        if kind == "tuple":
            return (logits, pooled, [cache])
        if kind == "dict":
            return {"logits": logits, "pooled": pooled, "past": (cache,), "none": None}
        if kind == "namedtuple":
            return Pair(logits, pooled)
        return FakeModelOutput(logits=logits, pooled_output=pooled, past_key_values=(cache,),
                               hidden_states=None)
    return model


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict", "namedtuple", "model_output"])
def test_outputs_are_sliced_back_to_the_real_length_in_their_own_types(emitted, kind):
    model = watch(outputs(kind), f"m-{kind}", pad=pad.Tokens(buckets=(WIDTH, 64)))
    want_fn = outputs(kind)
    for n in (5, 9, 40):  # 5: first of bucket 16 (checked), 9: not checked, 40: bucket 64
        x = ids(n)
        got, want = model(x), want_fn(x)
        assert type(got) is type(want)
        assert [p for p, _ in pad.leaves(got)] == [p for p, _ in pad.leaves(want)]
        for (path, a), (_, b) in zip(pad.leaves(got), pad.leaves(want)):
            assert a.shape == b.shape, path
            assert torch.equal(a, b), path
        if kind == "dict":
            assert got["none"] is None
    assert model.on and model.padded_calls == 3 and model.checks == 4  # 5 and 1, 40 and 17


@dataclasses.dataclass
class Plain:  # a dataclass that is no ModelOutput
    logits: torch.Tensor


@pytest.mark.parametrize("kind", ["int", "numpy", "str", "dataclass"])
def test_an_output_padding_cannot_see_is_refused_and_answered_unpadded(emitted, kind):
    """A length inside an int, a numpy array, a string or a plain dataclass would go back
    padded unseen: padding refuses at the first check, with the unpadded answer."""
    def model(x):
        logits = x.float() * 2
        return {"int": lambda: (logits, x.shape[1]), "numpy": lambda: logits.numpy(),
                "str": lambda: (logits, "n" * x.shape[1]), "dataclass": lambda: Plain(logits)
                }[kind]()

    padded = watch(model, f"unseen-{kind}", pad=pad.Tokens(buckets=(16,)))
    x = ids(5)
    got = padded(x)
    want = model(x)
    if kind == "dataclass":
        assert torch.equal(got.logits, want.logits)
    elif kind == "numpy":
        assert got.shape == (1, 5) and (got == want).all()
    else:
        assert got[1] == want[1] and torch.equal(got[0], want[0])
    assert not padded.on
    (event,) = [e for e in emitted if e.kind == "mitigation"]
    assert event.action == "refused" and "padding cannot slice it back" in event.detail


def test_attention_mask_is_extended_with_zeros_and_ids_with_the_pad_value(emitted):
    calls = []

    def model(input_ids, attention_mask):
        calls.append((input_ids.clone(), attention_mask.clone()))
        return input_ids * attention_mask

    padded = watch(model, "masked", pad=pad.Tokens(value=99, buckets=(8,)))
    x, mask = ids(5), torch.ones(1, 5, dtype=torch.long)
    assert torch.equal(padded(input_ids=x, attention_mask=mask), x)
    sent_ids, sent_mask = calls[0]
    assert sent_ids.shape == (1, 8) and sent_ids[0, 5:].tolist() == [99, 99, 99]
    assert sent_mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert torch.equal(sent_ids[:, :5], x)


def test_sequence_keywords_get_their_fills_and_the_decoders_its_own_bucket(emitted):
    sent = []

    def model(**kwargs):
        sent.append({k: v.clone() for k, v in kwargs.items()})
        return kwargs["decoder_input_ids"].float()

    padded = watch(model, "seq2seq", pad=pad.Tokens(value=99, buckets=(4, 8)))
    kw = {"input_ids": ids(5), "attention_mask": torch.ones(1, 5, dtype=torch.long),
          "position_ids": torch.arange(3, 8)[None], "token_type_ids": torch.ones(1, 5).long(),
          "decoder_input_ids": ids(3), "decoder_attention_mask": torch.ones(1, 3).long()}
    assert torch.equal(padded(**kw), kw["decoder_input_ids"].float())
    got = sent[0]  # the padded call: the encoder to 8, the decoder to its own bucket, 4
    assert got["input_ids"][0, 5:].tolist() == [99] * 3
    assert got["attention_mask"][0].tolist() == [1] * 5 + [0] * 3
    assert got["position_ids"][0].tolist() == [3, 4, 5, 6, 7, 7, 7, 7]  # the last, repeated
    assert got["token_type_ids"][0].tolist() == [1] * 5 + [0] * 3
    assert got["decoder_input_ids"][0].tolist()[3:] == [99]
    assert got["decoder_attention_mask"][0].tolist() == [1, 1, 1, 0]
    assert padded.on and padded.padding_tokens == 3 + 1


def test_a_users_own_pad_and_unpad_pair(emitted):
    def length(args, kwargs):
        return args[0].shape[0]

    def pad_fn(args, kwargs, n, bucket):
        return (torch.cat([args[0], args[0].new_zeros(bucket - n)]),), kwargs

    def unpad_fn(out, n, bucket):
        return out[:n]

    got = []
    model = watch(lambda v: got.append(v.shape[0]) or v.cumsum(0), "cumsum",
                  pad=pad.Custom(length, pad_fn, unpad_fn, buckets=(10,)))
    v = torch.arange(1.0, 7.0)
    assert torch.equal(model(v), v.cumsum(0))
    assert got[0] == 10 and model.on


def test_a_padded_call_that_fails_is_served_unpadded_and_that_signature_goes_off(emitted):
    shapes = []

    def picky(x):
        shapes.append(x.shape[1])
        if x.shape[1] == 16:
            raise ValueError("no length 16 here")
        return x + 1

    model = watch(picky, "picky", pad=pad.Tokens(buckets=(16, 24)))
    assert torch.equal(model(ids(14) * 0), torch.ones(1, 14, dtype=torch.long))
    (event,) = [e for e in emitted if e.kind == "mitigation"]
    assert event.action == "signature_off" and "no length 16 here" in event.detail
    assert "[1, 16]" in event.detail and model.on  # that signature only
    shapes.clear()
    assert torch.equal(model(ids(3) * 0), torch.ones(1, 3, dtype=torch.long))
    assert shapes == [3]  # served unpadded at once, not padded first
    assert torch.equal(model(ids(20) * 0), torch.ones(1, 20, dtype=torch.long))
    assert 24 in shapes  # the other bucket is padded still


def test_a_padded_call_that_fails_otherwise_unpadded_raises_the_unpadded_error(emitted):
    def odd(x):
        if x.shape[1] == 16:
            raise ValueError("padded")
        raise TypeError("the caller's, unpadded")

    model = watch(odd, "odd", pad=pad.Tokens(buckets=(16,)))
    with pytest.raises(TypeError):
        model(ids(5))
    (event,) = [e for e in emitted if e.kind == "mitigation"]
    assert event.action == "signature_off" and "TypeError" in event.detail and model.on


# -- the plan -------------------------------------------------------------------------------
def test_lengths_above_the_largest_bucket_run_unpadded(emitted):
    shapes = []
    model = watch(lambda x: shapes.append(tuple(x.shape)) or x, "m",
                  pad=pad.Tokens(buckets=(16,), max_buckets=1))
    model(ids(10))  # padded to 16, then checked: the model itself is the unpadded reference
    model(ids(40))
    # the check of 10, then of 1 (the bucket's most padding), then 40 as it comes
    assert shapes == [(1, 16), (1, 10), (1, 16), (1, 1), (1, 40)]
    assert model.plan == (16,)


def test_the_plan_only_ever_adds_buckets_up_to_the_budget():
    rng = random.Random(3)
    counts: dict = {}
    plan: tuple = (512,)
    for _ in range(6):
        for _ in range(50):
            n = rng.randint(1, 700)
            counts[n] = counts.get(n, 0) + 1
        new = buckets.extend(counts, plan, 2, multiple=8)
        assert set(plan) <= set(new) and len(new) <= len(plan) + 2
        assert new[-1] >= max(counts)  # lengths above the old plan are covered first
        plan = new
    # given the fixed buckets, the added ones are the advisor's optimum (brute force)
    small = {3: 5, 7: 1, 9: 4, 12: 2, 20: 3}
    best = min((buckets.padding(small, sorted({12, 20, *extra})), extra)
               for extra in ((a, b) for a in small for b in small if a < b))
    got = buckets.extend(small, (12, 20), 2)
    assert buckets.padding(small, got) == best[0] and len(got) == 4


def test_the_plan_grows_from_traffic_without_dropping_a_bucket(emitted):
    model = watch(lambda x: x, "plan", pad=pad.Tokens(max_buckets=4))
    plans, deadline = [model.plan], time.monotonic() + 20
    rng = random.Random(1)
    while len(model.plan) < 4 and time.monotonic() < deadline:
        model(ids(rng.randint(1, 100)))
        if model.plan != plans[-1]:
            plans.append(model.plan)
    assert len(model.plan) == 4
    assert all(set(a) <= set(b) for a, b in zip(plans, plans[1:]))
    assert all(b % 8 == 0 for b in model.plan)
    actions = [e.action for e in emitted if e.kind == "mitigation"]
    assert actions[0] == "engaged" and set(actions[1:]) <= {"plan"}


def test_padding_events_carry_the_totals(emitted):
    model = watch(lambda x: x * 2, "stats", pad=pad.Tokens(buckets=(8,)))
    model(ids(5))
    model(ids(8))
    got: list = []
    pad.emit_stats(got.append)
    pad.emit_stats(got.append)  # nothing new: no second event
    (e,) = [e for e in got if e.name == "stats"]
    assert (e.calls, e.padded_calls, e.real_tokens, e.padding_tokens, e.checks) == (2, 2, 13, 3, 2)
    assert events.decode(events.encode(e)) == e


def test_a_refusal_after_the_last_report_is_reported_without_a_new_call(emitted):
    """A heartbeat may send the totals between a call's count and its check's refusal: the
    next heartbeat sends `on` False though no call came since (the sidecar showed padding on,
    CI saw it on torch 2.9.1)."""
    model = watch(lambda x: x * 2, "late_refusal", pad=pad.Tokens(buckets=(8,)))
    model(ids(5))
    got: list = []
    pad.emit_stats(got.append)
    model._refuse("what a check found after the count")  # as the call's own check would
    pad.emit_stats(got.append)
    reports = [e for e in got if e.name == "late_refusal"]
    assert [e.on for e in reports] == [True, False] and reports[-1].calls == 1


def test_watch_without_pad_is_the_plain_watched_wrapper():
    assert type(watch(lambda x: x, "plain")) is Watched  # not the padding wrapper


def test_a_call_without_the_padded_dimension_is_served_as_it_comes(emitted):
    shapes = []
    model = watch(lambda x: shapes.append(tuple(x.shape)) or x, "unbatched",
                  pad=pad.Tokens(buckets=(16,)))
    model(torch.arange(5))  # no dimension 1: not padded, and padding stays on
    assert shapes == [(5,)] and model.on and model.padded_calls == 0


# -- the checks' memory (CheckMemory): which calls are checked after warm-up, the cap -------
def test_sampled_checks_run_only_at_lengths_already_covered_by_a_check(emitted):
    shapes = []

    def model(x, attention_mask):
        shapes.append(x.shape[1])
        return x * 2

    padded = watch(model, "sampled", pad=pad.Tokens(buckets=(64,), sample=1.0, check_share=1.0))
    for n in (20, 30, 10, 20):
        out = padded(ids(n) * 0 + 3, attention_mask=torch.ones(1, n, dtype=torch.long))
        assert torch.equal(out, torch.full((1, n), 6))
    # masked: no check at the bucket's most padding. 20: the bucket's first check; 30: longer
    # than any check so far, not checked (its bucket's first check covers it); 10 and 20:
    # their footprint is covered, checked
    assert shapes == [64, 20, 64, 64, 10, 64, 20]
    stats = padded.stats()
    assert (stats.checks, stats.checks_skipped, stats.checks_stopped) == (3, 1, None)
    assert stats.check_pool is None  # a CPU model: no CUDA pool involved
    assert events.decode(events.encode(stats)) == stats


def test_a_first_check_also_checks_the_bucket_at_its_most_padding(emitted):
    """A model that padding moves by 1e-4 a pad (no mask): within the tolerance at one pad,
    over it at the bucket's most. Refused at the first call, whose answer (one pad) was
    checked and is served."""
    def model(x):
        return x.float() + 0.005 * (x == 0).sum()  # padding (token 0) shifts every output

    padded = watch(model, "widen", pad=pad.Tokens(buckets=(32, 64)))
    x = torch.full((1, 63), 50)
    out = padded(x)
    assert torch.allclose(out, x.float() + 0.005) and not padded.on  # one pad: 1e-4
    (event,) = [e for e in emitted if e.kind == "mitigation"]
    assert "length 33 padded to 64 (the bucket's most padding)" in event.detail


def test_a_checks_own_outputs_do_not_outlive_its_memory_scope(emitted, monkeypatch):
    """What a check's runs allocate is freed inside its scope (a private CUDA pool, deleted at
    its end): a tensor alive past it would keep pool memory the pool cannot give back."""
    made, alive = [], []

    def model(x):
        out = x.float() * 2
        made.append(weakref.ref(out))
        return out

    scope = pad.CheckMemory.scope

    @contextlib.contextmanager
    def watched_scope(self, args, kwargs, n, sampled):
        first = len(made)
        with scope(self, args, kwargs, n, sampled):
            yield
        alive.append([r() is not None for r in made[first:]])

    monkeypatch.setattr(pad.CheckMemory, "scope", watched_scope)
    padded = watch(model, "scoped", pad=pad.Tokens(buckets=(16,)))
    assert torch.equal(padded(ids(9) * 0 + 1), torch.full((1, 9), 2.0))
    # the first check's reference; then the bucket's most padding: padded and unpadded
    assert alive == [[False], [False, False]]


def test_sampled_checks_stay_within_their_share_of_the_time(emitted):
    for share in (0.0, 1.0):
        padded = watch(lambda x, attention_mask: x * 2, f"share-{share}",
                       pad=pad.Tokens(buckets=(64,), sample=1.0, check_share=share))
        for n in (40, 30, 20):
            padded(ids(n), attention_mask=torch.ones(1, n, dtype=torch.long))
        # 40: the signature's first check; 30 and 20: sampled, past a share of 0 skipped
        assert (padded.checks, padded.memory.skipped) == ((1, 2) if share == 0 else (3, 0))


def test_sampled_checks_stop_past_the_cap_with_an_event():
    got = []
    memory = pad.CheckMemory(100, lambda action, detail: got.append((action, detail)))
    memory.longest = 50
    memory.charge(1000, sampled=False)  # a bucket's first check: warm-up, not charged
    memory.charge(60, sampled=True)
    memory.charge(-30, sampled=True)    # a check that freed memory earns nothing back
    assert memory.bound(40) and not got and memory.left == 60
    memory.charge(41, sampled=True)
    assert memory.left == 101 and memory.stopped
    assert got == [("checks_capped", memory.stopped)]
    assert "101 bytes" in memory.stopped and "check_memory_bytes=100" in memory.stopped
    assert not memory.bound(40) and memory.skipped == 1
    memory.charge(500, sampled=True)
    assert len(got) == 1  # one event, not one per check


def test_check_memory_bytes_must_not_be_negative():
    with pytest.raises(ValueError):
        pad.Tokens(check_memory_bytes=-1)


def test_without_a_private_pool_checks_run_in_the_shared_allocator_and_say_so(
        emitted, monkeypatch):
    # a CUDA model on a torch without MemPool, simulated: the check's inputs count as on cuda:0
    # and the allocator's reserved bytes come from a counter the model grows
    reserved = [0]
    monkeypatch.delattr(torch.cuda, "MemPool", raising=False)
    monkeypatch.setattr(pad.CheckMemory, "_device", staticmethod(lambda a, k: 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[0])

    def model(x):
        reserved[0] += 40 * x.shape[1]  # every run leaves memory behind
        return x + 1

    padded = watch(model, "old-torch", pad=pad.Tokens(buckets=(64,), sample=1.0, check_share=1.0,
                                                      check_memory_bytes=2000))
    for n in (50, 40, 30, 20, 10):
        assert torch.equal(padded(ids(n) * 0), torch.ones(1, n, dtype=torch.long))
    stats = padded.stats()
    assert stats.check_pool == "shared" and padded.on
    # 50: the bucket's first check, and 1 (its most padding): neither is charged; sampled
    # checks at 40 (1600 bytes) then 30 (1200: 2800 in all, over 2000) ran; 20 and 10 did not:
    # the cap stopped them
    assert (stats.checks, stats.checks_skipped, stats.check_left_bytes) == (4, 2, 2800)
    actions = [(e.action, e.detail) for e in emitted if e.kind == "mitigation"]
    assert [a for a, _ in actions] == ["check_pool_off", "checks_capped"]
    assert "MemPool is not in this torch" in actions[0][1]
    assert stats.checks_stopped and "2800 bytes" in stats.checks_stopped


def test_a_pool_that_fails_falls_back_to_the_shared_allocator(emitted, monkeypatch):
    monkeypatch.setattr(pad.CheckMemory, "_device", staticmethod(lambda a, k: 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(pad.memory, "pool_unavailable", lambda: None)  # as if this torch had one

    padded = watch(lambda x: x * 3, "bad-pool", pad=pad.Tokens(buckets=(16,)))
    x = ids(5)
    assert torch.equal(padded(x), x * 3)  # the check ran anyway, on CPU tensors
    assert padded.on and padded.checks == 2 and padded.stats().check_pool == "shared"
    (event,) = [e for e in emitted if e.kind == "mitigation"]
    assert event.action == "check_pool_off" and "checks run in the shared allocator" in \
        event.detail


def test_pool_unavailable_on_this_cpu_torch_names_the_reason():
    why = pad.pool_unavailable()  # a CPU build: the thread-scoped hook is a dummy, if present
    assert why is None or "torch" in why
    if not torch.cuda.is_available():
        assert why is not None
