"""What a padded call returns, as padding sees it: the tensors of an output (inside tuples,
lists, dicts, HF `ModelOutput` objects and HF KV-cache objects), replaced by their sliced
views, and compared with the unpadded output. Anything else in an output is `Unsupported`:
padding can neither slice it nor tell that it does not depend on the length, so it refuses."""
from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

# Largest |served - unpadded| at real positions, over the largest |unpadded| of that tensor.
# Compiled and eager code differ by rounding (fusions, other kernels), not by padding: fp16 has
# a 2^-10 epsilon and 12 layers of it; a padding error (a mean over the pads) is of the order of
# the values themselves (0.1-1 in tests/unit/test_pad.py).
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2,
             torch.bfloat16: 5e-2}
DEFAULT_TOLERANCE = 1e-3

# transformers' cache objects whose whole state is their layers' keys and values (a sliding
# window, a static or a quantized layer keeps counters of its own: not sliceable from outside)
_CACHE_STATE = {"DynamicCache": {"layers", "layer_class_to_replicate", "offloading"},
                "EncoderDecoderCache": {"self_attention_cache", "cross_attention_cache",
                                        "is_updated"}}
_LAYER_STATE = {"keys", "values", "is_initialized", "device"}


class Unsupported(Exception):
    """An output padding cannot slice back or compare: the reason, for the refusal."""


def _is_model_output(x: Any) -> bool:
    return isinstance(x, dict) and hasattr(x, "to_tuple")  # transformers' ModelOutput


def _cache_kind(x: Any, path: tuple) -> Optional[str]:
    """'DynamicCache' or 'EncoderDecoderCache' for such a transformers cache with no state
    beyond its layers; None for an object that is no cache; Unsupported for another cache."""
    t = type(x)
    if not t.__module__.startswith("transformers."):
        return None
    state = _CACHE_STATE.get(t.__name__)
    if state is None or not set(vars(x)) <= state or getattr(x, "offloading", False):
        raise Unsupported(f"output {list(path)} is a {t.__name__}, whose state padding cannot "
                          f"slice")
    return t.__name__


