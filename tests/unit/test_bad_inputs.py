"""Every command that reads a file, given one it cannot use: exit 2, one line on stderr naming
the file and what is wrong, no traceback (what a user passing the wrong file sees)."""
from __future__ import annotations

import gzip
import os
import random

import pytest

from torch_watchdog import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "h200-oom300.jsonl.gz")


def _gzip_of(text: str) -> bytes:
    return gzip.compress(text.encode())


def _truncated_gzip() -> bytes:
    with open(FIXTURE, "rb") as fh:
        data = fh.read()
    return data[: len(data) // 2]  # a copy cut short: 1,602 good lines, then the end


NOISE = random.Random(0).randbytes(4096)

# input kind -> (file name, content: bytes, or None for a directory, or "missing");
# each paired with what the message must say (for the log readers, for the config readers)
INPUTS = {
    "missing": ("missing.jsonl", "missing", "no such file", "no such file"),
    "directory": ("logs.jsonl", None, "directory", "directory"),
    "empty": ("empty.jsonl", b"", "empty", "empty"),
    "blank lines": ("blank.jsonl", b"\n  \n\n", "blank", "empty"),
    "binary": ("noise.jsonl", NOISE, "binary", "not UTF-8"),
    "random .gz": ("noise.jsonl.gz", NOISE, "binary", "not UTF-8"),
    "truncated .gz": ("cut.jsonl.gz", _truncated_gzip(), "truncated", "gzip"),
    "corrupt .gz": ("bad.jsonl.gz", _gzip_of("x" * 5000)[:20] + NOISE, "corrupt gzip", "gzip"),
    "plain text": ("hello.jsonl", b"hello\n", "line 1: not JSON", "not a watchdog config"),
    "gzip of text": ("hello.jsonl.gz", _gzip_of("hello\nworld\n"), "line 1: not JSON", "gzip"),
    "JSON, wrong kind": ("other.jsonl", b'{"a": 1}\n{"b": [2]}\n', "line 1:", "YAML"),
}
COMMANDS = {
    "events": (lambda path, tmp: ["events", path], 2),
    "replay": (lambda path, tmp: ["replay", path], 2),
    "replay --json": (lambda path, tmp: ["replay", "--json", path], 2),
    "report": (lambda path, tmp: ["report", path, "-o", os.path.join(tmp, "r.html")], 2),
    "check-config": (lambda path, tmp: ["check-config", path], 3),
    "status --config": (lambda path, tmp: ["status", "--config", path], 3),
    "replay --config": (lambda path, tmp: ["replay", FIXTURE, "--config", path], 3),
}


def _make(tmp_path, kind: str) -> str:
    name, content, *_ = INPUTS[kind]
    path = tmp_path / name
    if content is None:
        path.mkdir()
    elif content != "missing":
        path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", INPUTS)
def test_a_file_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, capsys, kind, command):
    path = _make(tmp_path, kind)
    argv, says_at = COMMANDS[command]
    code = cli.main(argv(path, str(tmp_path)))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert path in lines[0] and "Traceback" not in err
    assert INPUTS[kind][says_at].lower() in lines[0].lower(), lines[0]
    assert not os.path.exists(tmp_path / "r.html")


def test_one_bad_file_among_good_ones_is_named(tmp_path, capsys):
    bad = _make(tmp_path, "plain text")
    assert cli.main(["replay", FIXTURE, bad]) == 2
    err = capsys.readouterr().err
    assert bad in err and FIXTURE not in err


def test_replay_of_lines_that_give_nothing_to_replay_exits_2(tmp_path, capsys):
    """Trace lines replay knows but that make no observation on their own."""
    path = tmp_path / "starts.jsonl"
    path.write_text('{"kind": "compile_start", "trigger": "DYNAMO", "id": "0/0", "t": 1.0}\n')
    assert cli.main(["replay", str(path)]) == 2
    assert "nothing in" in capsys.readouterr().err
