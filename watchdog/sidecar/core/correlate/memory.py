"""The memory part of a server's state: its memory on one meter (per-process GPU bytes, else
the device's used, else in host-memory mode its PSS), each GPU's numbers, and how much of the
growth recordings and compiles explain.

MB per graph is the slope of the server's memory on recordings, poll by poll (no intercept;
one poll's step above `jump_bytes` is an allocator or compile step and is kept out), with a
confidence."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, cast

from torch_watchdog.sidecar.config.schema import CorrelateConfig
from torch_watchdog.sidecar.core import horizons
from torch_watchdog.sidecar.core.observations import ProcessSample, Sample
from torch_watchdog.sidecar.core.trend import Trend

COMPILE_SETTLE_S = 10.0  # memory steps this long after a compile are the compile's
# a step may belong to a compile still running: Inductor compiles of the models measured took
# 6-14 s each, and the compile's event comes only at its end
PENDING_S = 60.0


@dataclass
class Regression:
    """y = b·x through the origin, accumulated one interval at a time."""
    n: int = 0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sxx += x * x
        self.sxy += x * y
        self.syy += y * y

    @property
    def slope(self) -> Optional[float]:
        return self.sxy / self.sxx if self.sxx > 0 else None

    @property
    def confidence(self) -> float:
        """1 - (standard error / slope), clipped to [0, 1]."""
        b = self.slope
        if b is None or b <= 0 or self.n < 3:
            return 0.0
        residual = max(0.0, self.syy - 2 * b * self.sxy + b * b * self.sxx)
        se = math.sqrt(residual / (self.n - 1) / self.sxx)
        return max(0.0, min(1.0, 1.0 - se / b))


@dataclass
class Memory:
    bytes: Optional[int] = None           # the server's memory, on `source`'s meter
    source: Optional[str] = None          # "process" | "device" | "rss"
    start: Optional[int] = None           # where growth counts from (after the warm-up)
    per_process: dict[int, int] = field(default_factory=dict)  # pid -> its memory, same meter
    device_used: Optional[int] = None
    device_total: Optional[int] = None
    device_usable: Optional[int] = None  # used + free: total less what the driver reserves
    host_used: Optional[int] = None
    host_total: Optional[int] = None
    host_available: Optional[int] = None
    # host-memory mode: the server's cgroup memory limit (the lowest of its processes')
    limit: Optional[int] = None
    # per GPU of this server: uuid -> (device used, usable = used + free, this server's bytes
    # there or None): each GPU is forecast against its own budget (two GPUs summed into one
    # budget hide one of them filling up while the other has room)
    gpus: dict[str, tuple[int, int, Optional[int]]] = field(default_factory=dict)
    gpu_down: bool = False                # NVML down or late at the last poll
    trend: Trend = field(default_factory=Trend)  # the memory of each poll, and its growth
    # the same memory over a day, bounded, and its growth at the horizon that fits it best,
    # estimated once every horizons.EVAL_S of the polls' time (replay and live alike)
    history: horizons.History = field(default_factory=horizons.History)
    reading: Optional[horizons.Reading] = None
    readings: horizons.Readings = field(default_factory=dict)   # per horizon, until its next bucket
    next_estimate_t: float = -math.inf
    regression: Regression = field(default_factory=Regression)  # memory on recordings
    records_at_last_sample: int = 0
    compile_jump_bytes: int = 0           # steps that were compiles'
    pending_jumps: list[tuple[float, int]] = field(default_factory=list)  # (t, bytes) undecided

    @property
    def mb_per_graph(self) -> Optional[float]:
        """None until recordings are seen to cost memory: a small model's graphs cost less
        than the allocator's own steps, and a slope <= 0 is noise, not a cost."""
        b = self.regression.slope
        return None if b is None or b <= 0 else b / 1e6

    def explained_bytes(self, records: int) -> float:
        b = self.regression.slope or 0.0
        return max(0.0, b) * records

    def unexplained_bytes(self, records: int, now: float) -> float:
        """Growth that recordings and compiles do not account for. A recent step is not
        counted yet: the compile behind it reports only when it ends."""
        mem, start = self.bytes, self.start
        if mem is None or start is None:
            return 0.0
        floor = self.trend.floor  # growth that lasts: a sawtooth's peaks are not counted
        if floor is not None and floor < mem:
            mem = floor
        undecided = sum(b for t, b in self.pending_jumps if b > 0 and t > now - PENDING_S) \
            if self.pending_jumps else 0
        return max(0.0, mem - start - self.explained_bytes(records) - self.compile_jump_bytes -
                   undecided)

    def on_compile(self, start: float, end: float) -> None:
        """A compile ran from `start` to `end`: the steps seen meanwhile are its own."""
        for jt, size in list(self.pending_jumps):
            if start - 1.0 <= jt <= end + COMPILE_SETTLE_S:
                self.compile_jump_bytes += size
                self.pending_jumps.remove((jt, size))

    def on_sample(self, s: Sample, cfg: CorrelateConfig, attribution: str, records: int,
                  warm_up: tuple[bool, bool], compile_end: float) -> None:
        """One poll, as the server sees it (`attribution`: config gpu.attribution).
        `warm_up`: (loading: weights and the first compile, whose growth is not a trend;
        settling: within a compile's settling time), `compile_end`: the latest compile's."""
        if not s.nvml_up and self.gpus:
            # NVML down or late: the GPUs' numbers are unknown now; the last ones must not
            # feed the forecast, and this poll has no memory reading
            self.gpus, self.device_used, self.device_total = {}, None, None
            self.device_usable, self.gpu_down = None, True
            return
        if s.devices:
            self._devices(s)
        self._host(s)
        mem, source = server_memory(s, attribution)
        if mem is None:
            return
        assert source is not None  # server_memory gives a source with every memory reading
        self.per_process = _per_process(s, source)
        self._reading(s.t, mem, source, cfg, records, warm_up, compile_end)

    def _devices(self, s: Sample) -> None:
        self.gpu_down = False
        procs = [p for p in s.processes if p.alive]
        gpus, used_sum, total_sum, usable_sum = {}, 0, 0, 0
        for d in s.devices:
            used, total = d.used_bytes, d.total_bytes
            # NVML v2: free = total - reserved - used; the reserved part (645 MB on an H200)
            # can never be allocated, so the budget is used + free
            usable = total if d.free_bytes is None else used + d.free_bytes
            gpus[d.uuid] = (used, usable, _bytes_on(procs, d.uuid))
            used_sum, total_sum, usable_sum = used_sum + used, total_sum + total, \
                usable_sum + usable
        self.gpus, self.device_used = gpus, used_sum
        self.device_total, self.device_usable = total_sum, usable_sum

    def _host(self, s: Sample) -> None:
        if s.host_total_bytes is not None and s.host_available_bytes is not None:
            self.host_used = s.host_total_bytes - s.host_available_bytes
            self.host_total = s.host_total_bytes
            self.host_available = s.host_available_bytes
            limits = [p.mem_limit_bytes for p in s.processes if p.alive and
                      p.mem_limit_bytes is not None]
            self.limit = min(limits) if limits else None

    def _reading(self, t: float, mem: int, source: str, cfg: CorrelateConfig, records: int,
                 warm_up: tuple[bool, bool], compile_end: float) -> None:
        if source != self.source:  # a new meter: never regress across the change
            self.source, self.start, self.bytes = source, mem, mem
            self.trend = Trend(cfg.jump_bytes)
            self._restart_history()
            self.records_at_last_sample = records
            return
        assert self.bytes is not None  # set with source, never None again: the same meter
        delta, recorded = mem - self.bytes, records - self.records_at_last_sample
        self.bytes, self.records_at_last_sample = mem, records
        loading, settling = warm_up
        if loading:  # loading weights and the first compile are not growth to forecast:
            self.trend = Trend(cfg.jump_bytes)  # the trend starts after them
            self._restart_history()
        self.trend.jump_bytes = cfg.jump_bytes
        self.trend.append(t, mem, records)
        self.history.add(t, mem)
        if t >= self.next_estimate_t:
            self.reading = horizons.estimate(self.history, self.readings)
            self.next_estimate_t = t + horizons.EVAL_S
        if settling and records == 0:
            self.start = mem
            self.compile_jump_bytes = 0
            self.pending_jumps = []
            return
        if abs(delta) > cfg.jump_bytes:
            if t <= compile_end + COMPILE_SETTLE_S:
                self.compile_jump_bytes += delta
            else:
                self.pending_jumps.append((t, delta))
                self.pending_jumps = [j for j in self.pending_jumps if j[0] > t - 2 * PENDING_S]
            return
        if records > 0:  # the regression starts with the first recording
            self.regression.add(recorded, delta)


    def _restart_history(self) -> None:
        if self.history.first_t is not None:
            self.history = horizons.History()
        self.reading, self.next_estimate_t = None, -math.inf
        self.readings = {}


