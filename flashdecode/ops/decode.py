"""flash_decode, DecodePlan (ops/decode_plan.py) and append_kv (ops/append_kv.py): the public decode API.

Two ways to call decode attention:
  - ``flash_decode(...)``: convenient. Without ``num_splits`` it sizes the splits for any mix of lengths up to the
    cache capacity (or ``max_seqlen_k``), as a DecodePlan does, and lets the device give each sequence the splits
    its live length needs (lengths on the host choose them there); it never syncs, allocates only its outputs
    (workspace from a per-stream pool), and a repeated
    call of the same metadata re-checks and re-resolves nothing (ops/decode_host.py) and launches the compiled
    kernels directly (ops/launch_cache.py); a contiguous cache that grows between calls (a generation's steps) is
    sized for its capacity bucket (decode_host.capacity_bucket), so its steps share one record per bucket.
  - ``DecodePlan(...).run(...)`` (or ``flash_decode(..., plan=plan)``): CUDA-graph capturable, with a split count
    and buffers fixed by the plan (ops/decode_plan.py).

Every launch decision is a ``DecodeConfig`` (flashdecode/config.py) resolved once by
heuristics.resolve_decode_config; ``config=`` overrides it (docs/architecture.md, "Decode dispatch").
"""

from __future__ import annotations

import dataclasses

import torch

from flashdecode import heuristics
from flashdecode.config import DecodeConfig, DecodePath
from flashdecode.ops import checks
from flashdecode.ops.append_kv import append_kv
from flashdecode.ops.decode_checks import _check_batch_invariant, _check_metadata
from flashdecode.ops.decode_host import NO_WINDOW, window_key
from flashdecode.ops.decode_launch import lse_view, plan_launch, run_decode
from flashdecode.ops.decode_plan import DecodePlan
from flashdecode.ops.decode_policy import _DecodeShape, check_config_fits, choose_live_keys, decode_device
from flashdecode.ops.util import call_scoped, capturing
from flashdecode.ops import decode_host, direct_launch
from flashdecode.ops.decode_workspace import call_workspace, stream_workspace, workspace
from flashdecode.ops.sinks import check_decode_sinks, decode_sinks_step

__all__ = ["flash_decode", "flash_decode_with_sinks", "decode_config", "DecodePlan", "append_kv"]

_check_num_splits = checks.check_num_splits  # None or an int in [1, checks.MAX_NUM_SPLITS]


def _resolve(shape: _DecodeShape, cache_seqlens, num_splits, max_seqlen_k, config, in_capture: bool = False,
             batch_invariant: bool = False):
    """(config, launch geometry) of a flash_decode call: the override checked against the call, or resolved."""
    num_splits = _check_num_splits(num_splits)
    fixed_split = batch_invariant or getattr(config, "path", None) is DecodePath.FIXED_SPLIT
    if fixed_split:
        live, total = shape.capacity, None  # no length is read: the config does not depend on them
    else:
        live, total = choose_live_keys(shape, cache_seqlens, num_splits, max_seqlen_k, in_capture)
    # lengths the host did not read (device-resident, a capture, a max_seqlen_k bound) may hold any mix: the splits
    # cover one long sequence among short ones, as a DecodePlan's do (the device paths give short ones fewer)
    problem = shape.problem(live, total_keys=total, num_splits=num_splits, batch_invariant=batch_invariant,
                            balance_mixed=num_splits is None and total is None and not fixed_split)
    if not fixed_split and total is None and not shape.paged:
        problem = _sized_for_bucket(problem)
    dev = decode_device(shape.device)
    if config is None:
        config = heuristics.resolve_decode_config(problem, dev)
    else:
        check_config_fits(config, problem, dev)
        if num_splits is not None and num_splits != config.num_splits:
            raise ValueError(f"num_splits ({num_splits}) disagrees with config.num_splits ({config.num_splits})")
    return config, plan_launch(config, problem)


