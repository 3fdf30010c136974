"""Reload-to-ready: from the reload request (SIGTERM, or the sidecar's drain request) to the
first answer of the new server process, for three starts of the new process:

- cold:   empty Inductor/Triton cache directories, no bundle (a new machine, a new pod);
- fx:     the previous process's cache directory (today's persistent FX cache);
- bundle: empty cache directories, the agent's warm bundle loaded at install (agent/warm.py);
- drain, standby start: the server under `torch-watchdog run` (watchdog/launcher.py), bundle
  and FX cache; a drain request; the released standby (torch etc. already imported) answers.

Every row's `phases`: where the new process's start went (import, CUDA context, agent
install, model on the device, first answer), each from the end of the one before.

Per model: gen0 starts cold and saves the bundle once warmed up; SIGTERM; gen1 (cold); SIGTERM;
gen2 (fx); SIGTERM; gen3 (bundle); then the standby case. For the first model the drain path
runs end to end once: gen3 runs under a supervisor (`sh`: restart on exit 75) and the control
socket asks it to drain; the record says whether it stopped taking work, finished the call in
hand, exited 75, and when the next process (bundle start) answered.

GPU (torch 2.11, CUDA; the seed model and a 24-layer 1024-wide one, fp16, reduce-overhead):

    python benchmarks/reload_to_ready.py    # results: $WATCHDOG_GPU_RESULTS/reload_to_ready.json

CPU proof that it runs (a 2-layer 64-wide model, default mode, one model):

    python benchmarks/reload_to_ready.py --cpu --small [--out DIR]

The server side is this file with --serve. A global budget (--budget-s, 330 s) skips what is
left rather than overrun it; skipped runs are listed in the JSON.
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

GPU_MODELS = [("seed-12x768", 12, 768, 12), ("big-24x1024", 24, 1024, 16)]
CPU_MODELS = [("small-2x64", 2, 64, 4)]


# -- the server ---------------------------------------------------------------------------------
def serve(a: argparse.Namespace) -> int:
    import torch

    import torch_watchdog.agent as agent
    from record_trace import Model

    fh = open(a.progress, "a")

    def put(kind: str, **fields) -> None:
        fh.write(json.dumps({"kind": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")
        fh.flush()

    put("start", **began_at())  # its t: torch, the agent and the model's module imported
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    gpu = not a.cpu
    if gpu:
        torch.cuda.init()
        put("cuda")
    agent.install(socket_path=a.socket, event_log=a.event_log, server=a.name)
    put("installed")
    agent.on_drain(lambda: put("on_drain"))
    model = Model(a.layers, a.dim, a.heads)
    if gpu:
        model = model.cuda().half()
    model.eval()
    put("model_on_device")
    served = agent.watch(torch.compile(model, mode="reduce-overhead" if gpu else None),
                         name="model")
    ids = torch.randint(0, 32000, (1, a.seq), device="cuda" if gpu else "cpu")
    began = time.monotonic()
    with torch.no_grad():
        served(ids)
        if gpu:
            torch.cuda.synchronize()
        put("ready", seconds=time.monotonic() - began)
        i, refused = 0, False
        while not stopping:
            if not agent.ready():  # the health endpoint's answer: no new work
                if not refused:
                    put("not_ready")
                    refused = True
                time.sleep(0.005)
                continue
            i += 1
            put("begin", i=i)
            served(ids)
            if gpu:
                torch.cuda.synchronize()
            time.sleep(a.pause_s)  # the rest of a request (tokenising, sending)
            put("end", i=i)
    put("stopped", requests=i)
    return 0


# -- the driver -----------------------------------------------------------------------------
def began_at() -> dict:
    """When this process began (wall clock, from /proc: 10 ms ticks) and, in a released
    standby of the launcher, when it was released: a standby's start counts from there."""
    out: dict = {}
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            btime = next(int(x.split()[1]) for x in fh if x.startswith("btime"))
        out["proc_start_t"] = btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        pass
    released = os.environ.get("TORCH_WATCHDOG_RELEASED_AT")
    if released:
        out["released_t"] = float(released)
    return out


def phases(prog: str, pid: int = 0, after: float = 0.0) -> dict:
    """Where the process's start went, each phase from the end of the one before: import
    (from process start, or from the release for a standby), CUDA context, agent install,
    model on the device, first answer (compile, cudagraph record, the call)."""
    lines = [x for x in read_lines(prog) if not pid or x["pid"] == pid]
    at = {}
    for x in lines:
        at.setdefault(x["kind"], x)
    if "start" not in at:
        return {}
    st = at["start"]
    t = st.get("released_t") or st.get("proc_start_t")
    if t is not None and after > t:  # `sh` exec'd it: the process began with the shell
        t = after
    out = {"standby": "released_t" in st}
    for key, kind in (("import_s", "start"), ("cuda_s", "cuda"), ("install_s", "installed"),
                      ("model_on_device_s", "model_on_device"), ("first_answer_s", "ready")):
        if kind in at and t is not None:
            out[key] = round(at[kind]["t"] - t, 3)
            t = at[kind]["t"]
    return {"phases": out}


