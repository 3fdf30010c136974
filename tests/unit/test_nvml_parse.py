"""nvml's pure parse (`parse_answers`) on recorded NVML answers: one table, each row named for
where its answers come from, asserting the whole of what the reading says (the devices read,
those down and the message each shows, each pid's bytes per device, the errors counted, whether
the session ends). No NVML, no clock, no thread: the fast tier.

The numbers: the H200 rows are the sidecar's own sample logs (tests/fixtures/README.md:
`h200-seed-oom-samples.jsonl.gz`, one H200 and pid 795 near its OOM; `h200x2-two-replicas-
samples.jsonl.gz`, two H200s, pids 708 and 709); the others are tests/fakes.py's fake
host (two 80 GiB GPUs, G0 at 10 GiB used and G1 at 2 GiB, pid 100 on both), with its
pynvml-named error classes and pynvml's messages for them."""
from __future__ import annotations

import pytest

from tests.fakes import (
    G0, G1, GiB, MiB, FakeNvml, NVMLError_GpuIsLost, NVMLError_NoPermission,
    NVMLError_NotSupported, NVMLError_Uninitialized, NVMLError_Unknown, two_gpus)
from torch_watchdog.sidecar.sources.nvml import (
    DeviceAnswers, ParsedAnswers, _Session, parse_answers)

G2 = "GPU-22222222-cccc"
# h200-seed-oom-samples.jsonl.gz: 645 MB of the 150.75 GB are driver-reserved (used + free)
H200, H200_TOTAL = "GPU-c4d76be8-e45d-56e5-f5f6-b763bf24ae73", 150_754_820_096
# h200x2-two-replicas-samples.jsonl.gz
H200_A = "GPU-045eeb97-b7f7-321a-48ee-7b1f8855995a"
H200_B = "GPU-2185eaba-d202-099e-c7b2-3f6718475afa"

# the fake host's memory answers: (used, total, free) as nvmlDeviceGetMemoryInfo v2 gives them
G0_MEM = (10 * GiB, 80 * GiB, 70 * GiB)
G1_MEM = (2 * GiB, 80 * GiB, 78 * GiB)
G0_PROCS = [(100, 3 * GiB), (300, 5 * GiB)]
G1_PROCS = [(100, 512 * MiB), (200, 256 * MiB)]

IS_LOST = "NVMLError_GpuIsLost: GPU is lost"
UNKNOWN = "NVMLError_Unknown: Unknown Error"
VANISHED = "vanished: not listed after re-enumeration"

# what every row expects unless it says otherwise: a clean reading of nothing
NOTHING = {"devices": (), "per_pid": {}, "down": {}, "lost": {}, "reasons": (), "error": None,
           "end": None}

