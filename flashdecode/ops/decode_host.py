"""The host path of an eager decode call: what a call's metadata decides (its checks, the resolved config and the
launch geometry) kept per key, so a repeated call re-checks and re-resolves nothing and only launches.

A call's key holds every input the checks and the resolver read besides the tensors' contents: each tensor's
shape, strides, dtype, device and 16-byte alignment (launch_cache.tensor_key), every option with its type (so
that 3.0 never passes where 3 was checked), and whether the stream is capturing. Calls whose checks read values -
host-resident lengths (checked against the capacity, and they choose the splits), validate=True, an 8-bit cache's
scales - take the full path every time. Each remembered call gets a launch id (shape.launch_key), which the
decode launches key the launch cache with: the call key fixes the layout of every tensor they are handed (a
caller's out=; the pools' and plans' buffers are views at offset 0 of shapes the launch geometry fixes).
"""

from __future__ import annotations

import itertools

from flashdecode.ops.launch_cache import tensor_key

__all__ = ["call_key", "remember", "recall", "keep", "kept", "clear"]

_MAX_CALLS = 1024  # remembered call keys (cleared when full)
_CALLS: dict = {}
_LAUNCH_IDS = itertools.count()


def _option(x):
    """An option in a key: its value and type (an unhashable value makes the call take the full path)."""
    if isinstance(x, (tuple, list)):
        return (x.__class__,) + tuple(_option(v) for v in x)
    return x.__class__, x


def call_key(tag, tensors: tuple, options: tuple):
    """The key of a call (``tag``: the op, or a plan), or None where an argument cannot be keyed (not a tensor, an
    unhashable option): that call takes the full path, whose checks then name the argument."""
    try:
        key = (tag, tuple(tensor_key(x) for x in tensors), tuple(_option(x) for x in options))
        hash(key)
    except (AttributeError, TypeError, RuntimeError):
        return None
    return key


def keep(key, value) -> None:
    """Keep another op's per-key host state (append_kv's launch) beside the decode calls' (cleared with them)."""
    if key is not None:
        if len(_CALLS) >= _MAX_CALLS:
            _CALLS.clear()
        _CALLS[key] = value


def kept(key):
    """What ``keep`` kept under ``key`` (None: nothing, or key None)."""
    return None if key is None else _CALLS.get(key)


class _Entry:
    __slots__ = ("shape", "config", "launch")

    def __init__(self, shape, config, launch):
        self.shape, self.config, self.launch = shape, config, launch


def remember(key, shape, config, launch) -> None:
    """Keep a checked call's shape facts (without its tensors), config and launch geometry under ``key``."""
    if key is None:
        return
    shape.launch_key = next(_LAUNCH_IDS)
    kept = _copy(shape)
    kept.q4 = kept.alibi_slopes = None
    if len(_CALLS) >= _MAX_CALLS:
        _CALLS.clear()
    _CALLS[key] = _Entry(kept, config, launch)


def recall(key, q, alibi_slopes):
    """(shape, config, launch) of a call whose key was remembered, the shape bound to this call's q and ALiBi
    slopes; None where it was not."""
    entry = None if key is None else _CALLS.get(key)
    if entry is None:
        return None
    shape = _copy(entry.shape)
    shape.q4 = q.unsqueeze(1) if q.dim() == 3 else q
    shape.alibi_slopes = alibi_slopes
    return shape, entry.config, entry.launch


def _copy(shape):
    """A shallow copy of a _DecodeShape (copy.copy's generic path costs a few microseconds more)."""
    new = object.__new__(shape.__class__)
    new.__dict__.update(shape.__dict__)
    return new


def clear() -> None:
    _CALLS.clear()
