"""What the sidecar's sources read, as plain values: the input of the pure pipeline.

Sources (nvml.py, process.py) produce these; correlate.fold() consumes them together with the
agent's events. Times are wall-clock seconds (same base as event `t`); byte counts are ints;
`None` means "not available" (NVML said so, or the source is down), never zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class DeviceSample:
    uuid: str                      # "GPU-…" (or "MIG-…"), the stable identity of a device
    used_bytes: int
    total_bytes: int
    free_bytes: Optional[int] = None


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    alive: bool
    rss_bytes: Optional[int] = None
    # per device UUID: this process's usedGpuMemory; None where NVML does not say (MIG, containers)
    gpu_bytes: dict[str, Optional[int]] = field(default_factory=dict)

    @property
    def gpu_total(self) -> Optional[int]:
        values = [v for v in self.gpu_bytes.values() if v is not None]
        return sum(values) if values else None


@dataclass(frozen=True)
class Sample:
    """One poll of every source at time `t`."""
    t: float
    devices: tuple[DeviceSample, ...] = ()
    processes: tuple[ProcessSample, ...] = ()
    nvml_up: bool = True
    nvml_error: Optional[str] = None
    query_s: Optional[float] = None  # how long the NVML queries took (FACTS #11: p99 ~100 ms)
    # host memory, for host-memory mode (no GPU: the server's RSS against the machine's RAM)
    host_total_bytes: Optional[int] = None
    host_available_bytes: Optional[int] = None
