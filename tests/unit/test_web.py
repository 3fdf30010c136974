"""web.py: /metrics, /, /status.json and 404 on one port; errors answer 500, never raise."""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from tests.unit.test_status import a_view
from torch_watchdog.sidecar.present.metrics import SnapshotCollector, make_registry, stop
from torch_watchdog.sidecar.present.web import local_url, read_status, serve


def get(port: int, path: str, method: str = "GET"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as reply:
            return reply.status, reply.headers.get("Content-Type"), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type"), err.read()


@pytest.fixture
def served():
    collector = SnapshotCollector()
    holder = {"view": None}
    server, thread = serve("127.0.0.1", 0, make_registry(collector), lambda: holder["view"])
    yield server.server_port, collector, holder
    stop(server, thread)
    assert not thread.is_alive()


def test_routes(served):
    port, collector, holder = served
    view = a_view()
    collector.update(view.snapshot)
    holder["view"] = view
    code, ctype, body = get(port, "/")
    assert code == 200 and ctype == "text/html; charset=utf-8"
    assert b'class="memory-line"' in body and b'id="causes"' in body
    code, ctype, body = get(port, "/status.json?x=1")   # a query string is ignored
    assert code == 200 and ctype == "application/json"
    status = json.loads(body)
    assert status["graphs"]["recordings"] == 1983 and status["causes"][0]["cause"] == \
        "cudagraph_per_shape"
    code, ctype, body = get(port, "/metrics")
    assert code == 200 and ctype.startswith("text/plain; version=")
    assert b'torch_watchdog_cudagraph_recordings_total{server="default"} 1983.0' in body
    code, _, body = get(port, "/nope")
    assert code == 404 and b"not found: /nope" in body
    code, _, body = get(port, "/", method="HEAD")
    assert code == 200 and body == b""
    assert read_status(f"http://127.0.0.1:{port}/")["memory"]["source"] == "process"


def test_before_the_first_poll_everything_answers(served):
    port, _, _ = served
    assert get(port, "/")[0] == 200
    assert json.loads(get(port, "/status.json")[2])["t"] is None
    assert b"torch_watchdog_source_up" not in get(port, "/metrics")[2]


def test_a_failing_view_answers_500_and_the_server_goes_on(served):
    port, _, holder = served

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("half-built view")
    holder["view"] = Broken()
    code, _, body = get(port, "/status.json")
    assert code == 500 and b"half-built view" in body
    assert get(port, "/")[0] == 500
    holder["view"] = a_view()
    assert get(port, "/status.json")[0] == 200
    assert get(port, "/metrics")[0] == 200


def test_stop_releases_the_port():
    server, thread = serve("127.0.0.1", 0, make_registry(SnapshotCollector()))
    port = server.server_port
    stop(server, thread)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # would raise EADDRINUSE if the listener were still there


def test_a_busy_port_raises_oserror():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError):
            serve("127.0.0.1", busy.getsockname()[1], make_registry(SnapshotCollector()))


def test_read_status_rejects_what_is_not_a_sidecar(served):
    port, _, _ = served
    with pytest.raises(OSError):      # 404: an HTTPError, an OSError
        read_status(f"http://127.0.0.1:{port}/nope")


@pytest.mark.parametrize("address, url", [("127.0.0.1", "http://127.0.0.1:9464"),
                                          ("0.0.0.0", "http://127.0.0.1:9464"),
                                          ("::", "http://[::1]:9464"),
                                          ("10.1.2.3", "http://10.1.2.3:9464")])
def test_local_url(address, url):
    assert local_url(address, 9464) == url


def test_a_sidecar_that_answers_but_no_longer_polls_is_stale_in_red_and_status_exits_3(served):
    """The loop once froze behind an exception while the page, `status` and /metrics kept
    serving the last numbers; only a grey "last poll 3 min 31 s ago" said otherwise."""
    import io
    import time

    from torch_watchdog.cli import run_status

    port, collector, holder = served
    url = f"http://127.0.0.1:{port}"
    for age, stale in ((1.0, False), (120.0, True)):
        view = a_view(t=time.time() - age)
        collector.update(view.snapshot)
        holder["view"] = view
        out = io.StringIO()
        assert run_status(url, None, False, out) == (3 if stale else 0)
        assert ("STALE" in out.getvalue()) is stale
        assert (b'id="stale"' in get(port, "/")[2]) is stale
