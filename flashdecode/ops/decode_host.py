"""The host path of an eager decode call: what a call's metadata decides (its checks, the resolved config and the
launch geometry) kept per key, so a repeated call re-checks and re-resolves nothing and only launches.

A call's key holds every input the checks and the resolver read besides the tensors' contents: each tensor's
shape, strides, dtype, device and 16-byte alignment (launch_cache.tensor_key), every option with its type (so
that 3.0 never passes where 3 was checked), and whether the stream is capturing. Calls whose checks read values -
host-resident lengths (checked against the capacity, and they choose the splits), validate=True, an 8-bit cache's
scales - take the full path every time. Each remembered call gets a launch id (shape.launch_key), which the
decode launches key the launch cache with: the call key fixes the layout of every tensor they are handed (a
caller's out=; the pools' and plans' buffers are views at offset 0 of shapes the launch geometry fixes).

A contiguous cache that grows between calls (a generation: transformers' DynamicCache makes a longer tensor each
step, a flash-attn loop passes k_cache[:, :L] or a growing max_seqlen_k) keeps one record per capacity bucket
(``capacity_bucket``): its key (``growing_cache``) holds the cache's batch, heads, head dim, token and head-dim
strides, dtypes, device and alignment and the bucket of its length, not the length nor the batch and head strides
that follow it; the config is resolved for the bucket (ops/decode.py sizes every contiguous call's problem so,
cached or not). Each call then reads what its extent decides (``GrowingCache``): the facts the config depends on
(int32 offsets, the TMA row view; in the call key), the capacity the kernels clamp the lengths to and bound their
reads by (bound to the recalled shape), and Triton's specialisation of the capacity and the two strides (in the
launch key).
"""

from __future__ import annotations

import itertools

from flashdecode.ops import checks
from flashdecode.ops.decode_policy import _offsets_fit_int32
from flashdecode.ops.util import cache_rows_tma_ok

__all__ = ["call_key", "options_key", "lookup", "remember", "recall", "detach", "keep", "kept", "keep_checks",
           "kept_checks", "keep_bound", "bound", "clear", "capacity_bucket", "growing_cache", "GrowingCache",
           "NO_WINDOW", "window_key"]

# the decode ops' default window_size (checks' own, so score_transform's identity test sees it too), and what a call
# key holds for it when the call passed this very object: a token no argument can be, so the key stays flat
# (options_key reads a tuple option element by element)
NO_WINDOW = checks.NO_WINDOW
_NO_WINDOW_KEY = object()

_MAX_CALLS = 1024  # remembered call keys (cleared when full)
_CALLS: dict = {}
_LAUNCH_IDS = itertools.count()


def options_key(options: tuple) -> tuple:
    """Options in a key: their values and types, so that 3.0 never passes where 3 was checked, nor True where 1 was
    (a tuple or list of them, e.g. window_size, element by element: the options_key of each, a list as a tuple)."""
    types = tuple(map(type, options))
    if tuple in types or list in types:
        inner = tuple([options_key(x) for x, t in zip(options, types) if t is tuple or t is list])
        if list in types:
            options = tuple([tuple(x) if t is list else x for x, t in zip(options, types)])
        return options, types, inner
    return options, types


def window_key(window_size):
    """window_size in a call key (module constants above)."""
    return _NO_WINDOW_KEY if window_size is NO_WINDOW else window_size


def call_key(tag, tensors: tuple, options: tuple):
    """The key of a call (``tag``: the op, or a plan), or None where an argument is not a tensor: that call takes
    the full path, whose checks then name the argument. A key with an unhashable option is found in no store and
    kept in none (``lookup``, _store): that call too takes the full path every time (its hash is left to the one
    lookup that needs it)."""
    try:  # launch_cache.tensor_key of each tensor (None where None passed), inlined: the key is built on every call
        return (tag, tuple([None if x is None else (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0)
                            for x in tensors]), options_key(options))
    except (AttributeError, TypeError, RuntimeError):
        return None


def lookup(store: dict, key):
    """store.get(key); None where key is None or unhashable (call_key's keys are hashed here, once)."""
    if key is None:
        return None
    try:
        return store.get(key)
    except TypeError:
        return None


