"""merge_states / merge_states_many: the log-sum-exp merge of attention states as a public primitive (cascade and
shared-prefix attention, sequence parallelism), and the launcher that Flash-Decoding's stage 2 shares."""

from __future__ import annotations


import torch

from flashdecode import heuristics
from flashdecode.kernels.merge import merge_many_kernel, merge_two_kernel
from flashdecode.ops import checks
from flashdecode.ops.util import interpreting_now
from flashdecode.ops.launch_cache import BoundLaunch, LaunchSite, tensor_key

__all__ = ["merge_states", "merge_states_many", "launch_merge_many", "relaunch_merge"]

_DTYPES = checks.FLOAT_DTYPES
_TILE_ELEMS = 8192  # fp32 elements of the (rows, states, headdim) tile one merge program holds: 64 splits x hd128
# live_only merges (kernels/merge.py LIVE_ONLY): states folded per step, and the most lse values / (rows, states,
# headdim) elements one program holds. The device-split grid gives a sequence 1-2 of its slots at batch 16-64.
_LIVE_BLOCK_S = 2
_LIVE_LSE_ELEMS = 2048
_LIVE_TILE_ELEMS = 4096
# Widest head dim the merge tiles take: one program holds a (rows, states, headdim) tile of _TILE_ELEMS values,
# so this bounds its registers (MLA-style 512-wide states fit with room to spare).
MAX_MERGE_HEAD_DIM = 1024


def _check_state(name_o, o, name_lse, lse):
    """o (..., nheads, headdim) float, lse (..., nheads) fp32 on o's device, which the kernels can run on."""
    checks.check_tensor(name_o, o, range(2, 64), _DTYPES)
    checks.check_tensor(name_lse, lse, range(1, 64), (torch.float32,))
    if tuple(lse.shape) != tuple(o.shape[:-1]):
        raise ValueError(f"{name_o} must be (..., nheads, headdim) and {name_lse} (..., nheads); got "
                         f"{tuple(o.shape)} and {tuple(lse.shape)}")
    if o.shape[-1] > MAX_MERGE_HEAD_DIM:
        raise ValueError(f"{name_o} head dim must be <= {MAX_MERGE_HEAD_DIM}, got {o.shape[-1]}")
    checks.check_device(name_lse, lse, o.device, ref=name_o)
    checks.check_kernel_device(name_o, o)


def _stack_states(name, xs):
    """A sequence of same-shape, same-dtype, same-device tensors -> one (N, ...) tensor (a tensor passes as is)."""
    if isinstance(xs, torch.Tensor):
        return xs
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name} must be a tensor or a list/tuple of tensors, got {type(xs).__name__}")
    if not xs:
        raise ValueError(f"{name} is an empty sequence: pass an (0, ..., nheads[, headdim]) tensor for no states")
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != xs[0].shape or x.dtype != xs[0].dtype or x.device != xs[0].device:
            raise ValueError(f"{name}[{i}] is {tuple(x.shape)} {x.dtype} on {x.device} but {name}[0] is "
                             f"{tuple(xs[0].shape)} {xs[0].dtype} on {xs[0].device}")
    return torch.stack(list(xs))


def _rows3(x, headdim_last: bool):
    """(..., nheads[, headdim]) -> (outer, nheads[, headdim]) view when possible (reshape copies otherwise)."""
    if headdim_last:
        return x.reshape(-1, x.shape[-2], x.shape[-1])
    return x.reshape(-1, x.shape[-1])