def _sized_for_bucket(problem):
    """A contiguous cache's problem sized for the bucket of its capacity and length bound
    (decode_host.capacity_bucket), so that every call of a growing cache within one bucket resolves the same config
    and shares one record (ops/decode_host.py). Safe for every capacity in the bucket: the kernels take the real
    capacity at launch (they clamp the lengths to it and bound every read by it); a contiguous cache preloads no
    page ids and bounds no split by the capacity, so the geometry only sizes the split count and tiles."""
    return dataclasses.replace(problem, capacity=decode_host.capacity_bucket(problem.capacity),
                               live_keys=decode_host.capacity_bucket(problem.live_keys))


def decode_config(q, k_cache, v_cache, cache_seqlens, *, block_table=None, num_splits=None, window_size=(-1, -1),
                  max_seqlen_k=None, batch_invariant: bool = False, k_scale=None, v_scale=None) -> DecodeConfig:
    """The DecodeConfig flash_decode resolves for these arguments (the same policy: device-resident lengths are
    not read), e.g. to pass ``flash_decode(..., config=dataclasses.replace(decode_config(...), block_n=64))``."""
    batch_invariant = _check_batch_invariant(batch_invariant, num_splits, None)
    shape = _DecodeShape(q, k_cache, v_cache, cache_seqlens, block_table, None, 0.0, window_size, k_scale=k_scale,
                         v_scale=v_scale)
    return _resolve(shape, cache_seqlens, num_splits, max_seqlen_k, None, batch_invariant=batch_invariant)[0]