def capacity_bucket(n: int) -> int:
    """The capacity (or host length bound) a contiguous cache's call is sized for: ``n`` rounded up to one of 8
    steps per power of two, at least 64 (at most 1/8 more keys than ``n`` above 64), so a generation's calls share a
    resolved config and a record until the cache outgrows the bucket. A power of two is its own bucket."""
    if n <= 64:
        return 64
    step = (1 << (n - 1).bit_length()) // 8
    return -(-n // step) * step


def _int_class(n: int) -> tuple:
    """Triton's specialisation of an int argument: equal to 1, divisible by 16, beyond int32."""
    return n == 1, n % 16 == 0, not -2**31 <= n < 2**31


class GrowingCache:
    """A contiguous (batch_cache, seqlen, nheads_kv, headdim) K/V pair whose seqlen may grow, as the host path keys
    it (module doc): ``key``, what the call key holds of it - everything but seqlen (in its bucket) and the batch and
    head strides, plus what they decide for the config (element offsets within int32, the TMA row view);
    ``capacity`` (seqlen); ``spec``, Triton's specialisation of the capacity and the batch and head strides (in the
    launch key)."""

    __slots__ = ("key", "capacity", "spec")

    def __init__(self, key, capacity: int, spec: tuple):
        self.key, self.capacity, self.spec = key, capacity, spec


_GROWING: dict = {}  # the exact layout of a K/V pair -> its GrowingCache (the layers of a step share one)


def growing_cache(k_cache, v_cache) -> GrowingCache | None:
    """The GrowingCache of a K/V pair; None where it cannot be keyed so (not 4-D tensors of one shape and strides:
    the full path then names the argument). Kept per exact layout, so a step's layers (same shapes, other tensors)
    derive it once."""
    try:
        shape, stride = k_cache.shape, k_cache.stride()
        if len(shape) != 4 or v_cache.shape != shape or v_cache.stride() != stride:
            return None
        layout = (shape, stride, k_cache.dtype, v_cache.dtype, k_cache.device, v_cache.device,
                  k_cache.data_ptr() % 16 == 0, v_cache.data_ptr() % 16 == 0)
    except (AttributeError, TypeError, RuntimeError):
        return None
    found = _GROWING.get(layout)
    if found is None:
        if len(_GROWING) >= 256:
            _GROWING.clear()
        capacity = shape[1]
        key = (shape[0], shape[2], shape[3], stride[1], stride[3], capacity_bucket(capacity)) + layout[2:] + (
            _offsets_fit_int32(k_cache), cache_rows_tma_ok(k_cache))
        found = _GROWING[layout] = GrowingCache(
            key, capacity, (_int_class(capacity), _int_class(stride[0]), _int_class(stride[2])))
    return found


def _store(store: dict, key, value) -> bool:
    """store[key] = value (key None or unhashable: nothing, False), the store cleared first when full."""
    if key is None:
        return False
    if len(store) >= _MAX_CALLS:
        store.clear()
    try:
        store[key] = value
    except TypeError:
        return False
    return True


def keep(key, value) -> None:
    """Keep another op's per-key host state (append_kv's launch) beside the decode calls' (cleared with them)."""
    _store(_CALLS, key, value)


def kept(key):
    """What ``keep`` kept under ``key`` (None: nothing, or key None)."""
    return lookup(_CALLS, key)


_CHECKS: dict = {}  # wrappers' kept checks (flash_attn_with_kvcache), apart from the decode records (below)


def keep_checks(key, value) -> None:
    """Keep what a wrapper's checks decided under ``key``, in a store of their own: a cache that grows between
    calls gives the wrapper a key per length (its checks read the capacity), which must not crowd the decode
    records out of theirs (those share one per capacity bucket)."""
    _store(_CHECKS, key, value)


def kept_checks(key):
    """What ``keep_checks`` kept under ``key`` (None: nothing, or key None)."""
    return lookup(_CHECKS, key)


class _Entry:
    __slots__ = ("shape", "config", "launch")

    def __init__(self, shape, config, launch):
        self.shape, self.config, self.launch = shape, config, launch


def remember(key, shape, config, launch, growing: GrowingCache | None = None) -> None:
    """Keep a checked call's shape facts (without its tensors), config and launch geometry under ``key``
    (``growing``: a growing cache's, whose specialisation joins the launch key)."""
    launch_id = next(_LAUNCH_IDS)
    kept = detach(shape)
    kept.launch_key = launch_id
    if _store(_CALLS, key, _Entry(kept, config, launch)):  # (an unhashable key: launched without recording)
        shape.launch_key = launch_id if growing is None else (launch_id, growing.spec)


def recall(key, growing: GrowingCache | None = None):
    """(shape, config, launch) of a call whose key was remembered (a growing cache's: a copy of the shape with its
    capacity and launch key in place); None where it was not."""
    entry = lookup(_CALLS, key)
    if entry is None:
        return None
    shape = entry.shape
    if growing is not None:
        shape = _copy(shape)
        shape.capacity = growing.capacity
        shape.launch_key = (shape.launch_key, growing.spec)
    return shape, entry.config, entry.launch


_BOUND: dict = {}  # exact call key -> the decision bound to that layout (ops/decode.py DecidedDecode, kept)


def keep_bound(key, value) -> None:
    """Keep what a call of one exact layout runs (its record of _CALLS with a growing cache's capacity and launch
    key in place, and what its launch derives per layout) under its exact call key, in a store of its own: a
    growing cache's steps each add one, which must not crowd out the records they share."""
    _store(_BOUND, key, value)


def bound(key):
    """What ``keep_bound`` kept under ``key`` (None: nothing, or key None)."""
    return lookup(_BOUND, key)


def detach(shape):
    """A copy of a checked call's _DecodeShape without its tensors (q, the ALiBi slopes), to keep beside a
    wrapper's own record: the launches take a call's tensors as arguments."""
    kept = _copy(shape)
    kept.q4 = kept.alibi_slopes = None
    return kept


def _copy(shape):
    """A shallow copy of a _DecodeShape (copy.copy's generic path costs a few microseconds more)."""
    new = object.__new__(shape.__class__)
    new.__dict__.update(shape.__dict__)
    return new


def clear() -> None:
    _CALLS.clear()
    _CHECKS.clear()
    _BOUND.clear()
    _GROWING.clear()
