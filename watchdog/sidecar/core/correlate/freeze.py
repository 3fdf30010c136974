"""The freeze of a server's CUDA-graph recording: asked by the sidecar over the
control channel, answered by each agent with a `mitigation` event named `freeze` ("engaged",
"unavailable" and why, "released"). A reload or a restart ends it with the process (a new
state); `torch-watchdog unfreeze SERVER` ends it by hand."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch_watchdog import buckets, events

ADVICE_BUCKETS = 8        # the buckets a frozen server's alert proposes (the report's default)
ADVICE_MAX_SIZES = 4096   # sizes the advice is computed over at most (once, at the freeze)
MAX_LIMITED = 64          # graphs named by torch's re-record limit, kept per server


@dataclass
class Freeze:
    asked_t: Optional[float] = None     # the sidecar decided the freeze (dry run included)
    level_bytes: Optional[int] = None   # the server's memory then: growth past it did not stop
    engaged: dict[int, str] = field(default_factory=dict)   # pid -> what its agent said
    since: Optional[float] = None       # the first agent's "engaged"
    unavailable: Optional[str] = None   # an agent said it cannot freeze, and why
    released_t: Optional[float] = None  # unfrozen (by hand): no freeze again for this process
    advice: Optional[dict[str, Any]] = None   # the buckets that would end the growth
    # torch 2.15's own stop (cudagraph_dynamic_shape_rerecord_limit): graph -> the limit
    limited: dict[str, int] = field(default_factory=dict)

    @property
    def frozen(self) -> bool:
        return bool(self.engaged)

    def on_mitigation(self, e: events.Mitigation) -> None:
        if e.name != "freeze":
            return
        if e.action == "engaged":
            self.engaged[e.pid] = e.detail
            self.since = e.t if self.since is None else self.since
            if self.asked_t is None:   # an earlier sidecar asked (the agent restates it)
                self.asked_t = e.t
        elif e.action == "unavailable":
            self.unavailable = e.detail
        elif e.action == "released":
            self.engaged.pop(e.pid, None)
            if not self.engaged:
                self.released_t, self.since = e.t, None

    def on_limit(self, e: events.CudagraphWarning) -> None:
        if e.rerecord_limit is not None and len(self.limited) < MAX_LIMITED:
            self.limited[str(e.graph)] = e.rerecord_limit

    def ask(self, t: float, level_bytes: Optional[int], shape_keys: dict[str, set[Any]]
            ) -> None:
        self.asked_t, self.level_bytes = t, level_bytes
        self.advice = advice(shape_keys)

    def view(self) -> Optional[dict[str, Any]]:
        """As shown (status, page, the alert); None: never asked, and torch stopped nothing."""
        if self.asked_t is None:
            return {"frozen": False, "asked_t": None, "rerecord_limited": dict(self.limited)} \
                if self.limited else None
        sizes = [_sizes(d) for d in self.engaged.values()]
        return {"frozen": self.frozen, "asked_t": round(self.asked_t, 3),
                "since": None if self.since is None else round(self.since, 3),
                "sizes_kept": max((s for s in sizes if s is not None), default=None),
                "processes": len(self.engaged), "unavailable": self.unavailable,
                "released_t": self.released_t, "advice": self.advice,
                "rerecord_limited": dict(self.limited)}


def _sizes(detail: str) -> Optional[int]:
    """The sizes an agent's "engaged" detail says were kept ("312 sizes recorded; ...",
    "already stopped at 312 sizes ...")."""
    words = detail.replace(";", " ").split()
    for i, w in enumerate(words[1:], 1):
        if w == "sizes" and words[i - 1].isdigit():
            return int(words[i - 1])
    return None


def advice(shape_keys: dict[str, set[Any]]) -> Optional[dict[str, Any]]:
    """The buckets (bucket advisor) that cover the sizes seen so far of the watched callable
    with the most of them: its first argument's varying dimension, each size once."""
    if not shape_keys:
        return None
    name, keys = max(shape_keys.items(), key=lambda kv: len(kv[1]))
    firsts = [k[0] for k in list(keys)[:ADVICE_MAX_SIZES]
              if isinstance(k, tuple) and k and isinstance(k[0], tuple)
              and all(isinstance(d, int) for d in k[0])]
    ranks = {len(s) for s in firsts}
    if len(ranks) != 1:
        return None
    dim = buckets.varying_dimension(firsts)
    if dim is None:
        return None
    got = buckets.advise(buckets.size_counts(firsts, dim), ADVICE_BUCKETS)
    return {"model": name, "dimension": dim, "buckets": list(got.boundaries),
            "sizes_seen": got.graphs_before}