def flash_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None, num_splits=None,
                 softcap=0.0, window_size=NO_WINDOW, return_lse=False, out=None, max_seqlen_k=None, plan=None,
                 config: DecodeConfig | None = None, validate=False, sinks=None, batch_invariant: bool = False,
                 alibi_slopes=None, k_scale=None, v_scale=None):
    """Flash-Decoding: attention of a few new query tokens against a KV cache, split over the KV length.

    Args:
        q: (batch, nheads, headdim) or (batch, seqlen_q, nheads, headdim) fp16/bf16/fp32; the seqlen_q tokens are
            the LAST seqlen_q positions of each sequence and are causal among themselves (bottom-right aligned).
        k_cache, v_cache: same dtype as q (or both 8-bit, see k_scale), same shape and strides, unit stride on
            headdim. Contiguous
            (batch_cache >= batch, max_seqlen, nheads_kv, headdim), or paged (num_pages, page_size, nheads_kv,
            headdim) when ``block_table`` is given. nheads % nheads_kv == 0 (GQA/MQA, any group size).
        cache_seqlens: int32 (batch,) on q's device: live keys per sequence INCLUDING the seqlen_q new ones
            (call append_kv first). 0 is allowed (out 0, lse -inf). Values on the host are checked against the
            capacity; values on the device are clamped to it by the kernel (too-long lengths cannot be detected
            without a sync; see validate).
        block_table: int32 (batch, max_pages_per_seq) page ids (paged cache only); any page_size >= 1. On the
            host, the ids of the pages that hold live keys are checked (ValueError naming the entry). On the
            device they are not (that would need a sync): the kernels read a position whose id is outside
            [0, num_pages) as absent (it contributes nothing), never memory outside the cache.
        softmax_scale: default headdim ** -0.5. softcap: logits -> softcap * tanh(logits / softcap), 0 = off.
        window_size: (left, right); left >= 0 restricts row i to keys >= its position - left. right is moot:
            decode rows see no keys after their own position.
        num_splits: KV splits per sequence; None = heuristic from the live lengths, 1 = one kernel, no merge.
        max_seqlen_k: optional host-side bound on cache_seqlens for the split policy (default: the cache capacity,
            or the longest host-resident length; device-resident lengths are never read on the host).
        plan: a DecodePlan; the call then runs plan.run(...) (capturable, buffers owned by the plan).
        out: optional output tensor like q; with seqlen_q > 1 and splits its (batch, seqlen_q) dims must collapse
            into one (e.g. contiguous). Without it the output is a new contiguous tensor, whatever q's layout.
        validate: True copies device-resident cache_seqlens / block_table to the host once (one sync; not
            during CUDA-graph capture) and raises ValueError naming the sequence and position of the first
            length outside [0, capacity] or page id outside [0, num_pages) - for debugging a serving loop.
        config: a DecodeConfig overriding every launch decision (e.g. ``dataclasses.replace`` of
            ``decode_config(...)``); checked against this call (TypeError / ValueError naming ``config``).
        sinks: optional (nheads,) float32 per-head sink logits that join each row's softmax denominator with no
            value (GPT-OSS, StreamingLLM); applied exactly to (out, lse) after the kernels, as a step
            (ops/sinks.py), so the call then allocates its result.
        batch_invariant: each sequence's out and lse are bitwise identical whatever batch it sits in and whatever
            the other sequences' lengths (and the cache's capacity): every sequence is split at fixed key offsets,
            every heuristics.DECODE_BATCH_INVARIANT_SPLIT_KEYS (2048) keys from its first live key, each split run
            with the same tiles, and its splits merged in order in fixed steps (the FIXED_SPLIT path,
            heuristics.batch_invariant_config; docs/architecture.md, "Decode dispatch"), so only its own length
            decides its splits; num_splits=1 runs it unsplit instead (also invariant, slower for long sequences);
            excludes num_splits > 1 and config= (a FIXED_SPLIT config, e.g. dataclasses.replace of
            decode_config(..., batch_invariant=True) with another split_keys, is batch-invariant by itself). It never
            reads the lengths on the host (max_seqlen_k is ignored): the split grid is sized from the cache's
            capacity, its splits past a sequence's end are empty. With plan=, the plan's own flag decides.
        alibi_slopes: optional float32 (nheads,) or (batch, nheads) ALiBi slopes, one per query head: the bias
            -slope * |qpos - j| for the row at key position qpos (its token's position in the sequence, the new
            tokens being the last seqlen_q) and key j joins the scaled logits after the softcap (flash-attn's
            rule), on every decode path; lse includes it.
        k_scale, v_scale: required with an 8-bit cache (k_cache / v_cache torch.float8_e4m3fn, or int8 symmetric),
            refused otherwise: float32 on q's device, broadcastable to the cache's shape[:-1]: () one scale,
            (nheads_kv,) one per kv head, or per token and kv head ((batch_cache, max_seqlen, nheads_kv) contiguous,
            (num_pages, page_size, nheads_kv) paged). The cache stands for k_cache.float() * k_scale[..., None]
            (likewise V); q and out stay fp16/bf16/fp32. append_kv(..., k_scale=, v_scale=) writes such a cache.
            They combine with sinks, batch_invariant and alibi_slopes.
    Under CUDA-graph capture (torch.cuda.is_current_stream_capturing()) the call never syncs the host: without
    num_splits / max_seqlen_k the split count is sized from the cache capacity (the device-side split counts then
    follow the live lengths), and the split workspace comes from a per-device pool that eager calls of the same
    shapes have sized (a capture that needs more grows it inside the graph's memory pool). Inside
    util.call_scoped_buffers (the transformers op torch.compile runs) every buffer is the call's own (no pool).
    Returns:
        out like q, and if return_lse, lse float32 (batch, [seqlen_q,] nheads), natural log.
    """
    batch_invariant = _check_batch_invariant(batch_invariant, num_splits, config)
    if plan is not None and batch_invariant and not plan.batch_invariant:
        raise ValueError("batch_invariant=True with a plan made without it; make the DecodePlan with "
                         "batch_invariant=True")
    if plan is not None:
        if num_splits is not None or max_seqlen_k is not None or config is not None:
            raise ValueError("num_splits / max_seqlen_k / config are fixed by the plan; do not pass them with plan=")
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan, got {type(plan).__name__}")
        return plan.run(q, k_cache, v_cache, cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
                        softcap=softcap, window_size=window_size, return_lse=return_lse, out=out,
                        validate=validate, sinks=sinks, alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale)
    checks.check_bool("return_lse", return_lse)
    if sinks is not None:
        check_decode_sinks(sinks, q)
    decided = decide_flash_decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                                  softmax_scale=softmax_scale, num_splits=num_splits, softcap=softcap,
                                  window_size=window_size, out=out, max_seqlen_k=max_seqlen_k, config=config,
                                  validate=validate, batch_invariant=batch_invariant, alibi_slopes=alibi_slopes,
                                  k_scale=k_scale, v_scale=v_scale)
    result, lse = launch_decided(decided, q, k_cache, v_cache, cache_seqlens, block_table, out,
                                 return_lse or sinks is not None, alibi_slopes)
    if sinks is not None:
        return decode_sinks_step(result, lse, sinks, out, return_lse)
    return (result, lse) if return_lse else result