ROWS = [
    # -- healthy hosts -------------------------------------------------------------------------
    {"from": "H200, one server near its OOM (h200-seed-oom-samples, pid 795)",
     "answers": [(H200, (149_796_290_560, H200_TOTAL, 313_589_760), [(795, 149_786_984_448)])],
     "pids": {795},
     "expect": {"devices": (H200,), "per_pid": {795: {H200: 149_786_984_448}}}},
    {"from": "H200 before the server allocates: pid 795 not in the process list",
     "answers": [(H200, (3_407_872, H200_TOTAL, 150_106_472_448), [])],
     "pids": {795},
     "expect": {"devices": (H200,), "per_pid": {795: {}}}},
    {"from": "two H200s, one replica on each (h200x2-two-replicas, pids 708 and 709)",
     "answers": [(H200_A, (1_177_354_240, H200_TOTAL, 148_932_526_080), [(708, 1_168_113_664)]),
                 (H200_B, (1_177_419_776, H200_TOTAL, 148_932_460_544), [(709, 1_168_113_664)])],
     "pids": {708, 709},
     "expect": {"devices": (H200_A, H200_B),
                "per_pid": {708: {H200_A: 1_168_113_664}, 709: {H200_B: 1_168_113_664}}}},
    {"from": "the same two H200s asked for pid 708 only: 709 is not claimed",
     "answers": [(H200_A, (1_177_354_240, H200_TOTAL, 148_932_526_080), [(708, 1_168_113_664)]),
                 (H200_B, (1_177_419_776, H200_TOTAL, 148_932_460_544), [(709, 1_168_113_664)])],
     "pids": {708},
     "expect": {"devices": (H200_A, H200_B), "per_pid": {708: {H200_A: 1_168_113_664}}}},
    {"from": "fake host, pids 100 200 400: 300 not asked for, 400 on no GPU",
     "answers": [(G0, G0_MEM, G0_PROCS), (G1, G1_MEM, G1_PROCS)],
     "pids": {100, 200, 400},
     "expect": {"devices": (G0, G1),
                "per_pid": {100: {G0: 3 * GiB, G1: 512 * MiB}, 200: {G1: 256 * MiB}, 400: {}}}},
    {"from": "no pid asked for: the process list is not called",
     "answers": [(G0, G0_MEM, None), (G1, G1_MEM, None)],
     "pids": set(),
     "expect": {"devices": (G0, G1)}},
    {"from": "driver older than the bindings: no usable process call (_v3, _v2 FunctionNotFound)",
     "answers": [(G0, G0_MEM, None), (G1, G1_MEM, None)],
     "pids": {100},
     "expect": {"devices": (G0, G1), "per_pid": {100: {}}}},
    # -- per-process memory NVML does not say ----------------------------------------------------
    {"from": "MIG / WDDM: usedGpuMemory None (NVML_VALUE_NOT_AVAILABLE)",
     "answers": [(G0, G0_MEM, [(100, None)]), (G1, G1_MEM, G1_PROCS)],
     "pids": {100},
     "expect": {"devices": (G0, G1), "per_pid": {100: {G0: None, G1: 512 * MiB}}}},
    {"from": "struct layout not the driver's: usedGpuMemory 81 GiB on an 80 GiB GPU",
     "answers": [(G0, G0_MEM, G0_PROCS), (G1, G1_MEM, [(100, 81 * GiB)])],
     "pids": {100},
     "expect": {"devices": (G0, G1), "per_pid": {100: {G0: 3 * GiB, G1: None}}}},
    {"from": "MIG: one entry per compute instance, summed",
     "answers": [(G0, G0_MEM, [(100, 3 * GiB), (100, 1 * GiB)])],
     "pids": {100},
     "expect": {"devices": (G0,), "per_pid": {100: {G0: 4 * GiB}}}},
    {"from": "MIG: one instance's entry unknown makes the pid's sum unknown",
     "answers": [(G0, G0_MEM, [(100, 3 * GiB), (100, None)])],
     "pids": {100},
     "expect": {"devices": (G0,), "per_pid": {100: {G0: None}}}},
    {"from": "NVML_ERROR_NOT_SUPPORTED for the process list (vGPU, MIG): device-level only",
     "answers": [(G0, G0_MEM, NVMLError_NotSupported("Not Supported")), (G1, G1_MEM, G1_PROCS)],
     "pids": {100},
     "expect": {"devices": (G0, G1), "per_pid": {100: {G1: 512 * MiB}}}},
    {"from": "NVML_ERROR_NO_PERMISSION for the process list (container, MIG unprivileged)",
     "answers": [(G0, G0_MEM, NVMLError_NoPermission("Insufficient Permissions")),
                 (G1, G1_MEM, NVMLError_NoPermission("Insufficient Permissions"))],
     "pids": {100, 200},
     "expect": {"devices": (G0, G1), "per_pid": {100: {}, 200: {}}}},
    # -- one call failing --------------------------------------------------------------------------
    {"from": "process list raises NVMLError_Unknown: G0's numbers stand, counted",
     "answers": [(G0, G0_MEM, NVMLError_Unknown("Unknown Error")), (G1, G1_MEM, G1_PROCS)],
     "pids": {100},
     "expect": {"devices": (G0, G1), "per_pid": {100: {G1: 512 * MiB}},
                "reasons": ("NVMLError_Unknown",)}},
    {"from": "a binding bug in the process list (TypeError): counted as other",
     "answers": [(G0, G0_MEM, TypeError("'NoneType' object is not iterable"))],
     "pids": {100},
     "expect": {"devices": (G0,), "per_pid": {100: {}}, "reasons": ("other",)}},
    {"from": "a device whose memory info raises NVMLError_Unknown: down this reading",
     "answers": [(G0, G0_MEM, G0_PROCS), (G1, NVMLError_Unknown("Unknown Error"), None)],
     "pids": {100},
     "expect": {"devices": (G0,), "per_pid": {100: {G0: 3 * GiB}}, "down": {G1: UNKNOWN},
                "reasons": ("NVMLError_Unknown",), "error": f"1 GPU(s) down: {UNKNOWN}"}},
    {"from": "memory info NVMLError_Unknown on every GPU: all down, the session goes on",
     "answers": [(G0, NVMLError_Unknown("Unknown Error"), None),
                 (G1, NVMLError_Unknown("Unknown Error"), None)],
     "pids": {100},
     "expect": {"per_pid": {100: {}}, "down": {G0: UNKNOWN, G1: UNKNOWN},
                "reasons": ("NVMLError_Unknown", "NVMLError_Unknown"),
                "error": f"NVML read failed: {UNKNOWN}"}},
    {"from": "three GPUs, two down for different reasons: each named",
     "answers": [(G0, G0_MEM, G0_PROCS), (G1, NVMLError_Unknown("Unknown Error"), None),
                 (G2, NVMLError_GpuIsLost("GPU is lost"), None)],
     "pids": {100},
     "expect": {"devices": (G0,), "per_pid": {100: {G0: 3 * GiB}},
                "down": {G1: UNKNOWN, G2: IS_LOST}, "lost": {G2: IS_LOST},
                "reasons": ("NVMLError_Unknown", "NVMLError_GpuIsLost"),
                "error": f"2 GPU(s) down: {G1}: {UNKNOWN}; {G2}: {IS_LOST}"}},
    # -- lost and vanished GPUs -------------------------------------------------------------------
    {"from": "GPU lost: NVMLError_GpuIsLost from G1's memory info",
     "answers": [(G0, G0_MEM, G0_PROCS), (G1, NVMLError_GpuIsLost("GPU is lost"), None)],
     "pids": {100},
     "expect": {"devices": (G0,), "per_pid": {100: {G0: 3 * GiB}}, "down": {G1: IS_LOST},
                "lost": {G1: IS_LOST}, "reasons": ("NVMLError_GpuIsLost",),
                "error": f"1 GPU(s) down: {IS_LOST}"}},
    {"from": "GPU lost in G1's process list: its memory numbers just read are dropped too",
     "answers": [(G0, G0_MEM, G0_PROCS), (G1, G1_MEM, NVMLError_GpuIsLost("GPU is lost"))],
     "pids": {100},
     "expect": {"devices": (G0,), "per_pid": {100: {G0: 3 * GiB}}, "down": {G1: IS_LOST},
                "lost": {G1: IS_LOST}, "reasons": ("NVMLError_GpuIsLost",),
                "error": f"1 GPU(s) down: {IS_LOST}"}},
    {"from": "G1 lost earlier this session: not called, down with the reason it was lost for",
     "answers": [(G0, G0_MEM, G0_PROCS), (G1, None, None)],
     "pids": {100}, "lost": {G1: IS_LOST},
     "expect": {"devices": (G0,), "per_pid": {100: {G0: 3 * GiB}}, "down": {G1: IS_LOST},
                "error": f"1 GPU(s) down: {IS_LOST}"}},
    {"from": "GPU lost on every GPU: nothing left to read, the session ends",
     "answers": [(G0, NVMLError_GpuIsLost("GPU is lost"), None),
                 (G1, NVMLError_GpuIsLost("GPU is lost"), None)],
     "pids": {100},
     "expect": {"down": {G0: IS_LOST, G1: IS_LOST}, "lost": {G0: IS_LOST, G1: IS_LOST},
                "reasons": ("NVMLError_GpuIsLost", "NVMLError_GpuIsLost"),
                "error": f"NVML read failed: {IS_LOST}", "end": f"NVML read failed: {IS_LOST}"}},
    {"from": "re-enumeration no longer lists G1: vanished, G0 read",
     "answers": [(G0, G0_MEM, G0_PROCS)],
     "pids": {100}, "vanished": {G1: VANISHED},
     "expect": {"devices": (G0,), "per_pid": {100: {G0: 3 * GiB}}, "down": {G1: VANISHED},
                "error": f"1 GPU(s) down: {VANISHED}"}},
    {"from": "the only GPU vanished: nothing listed, the session ends",
     "answers": [],
     "pids": {100}, "vanished": {G0: VANISHED},
     "expect": {"down": {G0: VANISHED}, "error": f"NVML read failed: {VANISHED}",
                "end": f"NVML read failed: {VANISHED}"}},
    {"from": "no GPU listed at all (nvmlDeviceGetCount 0)",
     "answers": [],
     "pids": {100},
     "expect": {"error": "NVML read failed: no GPU listed",
                "end": "NVML read failed: no GPU listed"}},
    # -- the library or driver gone ------------------------------------------------------------
    {"from": "driver gone mid-read: NVMLError_Uninitialized from G1 ends the session",
     "answers": [(G0, G0_MEM, G0_PROCS), (G1, NVMLError_Uninitialized("Uninitialized"), None)],
     "pids": {100},
     "expect": {"reasons": ("NVMLError_Uninitialized",),
                "error": "NVML read failed: NVMLError_Uninitialized: Uninitialized",
                "end": "NVML read failed: NVMLError_Uninitialized: Uninitialized"}},
    {"from": "G0 Unknown, then the driver gone in G1's process list: both counted",
     "answers": [(G0, NVMLError_Unknown("Unknown Error"), None),
                 (G1, G1_MEM, NVMLError_Uninitialized("Uninitialized"))],
     "pids": {100},
     "expect": {"reasons": ("NVMLError_Unknown", "NVMLError_Uninitialized"),
                "error": "NVML read failed: NVMLError_Uninitialized: Uninitialized",
                "end": "NVML read failed: NVMLError_Uninitialized: Uninitialized"}},
]


