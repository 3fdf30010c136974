"""Time of the bucket advisor (optimal 1-D bucketing) on the seed scenario's shape space:
2,017 distinct seq_len (32..2048), for several bucket counts.

    python benchmarks/bucket_advisor.py
"""
from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_watchdog.sidecar.offline.buckets import advise  # noqa: E402


def main() -> int:
    rng = random.Random(0)
    counts = {s: rng.randint(1, 50) for s in range(32, 2049)}
    for k in (4, 8, 16, 32, 64):
        start = time.perf_counter()
        advice = advise(counts, k, bytes_per_graph=0.468e6)
        took = time.perf_counter() - start
        print(f"k={k:3d}: {took * 1e3:7.1f} ms  padding {advice.padding_ratio:6.1%}  "
              f"graphs {advice.graphs_before} -> {advice.graphs_after}  "
              f"saves {advice.memory_saved_bytes / 1e6:6.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