def flash_decode_with_sinks(q, k_cache, v_cache, cache_seqlens, sinks, *, return_lse=False, **kwargs):
    """flash_decode(..., sinks=sinks) (with plan=, DecodePlan.run): attention sinks, forward only.

    Args: as flash_decode (q (batch, [seqlen_q,] nheads, headdim), ...), plus sinks (nheads,) float; ``out=``
        receives the final result (written in place, and returned).
    Returns: out like q [, lse' (batch, [seqlen_q,] nheads) float32].
    """
    return flash_decode(q, k_cache, v_cache, cache_seqlens, sinks=sinks, return_lse=return_lse, **kwargs)


def prepare_flash_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                         num_splits=None, softcap=0.0, window_size=NO_WINDOW, out=None, max_seqlen_k=None,
                         config: DecodeConfig | None = None, validate=False, batch_invariant: bool = False,
                         alibi_slopes=None, k_scale=None, v_scale=None, return_lse: bool = True):
    """Every check and launch decision of flash_decode(...) (same arguments, no sinks / plan), and nothing written:
    returns a function that launches the call and returns (out, lse; None unless return_lse). A caller that writes
    the cache first (append then attend, flash_attn_with_kvcache) checks the whole call here before its write, so
    a call that raises has changed nothing. The tensors must not change shape or move before the launch;
    cache_seqlens is read on the host here (host-resident lengths, for the split heuristic) exactly as flash_decode
    reads it, so its values must be the ones the launch sees. A repeated call key whose checks read no value
    (device lengths, validate=False, no 8-bit scales) skips the checks and the resolution (ops/decode_host.py)."""
    decided = decide_flash_decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                                  softmax_scale=softmax_scale, num_splits=num_splits, softcap=softcap,
                                  window_size=window_size, out=out, max_seqlen_k=max_seqlen_k, config=config,
                                  validate=validate, batch_invariant=batch_invariant, alibi_slopes=alibi_slopes,
                                  k_scale=k_scale, v_scale=v_scale)

    def run():
        return launch_decided(decided, q, k_cache, v_cache, cache_seqlens, block_table, out, return_lse,
                              alibi_slopes)
    return run


class DecidedDecode:
    """What prepare_flash_decode decides for one call: the checked shape facts (shape.launch_key keys its launches;
    a growing cache's capacity in place), the config and launch geometry, whether the stream was capturing, whether
    this is the first call of its exact layout (which sizes the device pool for captures of it). Kept per exact
    call key (decode_host.keep_bound): a repeated call finds it whole and only launches."""

    __slots__ = ("shape", "config", "launch", "in_capture", "new_key")

    def __init__(self, shape, config, launch, in_capture: bool, new_key: bool):
        self.shape, self.config, self.launch = shape, config, launch
        self.in_capture, self.new_key = in_capture, new_key

    def kept(self) -> "DecidedDecode":
        """A copy to keep for later calls of this layout: its shape without the call's tensors
        (decode_host.detach), not a new key any more."""
        return DecidedDecode(decode_host.detach(self.shape), self.config, self.launch, self.in_capture, False)

    def relaunch(self, q, alibi_slopes, k_cache, v_cache, cache_seqlens, block_table, return_lse: bool):
        """A kept decision launched for a later call on tensors of the layouts it was decided for (no out=; the
        caller's key fixes every layout and checks that the stream's capture state is the decided one)."""
        return _launch_decode(self, q, k_cache, v_cache, cache_seqlens, block_table, None, return_lse,
                              alibi_slopes)