def read_lines(path: str) -> list[dict]:
    try:
        with open(path) as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]
    except FileNotFoundError:
        return []


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise TimeoutError(what)


class Run:
    def __init__(self, a: argparse.Namespace, work: str):
        self.a, self.work = a, work
        self.sock = os.path.join(work, "ev.sock")
        self.started = time.monotonic()

    def left(self) -> float:
        return self.a.budget_s - (time.monotonic() - self.started)

    def argv(self, gen: str, spec: tuple) -> tuple[list[str], str, str]:
        name, layers, dim, heads = spec
        prog, log = (os.path.join(self.work, f"{name}-{gen}.{x}") for x in ("progress", "jsonl"))
        argv = [sys.executable, os.path.abspath(__file__), "--serve", "--progress", prog,
                "--event-log", log, "--socket", self.sock, "--name", name,
                "--layers", str(layers), "--dim", str(dim), "--heads", str(heads),
                "--seq", str(self.a.seq), "--pause-s", str(self.a.pause_s)]
        return argv + (["--cpu"] if self.a.cpu else []), prog, log

    def env(self, cache: str, warm: bool, name: str) -> dict:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
            ROOT, os.environ.get("PYTHONPATH")])),
            TORCHINDUCTOR_CACHE_DIR=os.path.join(self.work, cache),
            TRITON_CACHE_DIR=os.path.join(self.work, cache, "triton"),
            TORCH_WATCHDOG_WARM="1" if warm else "0",
            TORCH_WATCHDOG_WARM_DIR=os.path.join(self.work, "warm"),
            TORCH_WATCHDOG_WARM_SAVE_QUIET_S="1",
            TORCH_WATCHDOG_RESTART_FILE=os.path.join(self.work, f"{name}.restart-requested"))
        env.pop("TORCH_COMPILE_JOB_ID", None)
        if self.a.cpu:
            env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no worker pool on a small CPU host
        return env

    def start(self, gen: str, spec: tuple, cache: str, warm: bool):
        argv, prog, log = self.argv(gen, spec)
        p = subprocess.Popen(argv, env=self.env(cache, warm, spec[0]), cwd=ROOT,
                             stderr=open(os.path.join(self.work, f"{spec[0]}-{gen}.stderr"), "w"))
        return p, prog, log

    def ready_t(self, prog: str, timeout: float) -> float:
        wait_until(lambda: any(x["kind"] == "ready" for x in read_lines(prog)), timeout,
                   f"{prog}: no first answer within {timeout:.0f} s")
        return next(x for x in read_lines(prog) if x["kind"] == "ready")["t"]


def compile_facts(log: str, pid: int = 0) -> dict:
    """From the new process's event log (its agent writes it every 0.1 s: wait for the
    compile event a moment, it may come after the first answer was written down)."""
    try:
        wait_until(lambda: any(e["kind"] == "compile" for e in read_lines(log)), 10, "")
    except TimeoutError:
        pass
    ev = [e for e in read_lines(log) if not pid or e.get("pid", pid) == pid]
    compiles = [e for e in ev if e["kind"] in ("compile", "recompile")]
    warm = [{"action": e["action"], "seconds": round(e["seconds"] or 0, 3), "bytes": e["bytes"],
             "detail": e["detail"]} for e in ev if e["kind"] == "warm"]
    return {"compile_s": round(sum(e["seconds"] or 0 for e in compiles), 3),
            "fx_cache_hits": sum(e["fx_cache_hits"] or 0 for e in compiles),
            "fx_cache_misses": sum(e["fx_cache_misses"] or 0 for e in compiles),
            "cudagraph_records": sum(1 for e in ev if e["kind"] == "cudagraph_record"),
            "warm": warm}


def sigterm_reload(run: Run, old, spec: tuple, gen: str, cache: str, warm: bool) -> tuple:
    """SIGTERM `old`, start the next process once it exited; reload-to-ready."""
    p, prog, log = old
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    p.wait(120)
    exited = time.time()
    new = run.start(gen, spec, cache, warm)
    ready = run.ready_t(new[1], max(30.0, run.left()))
    row = {"model": spec[0], "case": gen, "trigger": "SIGTERM",
           "reload_to_ready_s": round(ready - t0, 3), "stop_s": round(exited - t0, 3),
           "start_to_ready_s": round(ready - exited, 3), **phases(new[1]),
           **compile_facts(new[2])}
    print(json.dumps(row), flush=True)
    return new, row


