"""The README's example server: docs/agent.md's FastAPI app ("In a FastAPI server").

    . .torch-watchdog/env     # the environment `torch-watchdog sidecar --dev` printed
    .venv/bin/uvicorn examples.fastapi_server:app --port 8000 --workers 2

It runs as is on a CPU (a tiny stand-in model; `backend="eager"` keeps the compile short).

Warm-up: each worker compiles before it takes requests, at lengths 1 and 16. The first call
compiles the model for its static shape; the second, at a new length, makes Dynamo compile it
again with the length dynamic (automatic dynamic shapes), and every later length reuses that
graph. So each worker compiles twice at start, the second time a recompile, and `status` says
"2 compiles, 2 recompiles" for the two-worker server: expected, and over before the first
request.

Requests are checked before they reach the model: a missing or non-string `text`, an empty one
(a (1, 0) tensor would make torch.compile fail inside Dynamo, which the sidecar would count as
a recompile) or one over 512 characters gets a 422 saying which.
"""
import torch_watchdog.agent.auto          # first, before the model is compiled
import torch
from fastapi import FastAPI, Response
from pydantic import BaseModel, Field
import torch_watchdog.agent

app = FastAPI()
# yours; on a GPU: .cuda() and torch.compile(model, mode="reduce-overhead")
model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)).eval()
llm = torch_watchdog.agent.watch(torch.compile(model, backend="eager"), name="llm")


def tokenize(text: str) -> torch.Tensor:  # yours: a (1, seq_len) tensor of token ids
    return torch.tensor([[ord(c) % 64 for c in text]])


# Warm up before the worker accepts requests (uvicorn and gunicorn import the app first):
# compile the sizes you serve now, not in a user's request. A rolling reload stops the next
# old worker only once this one answered a watched call, so a cold worker never holds traffic.
with torch.inference_mode():
    for n in (1, 16):
        llm(torch.zeros(1, n, dtype=torch.long))


@app.exception_handler(torch_watchdog.agent.Draining)  # a call begun once a drain began
async def draining(request, exc):
    return Response(status_code=503, headers={"Retry-After": "1"})  # retried elsewhere


class Prompt(BaseModel):                  # a bad request: 422 with the reason
    text: str = Field(min_length=1, max_length=512)


@app.post("/generate")
async def generate(req: Prompt):
    with torch.inference_mode():
        return {"tokens": llm(tokenize(req.text)).argmax(-1).tolist()}


@app.get("/healthz")                      # readiness: 503 once a drain began
async def healthz():
    return Response(status_code=200 if torch_watchdog.agent.ready() else 503)