def _cache_layers(cache: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
    for i, layer in enumerate(cache.layers):
        if type(layer).__name__ != "DynamicLayer" or not set(vars(layer)) <= _LAYER_STATE:
            raise Unsupported(f"output {list(path)} layer {i} is a {type(layer).__name__}, "
                              f"whose state padding cannot slice")
        if getattr(layer, "is_initialized", False):
            yield path + ("layers", i), layer


def leaves(out: Any, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(path, tensor) of every tensor in `out`, in order; Unsupported for what is not a
    tensor, None or a container of them (a number or a string could depend on the length)."""
    if isinstance(out, torch.Tensor):
        yield path, out
    elif out is None:
        return
    elif isinstance(out, dict):
        for k, v in out.items():
            yield from leaves(v, path + (k,))
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            yield from leaves(v, path + (i,))
    else:
        kind = _cache_kind(out, path)
        if kind == "DynamicCache":
            for where, layer in _cache_layers(out, path):
                yield where + ("keys",), layer.keys
                yield where + ("values",), layer.values
        elif kind == "EncoderDecoderCache":
            yield from leaves(out.self_attention_cache, path + ("self_attention_cache",))
            yield from leaves(out.cross_attention_cache, path + ("cross_attention_cache",))
        else:
            raise Unsupported(f"output {list(path)} is a {type(out).__name__}: padding cannot "
                              f"slice it back nor compare it")


def rebuild(out: Any, fn: Callable[[tuple, torch.Tensor], Any], path: tuple = ()) -> Any:
    """`out` with every tensor replaced by fn(path, tensor). Tuples, lists and plain dicts are
    new objects of the same types; a ModelOutput and a cache object are the padded call's own,
    fresh from the model: updated in place (rebuilding a ModelOutput costs ~30 us a call)."""
    if isinstance(out, torch.Tensor):
        return fn(path, out)
    if out is None:
        return out
    if _is_model_output(out):
        for k, v in list(out.items()):
            new = rebuild(v, fn, path + (k,))
            if new is not v:
                out[k] = new  # ModelOutput.__setitem__ sets the attribute too
        return out
    if isinstance(out, dict):
        items = [(k, rebuild(v, fn, path + (k,))) for k, v in out.items()]
        return dict(items) if type(out) is dict else type(out)(items)
    if isinstance(out, tuple):
        items = [rebuild(v, fn, path + (i,)) for i, v in enumerate(out)]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return type(out)(rebuild(v, fn, path + (i,)) for i, v in enumerate(out))
    kind = _cache_kind(out, path)
    if kind == "DynamicCache":
        for where, layer in _cache_layers(out, path):
            layer.keys = fn(where + ("keys",), layer.keys)
            layer.values = fn(where + ("values",), layer.values)
        return out
    if kind == "EncoderDecoderCache":
        rebuild(out.self_attention_cache, fn, path + ("self_attention_cache",))
        rebuild(out.cross_attention_cache, fn, path + ("cross_attention_cache",))
        return out
    raise Unsupported(f"output {list(path)} is a {type(out).__name__}: padding cannot slice it "
                      f"back")


class Layout(NamedTuple):
    """Where each tensor of a checked output carries the padding: path -> ((dim, axis), ...),
    the trailing `pads[axis]` positions of `dim` to cut (no pair: left whole). Ambiguous when
    a dimension grew by the padding of two axes alike (a decoder padded as much as the
    encoder): that check cannot tell them apart for other lengths."""
    cuts: dict
    ambiguous: bool


def learn(padded: Any, reference: Any, pads: tuple) -> Layout:
    """The layout of a padded output against the unpadded one, `pads[axis]` positions padded
    on each axis; Unsupported where they differ otherwise than by the padding."""
    ref = dict(leaves(reference))
    cuts, ambiguous = {}, False
    for path, t in leaves(padded):
        r = ref.get(path)
        if r is None or r.dim() != t.dim():
            raise Unsupported(f"output {list(path)} is not in the unpadded output as it is "
                              f"padded")
        pairs = []
        for d in range(t.dim()):
            grown = t.shape[d] - r.shape[d]
            if grown:
                axes = [k for k, p in enumerate(pads) if p == grown]
                if not axes:
                    raise Unsupported(f"output {list(path)} has shape {list(t.shape)} padded, "
                                      f"{list(r.shape)} unpadded: not the padding's")
                ambiguous = ambiguous or len(axes) > 1
                pairs.append((d, axes[0]))
        cuts[path] = tuple(pairs)
    if len(cuts) != len(ref):
        raise Unsupported(f"outputs differ in structure ({len(cuts)} tensors padded, "
                          f"{len(ref)} unpadded)")
    return Layout(cuts, ambiguous)


def slice_back(out: Any, layout: Layout, pads: tuple) -> Any:
    """The padded output cut back along its layout; Unsupported for an output whose tensors
    are not the ones checked (another structure: it needs a check of its own)."""
    cuts, seen = layout.cuts, []

    def one(path: tuple, t: torch.Tensor) -> torch.Tensor:
        pairs = cuts.get(path)
        if pairs is None:
            raise Unsupported(f"output {list(path)} was not in the checked output")
        seen.append(path)
        for d, axis in pairs:
            t = t.narrow(d, 0, t.shape[d] - pads[axis])
        return t

    out = rebuild(out, one)
    if len(seen) != len(cuts):
        raise Unsupported(f"{len(seen)} output tensors, {len(cuts)} in the checked output")
    return out


def compare(served: Any, reference: Any, tolerance: Optional[float] = None
            ) -> tuple[bool, dict[str, float], Optional[str]]:
    """(within tolerance, the largest relative error per dtype, what differed). Floating
    tensors: max |a - b| / max |b| (NaN where both are NaN is equal); other tensors: equal or
    error 1.0; a different structure or shape, or an output padding cannot see, is a
    mismatch."""
    try:
        a, b = list(leaves(served)), list(leaves(reference))
    except Unsupported as e:
        return False, {}, str(e)
    if [p for p, _ in a] != [p for p, _ in b]:
        return False, {}, f"outputs differ in structure ({len(a)} tensors, {len(b)} unpadded)"
    ok, errors, problem = True, {}, None
    for (path, x), (_, y) in zip(a, b, strict=True):
        name = str(y.dtype).replace("torch.", "")
        if x.shape != y.shape:
            return False, errors, (f"output {list(path)} has shape {list(x.shape)} padded, "
                                   f"{list(y.shape)} unpadded")
        if y.is_floating_point():
            diff, scale = _max_diff(x.detach(), y.detach())
            err = diff / (scale or 1.0)
            err = err if err == err else float("inf")  # NaN on one side only
            limit = tolerance if tolerance is not None else TOLERANCE.get(y.dtype,
                                                                          DEFAULT_TOLERANCE)
        else:
            err = 0.0 if torch.equal(x, y) else 1.0
            limit = 0.0
        errors[name] = max(errors.get(name, 0.0), err)
        if err > limit and ok:
            ok, problem = False, (f"output {list(path)} ({name}) differs by {err:.3g} "
                                  f"(relative), over the tolerance {limit:g}")
    return ok, errors, problem


CHUNK = 1 << 24  # elements compared at a time: a 2048 x 50257 fp16 logits tensor in float32
                 # at once is 400 MB per temporary; 16M elements is 64 MB


def _max_diff(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(max |x - y|, max |y|) in float32 or wider, a chunk at a time; NaN in both is equal."""
    x, y = x.reshape(-1), y.reshape(-1)
    wide = torch.float64 if y.dtype == torch.float64 else torch.float32
    diff = scale = 0.0
    for i in range(0, y.numel(), CHUNK):
        a, b = x[i:i + CHUNK].to(wide), y[i:i + CHUNK].to(wide)
        d = (a - b).abs()
        d = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(d), d)
        worst = float(d.max())
        if worst != worst:  # NaN on one side only (max() of Python floats would drop it)
            return worst, scale
        diff = max(diff, worst)
        scale = max(scale, float(b.abs().nan_to_num(0.0, 0.0, 0.0).max()))
    return diff, scale
