"""Serving again after a reload decision, per way of reloading, on the GPU machine.

From the decision (SIGTERM, or the control socket's drain request, as the sidecar sends it)
to the first answer of the server's next process, for an HF GPT-2 server (`transformers`
imported by the script, 12 x 768, fp16, `reduce-overhead`) and the seed model (no
`transformers`), each with a shared, warm FX cache (a restart on the same machine):

- signal:            SIGTERM; a supervisor (a shell loop) starts a fresh process;
- drain busy:        the server calls the model back to back and never reads ready() (a
                     queue worker); drain request; restarted on exit 75;
- drain cooperating: the server takes work only while ready() is True; the same;
- launcher:          `torch-watchdog run` (busy server): the released standby, which had
                     imported torch and what the first generation had imported
                     (`transformers`);
- launcher (list only): the same with `--no-recorded-preload` (torch and the agent only);
- launcher cooperating: the launcher, the server reading ready().

Each row: `serving_again_s` (the decision to the first answer), `stop_s` (the decision to
the old process's exit), and the new process's `phases` (import, model built and on the GPU,
first answer = compile from cache + CUDA-graph recording + the call) with `compile_s` from
its agent. The target is read against `model_s + compile_s`.

    python benchmarks/reload_serving.py [--out DIR]       # $OUT/reload_serving.json
    python benchmarks/reload_serving.py --cpu --model seed  # CPU: proof that it runs
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from reload_to_ready import began_at, compile_facts, read_lines, wait_until  # noqa: E402

CASES = ("signal", "drain busy", "drain cooperating", "launcher", "launcher (list only)",
         "launcher cooperating")


# -- the server ---------------------------------------------------------------------------------
def serve(a: argparse.Namespace) -> int:
    fh = open(a.progress, "a")

    def put(kind: str, **fields) -> None:
        fh.write(json.dumps({"kind": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")
        fh.flush()

    put("start", **began_at(), had_transformers="transformers" in sys.modules)
    import torch

    import torch_watchdog.agent as agent

    agent.install(socket_path=a.socket, event_log=a.event_log, server=a.model)
    gpu = not a.cpu
    dev = "cuda" if gpu else "cpu"
    if a.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        put("imported")
        net = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024))

        class Logits(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, ids):
                return self.m(input_ids=ids, use_cache=False).logits

        model = Logits(net)
        vocab = 50000
    else:
        from record_trace import Model
        put("imported")
        model, vocab = (Model(2, 64, 4) if a.cpu else Model(12, 768, 12)), 32000
    model = model.to(dev)
    if gpu:
        model = model.half()
        torch.cuda.synchronize()
    model.eval()
    put("model_on_device")
    served = agent.watch(torch.compile(model, mode="reduce-overhead" if gpu else None),
                         name="model")
    ids = torch.randint(0, vocab, (1, a.seq), device=dev)
    with torch.no_grad():
        served(ids)
        if gpu:
            torch.cuda.synchronize()
        put("ready")
        i = 0
        while True:
            if a.mode == "cooperating" and not agent.ready():
                time.sleep(0.005)
                continue
            try:
                served(ids)
                if gpu:
                    torch.cuda.synchronize()
            except agent.Draining:
                time.sleep(0.005)  # requeued: another replica takes it
                continue
            i += 1
            if i % 20 == 0:
                put("served", n=i)


# -- the driver -----------------------------------------------------------------------------
class Case:
    def __init__(self, a: argparse.Namespace, work: str, model: str, case: str):
        self.a, self.work, self.model, self.case = a, work, model, case
        slug = f"{model}-{case.replace(' ', '-').replace(',', '')}"
        self.prog = os.path.join(work, f"{slug}.progress")
        self.log = os.path.join(work, f"{slug}-{{pid}}.jsonl")
        self.err = os.path.join(work, f"{slug}.stderr")
        self.sock = os.path.join(work, "ev.sock")

    def argv(self, mode: str) -> list[str]:
        return [sys.executable, os.path.abspath(__file__), "--serve", "--progress", self.prog,
                "--event-log", self.log, "--socket", self.sock, "--model", self.model,
                "--mode", mode, "--seq", str(self.a.seq)] + (["--cpu"] if self.a.cpu else [])

    def env(self) -> dict:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
            ROOT, os.environ.get("PYTHONPATH")])),
            TORCHINDUCTOR_CACHE_DIR=os.path.join(self.work, "inductor"),
            TRITON_CACHE_DIR=os.path.join(self.work, "inductor", "triton"),
            TORCH_WATCHDOG_RESTART_FILE="")
        env.pop("TORCH_WATCHDOG_WARM", None)
        return env

    def start(self) -> subprocess.Popen:
        mode = "cooperating" if self.case.endswith("cooperating") else "busy"
        argv = self.argv(mode)
        err = open(self.err, "w")
        if self.case.startswith("launcher"):
            extra = ["--no-recorded-preload"] if "list only" in self.case else []
            return subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "run", *extra,
                                     "--", *argv], env=self.env(), cwd=ROOT, stderr=err)
        # the supervisor: a shell loop, restarting on exit (signal) or on 75 (drain)
        again = "true" if self.case == "signal" else '[ "$c" -eq 75 ]'
        script = f"while true; do {shlex.join(argv)}; c=$?; {again} || exit $c; done"
        return subprocess.Popen(["sh", "-c", script], env=self.env(), cwd=ROOT, stderr=err,
                                start_new_session=True)

    def lines(self, kind: str) -> list[dict]:
        return [x for x in read_lines(self.prog) if x["kind"] == kind]


def one(a: argparse.Namespace, work: str, model: str, case: str, control) -> dict:
    c = Case(a, work, model, case)
    sup = c.start()
    try:
        return _measure(c, control)
    except TimeoutError as e:
        raise TimeoutError(f"{e}; its stderr: {open(c.err).read()[-2000:]}") from None
    finally:
        _stop(c, sup)


def _measure(c: Case, control) -> dict:
    model, case = c.model, c.case
    wait_until(lambda: c.lines("ready"), 240, f"{model} {case}: no first answer")
    pid = c.lines("ready")[0]["pid"]
    wait_until(lambda: any(x["pid"] == pid for x in c.lines("served")), 60, "no traffic")
    if case.startswith("launcher"):  # the standby takes the recorded imports up (a server
        time.sleep(15)               # serves minutes or hours before its reload)
    if case != "signal":
        wait_until(lambda: pid in control.connected(), 30, "the agent never connected")
    t0 = time.time()
    if case == "signal":
        os.kill(pid, signal.SIGTERM)
        outcome = None
    else:
        outcome = control.drain({pid}, 30.0)
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or
               open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z",
               60, "the old process never exited")
    stopped = time.time()

    def second() -> list[dict]:
        return [x for x in c.lines("ready") if x["pid"] != pid]

    wait_until(second, 240, f"{model} {case}: no next generation")
    new = second()[0]
    at = {x["kind"]: x for x in read_lines(c.prog) if x["pid"] == new["pid"]}
    st = at["start"]
    begin = st.get("released_t") or max(st.get("proc_start_t") or stopped, t0)
    phases = {"standby": "released_t" in st, "had_transformers": st["had_transformers"]}
    t = begin
    for key, kind in (("import_s", "imported"), ("model_s", "model_on_device"),
                      ("first_answer_s", "ready")):
        phases[key] = round(at[kind]["t"] - t, 3)
        t = at[kind]["t"]
    facts = compile_facts(c.log.format(pid=new["pid"]))
    row = {"model": model, "case": case, "serving_again_s": round(new["t"] - t0, 3),
           "stop_s": round(stopped - t0, 3), "phases": phases,
           "compile_s": facts["compile_s"], "fx_cache_hits": facts["fx_cache_hits"],
           "cudagraph_records": facts["cudagraph_records"],
           "drain": None if outcome is None else
           {"ok": outcome.ok, "seconds": round(outcome.seconds, 3),
            "detail": outcome.detail}}
    row["build_plus_compile_s"] = round(phases["model_s"] + facts["compile_s"], 3)
    row["ratio_to_build_plus_compile"] = round(
        row["serving_again_s"] / max(1e-3, row["build_plus_compile_s"]), 2)
    if case.startswith("launcher"):
        row["launcher"] = [x for x in open(c.err).read().splitlines()
                           if "released standby" in x]
    print(json.dumps(row), flush=True)
    return row


def _stop(c: Case, sup: subprocess.Popen) -> None:
    try:
        if c.case.startswith("launcher"):
            sup.send_signal(signal.SIGTERM)
            sup.wait(60)
        else:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait(30)
    except (OSError, subprocess.TimeoutExpired):
        sup.kill()
    for x in read_lines(c.prog):  # a generation the loop started after the kill
        try:
            os.kill(x["pid"], signal.SIGKILL)
        except OSError:
            pass


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--progress")
    p.add_argument("--event-log")
    p.add_argument("--socket")
    p.add_argument("--mode", default="busy")
    p.add_argument("--model", default=None, help="gpt2 or seed (default: both)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    a = p.parse_args()
    if a.serve:
        return serve(a)

    from torch_watchdog.sidecar.actions.control import ControlServer

    work = tempfile.mkdtemp(prefix="rsv-", dir="/tmp")
    control = ControlServer(os.path.join(work, "ev.sock.ctl"))
    rows: list = []
    result = {"benchmark": "reload_serving", "cpu": a.cpu, "rows": rows}
    started = time.monotonic()
    try:
        import torch

        result["torch"] = torch.__version__
        result["gpu"] = None if a.cpu else torch.cuda.get_device_name()
        del torch
        for model in ([a.model] if a.model else ["seed", "gpt2"]):
            for case in a.cases.split(","):
                rows.append(one(a, work, model, case, control))
                save(a.out, result)  # so far: a run cut short keeps its rows
    except Exception as e:  # what was measured still goes to the JSON
        result["error"] = f"{type(e).__name__}: {e}"
        print("error:", result["error"], file=sys.stderr)
    finally:
        control.close()
        result["seconds"] = round(time.monotonic() - started, 1)
        save(a.out, result)
    return 0 if "error" not in result else 1


def save(out: str, result: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "reload_serving.json"), "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
