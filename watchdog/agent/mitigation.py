"""Opt-in mitigations (off by default): a CUDA-graph budget and a recompile guard.

Graph budget: after N distinct cudagraph size keys, new sizes stop being recorded. The same
stop on request (`freeze`, from the sidecar over the control channel): at the sizes recorded so
far, until `unfreeze`.
- "capture_sizes" (torch >= 2.9): `torch._inductor.config.triton.cudagraph_capture_sizes` is read
  on every call (reference §3.4); we set it to the keys already recorded, so recorded sizes keep
  replaying and new sizes run the compiled code without a CUDA graph.
- "eager": watched callables send shapes they have not seen to the uncompiled model.
Recompile guard: after N recompiles, `torch.compiler.set_stance("eager_on_recompile")`
(torch >= 2.6), set from the agent's thread (the stance is process-wide and read at every call).
"""
from __future__ import annotations

import contextvars
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
        self.engaged_by = ""     # "graph_budget" or "freeze": what stopped the recording
        self._asked = mode
        self._triton = None
        self.mode = mode
        if limit:
            self._resolve()
        self._saved = None

    def _resolve(self) -> None:
        """The mode, once the budget is used (a limit at start, or the first freeze): Inductor's
        config is imported then, not at every install."""
        import torch._inductor.config as inductor_config

        self._triton = getattr(inductor_config, "triton", None)
        supported = hasattr(self._triton, "cudagraph_capture_sizes")
        mode = self._asked
        self.mode = ("capture_sizes" if supported else "eager") if mode == "auto" else mode
        if self.mode == "capture_sizes" and not supported:
            self.mode = "unavailable"

    def note_key(self, key: Any) -> None:
        """A cudagraph size key at its warm-up (serving thread, from the log hook): kept while
        recording is not stopped (a freeze keeps the sizes recorded by then)."""
        if self.engaged or key is None:
            return
        self.keys.add(key)
        if 0 < self.limit <= len(self.keys):
            self.engage()

    def engage(self, name: str = "graph_budget") -> None:
        if self._triton is None:
            self._resolve()
        self.engaged, self.engaged_by = True, name
        if self.mode == "capture_sizes":
            self._saved = _capture_sizes(self._triton, AllowedSizes(self.keys | {None}))
            detail = (f"{len(self.keys)} sizes recorded; new sizes now run without CUDA graphs "
                      f"(cudagraph_capture_sizes)")
        elif self.mode == "eager":
            settings.configure(route_eager=True)
            detail = (f"{len(self.keys)} sizes recorded; watched callables now run unseen "
                      f"shapes eagerly")
        else:
            self.engaged = False
            self.emit(_mitigation(name, "unavailable",
                                  "cudagraph_capture_sizes needs torch >= 2.9"))
            return
        self.emit(_mitigation(name, "engaged", detail))

    def freeze(self) -> None:
        """The sidecar asked (control channel, the agent's thread): stop recording now, at the
        sizes recorded so far. Said again if already stopped (the sidecar's ask is answered)."""
        if self.engaged:
            self.emit(_mitigation("freeze", "engaged", f"already stopped at {len(self.keys)} "
                                  f"sizes ({self.mode})"))
            return
        self.engage("freeze")

    def restate(self) -> None:
        """A new sidecar at the socket (it restarted): a freeze an earlier one asked for still
        holds, and the new one is told so (it knows nothing of it otherwise)."""
        if self.engaged and self.engaged_by == "freeze":
            self.emit(_mitigation("freeze", "engaged", f"still stopped at {len(self.keys)} "
                                  f"sizes ({self.mode}), as an earlier sidecar asked"))

    def unfreeze(self) -> None:
        """The sidecar asked: record new sizes again."""
        if not self.engaged:
            return
        self.release()
        self.emit(_mitigation("freeze", "released", f"new sizes are recorded again "
                              f"({len(self.keys)} recorded before)"))

    def release(self) -> None:
        if self.engaged and self.mode == "capture_sizes":
            _capture_sizes(self._triton, self._saved)
        self.engaged = False
        settings.configure(route_eager=False)


def _capture_sizes(triton: Any, sizes: Any) -> Any:
    """Set `cudagraph_capture_sizes` for every thread of the process; the value it replaces.
    Since torch's config keeps a user's setting per thread (a ContextVar: 2.13 measured), a
    setting made on the agent's thread, or on the one serving thread that met the budget, is
    not seen by the others, nor by threads started later: the process-wide default is set
    instead where the config has one (a thread that set its own value keeps it)."""
    import torch._inductor.config as inductor_config

    entry = getattr(inductor_config, "_config", {}).get("triton.cudagraph_capture_sizes")
    if entry is not None and isinstance(getattr(entry, "user_override", None),
                                        contextvars.ContextVar) and hasattr(entry, "default"):
        saved, entry.default = entry.default, sizes
        return saved
    saved = triton.cudagraph_capture_sizes   # one value for the process (older torch)
    triton.cudagraph_capture_sizes = sizes
    return saved


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
