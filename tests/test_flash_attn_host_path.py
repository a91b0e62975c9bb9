"""flash_attn's host path on repeated calls (runs on the CPU interpreter and on the GPU): a plain dense call whose key
(shapes, strides, dtypes, devices, alignment, mask flags) was seen before goes straight to its ready forward in the
dense call cache - no tensor checks, no plan or configuration work, no autograd.Function unless a gradient can flow -
and computes what the general path computes; bad options still raise the general checks' errors after the key is
cached. Counts of Python-level calls, never timings."""

from __future__ import annotations

import pytest
import torch

import flashdecode
from flashdecode.ops import attention as attn_ops
from flashdecode.ops import (attention_autograd, attention_config, attention_launch, attention_plans, checks,
                             launch_cache)
from helpers import HAS_CUDA, KERNEL_DTYPES, SUBPROCESS_TIMEOUT_S, randn

SHAPE_Q, SHAPE_KV = (1, 19, 4, 32), (1, 23, 2, 32)


def _qkv(seed: int, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(seed)  # helpers.randn draws on the CPU
    q, k, v = (randn(*s, gen=gen, dtype=KERNEL_DTYPES[0]) for s in (SHAPE_Q, SHAPE_KV, SHAPE_KV))
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


@pytest.fixture
def spied(monkeypatch):
    """Records the general path's work: the tensor checks, the dense entry's construction, the launch-plan and
    configuration lookups, the autograd Functions and the forward op's implementation."""
    work = []
    for owner, name in ((checks, "check_attention_tensors"), (checks, "check_attention_tensors_once"),
                        (attention_plans, "config_for"), (attention_plans, "_fwd_plan"),
                        (attention_launch, "_fwd_plan"), (attention_autograd, "_fwd_impl"),
                        (attention_plans._DenseCall, "__init__")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **kw: (work.append(_name),
                                                                                 _real(*a, **kw))[1])
    monkeypatch.setattr(attention_autograd._FlashAttnFunction, "apply", lambda *a,
                        _apply=attention_autograd._FlashAttnFunction.apply:
                        (work.append("_FlashAttnFunction"), _apply(*a))[1])
    # the dense call cache's autograd: _DenseCallFunction through its C apply (_dense_autograd)
    monkeypatch.setattr(attn_ops, "_dense_autograd", lambda *a, _apply=attn_ops._dense_autograd:
                        (work.append("_DenseCallFunction"), _apply(*a))[1])
    return work


@pytest.mark.parametrize("causal", [False, True])
def test_repeated_call_goes_straight_to_its_ready_forward(spied, causal):
    q, k, v = _qkv(0)
    first = flashdecode.flash_attn(q, k, v, causal=causal)
    assert "__init__" in spied and not any("Function" in w for w in spied)  # the key's entry is built on its first call
    entry = attn_ops._DENSE_CALLS[attn_ops._dense_key(q, k, v, -1, 0 if causal else -1, 0.0, -1)]
    calls = entry.calls
    spied.clear()
    q2, k2, v2 = _qkv(1)  # new tensors, same key
    out, lse = flashdecode.flash_attn(q2, k2, v2, causal=causal, softmax_scale=0.2, return_lse=True)
    assert spied == [] and entry.calls == calls + 1
    # the general path (a window given as a list is checked and normalised there) computes the same
    general, general_lse = flashdecode.flash_attn(q2, k2, v2, causal=causal, softmax_scale=0.2, return_lse=True,
                                                  window_size=[-1, -1])
    assert "check_attention_tensors_once" in spied
    assert torch.equal(out, general) and torch.equal(lse, general_lse)
    assert torch.equal(first, flashdecode.flash_attn(q, k, v, causal=causal))


def test_flash_attn_interface_calls_take_the_cache(spied):
    """flash_attn_func passes its own (-1, -1) window and 0.0 softcap: still a plain call."""
    from flashdecode.flash_attn_interface import flash_attn_func

    q, k, v = _qkv(5)
    flash_attn_func(q, k, v, causal=True)
    spied.clear()
    flash_attn_func(q, k, v, causal=True)
    assert spied == []


def test_autograd_only_where_a_gradient_can_flow(spied):
    q, k, v = _qkv(2, requires_grad=True)
    flashdecode.flash_attn(q, k, v, causal=True)  # the key's first call
    spied.clear()
    with torch.no_grad():
        out = flashdecode.flash_attn(q, k, v, causal=True)
    assert spied == [] and not out.requires_grad
    out = flashdecode.flash_attn(q, k, v, causal=True)
    assert spied == ["_DenseCallFunction"] and out.requires_grad  # with the ready forward: nothing else runs
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    general = flashdecode.flash_attn(q, k, v, causal=True, window_size=[-1, -1])  # the general path
    assert "_FlashAttnFunction" in spied and torch.equal(out, general)
    for a, b in zip(grads, torch.autograd.grad(general, (q, k, v), dout)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(causal=1), TypeError, "causal"),
    (dict(deterministic=None), TypeError, "deterministic"),
    (dict(return_lse="yes"), TypeError, "return_lse"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(softmax_scale=True), TypeError, "softmax_scale"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
])
def test_bad_options_raise_after_the_key_is_cached(kwargs, error, match):
    q, k, v = _qkv(3)
    flashdecode.flash_attn(q, k, v)
    flashdecode.flash_attn(q, k, v)
    with pytest.raises(error, match=match):
        flashdecode.flash_attn(q, k, v, **kwargs)


