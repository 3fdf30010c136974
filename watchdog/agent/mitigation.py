"""Opt-in mitigations (off by default): a CUDA-graph budget and a recompile guard.

Graph budget: after N distinct cudagraph size keys, new sizes stop being recorded.
- "capture_sizes" (torch >= 2.9): `torch._inductor.config.triton.cudagraph_capture_sizes` is read
  on every call (reference §3.4); we set it to the keys already recorded, so recorded sizes keep
  replaying and new sizes run the compiled code without a CUDA graph.
- "eager": watched callables send shapes they have not seen to the uncompiled model.
Recompile guard: after N recompiles, `torch.compiler.set_stance("eager_on_recompile")`
(torch >= 2.6), set from the agent's thread (the stance is process-wide and read at every call).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

from torch_watchdog import events
from torch_watchdog.agent import settings

Emit = Callable[[events.Event], None]


class AllowedSizes(tuple):
    """A tuple for torch's config, whose `in` is a set lookup (it runs on every call)."""

    def __new__(cls, keys: Any) -> "AllowedSizes":
        self = super().__new__(cls, sorted((k for k in keys if k is not None), key=repr))
        self._keys = frozenset(keys)
        return self

    def __contains__(self, key: Any) -> bool:
        return key in self._keys

    def __reduce__(self) -> Any:  # torch may pickle config into cache keys
        return (AllowedSizes, (tuple(self._keys),))


def _mitigation(name: str, action: str, detail: str) -> events.Mitigation:
    return events.Mitigation(t=time.time(), pid=os.getpid(), name=name, action=action,
                             detail=detail)


class GraphBudget:
    def __init__(self, torch: Any, limit: int, mode: str, emit: Emit):
        self.torch = torch
        self.limit = limit
        self.emit = emit
        self.keys: set = set()
        self.engaged = False
        self._triton = None
        if limit:
            import torch._inductor.config as inductor_config

            self._triton = getattr(inductor_config, "triton", None)
        supported = hasattr(self._triton, "cudagraph_capture_sizes")
        self.mode = ("capture_sizes" if supported else "eager") if mode == "auto" else mode
        if self.mode == "capture_sizes" and not supported:
            self.mode = "unavailable"
        self._saved = None

    def note_key(self, key: Any) -> None:
        """A cudagraph size key at its warm-up (serving thread, from the log hook)."""
        if self.limit <= 0 or self.engaged or key is None:
            return
        self.keys.add(key)
        if len(self.keys) >= self.limit:
            self.engage()

    def engage(self) -> None:
        self.engaged = True
        if self.mode == "capture_sizes":
            self._saved = self._triton.cudagraph_capture_sizes
            self._triton.cudagraph_capture_sizes = AllowedSizes(self.keys | {None})
            detail = (f"{len(self.keys)} sizes recorded; new sizes now run without CUDA graphs "
                      f"(cudagraph_capture_sizes)")
        elif self.mode == "eager":
            settings.configure(route_eager=True)
            detail = (f"{len(self.keys)} sizes recorded; watched callables now run unseen "
                      f"shapes eagerly")
        else:
            self.emit(_mitigation("graph_budget", "unavailable",
                                  "cudagraph_capture_sizes needs torch >= 2.9"))
            return
        self.emit(_mitigation("graph_budget", "engaged", detail))

    def release(self) -> None:
        if self.engaged and self.mode == "capture_sizes":
            self._triton.cudagraph_capture_sizes = self._saved
        settings.configure(route_eager=False)


class RecompileGuard:
    def __init__(self, torch: Any, after: int, emit: Emit):
        self.torch = torch
        self.after = after
        self.emit = emit
        self.recompiles = 0
        self.engaged = False

    def note_recompile(self) -> None:
        self.recompiles += 1

    def tick(self) -> None:
        """On the agent's thread: set_stance refuses inside a compiled frame."""
        if self.engaged or self.after <= 0 or self.recompiles < self.after:
            return
        self.engaged = True
        set_stance = getattr(getattr(self.torch, "compiler", None), "set_stance", None)
        if set_stance is None:
            self.emit(_mitigation("recompile_guard", "unavailable",
                                  "torch.compiler.set_stance needs torch >= 2.6"))
            return
        set_stance("eager_on_recompile")
        self.emit(_mitigation("recompile_guard", "engaged",
                              f"{self.recompiles} recompiles; further guard failures run eager "
                              f"(set_stance('eager_on_recompile'))"))

    def release(self) -> None:
        if self.engaged:
            set_stance = getattr(getattr(self.torch, "compiler", None), "set_stance", None)
            if set_stance is not None:
                set_stance("default")
