"""An ASGI app with the agent for `uvicorn --workers 2` (test_server_identity.py): each worker
imports it, installs the agent and compiles its model; GET answers the worker's pid."""
import os

import torch_watchdog.agent.auto  # noqa: F401  (first, before the model is compiled)

import torch

import torch_watchdog.agent

model = torch_watchdog.agent.watch(torch.compile(torch.nn.Linear(8, 8), backend="eager"),
                                   name="model")


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    with torch.no_grad():
        model(torch.ones(1, 8))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(os.getpid()).encode()})
