"""The rules an SRE writes today instead of the sidecar, replayed on the judgment corpus beside it
(`benchmarks/judgment.py --peers`; issue 51, item 5).

Each peer reads what Prometheus would hold from NVML (dcgm-exporter's `DCGM_FI_DEV_FB_USED`, or
nvidia_gpu_exporter): the server's used GPU memory, scraped every 15 s, rules evaluated at each
scrape, against the memory the server can reach (the label's budget: the emulated GPU, or the
real device's reach). A peer's first firing before the OOM is scored as its reload, with the
sidecar's verdicts (hit, late, missed, false reload; too early):

- `predict_linear 1h/30m for 5m`: `predict_linear(used[1h], 1800) > total` with `for: 5m`, the
  alert of public guides;
- `predict_linear 5m/lead for 1m`: `predict_linear(used[5m], reload_lead_s) > total` with
  `for: 1m`, the same rule as a reload trigger;
- each of the two `after start-up`: also `time() - process_start_time_seconds > 300`, the
  exclusion a careful SRE adds (a model load is a step up);
- `used/total > 0.9 for 5m`: the static threshold;
- `gpu-watchdog 30 %/10 min`: used memory up >= 30 % on its value 10 min before (or the oldest
  scrape within them);
- `Mann-Kendall + Sen, change point`: the literature's trend test (pymannkendall's
  `original_test`, p < 0.05, rising) over the scrapes since the last change point in the last
  hour (ruptures' PELT over piecewise lines, a BIC penalty on the scrapes' own noise, found
  again every 2 min), firing when the Sen slope reaches the total within reload_lead_s.

`pip install -e ".[peers]"` (pymannkendall, ruptures) for the last; the others need nothing.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Iterable, Optional

from torch_watchdog.sidecar.core.observations import Sample

SCRAPE_S = 15.0          # the scrape and evaluation interval the rules assume
START_UP_S = 300.0       # `time() - process_start_time_seconds > 300`
Series = list[tuple[float, float]]   # (scrape time, used bytes)


def scrapes(observations: Iterable[Any], pids: Iterable[int]) -> dict[int, Series]:
    """Each pid's used GPU memory (its NVML usedGpuMemory, summed over devices) as a scrape
    every SCRAPE_S would have read it: the last poll at or before each scrape time."""
    want = set(pids)
    last: dict[int, float] = {}
    out: dict[int, Series] = {p: [] for p in want}
    due: Optional[float] = None
    for obs in observations:
        if not isinstance(obs, Sample):
            continue
        if due is None:
            due = obs.t
        while due < obs.t:   # the scrapes before this poll read the polls before it
            for pid, v in last.items():
                out[pid].append((due, v))
            due += SCRAPE_S
        for p in obs.processes:
            if p.pid in want:
                used = [b for b in p.gpu_bytes.values() if b is not None]
                if p.alive and used:
                    last[p.pid] = float(sum(used))
                else:
                    last.pop(p.pid, None)
    return out


def predict_linear(series: Series, i: int, range_s: float, ahead_s: float) -> Optional[float]:
    """Prometheus' predict_linear(v[range], ahead) evaluated at scrape i: the least-squares line
    through the scrapes in (t - range, t], read ahead_s after t."""
    t = series[i][0]
    pts = [(ts - t, v) for ts, v in series[max(0, i - int(range_s / SCRAPE_S)):i + 1]
           if ts > t - range_s]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    return my + slope * (ahead_s - mx)


def held_for(series: Series, cond: Callable[[int], bool], for_s: float) -> Optional[float]:
    """A Prometheus alert's firing time: `cond` true at every evaluation for `for_s`."""
    pending: Optional[float] = None
    for i, (t, _) in enumerate(series):
        if cond(i):
            pending = t if pending is None else pending
            if t - pending >= for_s:
                return t
        else:
            pending = None
    return None


def _linear(range_s: float, ahead: Optional[float], for_s: float, start_up: bool):
    def fire(series: Series, total: float, start: float, lead_s: float) -> Optional[float]:
        ahead_s = lead_s if ahead is None else ahead

        def cond(i: int) -> bool:
            if start_up and series[i][0] - start <= START_UP_S:
                return False
            p = predict_linear(series, i, range_s, ahead_s)
            return p is not None and p > total
        return held_for(series, cond, for_s)
    return fire


def _static(series: Series, total: float, start: float, lead_s: float) -> Optional[float]:
    return held_for(series, lambda i: series[i][1] > 0.9 * total, 300.0)


