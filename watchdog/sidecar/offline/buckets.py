"""The bucket advisor, under its old import path: it moved to `torch_watchdog.buckets`, where the
agent's padding imports it without the sidecar's modules."""
from torch_watchdog.buckets import (  # noqa: F401
    Advice, advise, padding, size_counts, varying_dimension)
