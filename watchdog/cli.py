"""`torch-watchdog`: command-line entry point. Exit codes: 0 ok, 1 runtime failure, 2 bad input
(a file that is missing, empty, a directory, binary, truncated or of the wrong kind: one line
naming it, no traceback), 141 stdout closed early (`| head`: quiet, as SIGPIPE), 130 Ctrl-C.

    torch-watchdog listen [--socket PATH] [--json]   print the agent's events as they arrive
    torch-watchdog events FILE...                     check an agent event log, print a summary
    torch-watchdog replay TRACE... [--config FILE] [--json]   run the pipeline over recordings
    torch-watchdog report FILE... -o report.html [--config FILE] [--json]   HTML post-mortem
    torch-watchdog check-config FILE                  exit 0, or 2 listing every problem
    torch-watchdog sidecar [--config FILE]            the daemon (run it under systemd)
    torch-watchdog sidecar --dev [DIR]                the daemon in DIR, no root; prints the
                                                      server's environment (DIR/env)
    torch-watchdog status [--url URL] [--config FILE] [--json]   ask a running sidecar
    torch-watchdog demo [--short] [--workdir DIR] [--keep] [--port N]  the whole thing
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import select
import signal
import sys
from typing import Any, Callable, Optional, TextIO

from torch_watchdog import __version__, events
from torch_watchdog.jsonl import InputError, problem, read_lines
from torch_watchdog.sidecar.config import AgentSocketConfig, Config
from torch_watchdog.sidecar.dev import DEFAULT_DIR as DEV_DIR
from torch_watchdog.sidecar.dev import DevSetup
from torch_watchdog.sidecar.sources.receiver import Receiver


def describe(e: events.Event) -> str:
    """One readable line per event."""
    d = {k: v for k, v in events.to_dict(e).items() if k not in ("v", "kind", "t", "pid")}
    detail = " ".join(f"{k}={v}" for k, v in d.items() if v not in (None, [], {}))
    return f"{e.t:.3f} pid={e.pid} {e.kind:17s} {detail}"


def listen(path: str, as_json: bool, out: TextIO) -> int:
    """Print events from agents until SIGINT/SIGTERM; bad datagrams are counted on stderr."""
    receiver = Receiver(path)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    reported = 0

    def report_dropped() -> int:
        dropped = sum(receiver.dropped.values())
        if dropped > reported:
            print(f"dropped {dropped} bad datagram(s) so far: {receiver.dropped}",
                  file=sys.stderr, flush=True)
        return max(dropped, reported)

    try:
        while True:
            select.select([receiver], [], [], 1.0)
            got = receiver.receive()
            reported = report_dropped()  # before the events: a stop right after them loses none
            for event, _pid in got:
                print(json.dumps(events.to_dict(event)) if as_json else describe(event),
                      file=out, flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        report_dropped()  # a SIGTERM may land between a receive and its report
        receiver.close()


# the sidecar's sample log writes its own lines as {"kind":"sample"|"config"|"reload_outcome",...}
SIDECAR_LINE = re.compile(r'\s*\{"kind":\s*"(sample|config|reload_outcome)"')
MAX_LINE_PROBLEMS = 20  # per file: past this, a count (a wrong file is one line, not 10,000)


def check_events(paths: list[str], out: TextIO) -> int:
    """Count each file's events by kind; exit 2 naming every file that cannot be read or is
    not an event log, and every invalid line (the first MAX_LINE_PROBLEMS of a file)."""
    kinds: collections.Counter = collections.Counter()
    invalid = unusable = sidecar_lines = 0
    for path in paths:
        found: collections.Counter = collections.Counter()
        bad: list[str] = []
        try:
            for lineno, line in enumerate(read_lines(path), 1):
                if not line.strip():
                    continue
                try:
                    found[events.decode(line).kind] += 1
                except events.EventDecodeError as err:
                    if SIDECAR_LINE.match(line):  # the sample log holds events among these
                        sidecar_lines += 1
                    else:
                        bad.append(f"{lineno}: {err}")
        except InputError as err:
            unusable += 1
            print(f"torch-watchdog events: {err}", file=sys.stderr)
            continue
        if not found:  # a wrong file is one line, not one per line
            unusable += 1
            print(f"torch-watchdog events: {path}: " + (
                f"not an agent event log: none of its {len(bad):,} line(s) is an event "
                f"(line {bad[0]})" if bad else "no lines, only blank space"), file=sys.stderr)
            continue
        kinds.update(found)
        invalid += len(bad)
        for line in bad[:MAX_LINE_PROBLEMS]:
            print(f"{path}:{line}", file=sys.stderr)
        if len(bad) > MAX_LINE_PROBLEMS:
            print(f"{path}: ... and {len(bad) - MAX_LINE_PROBLEMS:,} more invalid line(s)",
                  file=sys.stderr)
    for kind, n in sorted(kinds.items()):
        print(f"{kind:18s} {n}", file=out)
    print(f"{sum(kinds.values())} valid events, {invalid} invalid lines"
          + (f", {unusable} unusable file(s)" if unusable else "")
          + (f" ({sidecar_lines} sidecar sample/config lines skipped)" if sidecar_lines else ""),
          file=out)
    return 2 if invalid or unusable else 0


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port 1..65535, got {port}")
    return port


def check_config(path: str, out: TextIO) -> int:
    from torch_watchdog.sidecar import config

    _, problems = config.check(path)
    for line in problems:
        print(f"torch-watchdog check-config: {path}: {line}", file=sys.stderr)
    if problems:
        return 2
    print(f"{path}: OK", file=out)
    return 0


def run_sidecar(config_path: Optional[str], dev_dir: Optional[str] = None) -> int:
    """Exit codes: 0 stopped by a signal, 1 could not start (another sidecar with this
    state_dir, socket, port), 2 bad config."""
    import structlog

    from torch_watchdog.sidecar import config, dev
    from torch_watchdog.sidecar.lock import take_lock

    structlog.configure(processors=[structlog.processors.add_log_level,
                                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                                    # log.exception's traceback as text, not `exc_info: true`
                                    structlog.processors.format_exc_info,
                                    structlog.processors.JSONRenderer()],
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    log = structlog.get_logger("torch-watchdog")
    setup = None
    if dev_dir is not None:
        try:
            setup = dev.prepare(dev_dir)
        except OSError as e:
            print(f"torch-watchdog sidecar: --dev {dev_dir}: {e}", file=sys.stderr)
            return 2
        config_path = setup.config_path
    cfg, problems = config.check(config_path) if config_path else (
        config.Config(), config.host_problems(config.Config()))
    if setup is not None and not problems:
        problems = [p for p in [dev.socket_problem(cfg.agent.socket_path)] if p]
    if problems:
        log.error("bad config", path=config_path, problems=problems)
        return 2
    try:  # before any file is renamed or written: a refused start changes nothing
        held = take_lock(cfg.state_dir)
    except OSError as e:
        log.error("cannot start", error=f"{e.strerror}: {e.filename}" if e.filename else str(e),
                  state_dir=cfg.state_dir)
        return 1
    try:
        return _run_locked(cfg, config_path, log, setup)
    finally:
        os.close(held)


def _run_locked(cfg: Config, config_path: Optional[str], log: Any,
                setup: Optional[DevSetup]) -> int:
    """The sidecar, its lock held: the earlier run's sample log set aside, the daemon run."""
    from torch_watchdog.sidecar import dev
    from torch_watchdog.sidecar.daemon import Daemon

    previous_log = dev.rotate_sample_log(cfg.sample_log) if setup is not None else None
    daemon = Daemon(cfg, config_path, log)
    try:
        daemon.start()
    except OSError as e:
        log.error("cannot start", error=str(e), socket=cfg.agent.socket_path,
                  metrics_port=cfg.metrics_port)
        daemon.halt()
        return 1
    if setup is not None:
        # once the socket is bound and the port taken: what it prints is then true
        from torch_watchdog.sidecar.present.web import local_url
        lines = dev.write_env(setup, cfg.agent.socket_path)
        print(dev.banner(setup, lines, local_url(cfg.metrics_address, cfg.metrics_port),
                         previous_log), flush=True)
    # what start-up built (modules, config, sources: ~37,000 objects) lives as long as the
    # process: frozen out of the cycle collector's sight, a collection walks only what the loop
    # allocated since (at 1,000 events/s the decode's allocations set off collections of the
    # old generation that walked it all: benchmarks/results/sidecar_cost.md)
    gc.collect()
    gc.freeze()
    return daemon.run()


