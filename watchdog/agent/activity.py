"""What the torch hooks last saw on each serving thread, for watch()'s slow path."""
from __future__ import annotations

import threading

# Written by hooks.py (rare): `activity`/`activity_ns` of the last compile or cudagraph step,
# `oom_ns` of the last OOM seen. Read by a watched call on its slow path only: a stall's cause,
# an OOM the allocator's observer already reported.
tls = threading.local()