def launch_merge_many(o_in, lse_in, o_out, lse_out, *, states_dim: int, lse_log2: bool, use_pdl: bool = False,
                      early_trigger: bool = False, d_chunks: int = 1, max_rows: int = 0, block_s: int = 0,
                      skip_empty: bool = False, live_only: bool = False, key=None):
    """Merge along the states dim. o_in (outer, inner, N, d) if states_dim == 2 else (N, outer, inner, d);
    lse_in likewise without d; o_out (outer, inner, d); lse_out (outer, inner) fp32 natural log. Any strides.
    use_pdl: launch as a programmatic dependent of the previous kernel (Hopper; it waits on the device for that
    kernel's writes, while its launch overlaps that kernel's tail). early_trigger (with use_pdl): let the next
    kernel launch before this one waits (only for next kernels that wait on the device before reading).
    d_chunks: programs per row block, each merging a slice of the head dim (a power of two; more, smaller
    programs for merges of few rows). max_rows: the most rows one program merges (0: as many as its tile of
    _TILE_ELEMS values holds; 1 with d_chunks spreads a merge of few rows over rows x d_chunks programs).
    block_s: states folded per step (a power of two; 0: up to the state count, as the tile allows). skip_empty
    (with a fixed block_s): steps whose states are all empty leave the result's bits alone (kernels/merge.py
    SKIP_EMPTY), so appending empty states changes nothing - batch-invariant decode's merge. live_only: all lse
    first, then the live states only (kernels/merge.py LIVE_ONLY; for launches whose states are mostly empty
    slots; block_s then counts live states a step). key: the launch-cache key of a caller whose key fixes every
    tensor's layout and these options (default: one built from the tensors and options)."""
    if states_dim == 2:
        o_in_s, lse_in_s = o_in, lse_in
    else:  # (N, outer, inner, ...) -> (outer, inner, N, ...) as a view
        o_in_s, lse_in_s = o_in.permute(1, 2, 0, 3), lse_in.permute(1, 2, 0)
    if key is None:
        key = (tensor_key(o_in_s), tensor_key(lse_in_s), tensor_key(o_out), tensor_key(lse_out), lse_log2, use_pdl,
               early_trigger, d_chunks, max_rows, block_s, skip_empty, live_only)
    plan = _MERGE_MANY.plans.get(key)
    if plan is None:
        plan = _MERGE_MANY.plans.put(key, _MergePlan(key, o_in_s, lse_in_s, o_out, lse_out, lse_log2, use_pdl,
                                                     early_trigger, d_chunks, max_rows, block_s, skip_empty, live_only))
    if plan.grid is not None:
        _MERGE_MANY.launch(key, plan.grid, (o_in_s, lse_in_s, o_out, lse_out) + plan.ints, plan.constexprs,
                           o_out.device)


def relaunch_merge(key, o_in, lse_in, o_out, lse_out) -> bool:
    """launch_merge_many's launch under a caller's ``key`` (states_dim 2) where that key is planned, with tensors at
    the data pointers of the views it was planned for (o_in, lse_in, o_out, lse_out: the kernel reads only their
    pointers and dtypes; the plan holds the views' strides), so a caller whose key fixes every layout reshapes
    nothing per call. False where the key has no plan yet (call launch_merge_many with the views)."""
    plan = _MERGE_MANY.plans.get(key)
    if plan is None:
        return False
    if plan.grid is None:
        return True
    full = plan.bound.full()
    if full is None:
        _MERGE_MANY.launch(key, plan.grid, (o_in, lse_in, o_out, lse_out) + plan.ints, plan.constexprs,
                           o_out.device)
    else:  # the key's recorded launch: its argument list, the four tensors written in
        at_o_in, at_lse_in, at_o_out, at_lse_out = _MERGE_MANY_TENSORS
        full[at_o_in], full[at_lse_in], full[at_o_out], full[at_lse_out] = o_in, lse_in, o_out, lse_out
        plan.bound.launch(plan.grid, full, o_out.device)
    return True