def load_config(path: Optional[str], command: str) -> Any:
    """The config in `path` (the defaults without one), or None after printing every problem.
    The file's values only: whether its directories are writable here is the sidecar's
    business (check-config), not that of a command reading recordings or asking for status."""
    from torch_watchdog.sidecar import config

    if not path:
        return config.Config()
    cfg, problems = config.check(path, host=False)
    for line in problems:
        print(f"torch-watchdog {command}: {path}: {line}", file=sys.stderr)
    return cfg


def inputs_readable(paths: list[str], command: str, hint: str = "") -> bool:
    """Each input file's first problem (missing, a directory, empty, binary), one line each."""
    bad = [(path, what) for path in paths if (what := problem(path)) is not None]
    for path, what in bad:
        print(f"torch-watchdog {command}: {path}: {what}{hint}", file=sys.stderr)
    return not bad


def run_replay(paths: list[str], config_path: Optional[str], as_json: bool, out: TextIO) -> int:
    """Exit codes: 0 replayed, 2 a config or an input that cannot be used (one line each)."""
    from torch_watchdog.sidecar.offline.replay import replay, since_start
    from torch_watchdog.sidecar.offline.replay_text import summary

    cfg = load_config(config_path, "replay")
    if cfg is None or not inputs_readable(paths, "replay"):
        return 2
    try:
        # without --config, the configs the live sidecar recorded in its sample log apply
        result = replay(paths, cfg, lambda line: print(line, file=sys.stderr, flush=True),
                        follow_config=config_path is None)
    except InputError as err:  # unreadable part-way (a truncated gzip), or nothing usable
        print(f"torch-watchdog replay: {err}", file=sys.stderr)
        return 2
    info = result["replay"]
    if info["observations"] == 0:
        print(f"torch-watchdog replay: nothing in {', '.join(paths)} could be used "
              f"({info['used_lines']:,} line(s) read, none an observation)", file=sys.stderr)
        return 2
    if as_json:
        json.dump(result, out, indent=1)
        out.write("\n")
        return 0
    for line in summary(result, lambda t: since_start(t, info["first_t"])):
        print(line, file=out)
    return 0