def decide_flash_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                        num_splits=None, softcap=0.0, window_size=NO_WINDOW, out=None, max_seqlen_k=None,
                        config: DecodeConfig | None = None, validate=False, batch_invariant: bool = False,
                        alibi_slopes=None, k_scale=None, v_scale=None) -> DecidedDecode:
    """prepare_flash_decode's checks and decisions (its arguments), as a DecidedDecode; launch_decided runs it.
    A call whose checks read no value (device-resident lengths, validate=False, no 8-bit scales) is keyed by the
    exact layout of every tensor and its options (decode_host.call_key): a repeated key returns the kept decision
    at once, a new one is decided from its record (a growing cache's bucket, ops/decode_host.py) or checked and
    resolved in full."""
    batch_invariant = _check_batch_invariant(batch_invariant, num_splits, config)
    in_capture = capturing(q.device) if isinstance(q, torch.Tensor) else False
    key = None
    if validate is False and k_scale is None and v_scale is None and isinstance(cache_seqlens, torch.Tensor) \
            and not checks.host_resident(cache_seqlens):  # the checks and the config read no value: keep them
        key = decode_host.call_key("flash_decode", (q, k_cache, v_cache, cache_seqlens, block_table, out,
                                                    alibi_slopes),
                                   (softmax_scale, num_splits, softcap, window_key(window_size), config,
                                    batch_invariant, in_capture, max_seqlen_k))
        found = decode_host.bound(key)
        if found is not None:
            return found
    decided = _decide_layout(key, q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, num_splits, softcap,
                             window_size, out, max_seqlen_k, config, validate, batch_invariant, alibi_slopes, k_scale,
                             v_scale, in_capture)
    if key is not None:
        decode_host.keep_bound(key, decided.kept())
    return decided


def _decide_layout(key, q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, num_splits, softcap,
                   window_size, out, max_seqlen_k, config, validate, batch_invariant, alibi_slopes, k_scale, v_scale,
                   in_capture) -> DecidedDecode:
    """The decision of a call layout met for the first time (``key``: its exact key, None where its checks read
    values): the remembered record of its call key - one per capacity bucket for a growing cache - bound to this
    layout, else every check and the resolution, remembered."""
    bucket_key, growing = key, None
    if key is not None:
        growing = _growing_cache(k_cache, v_cache, block_table, config, batch_invariant)
        if growing is not None:  # one record per capacity bucket: a growing cache's calls share it
            bucket_key = decode_host.call_key(
                ("flash_decode", growing.key), (q, cache_seqlens, out, alibi_slopes),
                (softmax_scale, num_splits, softcap, window_size, config, batch_invariant, in_capture,
                 _length_bound_key(max_seqlen_k)))
    found = decode_host.recall(bucket_key, growing)
    if found is None:
        shape, config, launch = _checked_call(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale,
                                              num_splits, softcap, window_size, out, max_seqlen_k, config, validate,
                                              batch_invariant, alibi_slopes, k_scale, v_scale, in_capture)
        decode_host.remember(bucket_key, shape, config, launch, growing)
    else:
        shape, config, launch = found
    return DecidedDecode(shape, config, launch, in_capture, True)


def launch_decided(decided: DecidedDecode, q, k_cache, v_cache, cache_seqlens, block_table, out, return_lse: bool,
                   alibi_slopes=None):
    """Launch a decided call on tensors of the layouts it was decided for; returns (out like q, lse float32
    (batch, [seqlen_q,] nheads) or None unless return_lse)."""
    return _launch_decode(decided, q, k_cache, v_cache, cache_seqlens, block_table, out, return_lse, alibi_slopes)