def drain_reload(run: Run, spec: tuple, first, control) -> dict:
    """`first` runs under `sh` (restart on 75); ask it to drain; time the next one's answer."""
    sh, prog, log = first
    pid = next(x["pid"] for x in read_lines(prog) if x["kind"] == "start")
    wait_until(lambda: pid in control.connected(), 30, "the agent never connected")
    wait_until(lambda: sum(x["kind"] == "end" for x in read_lines(prog)) >= 5, 30, "no traffic")
    t0 = time.time()
    outcome = control.drain({pid}, 30.0)
    next_prog = prog.replace("-drain1.", "-drain2.")
    ready = run.ready_t(next_prog, max(30.0, run.left()))
    lines = read_lines(prog)
    seen = [x["kind"] for x in lines]
    at = seen.index("on_drain") if "on_drain" in seen else len(seen)
    begins = [x["i"] for x in lines if x["kind"] == "begin"]
    ends = [x["i"] for x in lines if x["kind"] == "end"]
    code_file = os.path.join(run.work, "drain1.exit")
    wait_until(lambda: os.path.exists(code_file), 10, "no exit code")
    row = {"model": spec[0], "case": "drain (bundle start)", "trigger": "drain request",
           "reload_to_ready_s": round(ready - t0, 3), "outcome_ok": outcome.ok,
           "outcome": outcome.detail, "drain_s": round(outcome.seconds, 3),
           "exit_code": int(open(code_file).read().strip() or -1),
           "no_work_after_drain": "begin" not in seen[at:],
           "call_in_hand_finished": bool(begins) and begins[-1] == ends[-1],
           "stopped_taking_work": "not_ready" in seen,
           **phases(next_prog, after=max(x["t"] for x in lines)),
           **compile_facts(log.replace("-drain1.", "-drain2."))}
    print(json.dumps(row), flush=True)
    return row


def standby_reload(run: Run, spec: tuple, control) -> dict:
    """The server under `torch-watchdog run` (bundle + FX cache shared by both generations);
    a drain request; reload-to-ready of the released standby."""
    argv, prog, log = run.argv("standby", spec)
    env = run.env(f"{spec[0]}-cache6", True, spec[0])
    launcher = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "run",
                                 "--", *argv], env=env, cwd=ROOT,
                                stderr=open(os.path.join(run.work, "standby.stderr"), "w"))
    try:
        run.ready_t(prog, max(30.0, run.left()))
        pid = next(x["pid"] for x in read_lines(prog) if x["kind"] == "start")
        wait_until(lambda: pid in control.connected(), 30, "the agent never connected")
        wait_until(lambda: sum(x["kind"] == "end" for x in read_lines(prog)) >= 5, 30,
                   "no traffic")
        # the standby has had the first generation's whole start to import; let its bundle
        # be saved too (the next generation loads it)
        wait_until(lambda: any(e["kind"] == "warm" and e["action"] == "saved"
                               for e in read_lines(log)), 60, "no bundle saved")
        t0 = time.time()
        outcome = control.drain({pid}, 30.0)

        def second() -> list[dict]:
            return [x for x in read_lines(prog) if x["kind"] == "ready" and x["pid"] != pid]

        wait_until(lambda: bool(second()), max(30.0, run.left()), "no next generation")
        new = second()[0]
        row = {"model": spec[0], "case": "drain, standby start", "trigger": "drain request",
               "reload_to_ready_s": round(new["t"] - t0, 3), "outcome_ok": outcome.ok,
               "drain_s": round(outcome.seconds, 3), **phases(prog, new["pid"]),
               **compile_facts(log, new["pid"])}
        print(json.dumps(row), flush=True)
        return row
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            launcher.kill()


def supervised(run: Run, spec: tuple, cache1: str, cache2: str):
    """gen drain1 under `sh`, restarted as drain2 (bundle start) when it exits 75."""
    a1, prog, log = run.argv("drain1", spec)
    a2, _, _ = run.argv("drain2", spec)
    env = run.env(cache1, True, spec[0])
    env2 = run.env(cache2, True, spec[0])
    code = os.path.join(run.work, "drain1.exit")
    script = (f"{shlex.join(a1)} 2>{shlex.quote(run.work)}/drain1.stderr; c=$?; "
              f"echo $c > {shlex.quote(code)}; [ $c -eq 75 ] && "
              f"TORCHINDUCTOR_CACHE_DIR={shlex.quote(env2['TORCHINDUCTOR_CACHE_DIR'])} "
              f"TRITON_CACHE_DIR={shlex.quote(env2['TRITON_CACHE_DIR'])} "
              f"exec {shlex.join(a2)} 2>{shlex.quote(run.work)}/drain2.stderr")
    sh = subprocess.Popen(["sh", "-c", script], env=env, cwd=ROOT)
    return sh, prog, log


