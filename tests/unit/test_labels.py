"""A server's `server` label: its program where its name changes with each start, the same
over restarts and reloads, never two servers' on one host."""
from __future__ import annotations

import pytest

from torch_watchdog.sidecar.core.labels import assign, base, program


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
