"""The CUDA graph pool's bytes where NVML cannot see its growth (torch 2.15).

`triton.cudagraph_initial_mempool_allocation_gb` reserves the graph pool in one block at the
first recording: NVML counts the whole block from then on, and graphs fill it without NVML
moving until it runs out. The allocator still knows: its private pools' segments (CUDA graphs
record into private pools) and the bytes of them in use. Read on the agent's thread with each
heartbeat, and only where the pool is primed: `memory_snapshot()` walks every segment.
"""
from __future__ import annotations

from typing import Any, Optional

NO_POOL = (0, 0)   # the allocator's default pool's id in a segment's `segment_pool_id`


def primed(torch: Any) -> bool:
    inductor = getattr(torch, "_inductor", None)
    triton = getattr(getattr(inductor, "config", None), "triton", None)
    return bool(getattr(triton, "cudagraph_initial_mempool_allocation_gb", None))


def primed_pool_bytes(torch: Any) -> tuple[Optional[int], Optional[int]]:
    """(reserved, in use) bytes of the private pools, or (None, None): the pool is not primed,
    CUDA is not up, or the snapshot failed (never raises)."""
    try:
        if not primed(torch) or not torch.cuda.is_initialized():
            return None, None
        return pool_bytes(torch.cuda.memory_snapshot())
    except Exception:  # the agent never breaks the server for a number
        return None, None


def pool_bytes(segments: Any) -> tuple[Optional[int], Optional[int]]:
    """(reserved, in use) over the segments of private pools: `total_size` and the blocks
    `active_allocated` (pure: the shape `torch.cuda.memory_snapshot()` returns)."""
    reserved = active = 0
    seen = False
    for seg in segments:
        if tuple(seg.get("segment_pool_id") or NO_POOL) == NO_POOL:
            continue
        seen = True
        reserved += int(seg.get("total_size") or 0)
        active += sum(int(b.get("size") or 0) for b in seg.get("blocks") or ()
                      if b.get("state") == "active_allocated")
    return (reserved, active) if seen else (None, None)