def _growing_cache(k_cache, v_cache, block_table, config, batch_invariant):
    """decode_host.growing_cache of a contiguous cache whose config _resolve sizes for its capacity bucket (no
    config= override, not batch-invariant: those are keyed by their exact shapes); None otherwise."""
    if block_table is not None or config is not None or batch_invariant:
        return None
    return decode_host.growing_cache(k_cache, v_cache)


def _length_bound_key(max_seqlen_k):
    """max_seqlen_k in a growing cache's call key: its bucket (what _resolve sizes the call for) where it is an
    int, else itself (with its type: the full path's check then raises)."""
    if type(max_seqlen_k) is int and max_seqlen_k >= 0:
        return ("bucket", decode_host.capacity_bucket(max_seqlen_k))
    return max_seqlen_k


def _launch_decode(decided: DecidedDecode, q, k_cache, v_cache, cache_seqlens, block_table, out, return_lse: bool,
                   alibi_slopes):
    """flash_decode's launch of a checked, resolved call: its outputs (new, or ``out``) and the split workspace
    (the pool's: nothing allocated but the results), then the kernels. Returns (out like q, lse float32 (batch,
    [seqlen_q,] nheads) or None unless return_lse)."""
    shape, launch = decided.shape, decided.launch
    device = shape.device
    # contiguous whatever q's layout: the merge writes (batch * seqlen_q) rows through one collapsed view (and
    # empty_like parses less per call than torch.empty with its options)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse_shape = (shape.batch, shape.seqlen_q, shape.nheads)
    partial_shape, n_tickets = launch.partial_shape, launch.tickets  # (the call's problem fixed them)
    queue = None  # (run_decode slices it where the pool keeps no view)
    if call_scoped():  # an op torch.compile runs (a cudagraph tree's warmup or capture): this call's own buffers
        lse3 = torch.empty(lse_shape, dtype=torch.float32, device=device)
        partial_o, partial_lse, tickets = call_workspace(device, partial_shape, n_tickets)
    elif decided.in_capture:  # no allocation, no sync: the pool's buffers (zeros at rest for the tickets)
        lse3 = torch.empty(lse_shape, dtype=torch.float32, device=device)
        partial_o, partial_lse, tickets = workspace(device).take(partial_shape, n_tickets)
    else:  # the eager pool of this stream: nothing allocated but the results
        if decided.new_key:
            workspace(device).reserve(partial_shape, n_tickets)
        pool = stream_workspace(device, direct_launch.current_stream(device.index) if device.type == "cuda" else None)
        partial_o, partial_lse, tickets, lse3, queue = pool.take_eager(partial_shape, n_tickets,
                                                                       None if return_lse else lse_shape)
        if return_lse:
            lse3 = torch.empty(lse_shape, dtype=torch.float32, device=device)
    run_decode(shape, launch, q, alibi_slopes, k_cache, v_cache, cache_seqlens, block_table, out, lse3, partial_o,
               partial_lse, tickets, queue)
    return out, (lse_view(lse3, q) if return_lse else None)


def _checked_call(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, num_splits, softcap, window_size,
                  out, max_seqlen_k, config, validate, batch_invariant, alibi_slopes, k_scale, v_scale, in_capture):
    """Every check of a flash_decode call and its (shape, config, launch geometry)."""
    max_seqlen_k = checks.check_optional_int("max_seqlen_k", max_seqlen_k, 0)
    shape = _DecodeShape(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, softcap, window_size,
                         k_scale=k_scale, v_scale=v_scale)
    shape.with_alibi(alibi_slopes)
    shape.check_out(out, q)
    _check_metadata(shape, cache_seqlens, block_table, validate)
    config, launch = _resolve(shape, cache_seqlens, num_splits, max_seqlen_k, config, in_capture, batch_invariant)
    return shape, config, launch
