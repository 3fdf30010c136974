"""Opt-in bucketed padding of a watched model: `watch(model, "llm", pad=pad.Tokens(value=0))`.

Why: under `mode="reduce-overhead"` every distinct input length records its own CUDA graph (a
warm-up, a recording, memory). Padding lengths up to a few buckets keeps that to one graph per
bucket (the figures are in benchmarks/results/agent-internals.md). This package does
the padding for the user, and checks that it is exact.

- **What is padded** is a `Policy` (policies.py): `Tokens` right-pads one dimension of
  the token ids, the masks (0) and the other sequence keywords (`position_ids`: the last
  repeated; `token_type_ids`: 0), an encoder-decoder's decoder inputs to a bucket of their own,
  then slices the outputs back to the real length (outputs.py: tensors, containers,
  ModelOutput objects, HF cache objects; anything else is refused); a subclass (or `Custom`)
  brings its own length/pad/unpad.
- **The plan** (`buckets.extend`): the bucket advisor over the lengths seen, under
  `max_buckets`, starting from the configured `buckets`, refined at 32, 64, 128, ... calls (each
  time using half the buckets still free) on a short-lived thread, never on the request. A plan
  only ever adds buckets (a recorded graph is never thrown away); a length above the largest
  bucket runs unpadded.
- **Exact or off.** A padded output reaches the caller only where a check covers the call: the
  same `signature` (padded shapes, keywords, flag values: another output structure is another
  check) with no more padding than the check had, or masked padding. Else the call is checked
  first: also run unpadded on the uncompiled model, the outputs compared at the real positions
  with a tolerance for the dtype (`TOLERANCE`, relative to the reference's largest magnitude).
  A signature's first check (unmasked) also checks its bucket at the most padding, so that the
  bucket's later calls are covered; a `sample` fraction is checked again, within `check_share`
  of the time. A mismatch turns padding off for that model for good, returns the unpadded
  (correct) output, and emits a `mitigation` event (`padding`, `refused`) with the error seen.
  Checks cost one or two eager calls each, on the calls that are checked only; `padding`
  events report their count and time.
- **Memory** (`CheckMemory`, memory.py, whose docstring says why): flat after warm-up. A
  check's unpadded run and its comparison allocate in a private CUDA pool scoped to the calling
  thread, where this torch has one (a fresh pool given back after each check: "released";
  where deleting a pool frees nothing, one pool kept for every check: "kept"; else the shared
  allocator: "shared"); a sampled check runs only at a length no longer than one already
  checked; and what sampled checks leave reserved is capped (`check_memory_bytes`). Each is
  reported in the `padding` event.

Nothing here raises into the server: a policy that fails, a padded call that fails, outputs that
cannot be sliced, all run the call unpadded; the model's own exception from that unpadded call
is the caller's, as without padding. Where the unpadded call fails the same way (an exception
of the same type: a token id beyond the vocabulary, a bad request), the error is the caller's
and padding stays on (counted, a `caller_error` event once per exception type); where it does
not, padding did it, and padding goes off for that call signature (`signature_off`) or, with
no signature yet (the policy could not read or pad the call), for the model (`refused`).

The modules: `padded` (`Padded`, what `wrap` returns: the call path, the checks, the plan, the
`padding` events of `emit_stats`), `memory` (`CheckMemory`: where a check allocates),
`policies` (`Policy`, `Tokens`, `Custom`: how a call is padded) and `outputs` (an output's
tensors sliced back and compared: `leaves`, `rebuild`, `compare`, `TOLERANCE`). This face
is the import path: `from torch_watchdog.agent import pad`, then `pad.Tokens(...)`.
"""
from __future__ import annotations

from torch_watchdog.agent.pad.memory import CheckMemory, pool_unavailable
from torch_watchdog.agent.pad.outputs import (
    DEFAULT_TOLERANCE, TOLERANCE, Unsupported, compare, leaves, rebuild)
from torch_watchdog.agent.pad.padded import (
    MAX_SIGNATURES, MAX_SIZES, MAX_TOLD_ERRORS, PLAN_FIRST_AT, Padded, Padding, emit_stats,
    padded_models, signature, wrap)
from torch_watchdog.agent.pad.policies import (
    CHECK_MEMORY_BYTES, EDGE, STATEFUL, Custom, Policy, Tokens)

__all__ = [
    "CHECK_MEMORY_BYTES", "DEFAULT_TOLERANCE", "EDGE", "MAX_SIGNATURES", "MAX_SIZES",
    "MAX_TOLD_ERRORS", "PLAN_FIRST_AT", "STATEFUL", "TOLERANCE", "CheckMemory", "Custom",
    "Padded", "Padding", "Policy", "Tokens", "Unsupported", "compare", "emit_stats", "leaves",
    "padded_models", "pool_unavailable", "rebuild", "signature", "wrap"]
