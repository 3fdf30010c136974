"""The decisions every fixture replays to, written once and compared byte for byte.

For each recorded trace and sample log in tests/fixtures/ and tests/fixtures/corpus/, and each
of two configs (the default,
following the configs a sample log recorded; and `reload.method: signal` with the sample log's
configs ignored, so decisions are re-checked, carried out or cancelled), one JSON line per
observation the step acted on: the actions it returned and every server's firing alerts where
they changed. A refactoring of the core must leave these files unchanged:

    .venv/bin/python -m tests.golden --write     # after a change of behaviour, on purpose
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import sys
from typing import Any, Iterator

from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core import step
from torch_watchdog.sidecar.offline.traces import Reader, read_all
from torch_watchdog.sidecar.core.observations import ConfigChange

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
GOLDEN = os.path.join(FIX, "replay-golden")
CONFIGS = {"default": (Config(), True),
           "signal": (dataclasses.replace(Config(), reload=dataclasses.replace(
               Config().reload, method="signal")), False)}


def fixtures() -> list[str]:
    """Names relative to tests/fixtures/ ("corpus/<name>.jsonl.gz" for the corpus's)."""
    return sorted(os.path.relpath(p, FIX) for pattern in ("*.jsonl.gz", "corpus/*.jsonl.gz")
                  for p in glob.glob(os.path.join(FIX, pattern)))


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=repr)


def decisions(name: str, config: str) -> Iterator[str]:
    """The lines of one fixture's golden file under one config."""
    cfg, follow = CONFIGS[config]
    host, firing, n = step.Host(), {}, 0
    for obs in read_all([Reader(os.path.join(FIX, name))]):
        n += 1
        if isinstance(obs, ConfigChange):
            cfg = obs.config if follow else cfg
            continue
        result = step.step(host, obs, cfg)
        decided = result.actions
        changed = {}
        for sname, fires in sorted(result.poll.firing.items() if result.poll else ()):
            now = _dumps(fires)
            if firing.get(sname, "{}") != now:
                firing[sname] = now
                changed[sname] = fires
        if decided or changed:
            yield _dumps({"t": round(obs.t, 6), "actions": [a.as_dict() for a in decided],
                          "firing": changed})
    yield _dumps({"end": True, "observations": n,
                  "servers": {s: step.estimates(v, cfg) for s, v in sorted(host.servers.items())}})


def path(name: str, config: str) -> str:
    return os.path.join(GOLDEN, f"{name.removesuffix('.jsonl.gz')}.{config}.jsonl.gz")


def write() -> None:
    for name in fixtures():
        os.makedirs(os.path.dirname(path(name, "default")), exist_ok=True)
        for config in CONFIGS:
            text = "\n".join(decisions(name, config)) + "\n"
            with gzip.GzipFile(path(name, config), "wb", mtime=0) as f:
                f.write(text.encode())
            print(f"{path(name, config)}: {text.count(chr(10))} lines")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    write()