def test_bad_tensors_miss_the_cache_and_raise():
    q, k, v = _qkv(4)
    flashdecode.flash_attn(q, k, v)
    with pytest.raises(TypeError, match="k has dtype"):
        flashdecode.flash_attn(q, k.float(), v)
    with pytest.raises(ValueError, match="batch"):
        flashdecode.flash_attn(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(ValueError, match="head dim"):
        flashdecode.flash_attn(q, k[..., :16], v[..., :16])


# ----------------------------------------------------------------------------------------------------------------
# The direct launches of a cache hit on a faked Hopper (CPU tensors; every launch recorded instead of run): what each
# call hands the compiled kernel's C launcher, and where a hit must not happen
# ----------------------------------------------------------------------------------------------------------------

class _RecordingLaunch:
    """Stands in for the C launch function of a compiled kernel (a plain callable, like the C function)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _FakeCompiled:
    """Triton's CompiledKernel as a direct launch reads it: a CudaLauncher (not constructed: its constructor
    compiles C) over a recording C launch, with ``scratch`` bytes of global scratch per program."""

    def __init__(self, launch, scratch: int = 0):
        from triton.backends.nvidia import driver as nv

        self.function, self.packed_metadata = "function", (4, 1, 0)
        run = self.run = nv.CudaLauncher.__new__(nv.CudaLauncher)
        run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, False
        run.global_scratch_size, run.profile_scratch_size = scratch, 0
        run.global_scratch_align = run.profile_scratch_align = 128
        run.launch = launch

    def launch_metadata(self, grid, stream, *args):
        return None


class _FakeTuned:
    """The autotuner: one config (the first tile); a launch returns the fake compiled kernel."""

    def __init__(self, compiled, tiles, names):
        import triton

        tile = tiles[0]
        self.compiled = compiled
        self.best_config = triton.Config(dict(zip(names, tile)), num_warps=tile[len(names)],
                                         num_stages=tile[len(names) + 1])

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.compiled


@pytest.fixture
def hopper(monkeypatch):
    """CPU tensors take the GPU's host path: the dispatch sees a Hopper that does not interpret, first launches
    return fake compiled kernels (Gluon: Triton's own launcher wrapper; Triton: 256 bytes of global scratch per
    program, as the TMA forward has), and each later launch reaches a recording C launch. ``state.stream`` is the
    current stream each launch reads."""
    from types import SimpleNamespace

    import triton
    from helpers import FakeTmaDriver
    from test_gluon_launch_cache import _triton_launcher
    from triton.runtime.jit import JITFunction

    from flashdecode.ops import direct_launch, gluon_backward, gluon_plan
    from flashdecode.ops import gluon_attention as ga

    state = SimpleNamespace(stream=7, c_calls=_RecordingLaunch(), jit=[], tuned=[])
    state.triton_compiled = _FakeCompiled(state.c_calls, scratch=256)

    def gluon_compiled(grid, args, constexprs):
        state.jit.append((grid, args, constexprs))
        monkeypatch.setattr(triton.runtime.driver, "_active", FakeTmaDriver())
        compiled = _FakeCompiled(state.c_calls)
        compiled.run = _triton_launcher(state.c_calls.calls)
        return compiled

    def tuned(fn, tiles, names, autotune, reset_dq):
        state.tuned.append(fn)
        return _FakeTuned(state.triton_compiled, tiles, names)

    for module in (attention_config, attention_plans, launch_cache):
        monkeypatch.setattr(module, "interpreting_now", lambda: False)
    for module in (ga, gluon_backward):
        monkeypatch.setattr(module, "interpreting", lambda device=None: False)
        monkeypatch.setattr(module, "is_hopper", lambda device: True)
    monkeypatch.setattr(gluon_plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(gluon_plan, "_jit_launch", gluon_compiled)
    monkeypatch.setattr(launch_cache, "tuned", tuned)
    kernel = attn_ops.fwd_kernels.attn_fwd_kernel  # the GPU's form (the interpreter wraps it differently)
    if not isinstance(kernel, JITFunction):
        monkeypatch.setattr(attn_ops.fwd_kernels, "attn_fwd_kernel", JITFunction(kernel.fn))
    monkeypatch.setattr(attention_config, "device_facts", lambda device: (227 * 1024, 9))
    for module in (gluon_plan, launch_cache):
        monkeypatch.setattr(module, "_current_stream", lambda index: state.stream)
        monkeypatch.setattr(module, "_current_device", lambda: None)  # CPU tensors' device index
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the argument checks take CPU tensors (also on a GPU machine)
    monkeypatch.setattr(direct_launch, "SCRATCH", direct_launch.StreamScratch())
    for cache in (gluon_plan.PLANS, attention_plans._FWD_PLANS, attention_plans._DENSE_CALLS):
        cache.clear()
    yield state
    for cache in (gluon_plan.PLANS, attention_plans._FWD_PLANS, attention_plans._DENSE_CALLS):
        cache.clear()  # no fake kernel outlives the test


def _dense(shape_q=(2, 40, 4, 128), shape_kv=(2, 56, 2, 128), dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(dtype) for s in (shape_q, shape_kv, shape_kv)]


def _entries():
    return len(attn_ops._DENSE_CALLS)


_GLUON_OUT_AT = 13 + 3 * 5  # the C launch's out argument (after 13 launch fields and 3 x 5 descriptor fields)
_TRITON_OUT_AT = 13 + 3  # after 13 launch fields, q, k, v


@pytest.mark.parametrize("headdim, out_at", [(128, _GLUON_OUT_AT), (96, _TRITON_OUT_AT)], ids=["gluon", "triton"])
def test_a_hit_launches_on_the_stream_current_at_the_call(hopper, headdim, out_at):
    q, k, v = _dense(shape_q=(2, 40, 4, headdim), shape_kv=(2, 56, 2, headdim))
    flashdecode.flash_attn(q, k, v)  # the key's first launch
    flashdecode.flash_attn(q, k, v)
    hopper.stream = 9
    out = flashdecode.flash_attn(q, k, v)
    assert _entries() == 1 and [c[3] for c in hopper.c_calls.calls] == [7, 9]
    assert hopper.c_calls.calls[-1][out_at] == out.data_ptr()


@pytest.mark.parametrize("headdim, out_at", [(128, _GLUON_OUT_AT), (96, _TRITON_OUT_AT)], ids=["gluon", "triton"])
def test_no_lse_is_allocated_where_none_is_wanted(hopper, headdim, out_at):
    """A no-grad call without return_lse hands the kernel the device's discard buffer for lse (the same address
    every call, nothing allocated); return_lse and autograd calls get an lse of their own, and all compute out
    the same way."""
    from flashdecode.ops import direct_launch

    q, k, v = _dense(shape_q=(2, 40, 4, headdim), shape_kv=(2, 56, 2, headdim))
    flashdecode.flash_attn(q, k, v)
    flashdecode.flash_attn(q, k, v)
    flashdecode.flash_attn(q, k, v)
    discard = direct_launch.discard_buffer(q.device, 2 * 4 * 40 * 4).data_ptr()
    assert [c[out_at + 1] for c in hopper.c_calls.calls] == [discard, discard]
    out, lse = flashdecode.flash_attn(q, k, v, return_lse=True)
    assert lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    assert hopper.c_calls.calls[-1][out_at:out_at + 2] == (out.data_ptr(), lse.data_ptr())
    q.requires_grad_()
    out = flashdecode.flash_attn(q, k, v)
    assert out.requires_grad and hopper.c_calls.calls[-1][out_at + 1] not in (discard, lse.data_ptr())
    assert len({c[out_at + 2:] for c in hopper.c_calls.calls}) == 1  # the other arguments: one launch
    assert _entries() == 1


def test_discard_buffers_grow_and_are_never_freed():
    from flashdecode.ops import direct_launch

    device = torch.device("cpu")
    small = direct_launch.discard_buffer(device, 100)
    assert small.numel() >= 100 and direct_launch.discard_buffer(device, 50) is small
    big = direct_launch.discard_buffer(device, small.numel() + 1)
    assert big.numel() >= 2 * small.numel() and small in direct_launch._DISCARD[device]
    assert direct_launch.discard_buffer(device, direct_launch.DISCARD_MAX_BYTES + 1) is None


def test_call_scoped_buffers_keep_nothing(monkeypatch):
    """Inside util.call_scoped_buffers (the transformers op torch.compile runs) the launch scratch is each launch's
    own and no discard buffer, tensor template or decode workspace pool is made or kept; outside it they are."""
    from flashdecode.ops import decode_workspace, direct_launch
    from flashdecode.ops.util import call_scoped, call_scoped_buffers

    device = torch.device("cpu")
    monkeypatch.setattr(direct_launch, "SCRATCH", direct_launch.StreamScratch())
    monkeypatch.setattr(direct_launch, "_DISCARD", {})
    monkeypatch.setattr(decode_workspace, "_POOLS", {})
    with call_scoped_buffers():
        with call_scoped_buffers():
            assert call_scoped()
        assert call_scoped()  # (nested scopes restore the outer one)
        first = direct_launch.SCRATCH.get(64, device, None)
        assert direct_launch.SCRATCH.get(64, device, None) is not first and direct_launch.SCRATCH.buffers == {}
        assert direct_launch.discard_buffer(device, 64) is None and direct_launch._DISCARD == {}
        assert direct_launch.empty_template((2, 3), torch.float32, device) is None
        partial_o, partial_lse, tickets = decode_workspace.call_workspace(device, (1, 1, 2, 3, 4), 5)
        assert (partial_o.shape, partial_lse.shape) == ((1, 1, 2, 3, 4), (1, 1, 2, 3)) and torch.all(tickets == 0)
        assert decode_workspace._POOLS == {}
    assert not call_scoped()
    kept = direct_launch.SCRATCH.get(64, device, None)
    assert direct_launch.SCRATCH.get(64, device, None) is kept
    assert direct_launch.discard_buffer(device, 64) is not None
    assert direct_launch.empty_template((2, 3), torch.float32, device).shape == (2, 3)


@pytest.mark.parametrize("headdim", [128, 96], ids=["gluon", "triton"])
def test_no_hit_across_dtypes_strides_alignment_or_flags(hopper, headdim):
    """Each of these calls differs from the first in one thing its launch depends on: none may take another's
    entry. q, k, v dtypes, strides (a transposed view, a packed qkv), 16-byte alignment, causal."""
    q, k, v = _dense(shape_q=(2, 40, 4, headdim), shape_kv=(2, 40, 4, headdim))
    flashdecode.flash_attn(q, k, v)
    variants = [
        [x.to(torch.bfloat16) for x in (q, k, v)],
        [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)],
        list(torch.stack([q, k, v], dim=2).unbind(2)),
        [torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape).copy_(x) for x in (q, k, v)],
    ]
    for n, variant in enumerate(variants, start=2):
        flashdecode.flash_attn(*variant)
        assert _entries() == n
    flashdecode.flash_attn(q, k, v, causal=True)
    assert _entries() == len(variants) + 2
    keys = list(attn_ops._DENSE_CALLS)
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("headdim", [128, 96], ids=["gluon", "triton"])
def test_grad_mode_decides_per_call_on_a_hit(hopper, headdim, spied):
    q, k, v = _dense(shape_q=(1, 24, 2, headdim), shape_kv=(1, 24, 2, headdim))
    q.requires_grad_()
    flashdecode.flash_attn(q, k, v)
    spied.clear()
    with torch.no_grad():
        assert not flashdecode.flash_attn(q, k, v).requires_grad
    assert spied == []
    assert flashdecode.flash_attn(q, k, v).requires_grad
    assert spied == ["_DenseCallFunction"]
    with torch.inference_mode():
        assert not flashdecode.flash_attn(q, k, v).requires_grad
    assert spied == ["_DenseCallFunction"] and _entries() == 1


def test_triton_scratch_is_per_stream_and_fresh_under_capture(hopper, monkeypatch):
    """The Triton forward's global scratch (read back by the kernel): reused by launches on one stream, never
    shared between two streams, and a fresh one for each launch while a CUDA graph is being captured."""
    from flashdecode.ops import direct_launch

    q, k, v = _dense(shape_q=(2, 40, 4, 96), shape_kv=(2, 56, 2, 96))
    flashdecode.flash_attn(q, k, v)
    scratch = lambda: hopper.c_calls.calls[-1][7]  # noqa: E731  (the C launch's global scratch argument)
    flashdecode.flash_attn(q, k, v)
    first = scratch()
    flashdecode.flash_attn(q, k, v)
    assert scratch() == first and direct_launch.SCRATCH.allocations == 1
    hopper.stream = 9
    flashdecode.flash_attn(q, k, v)
    assert scratch() != first and direct_launch.SCRATCH.allocations == 2
    buffers = list(direct_launch.SCRATCH.buffers.values())
    assert all(b.data_ptr() <= s < b.data_ptr() + b.numel() for b, s in zip(buffers, (first, scratch())))
    monkeypatch.setattr(direct_launch, "capturing", lambda: True)
    flashdecode.flash_attn(q, k, v)
    flashdecode.flash_attn(q, k, v)
    assert direct_launch.SCRATCH.allocations == 4 and len(direct_launch.SCRATCH.buffers) == 2
    grid = hopper.c_calls.calls[-1][:3]
    assert min(b.numel() for b in buffers) >= grid[0] * grid[1] * grid[2] * 256


def test_plain_launcher_hands_the_c_launcher_what_tritons_wrapper_does(monkeypatch):
    """direct_launch.PlainLauncher against Triton 3.6's own CudaLauncher.__call__ over the same recording C launch:
    the same arguments but the global scratch (Triton's from the thread's allocator, ours per stream: both of
    grid size * num_ctas * global_scratch_size bytes) and the hooks (None: no hook registered)."""
    import triton

    from flashdecode.ops import direct_launch

    monkeypatch.setattr(direct_launch, "SCRATCH", direct_launch.StreamScratch())
    c_calls = _RecordingLaunch()
    compiled = _FakeCompiled(c_calls, scratch=256)
    compiled.run.num_ctas = 2
    plain = direct_launch.PlainLauncher.of(compiled)
    assert plain is not None and plain.scratch_bytes == 512
    asked = []

    def allocator(size, align, stream):
        asked.append((size, align, stream))
        return torch.empty(size, dtype=torch.int8)
    triton.set_allocator(allocator)
    try:
        args = (1 << 20, 2 << 20, (4, 1, 8, 16), 0.5, 3, "CONSTEXPR")
        compiled.run(5, 2, 3, 11, compiled.function, compiled.packed_metadata, None, None, None, *args)
    finally:
        triton.set_allocator(launch_cache._scratch_allocator)
    plain((5, 2, 3), 11, torch.device("cpu"), args)
    tritons, ours = c_calls.calls
    assert asked == [(5 * 2 * 3 * 2 * 256, 128, 11)]
    assert tritons[:7] == ours[:7] and tritons[8:] == ours[8:]  # all but the scratch
    assert ours[7] % 128 == 0 and direct_launch.SCRATCH.buffers[(torch.device("cpu"), 11)].numel() >= 5 * 2 * 3 * 512
    no_scratch = _FakeCompiled(c_calls)
    compiled.run.launch_pdl = True  # the next kernel may start before this one ends: Triton's path
    assert direct_launch.PlainLauncher.of(compiled) is None
    assert direct_launch.PlainLauncher.of(no_scratch).scratch_bytes == 0


def test_dense_autograd_is_the_functions_c_apply_unless_functorch_is_active(monkeypatch):
    """_dense_autograd skips Function.apply's Python part only where that part would just unwrap dead functorch
    wrappers: the same graph node (the Function's backward), the same outputs and gradients; with a functorch
    transform active it takes Function.apply itself (which refuses a Function without setup_context)."""
    q, k, v = _qkv(6, requires_grad=True)
    flashdecode.flash_attn(q, k, v)
    call, = [c for key, c in attn_ops._DENSE_CALLS.items() if key[0] == q.shape and key[3] == q.stride()][:1]
    options = (0.3, -1, True, None)
    fast, fast_lse = attn_ops._dense_autograd(q, k, v, call, options)
    assert type(fast.grad_fn).__name__ == "_DenseCallFunctionBackward" and not fast_lse.requires_grad
    slow, _ = attention_autograd._DenseCallFunction.apply(q, k, v, call, options)
    dout = torch.randn_like(fast)
    for a, b in zip(torch.autograd.grad(fast, (q, k, v), dout), torch.autograd.grad(slow, (q, k, v), dout)):
        assert torch.equal(a, b)
    assert torch.equal(fast, slow)
    applied = []
    real_apply = attention_autograd._DenseCallFunction.apply
    monkeypatch.setattr(attention_autograd._DenseCallFunction, "apply",
                        lambda *a: (applied.append(1), real_apply(*a))[1])
    attn_ops._dense_autograd(q, k, v, call, options)
    assert applied == []
    monkeypatch.setattr(torch._C, "_are_functorch_transforms_active", lambda: True)
    with pytest.raises(RuntimeError, match="setup_context"):  # what Function.apply says under a transform
        attn_ops._dense_autograd(q, k, v, call, options)
    assert applied == [1]


@pytest.mark.parametrize("headdim, out_at", [(128, _GLUON_OUT_AT), (96, _TRITON_OUT_AT)], ids=["gluon", "triton"])
def test_torch_compile_reaches_the_direct_launch(hopper, headdim, out_at):
    """Under torch.compile flash_attn is the forward op (its fake implementation traced); the op's eager
    implementation then takes the same dense entry and direct launch, lse included (the op returns it)."""
    q, k, v = _dense(shape_q=(2, 40, 4, headdim), shape_kv=(2, 56, 2, headdim))
    compiled = torch.compile(lambda q, k, v: flashdecode.flash_attn(q, k, v, causal=True, return_lse=True),
                             backend="aot_eager", fullgraph=True)
    compiled(q, k, v)
    out, lse = compiled(q, k, v)
    assert _entries() == 1 and out.shape == q.shape and lse.shape == (2, 4, 40)
    launched = hopper.c_calls.calls[-1]
    assert launched[out_at:out_at + 2] == (out.data_ptr(), lse.data_ptr())


def test_direct_launches_through_tritons_real_c_launchers():
    """benchmarks/probes/c_launcher_cpu.py --check in a fresh Python: the Triton and Gluon forwards' direct launches
    through Triton's real generated C launchers (and its CUtensorMap fills) over a stub libcuda built there, which
    records the kernel parameters: every pointer, map, shape, the scratch and the grid arrive intact."""
    import os
    import shutil
    import subprocess
    import sys

    if HAS_CUDA:  # the stub would meet the real libcuda.so.1 there
        pytest.skip("a CPU check: on a GPU the launches run for real (tests/test_direct_launch_gpu.py)")
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler to build Triton's launchers with")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join("benchmarks", "probes", "c_launcher_cpu.py"), "--check"],
                          capture_output=True, text=True, env=env, timeout=SUBPROCESS_TIMEOUT_S, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("intact"), proc.stdout[-2000:] + proc.stderr[-3000:]


def test_empty_templates_make_contiguous_tensors():
    from flashdecode.ops import direct_launch

    for shape in [(2, 1, 5), (16, 16, 1024), (1, 3, 1), (7,), (2, 3)]:
        template = direct_launch.empty_template(shape, torch.float32, torch.device("cpu"))
        made = direct_launch.empty_from(template, shape, torch.float32, torch.device("cpu"))
        reference = torch.empty(shape, dtype=torch.float32)
        assert template is not None and template.untyped_storage().nbytes() == 4
        assert made.shape == shape and made.stride() == reference.stride() and made.dtype == torch.float32
    # one element or none: empty_like would keep the zero strides; 4-D: it could pick channels-last
    for shape in [(1, 1, 1), (0, 4, 5), (2, 3, 4, 5)]:
        assert direct_launch.empty_template(shape, torch.float32, torch.device("cpu")) is None
        made = direct_launch.empty_from(None, shape, torch.float16, torch.device("cpu"))
        assert made.shape == shape and made.dtype == torch.float16 and made.is_contiguous()


@pytest.mark.parametrize("headdim, out_at", [(128, _GLUON_OUT_AT), (96, _TRITON_OUT_AT)], ids=["gluon", "triton"])
def test_a_hits_lse_is_a_new_contiguous_tensor(hopper, headdim, out_at):
    q, k, v = _dense(shape_q=(2, 40, 4, headdim), shape_kv=(2, 56, 2, headdim))
    flashdecode.flash_attn(q, k, v, return_lse=True)
    lses = [flashdecode.flash_attn(q, k, v, return_lse=True)[1] for _ in range(2)]
    for lse in lses:
        assert lse.shape == (2, 4, 40) and lse.stride() == (160, 40, 1) and lse.dtype == torch.float32
    assert lses[0].data_ptr() != lses[1].data_ptr() and lses[0].untyped_storage().nbytes() == 2 * 4 * 40 * 4
    assert [c[out_at + 1] for c in hopper.c_calls.calls] == [lse.data_ptr() for lse in lses]