def _gpu_watchdog(series: Series, total: float, start: float, lead_s: float
                  ) -> Optional[float]:
    def cond(i: int) -> bool:
        t, v = series[i]
        back = next(((ts, b) for ts, b in series[max(0, i - 40):i] if ts >= t - 600.0), None)
        return back is not None and back[1] > 0 and v >= 1.3 * back[1]
    return held_for(series, cond, 0.0)


def _linear_cost() -> Any:
    """A segment's cost for ruptures: the squared residual of its least-squares line, from
    prefix sums (O(1) a segment; ruptures' own `linear` cost solves each by lstsq). A ramp
    is one segment; a step (a model load) ends one. ruptures' `l2` cost, a mean per segment,
    cuts a ramp every few scrapes. (ruptures uses a custom cost only if it is a BaseCost.)"""
    import numpy as np
    from ruptures.base import BaseCost

    class LinearCost(BaseCost):
        model, min_size = "linear-prefix", 2

        def fit(self, signal: Any) -> "LinearCost":
            y = np.asarray(signal, dtype=float).reshape(-1)
            self.signal = y.reshape(-1, 1)
            t = np.arange(len(y), dtype=float)
            self.sums = [np.concatenate(([0.0], np.cumsum(v))).tolist()
                         for v in (t, y, t * t, t * y, y * y)]
            return self

        def error(self, start: int, end: int) -> float:
            n = end - start
            st, sy, stt, sty, syy = (c[end] - c[start] for c in self.sums)
            sxx, sxy, sse = stt - st * st / n, sty - st * sy / n, syy - sy * sy / n
            return max(sse - (sxy * sxy / sxx if sxx > 0 else 0.0), 0.0)

    return LinearCost()


def _change_point(window: Any) -> int:
    """Where the last regime of `window` (MiB) starts: PELT, a BIC penalty on the scrapes' own
    noise (the median absolute second difference), floored at one 2 MiB segment."""
    import numpy as np
    import ruptures

    if len(window) < 8:
        return 0
    noise = float(np.median(np.abs(np.diff(window, 2)))) / 0.6745 / math.sqrt(6)
    pen = 2 * math.log(len(window)) * max(noise, 2.0) ** 2
    bkps = ruptures.Pelt(custom_cost=_linear_cost(), min_size=4, jump=1).fit(
        window).predict(pen=pen)
    return bkps[-2] if len(bkps) > 1 else 0


def _mann_kendall(series: Series, total: float, start: float, lead_s: float
                  ) -> Optional[float]:
    import numpy as np
    import pymannkendall

    hour = int(3600 / SCRAPE_S)
    cut_at, cut = -1, 0      # the change point: found again every 8 scrapes (2 min) past 60
    for i in range(len(series)):
        lo = max(0, i - hour)
        window = np.array([v for _, v in series[lo:i + 1]]) / (1 << 20)
        if cut_at < 0 or len(window) < 60 or i - cut_at >= 8:
            cut_at, cut = i, lo + _change_point(window)
        seg = window[max(cut, lo) - lo:]
        if len(seg) < 8 or float(np.ptp(seg)) == 0.0:
            continue
        mk = pymannkendall.original_test(seg)
        if mk.trend == "increasing" and mk.p < 0.05 and \
                seg[-1] + mk.slope * (lead_s / SCRAPE_S) >= total / (1 << 20):
            return series[i][0]
    return None


PEERS: dict[str, Callable[[Series, float, float, float], Optional[float]]] = {
    "predict_linear 1h/30m for 5m": _linear(3600.0, 1800.0, 300.0, False),
    "predict_linear 1h/30m for 5m, after start-up": _linear(3600.0, 1800.0, 300.0, True),
    "predict_linear 5m/lead for 1m": _linear(300.0, None, 60.0, False),
    "predict_linear 5m/lead for 1m, after start-up": _linear(300.0, None, 60.0, True),
    "used/total > 0.9 for 5m": _static,
    "gpu-watchdog 30 %/10 min": _gpu_watchdog,
    "Mann-Kendall + Sen, change point": _mann_kendall,
}


def fire_times(series: Series, total: float, start: float, lead_s: float
               ) -> dict[str, Optional[float]]:
    """Each peer's first firing over the series (None: never)."""
    return {name: rule(series, total, start, lead_s) for name, rule in PEERS.items()}


def lead_ratio_median(rows: list[dict[str, Any]]) -> Optional[float]:
    got = [r["lead_s"] / r["oracle_lead_s"] for r in rows
           if r["verdict"] == "hit" and r.get("oracle_lead_s")]
    return round(statistics.median(got), 2) if got else None
