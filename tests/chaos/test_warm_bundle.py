"""The warm bundle is read with bounds and checks before its payload (issue 28, item 6): a
link to /dev/zero, a FIFO, or a huge file with someone else's header never blocks or bloats
the server's start; each is skipped with its reason."""
from __future__ import annotations

import json
import os
import resource
import threading
import time

from tests.unit.test_warm import make


def loaded_within(w, seconds: float = 5.0) -> str:
    out: list = []
    worker = threading.Thread(target=lambda: out.append(w.load()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, f"load() blocked for {seconds} s"
    return out[0]


def test_a_link_to_dev_zero_is_not_followed(tmp_path):
    w, _ = make(tmp_path)
    os.makedirs(os.path.dirname(w.path), exist_ok=True)
    os.symlink("/dev/zero", w.path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = loaded_within(w)
    assert "skipped" in line and "link" in line and w.torch.compiler.loaded == []
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB


def test_a_fifo_at_the_bundle_name_does_not_block_the_start(tmp_path):
    w, _ = make(tmp_path)
    os.makedirs(os.path.dirname(w.path), exist_ok=True)
    os.mkfifo(w.path)
    line = loaded_within(w)
    assert "skipped" in line and "not a plain file" in line


def test_a_huge_file_whose_header_is_not_ours_is_refused_before_its_payload_is_read(tmp_path):
    w, _ = make(tmp_path)
    w.note_compile()
    w.save("warm")
    with open(w.path, "rb") as fh:
        header = json.loads(fh.readline())
    header["gpu"] = "another GPU"
    with open(w.path, "wb") as fh:
        fh.write(json.dumps(header).encode() + b"\n")
        fh.truncate(fh.tell() + (512 << 20))  # 512 MiB of payload, sparse
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    line = loaded_within(w)
    assert "skipped" in line and "made for gpu 'another GPU'" in line
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB
    assert time.monotonic() - started < 2.0
    header["gpu"] = w.gpu  # ours, but its size is not what the header says
    with open(w.path, "wb") as fh:
        fh.write(json.dumps(header).encode() + b"\n")
        fh.truncate(fh.tell() + (512 << 20))
    line = loaded_within(w)
    assert "skipped" in line and "after a header that says" in line
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024