def server_memory(sample: Sample, attribution: str) -> tuple[Optional[int], Optional[str]]:
    """Per-process GPU bytes of the server's processes when NVML says, else the device's used
    (`attribution`, config gpu.attribution: "process" never falls back to the device, so a
    shared GPU's other tenants are never taken for the server; "device" always uses it). In a
    pod without hostPID NVML lists host pids that match none of the server's: auto then
    meters the pod's GPUs as a whole."""
    procs = sample.processes
    per_process = [p.gpu_total for p in procs if p.alive]
    if attribution != "device" and per_process and all(v is not None for v in per_process):
        return sum(cast("list[int]", per_process)), "process"  # all() above: no None
    if sample.devices and attribution != "process":
        return sum(d.used_bytes for d in sample.devices), "device"
    if sample.devices:
        return None, None  # process only, and NVML does not list the server's processes
    rss = [p.host_bytes for p in procs if p.alive]
    if rss and all(v is not None for v in rss):  # host-memory mode: no GPU (PSS, else RSS)
        return sum(cast("list[int]", rss)), "rss"  # all() above: no None
    return None, None


def _per_process(s: Sample, source: str) -> dict[int, int]:
    """Each live process's memory on the server's meter (none on a device-level meter)."""
    if source == "device":
        return {}
    out = {}
    for p in s.processes:
        if p.alive:
            v = p.gpu_total if source == "process" else p.host_bytes
            if v is not None:
                out[p.pid] = v
    return out


def _bytes_on(procs: list[ProcessSample], uuid: str) -> Optional[int]:
    """The processes' bytes on one GPU; None when NVML does not say for one of them."""
    values = [p.gpu_bytes.get(uuid, 0) for p in procs]
    return None if not procs or any(v is None for v in values) else \
        sum(cast("list[int]", values))  # any() above: no None
