"""How a call is padded (padded.py pads a watched model with one): a `Policy` reads a
call's real length(s), pads its arguments to a bucket and cuts the output back. `Tokens` for
token ids and the keywords along the sequence (masks, positions, token types, an
encoder-decoder's decoder inputs), `Custom` from three functions of your own."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from torch_watchdog.agent.pad import outputs

CHECK_MEMORY_BYTES = 256 << 20  # default cap on what sampled checks may leave reserved
EDGE = "edge"                 # a fill: the keyword's last value, repeated (position ids)
# keywords that carry state from an earlier call (a KV cache that grows): such a call is
# served as it comes (docs/agent.md, "Decoding with a cache")
STATEFUL = ("past_key_values", "cache", "cache_params")


class Policy:
    """How a call is padded, and the plan's settings. Subclass and implement `length`, `pad`
    and `unpad` for inputs of your own (or use `Custom`).

    buckets: the starting plan (e.g. the model's maximum length, or a hand-made plan);
    max_buckets: the graph budget (at most this many buckets, the starting ones included);
    multiple: buckets the plan adds are rounded up to a multiple of this (kernel-friendly sizes);
    sample: the fraction of padded calls checked after the first of each signature;
    tolerance: overrides TOLERANCE (a float for every dtype);
    check_memory_bytes: the reserved CUDA memory sampled checks may leave behind, in all;
    past it they stop (a `checks_capped` event; see CheckMemory);
    check_share: the most of the time since wrapping that sampled checks may take."""

    def __init__(self, *, buckets: Any = (), max_buckets: int = 8, multiple: int = 8,
                 sample: float = 0.001, tolerance: Optional[float] = None,
                 check_memory_bytes: int = CHECK_MEMORY_BYTES, check_share: float = 0.005):
        start = sorted({int(b) for b in buckets})
        if any(b < 1 for b in start):
            raise ValueError(f"buckets must be >= 1, got {start}")
        if isinstance(max_buckets, bool) or int(max_buckets) < 1:
            raise ValueError(f"max_buckets must be >= 1, got {max_buckets!r}")
        if len(start) > max_buckets:
            raise ValueError(f"{len(start)} buckets over max_buckets={max_buckets}")
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"sample must be in [0, 1], got {sample!r}")
        if int(multiple) < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple!r}")
        self.buckets = tuple(start)
        self.max_buckets = int(max_buckets)
        self.multiple = int(multiple)
        if isinstance(check_memory_bytes, bool) or int(check_memory_bytes) < 0:
            raise ValueError(f"check_memory_bytes must be >= 0, got {check_memory_bytes!r}")
        self.sample = float(sample)
        if not 0.0 <= check_share <= 1.0:
            raise ValueError(f"check_share must be in [0, 1], got {check_share!r}")
        self.check_share = float(check_share)
        self.tolerance = tolerance
        self.check_memory_bytes = int(check_memory_bytes)

    def length(self, args: tuple, kwargs: dict) -> Any:
        """The call's real length, or None: this call is not padded. A tuple of lengths for
        inputs with several (an encoder's and a decoder's): each is padded to its own bucket,
        and `pad`/`unpad` get tuples too."""
        raise NotImplementedError

    def pad(self, args: tuple, kwargs: dict, length: Any, bucket: Any) -> tuple[tuple, dict]:
        """The arguments padded from `length` to `bucket` (new objects; never the caller's)."""
        raise NotImplementedError

    def unpad(self, out: Any, length: Any, bucket: Any) -> Any:
        """The padded call's output as the unpadded call would have returned it."""
        raise NotImplementedError

    def learn(self, padded: Any, reference: Any, length: Any, bucket: Any) -> Any:
        """Called at a check with a padded output and the unpadded one; what it returns (a
        layout; None: none) is given back to `unpad` for the calls that check covers."""
        return None

    def masked(self, kwargs: dict) -> bool:
        """Whether the call's padded positions are masked (a mask keyword of every padded
        axis is passed): a check then covers calls with more padding than it had."""
        return False


class Tokens(Policy):
    """Right-pads dimension `dim` of the token ids (the first positional argument if it is a
    tensor, and the keywords in `keys`) with `value`, the keywords in `masks` with 0, and the
    other keywords along the sequence with their `fill` (a value, or EDGE: the last one
    repeated). `decoder` (keyword -> fill) is a second length, an encoder-decoder's, padded to
    its own bucket. A call that passes a `stateful` keyword (a cache) is served as it comes.
    Outputs are cut back where they are found, at a check, to carry the padding (logits along
    `dim`, a cache's keys and values along theirs; a pooled output is left whole)."""

    def __init__(self, value: int = 0, *, dim: int = 1, keys: tuple = ("input_ids",),
                 masks: tuple = ("attention_mask",), fill: Optional[dict] = None,
                 decoder: Optional[dict] = None, stateful: tuple = STATEFUL, **plan: Any):
        super().__init__(**plan)
        self.value, self.dim = value, dim
        self.keys, self.masks = tuple(keys), tuple(masks)
        self.stateful = tuple(stateful)
        fill = {"token_type_ids": 0, "position_ids": EDGE} if fill is None else dict(fill)
        if decoder is None:
            decoder = {"decoder_input_ids": value, "decoder_attention_mask": 0,
                       "decoder_position_ids": EDGE}
            self.masks += ("decoder_attention_mask",)
        encoder = {**fill, **{k: 0 for k in self.masks if k not in decoder},
                   **{k: value for k in self.keys}}
        # per axis, keyword -> fill; the first positional tensor is the first axis's ids
        self.axes = tuple(a for a in (encoder, dict(decoder)) if a)
        # keyword -> (axis, fill): one pass over a call's keywords reads and pads them
        self.where = {k: (i, f) for i, axis in enumerate(self.axes) for k, f in axis.items()}
        self._ids, self._stateful = frozenset(self.keys), frozenset(self.stateful)

    def length(self, args: tuple, kwargs: dict) -> Optional[tuple]:
        dim, where = self.dim, self.where
        lengths: list = [None] * len(self.axes)
        ids = bool(args) and isinstance(args[0], torch.Tensor)
        if ids:
            if args[0].dim() <= dim:
                return None  # no such dimension (an unbatched call): not padded
            lengths[0] = args[0].shape[dim]
        for k, v in kwargs.items():
            w = where.get(k)
            if w is None:
                if v is not None and k in self._stateful:
                    return None  # a cache from an earlier call: served as it comes
                continue
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() <= dim:
                return None
            n, i = v.shape[dim], w[0]
            if lengths[i] is None:
                lengths[i] = n
            elif lengths[i] != n:
                return None  # tensors of different lengths: not ours to pad
            ids = ids or k in self._ids
        if not ids:
            return None  # no token ids (embeddings, say): not padded
        return tuple(n for n in lengths if n is not None)

    def _grow(self, t: torch.Tensor, extra: int, value: Any) -> torch.Tensor:
        dim = self.dim
        if value is EDGE:
            tail = t.narrow(dim, t.shape[dim] - 1, 1)
            return torch.cat([t, tail.expand(*t.shape[:dim], extra, *t.shape[dim + 1:])], dim)
        # one op and one allocation (new_full + cat: two of each, ~2 us more a call)
        return torch.constant_pad_nd(t, (0, 0) * (t.dim() - 1 - dim) + (0, extra), value)

    def pad(self, args: tuple, kwargs: dict, length: Any, bucket: Any) -> tuple[tuple, dict]:
        extra = [b - n for n, b in zip(length, bucket, strict=True)]
        if args and isinstance(args[0], torch.Tensor) and extra[0]:
            args = (self._grow(args[0], extra[0], self.value), *args[1:])
        if kwargs:
            grow, where, axes = self._grow, self.where, len(extra)
            kwargs = {k: grow(v, extra[w[0]], w[1])
                      if (w := where.get(k)) is not None and w[0] < axes and extra[w[0]] and
                      isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return args, kwargs

    def shorten(self, args: tuple, kwargs: dict, length: tuple) -> tuple[tuple, dict]:
        """The call cut to `length[0]` on the first axis (its ids, masks, positions): the
        same inputs with the bucket's most padding, for a check."""
        n, dim, where = length[0], self.dim, self.where
        if args and isinstance(args[0], torch.Tensor):
            args = (args[0].narrow(dim, 0, n), *args[1:])
        return args, {k: v.narrow(dim, 0, n) if isinstance(v, torch.Tensor) and
                      where.get(k, (None,))[0] == 0 else v for k, v in kwargs.items()}

    def masked(self, kwargs: dict) -> bool:
        # the first axis is always padded; the decoder's where its keywords are passed
        return all(any(isinstance(kwargs.get(k), torch.Tensor) for k in self.masks if k in axis)
                   for i, axis in enumerate(self.axes)
                   if i == 0 or any(isinstance(kwargs.get(k), torch.Tensor) for k in axis))

    def learn(self, padded: Any, reference: Any, length: Any, bucket: Any) -> outputs.Layout:
        pads = tuple(b - n for n, b in zip(length, bucket, strict=True))
        return outputs.learn(padded, reference, pads)

    def unpad(self, out: Any, length: Any, bucket: Any, layout: Any = None) -> Any:
        if isinstance(length, int):
            length, bucket = (length,), (bucket,)
        pads = tuple(b - n for n, b in zip(length, bucket, strict=True))
        if layout is not None:
            return outputs.slice_back(out, layout, pads)
        dim, extra = self.dim, pads[0]  # not checked yet: the token dimension, where it is
        return outputs.rebuild(out, lambda path, t: t.narrow(dim, 0, t.shape[dim] - extra)
                               if t.dim() > dim and t.shape[dim] == bucket[0] else t)


class Custom(Policy):
    """A policy from three functions: length(args, kwargs) -> int | None; pad(args, kwargs,
    length, bucket) -> (args, kwargs); unpad(out, length, bucket) -> out."""

    def __init__(self, length: Callable, pad: Callable, unpad: Callable, **plan: Any):
        super().__init__(**plan)
        self._length, self._pad, self._unpad = length, pad, unpad

    def length(self, args: tuple, kwargs: dict) -> Any:
        return self._length(args, kwargs)

    def pad(self, args: tuple, kwargs: dict, length: Any, bucket: Any) -> tuple[tuple, dict]:
        return self._pad(args, kwargs, length, bucket)

    def unpad(self, out: Any, length: Any, bucket: Any) -> Any:
        return self._unpad(out, length, bucket)
