"""The sidecar's judgment, scored: replays the corpus of real GPU runs (tests/fixtures/corpus,
recorded by benchmarks/record_corpus.py) through the step the daemon runs and prints, per
scenario, what it decided and when, against the truth.

    python benchmarks/judgment.py [--json] [--check benchmarks/results/judgment.json]

Per server of a scenario: its first reload decision before its OOM and that decision's lead
(seconds before the OOM), the lead an oracle would have had (the first poll at which the true
time to OOM was <= reload_lead_s), and the alerts. Verdicts:
- an OOM whose growth was visible >= 60 s before it: `hit` when reloaded >= 20 s before the
  OOM with at least half the oracle's lead, else `late` or `missed`;
- an OOM with less to see (growth under 60 s, or none): `hit`/`late`/`missed` too, scored but
  outside the targets; with no trend at all a reload before it is `false reload`;
- no OOM: `ok`, or `false reload`; on a flat control also `false alert` for any alert.
`--check`: exit 1 if any scenario scores worse than in the given scoreboard (a verdict that was
good and is not, a lead more than 1 s shorter, more alerts on a flat control).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from torch_watchdog.sidecar.config import Config  # noqa: E402
from torch_watchdog.sidecar.offline.replay import run  # noqa: E402
from torch_watchdog.sidecar.offline.traces import Reader, read_all  # noqa: E402

CORPUS = os.path.join(ROOT, "tests", "fixtures", "corpus")
VISIBLE_S = 60.0     # growth visible this long before the OOM: in the targets
MIN_LEAD_S = 20.0
FLAT = {"bucketed-control", "plateau-99.5", "sawtooth", "shared-flat"}
GOOD = {"hit", "ok"}


def score_file(name: str, label: dict) -> list[dict[str, Any]]:
    path = os.path.join(CORPUS, label["file"])
    seen: dict[int, float] = {}   # pid -> when the sidecar first heard of it

    def observe(obs, _state, _decided) -> None:
        pid = getattr(obs, "pid", None)
        if isinstance(pid, int) and getattr(obs, "kind", None) == "hello":
            seen.setdefault(pid, obs.t)

    r = run(read_all([Reader(path)], None, "judgment"), Config(), observe=observe)
    cfg = r.config or Config()
    lead_s = cfg.policy.reload_lead_s
    rows = []
    for pid_s, truth in sorted(label["servers"].items()):
        pid = int(pid_s)
        server = next((n for n, s in r.host.servers.items() if pid in s.state.pids), None)
        mine = [a for a in r.actions if a.server == server] if server else []
        oom = truth["oom_t"]
        # until the OOM, or the end of a run that had none (after it, its pids are no one's)
        before = [a for a in mine if a.t < (oom if oom is not None else truth["end_t"])]
        reloads = [a for a in before if a.kind.value == "reload"]
        alerts = sorted({a.reason for a in before if a.kind.value == "alert"})
        first = seen.get(pid, truth["compiled_t"])
        row: dict[str, Any] = {"scenario": truth["scenario"], "file": name, "server": server,
                               "oom": oom is not None, "reloads": len(reloads),
                               "alerts": alerts}
        if oom is not None:
            oracle = oom - max(first, oom - lead_s)
            lead = round(oom - reloads[0].t, 1) if reloads else None
            visible = truth["growth_visible_s"]
            row.update(growth_visible_s=visible, lead_s=lead, oracle_lead_s=round(oracle, 1),
                       in_targets=visible >= VISIBLE_S)
            if visible == 0.0:
                row["verdict"] = "false reload" if reloads else "ok"
            elif lead is None:
                row["verdict"] = "missed"
            elif lead >= MIN_LEAD_S and lead >= 0.5 * oracle:
                row["verdict"] = "hit"
            else:
                row["verdict"] = "late"
        else:
            row["verdict"] = "false reload" if reloads else \
                "false alert" if alerts and truth["scenario"] in FLAT else "ok"
        rows.append(row)
    return rows


def scoreboard() -> dict[str, Any]:
    with open(os.path.join(CORPUS, "labels.json")) as fh:
        labels = json.load(fh)
    rows = [row for name, label in sorted(labels.items()) for row in score_file(name, label)]
    target = [r for r in rows if r.get("in_targets")]
    return {"rows": rows, "recall": f"{sum(r['verdict'] == 'hit' for r in target)}/{len(target)}",
            "false_reloads": sum(r["verdict"] == "false reload" for r in rows),
            "false_alerts": sum(len(r["alerts"]) for r in rows if r["scenario"] in FLAT),
            "targets_met": all(r["verdict"] in GOOD for r in rows
                               if r.get("in_targets") or not r["oom"]
                               or r.get("growth_visible_s") == 0.0)}


def regressions(now: dict[str, Any], before: dict[str, Any]) -> list[str]:
    old = {(r["file"], r["scenario"]): r for r in before["rows"]}
    out = []
    for r in now["rows"]:
        was: Optional[dict] = old.get((r["file"], r["scenario"]))
        if was is None:
            continue
        key = f"{r['file']}/{r['scenario']}"
        if was["verdict"] in GOOD and r["verdict"] not in GOOD:
            out.append(f"{key}: {was['verdict']} -> {r['verdict']}")
        if was.get("lead_s") is not None and (r.get("lead_s") is None
                                              or r["lead_s"] < was["lead_s"] - 1.0):
            out.append(f"{key}: lead {was['lead_s']} s -> {r.get('lead_s')}")
        if r["scenario"] in FLAT and len(r["alerts"]) > len(was["alerts"]):
            out.append(f"{key}: alerts {was['alerts']} -> {r['alerts']}")
    return out


def table(board: dict[str, Any]) -> str:
    lines = ["| scenario | OOM (growth seen) | verdict | lead | oracle | alerts |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in board["rows"]:
        oom = f"yes ({r['growth_visible_s']:.0f} s)" if r["oom"] else "no"
        lead = "" if r.get("lead_s") is None else f"{r['lead_s']:.1f} s"
        oracle = "" if not r["oom"] else f"{r['oracle_lead_s']:.1f} s"
        name = r["scenario"] if r["file"] == r["scenario"] else f"{r['scenario']} ({r['file']})"
        lines.append(f"| {name} | {oom} | {r['verdict']} | {lead} | {oracle} | "
                     f"{', '.join(r['alerts']) or '-'} |")
    lines.append(f"\nrecall {board['recall']} (OOMs with growth seen >= {VISIBLE_S:.0f} s), "
                 f"false reloads {board['false_reloads']}, alerts on flat controls "
                 f"{board['false_alerts']}, targets met: {board['targets_met']}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", help="a scoreboard (--json output) that must not be beaten down")
    a = p.parse_args()
    board = scoreboard()
    print(json.dumps(board, indent=1) if a.json else table(board))
    if a.check:
        with open(a.check) as fh:
            worse = regressions(board, json.load(fh))
        for line in worse:
            print("regression:", line, file=sys.stderr)
        return 1 if worse else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