class _MergePlan:
    """What a launch_merge_many key fixes (the tensors' shapes and strides, the options): the grid (None: nothing to
    merge), the kernel's integer arguments (also in place in ``bound``, the key's BoundLaunch) and its constexprs;
    made once per key (kept beside the site's records)."""

    __slots__ = ("grid", "ints", "constexprs", "bound")

    def __init__(self, key, o_in_s, lse_in_s, o_out, lse_out, lse_log2, use_pdl, early_trigger, d_chunks, max_rows,
                 block_s, skip_empty, live_only):
        outer, inner, num_states, headdim = o_in_s.shape
        self.grid = self.ints = None
        if d_chunks < 1 or d_chunks & (d_chunks - 1):
            raise ValueError(f"d_chunks must be a power of two >= 1, got {d_chunks}")
        if max_rows < 0 or max_rows & (max_rows - 1):
            raise ValueError(f"max_rows must be 0 or a power of two, got {max_rows}")
        if block_s < 0 or block_s & (block_s - 1):
            raise ValueError(f"block_s must be 0 or a power of two, got {block_s}")
        if outer == 0 or inner == 0:
            return
        block_d = max(16, heuristics.next_power_of_2(max(16, headdim)) // d_chunks)
        states_pad = heuristics.next_power_of_2(max(num_states, 1))
        if live_only:  # every lse of its rows at once, then BLOCK_S live states a step: a small tile, more rows
            block_s = block_s or _LIVE_BLOCK_S
            block_r = max(1, min(heuristics.next_power_of_2(inner), _LIVE_LSE_ELEMS // states_pad,
                                 _LIVE_TILE_ELEMS // (block_s * block_d)))
        else:
            block_s = block_s or min(states_pad, max(1, _TILE_ELEMS // block_d))
            block_r = max(1, min(heuristics.next_power_of_2(inner), _TILE_ELEMS // (block_s * block_d)))
        if max_rows:
            block_r = min(block_r, max_rows)
        self.grid = (outer, heuristics.cdiv(inner, block_r), heuristics.cdiv(headdim, block_d))
        self.ints = (num_states, inner, *o_in_s.stride(), *lse_in_s.stride(), *o_out.stride(), *lse_out.stride())
        self.bound = BoundLaunch(_MERGE_MANY, key, dict(zip(_MERGE_MANY.runtime_names[4:], self.ints)))
        options = dict(
            HEADDIM=headdim, BLOCK_R=block_r, BLOCK_S=block_s, BLOCK_D=block_d, LSE_LOG2=lse_log2, USE_PDL=use_pdl,
            EARLY_TRIGGER=bool(use_pdl and early_trigger), SKIP_EMPTY=bool(skip_empty), LIVE_ONLY=bool(live_only),
            STATES_PAD=states_pad if live_only else 1, num_warps=4, **({"launch_pdl": True} if use_pdl else {}))
        self.constexprs = lambda: options


_MERGE_MANY = LaunchSite(merge_many_kernel, "merge_many_kernel")
_MERGE_MANY_TENSORS = _MERGE_MANY.positions("O_IN", "LSE_IN", "O_OUT", "LSE_OUT")
_MERGE_TWO = LaunchSite(merge_two_kernel, "merge_two_kernel")


def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two attention states over disjoint key sets into the state over their union.

    Args:
        o_a, o_b: (..., nheads, headdim) fp16/bf16/fp32, each normalised over its own keys; same shape and dtype.
        lse_a, lse_b: (..., nheads) float32, natural-log log-sum-exp of each key set (-inf = empty set).
    Returns:
        o (..., nheads, headdim) in o_a's dtype, lse (..., nheads) float32:
        lse = log(e^lse_a + e^lse_b), o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b. A side with lse = -inf
        contributes nothing (its o is never read); both -inf gives (0, -inf). The values are not read on the host
        (no sync): a NaN or +inf lse gives NaN in its row, never a value that looks valid.
    Any strides and layouts (permuted, sliced views) are read in place; the results are new contiguous tensors.
    Raises TypeError / ValueError naming the argument for a bad type, dtype, shape or device (the Triton kernels
    need a CUDA tensor, or TRITON_INTERPRET=1 for CPU tensors).
    """
    key = _merge_two_key(o_a, lse_a, o_b, lse_b)
    plan = None if key is None else _MERGE_TWO.plans.get(key)
    if plan is None:
        _check_state("o_a", o_a, "lse_a", lse_a)
        _check_state("o_b", o_b, "lse_b", lse_b)
        if o_a.shape != o_b.shape or o_a.dtype != o_b.dtype or o_a.device != o_b.device:
            raise ValueError(f"o_a and o_b must match in shape, dtype and device; got {tuple(o_a.shape)} "
                             f"{o_a.dtype} and {tuple(o_b.shape)} {o_b.dtype}")
        # (key is not None here: an argument that is not a tensor has failed the checks)
        plan = _MERGE_TWO.plans.put(key, _MergeTwoPlan(o_a, lse_a, o_b, lse_b))
    # new contiguous results (lse_a is float32: checked); empty_like parses less per call than torch.empty
    out = torch.empty_like(o_a, memory_format=torch.contiguous_format)
    lse = torch.empty_like(lse_a, memory_format=torch.contiguous_format)
    if plan.grid is None:
        return out, lse
    if plan.in_place:  # every row view is a view: the kernel reads the tensors' own pointers
        tensors = (o_a, lse_a, o_b, lse_b, out, lse)
    else:
        tensors = (_rows3(o_a, True), _rows3(lse_a, False), _rows3(o_b, True), _rows3(lse_b, False), out, lse)
    _MERGE_TWO.launch(key, plan.grid, tensors + plan.ints, plan.constexprs, o_a.device)
    return out, lse


def _merge_two_key(o_a, lse_a, o_b, lse_b):
    """The key under which merge_states keeps its checks and launch (every tensor's shape, strides, dtype, device
    and alignment, and the interpreter switch for CPU tensors, which decides whether they are accepted), or None
    where an argument is not a tensor (the checks then name it)."""
    tensor = torch.Tensor
    if not (isinstance(o_a, tensor) and isinstance(lse_a, tensor) and isinstance(o_b, tensor)
            and isinstance(lse_b, tensor)):
        return None
    # launch_cache.tensor_key of each, inlined (the key is built on every call)
    return ("merge_states", tuple([(x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0)
                                   for x in (o_a, lse_a, o_b, lse_b)]), o_a.is_cpu and interpreting_now())


class _MergeTwoPlan:
    """What merge_states' key fixes (checked tensors): the grid (None: an empty result), whether the inputs' row
    views (_rows3) are views (in_place: the launch passes the tensors themselves, at the same pointers; else the
    reshapes that copy run per call), the kernel's integer arguments (the row views' strides) and its constexprs.
    The results are new contiguous tensors, passed as they are."""

    __slots__ = ("grid", "in_place", "ints", "constexprs")

    def __init__(self, o_a, lse_a, o_b, lse_b):
        self.grid = None
        if o_a.numel() == 0:
            return
        a, la, b_, lb = _rows3(o_a, True), _rows3(lse_a, False), _rows3(o_b, True), _rows3(lse_b, False)
        outer, inner, headdim = a.shape
        self.in_place = all(r.data_ptr() == x.data_ptr() for r, x in ((a, o_a), (la, lse_a), (b_, o_b), (lb, lse_b)))
        block_d = heuristics.next_power_of_2(max(16, headdim))
        block_r = max(1, min(heuristics.next_power_of_2(inner), _TILE_ELEMS // block_d))
        self.grid = (outer, heuristics.cdiv(inner, block_r), 1)
        # the results are new contiguous tensors: their row views' strides follow from the shapes
        self.ints = (inner, *a.stride(), *la.stride(), *b_.stride(), *lb.stride(), inner * headdim, headdim, 1,
                     inner, 1)
        options = dict(HEADDIM=headdim, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
        self.constexprs = lambda: options


def merge_states_many(outs, lses):
    """Merge N attention states along dim 0 (Flash-Decoding's reduction as a primitive).

    Args:
        outs: (N, ..., nheads, headdim) fp16/bf16/fp32 tensor, or a sequence of N (..., nheads, headdim) tensors.
        lses: (N, ..., nheads) float32 natural log (or a sequence); -inf marks an empty state (never read).
    Returns:
        o (..., nheads, headdim) in outs' dtype, lse (..., nheads) float32; (0, -inf) where every state is empty.
    Layouts, NaN / +inf lse and errors as in ``merge_states``; a sequence must hold tensors of one shape, dtype
    and device (an empty sequence is a ValueError: pass an (0, ..., nheads, headdim) tensor for no states).
    """
    outs, lses = _stack_states("outs", outs), _stack_states("lses", lses)
    checks.check_tensor("outs", outs, range(3, 64))
    _check_state("outs", outs, "lses", lses)
    n = outs.shape[0]
    out = torch.empty(outs.shape[1:], dtype=outs.dtype, device=outs.device)
    lse = torch.empty(lses.shape[1:], dtype=torch.float32, device=outs.device)
    if out.numel() == 0:
        return out, lse
    if n == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    o4 = outs.reshape(n, -1, outs.shape[-2], outs.shape[-1])
    l3 = lses.reshape(n, -1, lses.shape[-1])
    launch_merge_many(o4, l3, out.view(-1, *out.shape[-2:]), lse.view(-1, lse.shape[-1]), states_dim=0,
                      lse_log2=False)
    return out, lse
