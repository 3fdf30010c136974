"""A server's `server` label: its program where its name changes with each start, the same
over restarts and reloads, never two servers' on one host."""
from __future__ import annotations

import dataclasses

import pytest

from tests.unit.test_step import A, GB, Host2, hello
from torch_watchdog.sidecar.core.labels import assign, base, program
from torch_watchdog.sidecar.core.observations import ProcessSample, ReloadOutcome, Sample


@pytest.mark.parametrize("argv, expected", [
    ("app.py --port 8000", "app.py"),
    ("/srv/llm/serve.py", "serve.py"),
    ("/venv/lib/python3.12/site-packages/llm/__main__.py --model x", "llm"),
    ("/venv/bin/uvicorn main:app --workers 2", "uvicorn main:app"),
    ("/venv/bin/gunicorn -w 2 -k uvicorn.workers.UvicornWorker main:app",
     "gunicorn main:app"),
    ("/venv/bin/gunicorn", "gunicorn"),
    ("-c", "python"),
    ("", "python"),
])
def test_the_program_of_a_command_line(argv, expected):
    assert program(argv) == expected


@pytest.mark.parametrize("name, argv, expected", [
    ("pgid:7212", "app.py", "app.py"),
    ("pgid:7212/cuda:0", "app.py", "app.py/cuda:0"),
    ("pid:99", "app.py", "app.py"),
    ("dist:localhost:29500", "server.py", "server.py"),
    ("pgid:7212@uid:1000", "app.py", "app.py@uid:1000"),
    ("pgid:7212", None, "pgid:7212"),           # no argv known (yet)
    ("llm", "app.py", "llm"),                   # explicit or configured: stays
    ("llm.service/cuda:1", "app.py", "llm.service/cuda:1"),
    ("serve:app/Model/0", "x.py", "serve:app/Model/0"),
    ("default", "app.py", "default"),
])
def test_a_name_that_stays_is_its_own_label_and_one_per_start_is_its_program(
        name, argv, expected):
    assert base(name, argv) == expected


def test_two_copies_of_one_script_are_told_apart_in_name_order():
    got = assign({"pgid:20": "app.py", "pgid:10": "app.py", "llm": "llm"}, {},
                 {"pgid:10", "pgid:20", "llm"})
    assert got == {"pgid:10": "app.py", "pgid:20": "app.py#2", "llm": "llm"}


def test_a_held_label_stays_whoever_comes_later():
    # the second copy keeps #2 while the first is restarted under a new process group
    got = assign({"pgid:30": "app.py", "pgid:20": "app.py"}, {"pgid:20": "app.py#2"},
                 {"pgid:30", "pgid:20"})
    assert got == {"pgid:20": "app.py#2", "pgid:30": "app.py"}


def test_a_gone_server_gives_its_label_to_the_same_program_started_again():
    got = assign({"pgid:10": "app.py", "pgid:40": "app.py"}, {"pgid:10": "app.py"},
                 {"pgid:40"})
    assert got == {"pgid:40": "app.py", "pgid:10": "app.py#2"}


def test_a_live_server_keeps_its_label_against_a_newcomer():
    got = assign({"pgid:10": "app.py", "pgid:40": "app.py"}, {"pgid:10": "app.py"},
                 {"pgid:10", "pgid:40"})
    assert got == {"pgid:10": "app.py", "pgid:40": "app.py#2"}


def test_a_label_of_another_base_is_given_anew():
    # a pid heard before its hello was "default"; its hello named it, with its program
    assert assign({"pgid:10": "app.py"}, {"pgid:10": "default"}, {"pgid:10"}) == \
        {"pgid:10": "app.py"}


def test_through_the_step_a_reloaded_server_keeps_its_label_and_a_second_copy_gets_its_own():
    """`python app.py` on GPU 0, under a supervisor (parent 50): reloaded, it comes back in a
    new process group (`pgid:303` -> `pgid:404`) and its views keep `app.py/cuda:0`; the same
    script started by another supervisor on the same GPU set is `app.py/cuda:0#2`."""
    def started(t: float, pid: int, name: str, ppid: int):
        return dataclasses.replace(hello(t, pid, name, [A]), ppid=ppid, argv="app.py --port 1")

    def labels(h) -> dict:
        h.poll()
        return {name: s.label for name, s in h.host.servers.items() if s.pids}

    h = Host2()
    h.feed(started(h.t, 303, "pgid:303/cuda:0", 50))
    h.mine[303] = 2 * GB
    assert labels(h)["pgid:303/cuda:0"] == "app.py/cuda:0"
    h.feed(started(h.t, 505, "pgid:505/cuda:0", 60))
    h.mine[505] = 2 * GB
    assert labels(h) == {"replica-a": "replica-a", "replica-b": "replica-b",
                         "pgid:303/cuda:0": "app.py/cuda:0",
                         "pgid:505/cuda:0": "app.py/cuda:0#2"}
    h.feed(ReloadOutcome(True, "exited after SIGTERM", 2.0).at(h.t, "pgid:303/cuda:0"))
    del h.mine[303]
    h.feed(Sample(t=h.t + 1, processes=(ProcessSample(303, False, 0, {}),)))  # it exited
    h.feed(started(h.t + 2, 404, "pgid:404/cuda:0", 50))
    h.mine[404] = 2 * GB
    got = labels(h)
    assert "pgid:303/cuda:0" not in h.host.servers
    assert got["pgid:404/cuda:0"] == "app.py/cuda:0"
    assert got["pgid:505/cuda:0"] == "app.py/cuda:0#2"


def test_a_configured_or_explicit_name_keeps_itself_against_a_derived_label():
    app = "uvicorn main:app"  # a configured name, and the program of a `pgid:` server
    got = assign({app: app, "pgid:1": app}, {}, {app, "pgid:1"})
    assert got == {app: app, "pgid:1": app + "#2"}