def valid_url(url: str) -> bool:
    """http(s)://HOST[:PORT][/...]: what `--url` must look like."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port that is not a number)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def run_unfreeze(server: str, config_path: Optional[str], out: TextIO) -> int:
    """A request file in the sidecar's state directory (actions/requests.py), taken at its next
    poll; 2 for a bad --config, 1 when the directory cannot be written (not the sidecar's
    user: under systemd, run it as root)."""
    from torch_watchdog.sidecar.actions.requests import write_request

    cfg = load_config(config_path or _dev_config(), "unfreeze")
    if cfg is None:
        return 2
    try:
        path = write_request(cfg.state_dir, server, "unfreeze")
    except OSError as err:
        print(f"torch-watchdog unfreeze: cannot write the request in {cfg.state_dir}/requests: "
              f"{err.strerror or err} (run it as the sidecar's user, or give --config)",
              file=sys.stderr)
        return 1
    out.write(f"asked the sidecar to unfreeze {server} ({path}); it takes the request at its "
              "next poll: `torch-watchdog status` shows the freeze gone, its log says "
              "\"unfreeze sent\"\n")
    return 0


def _dev_config() -> Optional[str]:
    """The config of a `sidecar --dev` run in this directory, if any."""
    from torch_watchdog.sidecar import dev

    here = os.path.join(dev.DEFAULT_DIR, dev.CONFIG_NAME)
    return here if os.path.isfile(here) else None


def run_status(url: Optional[str], config_path: Optional[str], as_json: bool,
               out: TextIO, server: Optional[str] = None) -> int:
    """Print a running sidecar's /status.json; 1 when none answers at that address, 2 for a
    bad --url or --config or a --server it does not know (its servers listed), 3 when it
    answers but its last poll is stale."""
    import time

    from torch_watchdog.sidecar.present.status import format_terminal, stale_s
    from torch_watchdog.sidecar.present.web import local_url, read_status

    if url is None:
        if config_path is None:  # in the directory of a `sidecar --dev`: its config
            config_path = _dev_config()
        cfg = load_config(config_path, "status")
        if cfg is None:
            return 2
        url = local_url(cfg.metrics_address, cfg.metrics_port)
    elif not valid_url(url):
        print(f"torch-watchdog status: --url {url!r} is not a URL: give the sidecar's address "
              "as http://HOST:PORT, e.g. http://127.0.0.1:9464", file=sys.stderr)
        return 2
    try:
        data = read_status(url, server=server)
    except (OSError, ValueError) as err:
        print(f"torch-watchdog: no sidecar is running at {url} "
              f"({getattr(err, 'reason', None) or err}).\nStart it with `torch-watchdog sidecar "
              "--config FILE` (under systemd: `systemctl start torch-watchdog`), or point "
              "--url/--config at the address it listens on.", file=sys.stderr)
        return 1
    now = time.time()
    asked = (data.get("detail") or {}).get("asked")
    if asked is not None:  # shown another server's numbers instead, it said nothing wrong
        names = [str(r.get("server")) for r in data.get("servers") or []]
        print(f"torch-watchdog status: no server {asked!r} on this sidecar; its servers: "
              f"{', '.join(names) or 'none yet'}", file=sys.stderr)
        return 2
    if as_json:
        json.dump(data, out, indent=1)
        out.write("\n")
    else:
        out.write(format_terminal(data, url, now))
    late = stale_s(data, now)
    if late is not None:  # a sidecar that answers but no longer polls is no watchdog
        print(f"torch-watchdog status: the last poll was {late:.0f} s ago: the sidecar is not "
              "polling (its log says why)", file=sys.stderr)
        return 3
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand but `run` (the launcher's own parser: launcher.build_parser)."""
    p = argparse.ArgumentParser(
        prog="torch-watchdog", description="Watch PyTorch inference servers that use "
        "torch.compile: the agent's events, GPU memory, the time to OOM, alerts and a graceful "
        "reload before the crash. Exit codes: 0 ok, 1 runtime failure, 2 bad input.")
    p.add_argument("--version", action="version", version=f"torch-watchdog {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="`torch-watchdog COMMAND --help` says more")

    def command(name: str, what: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=what, description=what)

    lp = command("listen", "print the agent's events as they arrive: binds the socket the "
                 "agents send to, in place of a sidecar (to see what an agent sends)")
    lp.add_argument("--socket", default=os.environ.get("TORCH_WATCHDOG_SOCKET",
                                                   AgentSocketConfig().socket_path),
                    help="the datagram socket to bind (default: $TORCH_WATCHDOG_SOCKET, else "
                    "%(default)s)")
    lp.add_argument("--json", action="store_true", help="one JSON object per line")
    ep = command("events", "check an agent event log (.jsonl or .jsonl.gz): every line "
                 "decoded, a summary per kind")
    ep.add_argument("files", nargs="+", help="the agent's event logs (TORCH_WATCHDOG_EVENT_LOG)")
    rp = command("replay", "run fold/forecast/decide over recorded traces")
    rp.add_argument("traces", nargs="+", help=".jsonl or .jsonl.gz: agent event logs, "
                    "recorded traces")
    rp.add_argument("--config", help="sidecar config (YAML); defaults otherwise")
    rp.add_argument("--json", action="store_true", help="print the whole result as JSON (the "
                    "default: a summary per server, what was decided, when and why)")
    rep = command("report", "an HTML post-mortem of event logs and recorded traces")
    rep.add_argument("files", nargs="+", help=".jsonl or .jsonl.gz: agent event logs, the "
                     "sidecar's sample log, recorded traces")
    rep.add_argument("-o", "--output", default="report.html",
                     help="the HTML file to write (default: %(default)s)")
    rep.add_argument("--config", help="sidecar config (YAML); defaults otherwise")
    rep.add_argument("--json", action="store_true", help="also print the report's numbers")
    cp = command("check-config", "validate a sidecar config file")
    cp.add_argument("file", help="the YAML config; every problem is listed at once (exit 2)")
    sp = command("sidecar", "run the daemon")
    sp.add_argument("--config", help="YAML config (config/watchdog.yaml documents every key)")
    sp.add_argument("--dev", nargs="?", const=DEV_DIR, metavar="DIR",
                    help="no root: state, socket and sample log in DIR (default "
                    "./.torch-watchdog, its watchdog.yaml written the first time); prints the "
                    "server's environment and saves it in DIR/env")
    stp = command("status", "summarise a running sidecar (its /status.json)")
    stp.add_argument("--url", help="the sidecar's HTTP address, e.g. http://127.0.0.1:9464 "
                     "(default: metrics_address and metrics_port of --config, else of "
                     "./.torch-watchdog/watchdog.yaml where `sidecar --dev` ran here, else "
                     "the defaults)")
    stp.add_argument("--config", help="sidecar config (YAML) to take the port from")
    stp.add_argument("--json", action="store_true", help="print the status JSON as is")
    stp.add_argument("--server", metavar="NAME", help="one server's numbers, chart data and "
                     "actions (default: every server's row, and the one nearest to OOM)")
    up = command("unfreeze", "ask the sidecar to end a server's freeze (policy.remedy): its "
                 "agents record CUDA graphs for new sizes again, and that process of it is "
                 "not frozen again")
    up.add_argument("server", help="the server's name, as `torch-watchdog status` lists it")
    up.add_argument("--config", help="the sidecar's config (YAML), for its state_dir (default: "
                    "./.torch-watchdog/watchdog.yaml where `sidecar --dev` ran here, else "
                    "the defaults)")
    command("run", "the standby launcher: torch-watchdog run [options] -- python "
                   "server.py args... (see torch-watchdog run --help)")
    dp = command("demo", "a small torch.compile server, the agent and the sidecar, "
                        "end to end (CPU is enough)")
    dp.add_argument("--short", action="store_true",
                    help="CI mode: fewer requests, a smaller budget, shorter timings")
    dp.add_argument("--workdir", help="directory for the config, logs and report "
                    "(default: a new temporary directory, printed)")
    dp.add_argument("--keep", action="store_true", help="at the end, leave the sidecar and the "
                    "server running (status page, /metrics) until Ctrl-C")
    dp.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: cuda if torch sees a GPU, else cpu")
    dp.add_argument("--port", type=_port, default=None,
                    help="the sidecar's status page and /metrics port (default: a free one)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # the standby launcher: its own parser, everything after `--` is
        from torch_watchdog import launcher  # the server's; imported lazily (never torch)
        return launcher.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then one more case below
        return code
    except BrokenPipeError:
        # the reader of stdout went away (`... | head`): stop quietly with the status a tool
        # killed by SIGPIPE has (128 + 13), as `seq 100000 | head` does; later writes and the
        # flush at exit go to /dev/null instead of printing a second error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130


_PLAIN: dict[str, Callable[[argparse.Namespace], int]] = {
    "listen": lambda a: listen(a.socket, a.json, sys.stdout),
    "replay": lambda a: run_replay(a.traces, a.config, a.json, sys.stdout),
    "check-config": lambda a: check_config(a.file, sys.stdout),
    "status": lambda a: run_status(a.url, a.config, a.json, sys.stdout, a.server),
    "unfreeze": lambda a: run_unfreeze(a.server, a.config, sys.stdout),
}


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command in _PLAIN:
            return _PLAIN[args.command](args)
        if args.command == "report":
            from torch_watchdog.sidecar.offline import report
            cfg = load_config(args.config, "report")
            if cfg is None or not inputs_readable(args.files, "report",
                                                  f"; {report.USAGE_HINT}"):
                return 2
            return report.main(args.files, args.output, cfg, args.json,
                                                     sys.stdout, args.config is None)
        if args.command == "sidecar":
            if args.dev is not None and args.config:
                print("torch-watchdog sidecar: --dev uses DIR/watchdog.yaml; give --dev or "
                      "--config, not both", file=sys.stderr)
                return 2
            return run_sidecar(args.config, args.dev)
        if args.command == "demo":
            from torch_watchdog import demo  # the product's commands never load the demo
            return demo.run(args, sys.stdout)
        return check_events(args.files, sys.stdout)
    except BrokenPipeError:
        raise
    except OSError as err:
        print(f"torch-watchdog: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
