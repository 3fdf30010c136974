"""The README's example server (examples/fastapi_server.py), run by a real uvicorn: it answers a
good request, and a bad one gets a 422 saying what is wrong instead of a 500 and a traceback
(an empty text used to fail inside Dynamo, which the sidecar counted as a recompile). The copy
in docs/agent.md is the file's code, line for line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.conftest import ROOT, free_port, wait_for, with_root

EXAMPLE = os.path.join(ROOT, "examples", "fastapi_server.py")


def test_docs_agent_md_shows_the_example_as_it_is():
    source = open(EXAMPLE).read()
    code = source[source.index('"""', 3) + 3:].lstrip("\n")
    docs = open(os.path.join(ROOT, "docs", "agent.md")).read()
    start = docs.index("```python\n# examples/fastapi_server.py\n") + len("```python\n")
    block = docs[start:docs.index("```\n", start)]
    assert block == "# examples/fastapi_server.py\n" + code


def post(port: int, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("example") / "uvicorn.log"
    env = dict(os.environ, PYTHONPATH=with_root(), TORCH_WATCHDOG_ENABLED="0")
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "examples.fastapi_server:app",
                                 "--port", str(port)], cwd=ROOT, env=env, stdout=fh, stderr=fh)
    try:
        assert wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz",
                                                       timeout=5).status == 200, 120), \
            log.read_text()[-2000:]
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_good_request_is_answered(server):
    status, body = post(server, b'{"text": "hello world"}')
    assert status == 200 and len(body["tokens"][0]) == len("hello world")


@pytest.mark.parametrize("body, says", [
    (b"{}", "Field required"),
    (b'{"text": 42}', "valid string"),
    (b'{"text": ""}', "at least 1 character"),
    (b'{"text": "' + b"x" * 513 + b'"}', "at most 512 characters"),
    (b"not json", "JSON"),
])
def test_a_bad_request_gets_a_422_saying_why(server, body, says):
    status, answer = post(server, body)
    assert status == 422, (status, answer)
    assert says in json.dumps(answer), answer