@pytest.mark.parametrize("row", ROWS, ids=[row["from"] for row in ROWS])
def test_recorded_answers_parse_to_the_reading_the_source_reports(row):
    answers = [DeviceAnswers(*answer) for answer in row["answers"]]
    parsed = parse_answers(answers, row["pids"], row.get("lost", {}), row.get("vanished", {}))
    assert isinstance(parsed, ParsedAnswers)
    assert parsed._asdict() == {**NOTHING, **row["expect"]}


def test_the_read_records_each_answer_skips_a_lost_gpu_and_stops_where_the_driver_is_gone():
    nvml = two_gpus()
    nvml.devices.append({"uuid": G2.encode(), "total": 80 * GiB, "used": 1 * GiB, "procs": []})
    session = _Session(nvml, lambda: 0.0, 0.5, 30.0)
    assert session._init(0.0)
    session.lost[G0] = IS_LOST
    gone = NVMLError_Uninitialized("Uninitialized")
    nvml.devices[1]["procs"] = gone
    nvml.calls.clear()
    answers = session._ask_devices({100})
    assert answers == [DeviceAnswers(G0), DeviceAnswers(G1, G1_MEM, gone)]
    # G0 (lost) and G2 (after the driver went away) were not called
    assert nvml.calls == [("nvmlDeviceGetMemoryInfo", 1, FakeNvml.nvmlMemory_v2),
                          ("nvmlDeviceGetComputeRunningProcesses", 1)]
