"""The warm bundle (agent/warm.py) with a stand-in for torch.compiler: what is loaded, what is
skipped and why, and that nothing it meets raises into the server."""
from __future__ import annotations

import os
import types
from collections import defaultdict

import pytest

from torch_watchdog.agent.warm import Warm, bundle_name


class FakeCompiler:
    def __init__(self, payload: bytes = b"artifacts-v1", refuse: bool = False):
        self.payload, self.refuse, self.loaded = payload, refuse, []
        self.config = types.SimpleNamespace(job_id=None)

    def save_cache_artifacts(self):
        info = types.SimpleNamespace(artifacts=defaultdict(list, inductor=["k1"], pgo=["k2"]))
        return (self.payload, info) if self.payload else None

    def load_cache_artifacts(self, data: bytes):
        if self.refuse:
            raise RuntimeError("unpickling failed")
        self.loaded.append(data)
        return types.SimpleNamespace(artifacts={"inductor": ["k1"]})


def fake_torch(version: str = "2.13.0", **kw):
    cuda = types.SimpleNamespace(is_initialized=lambda: False)
    return types.SimpleNamespace(__version__=version, compiler=FakeCompiler(**kw), cuda=cuda)


def make(tmp_path, torch=None, name: str = "llm"):
    got = []
    w = Warm(torch or fake_torch(), str(tmp_path / "warm"), name, got.append)
    return w, got


def test_a_saved_bundle_is_loaded_by_the_next_process(tmp_path):
    w, got = make(tmp_path)
    w.note_compile()
    assert w.save("drain") is None
    assert os.path.basename(w.path) == bundle_name("llm", "2.13.0", w.gpu)
    assert not [n for n in os.listdir(tmp_path / "warm") if n.startswith(".warm.")]
    nxt, events = make(tmp_path)
    line = nxt.load()
    assert "loaded" in line and nxt.torch.compiler.loaded == [b"artifacts-v1"]
    assert [(e.action, e.bytes) for e in events] == [("loaded", len(b"artifacts-v1"))]
    assert [e.action for e in got] == ["saved"] and "1 inductor, 1 pgo" in got[0].detail


def test_a_corrupt_bundle_is_skipped_with_a_reason_never_a_crash(tmp_path):
    w, _ = make(tmp_path)
    w.save("warm")
    with open(w.path, "r+b") as fh:  # one payload byte flipped
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0xFF]))
    nxt, events = make(tmp_path)
    assert "corrupt" in nxt.load()
    assert nxt.torch.compiler.loaded == [] and events[0].action == "skipped"
    with open(w.path, "wb") as fh:
        fh.write(b"\x00garbage")
    assert "corrupt header" in make(tmp_path)[0].load()


def test_a_bundle_of_another_torch_is_not_loaded(tmp_path):
    make(tmp_path, fake_torch("2.12.0"))[0].save("warm")
    nxt, events = make(tmp_path, fake_torch("2.13.0"))
    line = nxt.load()
    assert "no bundle for torch 2.13.0" in line and "torch2.12.0" in line
    assert nxt.torch.compiler.loaded == [] and events[0].action == "missing"
    # a bundle renamed to pass for this torch's: its header says otherwise
    os.rename(os.path.join(tmp_path, "warm", bundle_name("llm", "2.12.0", nxt.gpu)), nxt.path)
    assert "made for torch '2.12.0'" in nxt.load() and nxt.torch.compiler.loaded == []


def test_torch_refusing_the_bundle_is_reported_not_raised(tmp_path):
    make(tmp_path)[0].save("warm")
    nxt, events = make(tmp_path, fake_torch(refuse=True))
    assert "torch refused it: RuntimeError" in nxt.load() and events[0].action == "skipped"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_bundle_another_user_wrote_is_not_unpickled(tmp_path):
    w, _ = make(tmp_path)
    w.save("warm")
    os.chown(w.path, 65534, 65534)
    nxt, _ = make(tmp_path)
    assert "owned by uid 65534" in nxt.load() and nxt.torch.compiler.loaded == []


def test_nothing_compiled_keeps_the_bundle_on_disk(tmp_path):
    make(tmp_path)[0].save("warm")
    empty, events = make(tmp_path, fake_torch(payload=b""))
    assert empty.save("drain") is None and events == []
    assert make(tmp_path)[0].load().endswith("1 inductor")


def test_save_is_due_once_compiles_stopped_for_the_quiet_period(tmp_path):
    w, _ = make(tmp_path)
    w.quiet_s = 0.0
    assert not w.due()  # nothing compiled yet
    w.note_compile()
    assert w.due()
    w.save("warm")
    assert not w.due()


def test_job_id_from_the_name_unless_the_user_set_one(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_COMPILE_JOB_ID", raising=False)
    monkeypatch.delenv("TORCH_COMPILE_STICKY_PGO_KEY", raising=False)
    w, _ = make(tmp_path, name="llm.service")
    w.set_job_id()
    assert os.environ["TORCH_COMPILE_JOB_ID"] == "llm.service"
    assert w.torch.compiler.config.job_id == "llm.service"
    monkeypatch.setenv("TORCH_COMPILE_JOB_ID", "mine")
    other, _ = make(tmp_path, name="x")
    other.set_job_id()
    assert os.environ["TORCH_COMPILE_JOB_ID"] == "mine"
    assert other.torch.compiler.config.job_id is None


def test_an_older_torch_gets_no_bundle():
    assert not Warm.supported(types.SimpleNamespace(compiler=types.SimpleNamespace()))
    assert Warm.supported(fake_torch())
