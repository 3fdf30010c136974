"""The shape signature of a watched call: read from its arguments, remembered, told in events."""
from __future__ import annotations

import itertools
from typing import Any, Optional

from torch_watchdog import events

# Nested containers (a list of tensors, a BatchEncoding) are read up to this many items: a
# signature must cost the same whatever the caller passes.
MAX_NESTED = 64


def shape_signature(args: tuple[Any, ...], kwargs: dict[str, Any], tensor_type: type[Any]
                    ) -> tuple[Any, ...]:
    """One entry per argument, positional then keyword in call order: a tensor's shape, a tuple
    of shapes for a list/tuple/dict of tensors (e.g. a tokenizer's BatchEncoding), else None.
    Never raises: an argument that cannot be read is None."""
    try:
        # one comprehension over all of them (a comprehension is a function call before 3.12)
        values = (*args, *kwargs.values()) if kwargs else args
        return tuple([a.shape if type(a) is tensor_type else other_entry(a, tensor_type)
                      for a in values])
    except Exception:  # a hostile argument: read each one on its own
        return tuple([entry(a, tensor_type) for a in arguments(args, kwargs)])


def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The call's arguments, positional then keyword values (the positional ones alone if the
    keywords cannot be read)."""
    try:
        return [*args, *kwargs.values()]
    except Exception:
        return list(args)


def entry(a: Any, tensor_type: type[Any]) -> Any:
    """One argument's entry of the signature; None if it cannot be read."""
    try:
        return a.shape if type(a) is tensor_type else other_entry(a, tensor_type)
    except Exception:
        return None


def other_entry(a: Any, tensor_type: type[Any]) -> Any:
    """The entry of an argument that is not an exact tensor (may raise)."""
    if isinstance(a, tensor_type):
        return a.shape
    if isinstance(a, dict):
        a = list(itertools.islice(a.values(), MAX_NESTED))
    elif isinstance(a, (list, tuple)):
        a = a[:MAX_NESTED]
    else:
        return None  # never iterate anything else: a generator would be consumed
    return tuple([x.shape for x in a if isinstance(x, tensor_type)]) or None


def _dims(shape: Any) -> Optional[tuple[int, ...]]:
    """A shape as an exact tuple of ints (GC-untracked), or None if it is not one."""
    if not isinstance(shape, tuple):
        return None
    dims = tuple(shape)
    for d in dims:
        if type(d) is not int:
            return None  # SymInt, a hijacked `.shape`: not a shape to remember
    return dims


def memory_key(sig: Any) -> Optional[tuple[Any, ...]]:
    """The signature to remember: equal to `sig` and of the same hash, made of exact tuples,
    ints and None only; None if `sig` is not a signature. Why not the torch.Size objects the
    calls produce: a tuple subclass is never untracked by the GC, so a full memory would add
    tens of thousands of objects for every full collection to walk, inside a watched call;
    an exact tuple of ints is untracked by the first young collection it meets, and a
    torch.Size still finds it (same hash, equal)."""
    if type(sig) is not tuple:  # a torch.Size, from the one-tensor path
        return _dims(sig)
    out: list[Optional[tuple[Any, ...]]] = []
    for item in sig:
        if item is None:
            out.append(None)
        elif type(item) is tuple:  # the shapes inside one list/tuple/dict argument
            inner = [_dims(s) for s in item]
            if None in inner:
                return None
            out.append(tuple(inner))
        else:
            dims = _dims(item)
            if dims is None:
                return None
            out.append(dims)
    return tuple(out)  # exact tuples of ints and None: young collections untrack it


def as_shape(sig: Any) -> events.Shape:
    """A signature as the schema's list of shapes (arguments without tensors left out)."""
    if type(sig) is not tuple or (sig and not isinstance(sig[0], (tuple, type(None)))):
        return [list(sig)]  # one shape, from the single-argument fast path
    out: events.Shape = []
    for item in sig:
        if type(item) is tuple:
            out.extend(list(x) for x in item)
        elif item is not None:
            out.append(list(item))
    return out


def shape_text(shape: events.Shape) -> str:
    """A new_shape event's shape as text, "x2,3;x4" for [[2, 3], [4]] (the emitter's builder
    reads it back on the sender thread: emitter.shape_from_text). Why text: a queued event's
    lists are tracked by the GC until the sender's next tick, and a burst of them is what a
    collection inside a watched call would walk; a tuple of str and numbers is untracked by
    the first collection it meets."""
    return ";".join(["x" + ",".join([str(d) for d in dims]) for dims in shape])