# over the complexity bound: the benchmark's scenarios, in the order they run
def main() -> int:  # noqa: C901
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--progress")
    p.add_argument("--event-log")
    p.add_argument("--socket")
    p.add_argument("--name")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--pause-s", type=float, default=None)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--small", action="store_true", help="the small model only")
    p.add_argument("--out", default=os.environ.get("WATCHDOG_GPU_RESULTS")
                   or os.environ.get("OUT") or ".")
    p.add_argument("--budget-s", type=float, default=330.0)
    p.add_argument("--no-drain", action="store_true")
    a = p.parse_args()
    if a.seq is None:
        a.seq = 32 if a.cpu else 128
    if a.pause_s is None:
        a.pause_s = 0.05 if a.cpu else 0.02
    if a.serve:
        return serve(a)

    from torch_watchdog.sidecar.actions.control import ControlServer

    models = CPU_MODELS if (a.small or a.cpu) else GPU_MODELS
    work = tempfile.mkdtemp(prefix="rtr-", dir="/tmp")  # AF_UNIX paths are short
    run = Run(a, work)
    control = ControlServer(run.sock + ".ctl")
    rows, skipped, procs = [], [], []
    result = {"benchmark": "reload_to_ready", "cpu": a.cpu, "work": work, "rows": rows,
              "skipped": skipped}
    try:
        import torch

        result["torch"] = torch.__version__
        result["gpu"] = None if a.cpu else torch.cuda.get_device_name()
        result["mega_cache"] = hasattr(torch.compiler, "save_cache_artifacts")
        del torch
        for n, spec in enumerate(models):
            if run.left() < 60:
                skipped.append(spec[0])
                continue
            name = spec[0]
            gen0 = run.start("gen0", spec, f"{name}-cache0", True)
            procs.append(gen0[0])
            run.ready_t(gen0[1], max(30.0, run.left()))
            wait_until(lambda log=gen0[2]: any(e["kind"] == "warm" and e["action"] == "saved"
                                               for e in read_lines(log)), 60, "no bundle saved")
            rows.append({"model": name, "case": "first start (cold, saves the bundle)",
                         **compile_facts(gen0[2])})
            cur = gen0
            for gen, cache, warm in (("cold", f"{name}-cache1", False),
                                     ("fx", f"{name}-cache0", False),
                                     ("bundle", f"{name}-cache3", True)):
                if run.left() < 30:
                    skipped.append(f"{name} {gen}")
                    continue
                cur, row = sigterm_reload(run, cur, spec, gen, cache, warm)
                procs.append(cur[0])
                rows.append(row)
            cur[0].send_signal(signal.SIGTERM)
            cur[0].wait(60)
            if run.left() < 45:
                skipped.append(f"{name} standby")
            else:
                rows.append(standby_reload(run, spec, control))
            if n == 0 and not a.no_drain:
                if run.left() < 45:
                    skipped.append(f"{name} drain")
                    continue
                first = supervised(run, spec, f"{name}-cache4", f"{name}-cache5")
                procs.append(first[0])
                run.ready_t(first[1], max(30.0, run.left()))
                rows.append(drain_reload(run, spec, first, control))
                for x in read_lines(first[1].replace("-drain1.", "-drain2.")):
                    if x["kind"] == "start":
                        os.kill(x["pid"], signal.SIGTERM)
                first[0].wait(60)
    except Exception as e:  # what was measured still goes to the JSON
        result["error"] = f"{type(e).__name__}: {e}"
        print("error:", result["error"], file=sys.stderr)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        control.close()
        result["seconds"] = round(time.monotonic() - run.started, 1)
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "reload_to_ready.json")
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {path} ({result['seconds']} s)")
        for r in rows:
            if "reload_to_ready_s" in r:
                ph = " ".join(f"{k[:-2]} {v:.2f}" for k, v in r.get("phases", {}).items()
                              if k.endswith("_s"))
                print(f"{r['model']:14s} {r['case']:22s} {r['reload_to_ready_s']:7.2f} s  "
                      f"compile {r['compile_s']:6.2f} s  fx hits/misses "
                      f"{r['fx_cache_hits']}/{r['fx_cache_misses']}  [{ph}]")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
