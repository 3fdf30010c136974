"""The inference server the container runs as llm.service: a torch model behind the real agent
(enabled by the shipped drop-in's TORCH_WATCHDOG_* variables), answering GET / on
127.0.0.1:8000 with the pid that served it; 503 while the agent drains it."""
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch_watchdog.agent.auto  # noqa: F401  (install() from the environment)
import torch
from torch_watchdog import agent

model = agent.watch(torch.nn.Linear(16, 16), name="toy")


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        try:
            with torch.no_grad():
                model(torch.randn(4, 16))
            code, body = 200, {"pid": os.getpid()}
        except agent.Draining:
            code, body = 503, {"draining": True}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


with torch.no_grad():  # warm up: the sidecar sees an answered call at once
    model(torch.randn(4, 16))
ThreadingHTTPServer(("127.0.0.1", 8000), Handler).serve_forever()
