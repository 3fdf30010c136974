"""On a real GPU: the sidecar's NVML source sees a real process's memory, by device UUID."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HOLD = """
import sys, time, torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(torch.cuda.get_device_properties(0).uuid, flush=True)
time.sleep(60)
"""


def test_nvml_source_sees_a_gpu_process_by_uuid():
    from torch_watchdog.sidecar.sources.nvml import NvmlSource
    from torch_watchdog.sidecar.sources.process import read_processes

    child = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    source = NvmlSource()
    try:
        uuid = child.stdout.readline().strip()
        time.sleep(0.5)
        reading = source.read({child.pid})
        assert reading.up, reading.error
        by_uuid = {d.uuid: d for d in reading.devices}
        device = by_uuid[uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"]
        held = reading.process_gpu_bytes[child.pid][device.uuid]
        assert held is not None and held >= 1 << 30
        assert device.used_bytes >= held and device.total_bytes > device.used_bytes
        assert 0 < reading.query_s < 1.0
        (proc,) = read_processes({child.pid}, reading.process_gpu_bytes)
        assert proc.alive and proc.rss_bytes > 0 and proc.gpu_total == held
        child.kill()
        child.wait()
        time.sleep(0.5)
        after = source.read({child.pid})
        assert after.up and after.process_gpu_bytes[child.pid] == {}
        assert not read_processes({child.pid})[0].alive
    finally:
        child.kill()
        source.close()
