"""Every recorded log replays to the same output, byte for byte, before and after a change of
the sidecar's code: the proof a refactoring changed no decision.

For each log in tests/fixtures/ and tests/fixtures/corpus/, under two configs (the default,
following the configs a sample log recorded; and `reload.method: signal` ignoring them, so
decisions are carried out or cancelled), the output of `torch-watchdog replay --json` (the
findings, every action, every server's numbers) less its wall-clock timings, one file each:

    python benchmarks/replay_identity.py --write DIR    # the outputs of this checkout's code
    python benchmarks/replay_identity.py --check DIR    # exit 1 where one differs from DIR's

To compare with an older commit, write DIR from a checkout of it (its own `torch_watchdog` on
PYTHONPATH, ahead of this one's), then `--check DIR` here. It uses only `replay.replay`, which
the CLI calls, so the same script runs against either.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after PYTHONPATH: an older checkout's package may come first

from torch_watchdog.sidecar.config import Config  # noqa: E402
from torch_watchdog.sidecar.offline.replay import replay  # noqa: E402

FIX = os.path.join(ROOT, "tests", "fixtures")


def logs() -> list[str]:
    return sorted(glob.glob(os.path.join(FIX, "*.jsonl.gz")) +
                  glob.glob(os.path.join(FIX, "corpus", "*.jsonl.gz")))


def configs() -> dict[str, tuple[Config, bool]]:
    signal = dataclasses.replace(Config(), reload=dataclasses.replace(Config().reload,
                                                                      method="signal"))
    return {"default": (Config(), True), "signal": (signal, False)}


def output(path: str, cfg: Config, follow: bool) -> str:
    out: dict[str, Any] = replay([path], cfg, follow_config=follow)
    timing = out["replay"]
    for key in ("wall_seconds", "speed", "files"):  # the machine's, and where it ran
        timing.pop(key, None)
    return json.dumps(out, sort_keys=True, indent=0, default=repr) + "\n"


def name_of(path: str, config: str) -> str:
    rel = os.path.relpath(path, FIX).replace(os.sep, "__")
    return f"{rel.removesuffix('.jsonl.gz')}.{config}.json"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="DIR")
    g.add_argument("--check", metavar="DIR")
    a = p.parse_args()
    differ = 0
    for path in logs():
        for config, (cfg, follow) in configs().items():
            text, name = output(path, cfg, follow), name_of(path, config)
            if a.write:
                os.makedirs(a.write, exist_ok=True)
                with open(os.path.join(a.write, name), "w") as f:
                    f.write(text)
                continue
            with open(os.path.join(a.check, name)) as f:
                want = f.read()
            if text != want:
                differ += 1
                line = next(i for i, (x, y) in enumerate(
                    zip(text.splitlines() + [""], want.splitlines() + [""])) if x != y)
                print(f"{name}: differs from line {line + 1}")
    n = len(logs()) * len(configs())
    print(f"{n - differ} of {n} replays the same" if a.check else f"{n} written to {a.write}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
