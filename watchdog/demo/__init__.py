"""`torch-watchdog demo`: the whole watchdog, for real, on a laptop without a GPU.

A small transformer under torch.compile (`server.py`, a subprocess, with the agent) is fed
variable-length requests while the real sidecar (`torch-watchdog sidecar`, a subprocess) watches
it: recompiles with their guard-failure reasons, the recompile-limit eager fallback and its cost,
new-shape stalls, memory growth against a budget, a graceful reload by SIGTERM, and the server
started again (as systemd would) serving. The timeline is printed as it happens
(`timeline.py`); at the end, the post-mortem report is written and the places to look are named.

On a CPU there are no CUDA graphs: the server keeps a few MB per distinct length as a stand-in
for the per-size memory of a CUDA graph pool (`server.py` says so, and so does the timeline).
With a GPU (`--device auto` finds it), real CUDA graphs grow real GPU memory instead.

Importing this package does not import torch; only the server subprocess does.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import tempfile
import time
from typing import Any, TextIO

INSTALL_HINT = ("torch is not installed in this environment. `make demo` creates .venv with a "
                "CPU build of torch; or run `pip install torch==2.13.0` and try again.")


def _interrupt(signum: int, frame: Any) -> None:
    from torch_watchdog.demo.driver import Interrupted

    raise Interrupted("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Exit codes: 0 every step was seen, 1 a step is missing or the demo failed."""
    if importlib.util.find_spec("torch") is None:
        print(f"torch-watchdog demo: {INSTALL_HINT}", file=sys.stderr)
        return 1
    from torch_watchdog.demo.driver import Demo, DemoError, Interrupted
    from torch_watchdog.demo.profile import FULL, SHORT

    profile = SHORT if args.short else FULL
    work = os.path.abspath(args.workdir) if args.workdir else \
        tempfile.mkdtemp(prefix="torch-watchdog-demo-")
    demo = Demo(profile, work, args.device, args.keep, out, port=args.port)
    _intro(demo, out)
    # SIGINT too: a shell starting us in the background may have left it ignored
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM,
                                                      signal.SIGHUP)}
    finished = False
    try:
        demo.prepare()
        demo.start_sidecar()
        demo.start_server()
        finished = demo.run_until_done()
        if args.keep and finished:
            _keep(demo, out)
    except (KeyboardInterrupt, Interrupted) as why:
        demo.say(f"{'--keep ended' if finished else 'interrupted'} ({why or 'Ctrl-C'}): "
                 "stopping what the demo started")
    except (DemoError, OSError) as err:
        demo.say(f"ERROR: {err}")
    finally:
        for s in old:  # a second Ctrl-C must not cut the clean-up short (it takes seconds)
            signal.signal(s, signal.SIG_IGN)
        try:
            demo.stop_all()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
    report = demo.write_report()
    return _summary(demo, report, finished, out)


def _intro(demo: Any, out: TextIO) -> None:
    from torch_watchdog.demo.profile import MEASURED_ON

    p = demo.p
    print(f"torch-watchdog demo ({p.name}): a small transformer under torch.compile, fed "
          "variable-length requests,\nwatched by the agent (in the server) and the real sidecar "
          "(a second process), which reloads the server before it runs out of memory.\n"
          f"  work dir     {demo.work}  (config, logs, the agent's events, the report)\n"
          f"  status page  {demo.url}/   (live while the demo runs; /status.json, /metrics)\n"
          "Expect: compiles and recompiles with their reasons, the recompile limit and the eager "
          "fallback, memory growing\nper distinct length, a reload decided by the memory policy, "
          f"the server started again and serving.\nIt took ~{p.expected_s[0]} s on "
          f"{MEASURED_ON} (~{p.expected_s[1]} s on a first run, which\ncompiles cold; later "
          "runs reuse torch's compile cache): a slower or busier machine takes longer.\n",
          file=out, flush=True)


def _keep(demo: Any, out: TextIO) -> None:
    report = demo.write_report()
    print(f"\n--keep: the sidecar and the server keep running. Open {demo.url}/ (status page), "
          f"{demo.url}/metrics\nand {report or 'the report (not written)'}; press Ctrl-C to "
          "stop them. The cooldown (600 s) rules out a second\nreload: the restarted server's "
          "memory grows past its budget, and the sidecar says so.\n", file=out, flush=True)
    while True:  # until Ctrl-C: the timeline goes on (the cooldown rules out another reload)
        demo.pump()
        time.sleep(0.2)


def _command() -> str:
    """How to call torch-watchdog from here: the script beside this Python, else `-m`."""
    tool = os.path.join(os.path.dirname(sys.executable), "torch-watchdog")
    cmd = tool if os.path.exists(tool) else sys.executable
    rel = os.path.relpath(cmd)
    cmd = cmd if rel.startswith("..") else rel
    return cmd if cmd.endswith("torch-watchdog") else f"{cmd} -m torch_watchdog.cli"


def _summary(demo: Any, report: Any, finished: bool, out: TextIO) -> int:
    f = demo.tl.facts
    slow = (f" ({f.slowdown[0]:.2f} -> {f.slowdown[1]:.2f} ms per call)" if f.slowdown else "")
    rows = [("recompiles, with their reasons", f.recompiles > 0, f"{f.recompiles} reported"),
            ("recompile limit -> eager fallback", f.limit_hit or f.fallback_found,
             ("found by the sidecar" if f.fallback_found else "reported by the agent" if
              f.limit_hit else "not seen") + slow),
            ("reload by the memory policy", bool(f.reload_ok), f.reload_detail or "none"),
            ("serving again after the reload", f.served_again > 0,
             f"pid {f.again_pid}: {f.served_again} requests" if f.again_pid else "no")]
    print("\nWhat the demo saw", file=out)
    for what, ok, detail in rows:
        print(f"  {'yes ' if ok else 'NO  '} {what:36s} {detail}", file=out)
    missing = f.missing()
    cli = _command()
    print("\nWhere to look", file=out)
    if report:
        print(f"  report       {report}  (open it in a browser: memory chart, causes, actions, "
              "bucket advisor)", file=out)
    print(f"  status page  {demo.url}/  and  {demo.url}/metrics  (live during the run; "
          "`--keep` leaves them up)", file=out)
    print(f"  replay       {cli} replay {demo.samples_path}  (the sidecar's configs, as it "
          "recorded them; --config FILE tries another)",
          file=out)
    print(f"  logs         {demo.work}/sidecar.log (the sidecar's JSON log), {demo.events_path} "
          f"(the agent's events), {demo.work}/server-N.log", file=out)
    if missing:
        print("\nNot seen: " + "; ".join(missing) + ("" if finished else
              " (the demo did not run to its end)"), file=out, flush=True)
        return 1
    print("\nEvery step was seen.", file=out, flush=True)
    return 0
