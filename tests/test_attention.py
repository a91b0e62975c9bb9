"""flash_attn / flash_attn_varlen against the float64 reference (FlashAttention rule: 2x for out and lse, 3x for
gradients), masks (causal, window, bottom-right alignment, empty rows), softcap, GQA, strides, determinism,
torch.compile, and bad input.

CPU (Triton interpreter): small shapes in fp16/fp32. GPU (`gpu` marker): the big sweeps in bf16/fp16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import reference as ref
from flashdecode.ops import attention as attn_ops
from flashdecode.ops import attention_plans, checks, launch_cache
from helpers import DEVICE, HAS_CUDA, KERNEL_DTYPES, assert_fa_close, randn, run_sm90_compile_script


# CPU-sized cases run in fp16/fp32 in the interpreter; on the GPU they run once, in bf16 (the GPU-marked sweeps cover
# fp16 and the big shapes), which keeps the number of distinct kernel compilations there down.
CASE_DTYPES = [torch.bfloat16] if HAS_CUDA else KERNEL_DTYPES


@pytest.fixture(autouse=True)
def _no_autotuning(monkeypatch):
    """Calls without config= run their first fitting tile (FLASHDECODE_AUTOTUNE=0): fewer GPU compilations."""
    monkeypatch.setenv(attn_ops.AUTOTUNE_ENV, "0")


def fixed_config(q, k, v, max_seqlen_k=None, deterministic=True, **changes):
    """The configuration flash_attn resolves for these inputs, without autotuning (one tile per shape class keeps
    GPU compile counts down), with ``changes`` applied."""
    config = attn_ops.resolve_config(q, k, v, max_seqlen_k, deterministic)
    # backend "triton": these tests are about the Triton kernels' tiles (sm_90 resolves "gluon")
    return dataclasses.replace(config, **{"fwd_autotune": False, "bwd_autotune": False, "backend": "triton",
                                          **changes})


def record_launches(monkeypatch) -> list:
    """Spy: the names of the attention kernels launched (fwd, bwd_dkdv, bwd_dq, bwd_fused, bwd_atomic; the
    backward preprocess bwd_delta left out), in order."""
    launched = []
    call, launch = launch_cache.TunedKernel.__call__, launch_cache.TunedKernel.launch

    def spy_call(self, *args, **kwargs):  # a first (or interpreted) launch; later ones go through launch
        if self.name != "bwd_delta" and self.compiled is None:
            launched.append(self.name)
        return call(self, *args, **kwargs)

    def spy_launch(self, *args, **kwargs):  # direct launches (on a GPU, a repeated call's plan launches here)
        if self.name != "bwd_delta":
            launched.append(self.name)
        return launch(self, *args, **kwargs)
    monkeypatch.setattr(launch_cache.TunedKernel, "__call__", spy_call)
    monkeypatch.setattr(launch_cache.TunedKernel, "launch", spy_launch)
    return launched


def _inputs(gen, dtype, q_shape, kv_shape, scale=1.0):
    q = randn(*q_shape, gen=gen, dtype=dtype, scale=scale)
    k = randn(*kv_shape, gen=gen, dtype=dtype, scale=scale)
    v = randn(*kv_shape, gen=gen, dtype=dtype)
    return q, k, v


def _leaf(*xs, dtype=None):
    return [x.detach().to(dtype or x.dtype).requires_grad_() for x in xs]


def check_against_reference(run, run_ref, q, k, v, gen, *, grads: bool, gen_dout_scale=1.0):
    """Compare run(q, k, v) -> (out, lse) with run_ref in float64 and in q's dtype; gradients of out too.

    run / run_ref take (q, k, v) and return (out, lse). Returns our (out, lse, grads) for further checks.
    """
    qx, kx, vx = _leaf(q, k, v)
    out, lse = run(qx, kx, vx)
    q64, k64, v64 = _leaf(q, k, v, dtype=torch.float64)
    out64, lse64 = run_ref(q64, k64, v64)
    qd, kd, vd = _leaf(q, k, v)
    out_d, lse_d = run_ref(qd, kd, vd)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.dtype == torch.float32 and lse.shape == lse64.shape
    assert_fa_close(out, out64, out_d, factor=2.0, name="out")
    assert_fa_close(lse, lse64, lse_d, factor=2.0, name="lse")
    if not grads:
        return out, lse, None
    dout = randn(*out.shape, gen=gen, dtype=q.dtype, scale=gen_dout_scale)
    out.backward(dout)
    out64.backward(dout.double())
    out_d.backward(dout)
    for name, ours, r64, rd in (("dq", qx, q64, qd), ("dk", kx, k64, kd), ("dv", vx, v64, vd)):
        assert ours.grad.shape == ours.shape and ours.grad.dtype == ours.dtype
        assert_fa_close(ours.grad, r64.grad, rd.grad, factor=3.0, atol=1e-4, name=name)
    return out, lse, (qx.grad, kx.grad, vx.grad)


def check_dense(gen, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, *, grads=False, logit_scale=1.0,
                kernel_opts=None, config_changes=None, **opts):
    """kernel_opts: options only our kernel takes (deterministic); config_changes: AttentionConfig fields set on
    the resolved configuration (autotuning off unless they turn it on)."""
    q, k, v = _inputs(gen, dtype, (batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_kv, headdim),
                      scale=logit_scale)
    kernel_opts = dict(kernel_opts or {})
    kernel_opts["config"] = fixed_config(q, k, v, None, kernel_opts.get("deterministic", True),
                                         **(config_changes or {}))
    return check_against_reference(
        lambda a, b, c: flashdecode.flash_attn(a, b, c, return_lse=True, **kernel_opts, **opts),
        lambda a, b, c: ref.attention_ref(a, b, c, **opts), q, k, v, gen, grads=grads)


def _cu_seqlens(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu.to(DEVICE)


def check_varlen(gen, dtype, lens_q, lens_k, nheads, nheads_kv, headdim, *, grads=False, kernel_opts=None,
                 config_changes=None, **opts):
    cu_q, cu_k = _cu_seqlens(lens_q), _cu_seqlens(lens_k)
    q, k, v = _inputs(gen, dtype, (sum(lens_q), nheads, headdim), (sum(lens_k), nheads_kv, headdim))
    kernel_opts = dict(kernel_opts or {})
    kernel_opts["config"] = fixed_config(q, k, v, max(lens_k), kernel_opts.get("deterministic", True),
                                         **(config_changes or {}))
    return check_against_reference(
        lambda a, b, c: flashdecode.flash_attn_varlen(a, b, c, cu_q, cu_k, max(lens_q), max(lens_k),
                                                      return_lse=True, **(kernel_opts or {}), **opts),
        lambda a, b, c: ref.attention_varlen_ref(a, b, c, cu_q, cu_k, **opts), q, k, v, gen, grads=grads)


# ----------------------------------------------------------------------------------------------------------------
# Forward (CPU-sized)
# ----------------------------------------------------------------------------------------------------------------

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, options)
FORWARD_CASES = [
    (1, 1, 1, 2, 1, 64, {}),
    (2, 2, 17, 2, 2, 64, dict(causal=True)),
    (1, 17, 17, 4, 2, 80, dict(causal=True)),
    (3, 97, 97, 2, 1, 64, {}),
    (2, 128, 128, 2, 2, 96, dict(causal=True)),
    (1, 129, 129, 5, 1, 32, dict(causal=True)),
    (4, 33, 70, 8, 1, 64, {}),
    (1, 70, 33, 16, 1, 64, dict(causal=True)),
    (1, 1, 129, 2, 1, 128, dict(causal=True)),
    (1, 40, 97, 2, 1, 64, dict(causal=True, window_size=(20, 3))),
    (1, 97, 97, 2, 2, 64, dict(window_size=(16, -1))),
    (1, 97, 64, 2, 2, 64, dict(window_size=(-1, 5))),
    (1, 65, 70, 2, 1, 64, dict(softcap=2.0, causal=True)),
    (1, 17, 33, 2, 1, 256, dict(softmax_scale=0.3)),
]


@pytest.mark.parametrize("dtype", CASE_DTYPES, ids=str)
@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: f"{c[:6]}{c[6]}")
def test_forward_matches_reference(gen, dtype, case):
    check_dense(gen, dtype, *case[:6], **case[6])


@pytest.mark.parametrize("case", [(2, 97, 97, 4, 2, 80, dict(causal=True)), (1, 33, 70, 2, 1, 64, {}),
                                  (1, 70, 33, 2, 2, 32, dict(causal=True, window_size=(8, 2)))],
                         ids=lambda c: f"{c[:6]}{c[6]}")
def test_forward_tensor_descriptor_path(gen, case):
    """The Hopper (TMA) forward: descriptors bounded by the sequence zero-fill the ragged tail and the padded
    head dim. The interpreter emulates descriptors, so the path is checked on the CPU too."""
    check_dense(gen, KERNEL_DTYPES[0], *case[:6], config_changes=dict(fwd_tma=True), **case[6])


def test_backward_tensor_descriptor_path(gen):
    """The Hopper backward (config.bwd_tma; default from 8k keys): Q/dO (dK/dV pass) and K/V (dQ pass) through
    descriptors, ragged tails zero-filled."""
    check_dense(gen, KERNEL_DTYPES[0], 1, 97, 70, 4, 2, 80, causal=True, grads=True,
                config_changes=dict(fwd_tma=True, bwd_tma=True))


def test_descriptor_allocator_is_set_in_every_thread():
    """Triton's allocator is per thread (a ContextVar) and autograd runs CUDA backwards on its own thread: a flag
    set once by the forward's thread left the backward's descriptors without scratch memory on the H100."""
    import threading

    from triton.runtime import _allocation

    launch_cache.ensure_triton_allocator()
    seen = []

    def in_new_thread():
        launch_cache.ensure_triton_allocator()
        seen.append(_allocation._allocator.get())

    worker = threading.Thread(target=in_new_thread)
    worker.start()
    worker.join()
    assert seen == [launch_cache._scratch_allocator]


def test_varlen_tensor_descriptor_path(gen):
    check_varlen(gen, KERNEL_DTYPES[0], [5, 0, 70, 33], [5, 3, 70, 40], 4, 1, 64, causal=True,
                 config_changes=dict(fwd_tma=True))


@pytest.mark.parametrize("scale", [-0.2, 0.0], ids=str)
def test_negative_and_zero_softmax_scale(gen, scale):
    """A negative scale flips which keys dominate; a zero scale gives the mean of the visible values (no 0 * -inf)."""
    check_dense(gen, KERNEL_DTYPES[0], 1, 40, 70, 2, 1, 64, causal=True, softmax_scale=scale)


def test_seqlen_q_longer_than_k_causal_gives_empty_rows(gen):
    """Bottom-right alignment: the first seqlen_q - seqlen_k rows see no key: out 0, lse -inf, zero grads."""
    out, lse, grads = check_dense(gen, torch.float16, 1, 50, 17, 2, 1, 64, causal=True, grads=True)
    assert torch.all(out[:, :33] == 0) and torch.all(lse[:, :, :33] == float("-inf"))
    assert torch.all(lse[:, :, 33:].isfinite())
    assert torch.all(grads[0][:, :33] == 0)
    for g in grads:
        assert not torch.isnan(g).any()


def test_window_leaving_rows_empty_is_not_nan(gen):
    """A window (0, 0) with seqlen_q > seqlen_k: rows past the keys are empty, the rest see exactly one key."""
    out, lse, _ = check_dense(gen, torch.float32, 1, 40, 20, 2, 2, 64, window_size=(0, 0))
    assert torch.all(lse[:, :, :20] == float("-inf")) and torch.all(out[:, :20] == 0)


def test_softcap_with_huge_logits_stays_finite(gen):
    """Logits ~ +-1e3 before capping: tanh saturates, nothing overflows, gradients match the reference."""
    out, lse, grads = check_dense(gen, torch.float32, 1, 33, 40, 2, 1, 64, softcap=30.0, causal=True,
                                  logit_scale=6.0, grads=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_no_keys_at_all(gen):
    q, k, v = _inputs(gen, torch.float16, (2, 5, 2, 64), (2, 0, 2, 64))
    out, lse = flashdecode.flash_attn(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_default_returns_only_out(gen):
    q, k, v = _inputs(gen, torch.float16, (1, 17, 2, 64), (1, 17, 2, 64))
    out = flashdecode.flash_attn(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


# ----------------------------------------------------------------------------------------------------------------
# Backward (CPU-sized: the interpreter is slow here)
# ----------------------------------------------------------------------------------------------------------------

BACKWARD_CASES = [
    (2, 17, 17, 2, 1, 64, dict(causal=True)),
    (1, 97, 97, 2, 2, 80, {}),
    (1, 97, 40, 5, 1, 64, dict(causal=True)),
    (1, 40, 97, 2, 1, 64, dict(causal=True, window_size=(20, 3))),
    (1, 65, 70, 2, 2, 64, dict(softcap=2.0, window_size=(10, -1))),
]


@pytest.mark.parametrize("dtype", CASE_DTYPES, ids=str)
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: f"{c[:6]}{c[6]}")
def test_backward_matches_reference(gen, dtype, case):
    check_dense(gen, dtype, *case[:6], grads=True, **case[6])


def test_gradients_are_deterministic(gen):
    q, k, v = _inputs(gen, KERNEL_DTYPES[0], (1, 70, 4, 64), (1, 70, 2, 64))
    dout = randn(1, 70, 4, 64, gen=gen, dtype=q.dtype)
    first = _grads(q, k, v, dout, causal=True)
    for _ in range(50 if HAS_CUDA else 1):
        again = _grads(q, k, v, dout, causal=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# The deterministic backward in one launch (dK/dV of KV block j, then dQ of Q block j, in one program)
FUSED_BACKWARD_CASES = [
    (1, 97, 40, 4, 2, 80, dict(causal=True)),
    (1, 40, 97, 2, 1, 64, dict(causal=True, window_size=(20, 3), softcap=2.0)),
]


@pytest.mark.parametrize("case", FUSED_BACKWARD_CASES, ids=lambda c: f"{c[:6]}{c[6]}")
def test_fused_backward_matches_reference(gen, case):
    """More KV blocks than Q blocks and the reverse (programs with only one phase), GQA, windows, softcap."""
    check_dense(gen, KERNEL_DTYPES[0], *case[:6], grads=True, config_changes=dict(bwd_fused=True), **case[6])


@pytest.mark.parametrize("split_dkdv", [False, True], ids=["dkdv", "split_dkdv"])
def test_fused_backward_varlen_and_descriptors(gen, split_dkdv):
    """Ragged sequences (one empty, one shorter in q than in k) through the tensor-descriptor path; split_dkdv:
    separate dV and dK programs per KV block (SPLIT_DKDV, the large-head-dim tiles)."""
    check_varlen(gen, KERNEL_DTYPES[0], [17, 1, 0, 40], [17, 9, 3, 33], 4, 2, 64, grads=True, causal=True,
                 config_changes=dict(bwd_fused=True, fwd_tma=True, bwd_tma=True,
                                     bwd_fused_tiles=((32, 32, 32, 32, split_dkdv, 4, 1),)))


def test_fused_backward_is_one_launch_and_deterministic(gen, monkeypatch):
    """config.bwd_fused launches one backward kernel instead of two; its gradients repeat bit for bit and match
    the two-launch path (bitwise in the interpreter, where both use the same tiles)."""
    launched = record_launches(monkeypatch)
    q, k, v = _inputs(gen, KERNEL_DTYPES[0], (1, 70, 4, 64), (1, 70, 2, 64))
    dout = randn(1, 70, 4, 64, gen=gen, dtype=q.dtype)
    split = _grads(q, k, v, dout, causal=True, config=fixed_config(q, k, v, bwd_fused=False))
    assert launched == ["fwd", "bwd_dkdv", "bwd_dq"]
    launched.clear()
    fused_config = fixed_config(q, k, v, bwd_fused=True)
    fused = _grads(q, k, v, dout, causal=True, config=fused_config)
    assert launched == ["fwd", "bwd_fused"]
    for _ in range(20 if HAS_CUDA else 1):
        assert all(torch.equal(a, b) for a, b in zip(fused, _grads(q, k, v, dout, causal=True, config=fused_config)))
    for a, b in zip(split, fused):
        if HAS_CUDA:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
        else:
            assert torch.equal(a, b)


def test_fused_backward_policy_and_shared_memory_fit():
    """The one-launch backward is the default only for 16-bit hd256 from PREFILL_BWD_FUSED_MIN_KEYS keys; its
    candidates are sized by their larger phase (the atomic-free dQ phase holds Q/dO and streams K/V)."""
    from flashdecode import heuristics as h
    assert h.use_bwd_fused(16384, 256, 2) and not h.use_bwd_fused(16384, 128, 2)
    assert not h.use_bwd_fused(h.PREFILL_BWD_FUSED_MIN_KEYS - 1, 256, 2) and not h.use_bwd_fused(16384, 256, 4)
    big = (64, 16, 128, 64, False, 8, 3)  # dQ phase: (2 * 128 + 3 * 2 * 64) rows x 256 x 2 bytes = 320 KiB
    small = h.PREFILL_LARGE_HEAD_DIM_CANDIDATES["bwd_fused"][0]
    assert h.prefill_bwd_fused_configs_that_fit((big, small), 256, 2, 227 * 1024) == [small]
    assert h.prefill_bwd_fused_configs_that_fit((big,), 256, 2, 227 * 1024) == [big]  # nothing fits: smallest


# deterministic=False: dQ by fp32 atomics inside the dK/dV pass
NONDETERMINISTIC_CASES = [
    (1, 65, 65, 4, 2, 64, dict(causal=True)),
    (1, 70, 40, 5, 1, 80, dict(causal=True)),
    (1, 40, 70, 2, 2, 64, dict(softcap=2.0, window_size=(10, 3))),
]


@pytest.mark.parametrize("dtype", CASE_DTYPES, ids=str)
@pytest.mark.parametrize("case", NONDETERMINISTIC_CASES, ids=lambda c: f"{c[:6]}{c[6]}")
def test_nondeterministic_backward_matches_reference(gen, dtype, case):
    check_dense(gen, dtype, *case[:6], grads=True, kernel_opts=dict(deterministic=False), **case[6])


def test_nondeterministic_varlen_backward(gen):
    check_varlen(gen, KERNEL_DTYPES[0], [17, 1, 0, 40], [17, 9, 3, 33], 2, 1, 64, grads=True, causal=True,
                 kernel_opts=dict(deterministic=False))


def test_nondeterministic_mode_skips_the_dq_pass(gen, monkeypatch):
    """deterministic=False launches the atomic dK/dV kernel and no dQ kernel; its gradients equal the
    deterministic ones up to fp32 summation order. The Triton kernels' property: an explicit config= keeps them on
    every GPU (without one, sm_90 dispatches this head dim to the Gluon forward and backward)."""
    launched = record_launches(monkeypatch)
    q, k, v = _inputs(gen, KERNEL_DTYPES[0], (1, 40, 2, 64), (1, 40, 1, 64))
    dout = randn(1, 40, 2, 64, gen=gen, dtype=q.dtype)
    det = _grads(q, k, v, dout, causal=True, config=fixed_config(q, k, v))
    assert launched == ["fwd", "bwd_dkdv", "bwd_dq"]
    launched.clear()
    nondet = _grads(q, k, v, dout, causal=True, deterministic=False,
                    config=fixed_config(q, k, v, deterministic=False))
    assert launched == ["fwd", "bwd_atomic"]
    for a, b in zip(det, nondet):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def _grads(q, k, v, dout, **opts):
    qx, kx, vx = _leaf(q, k, v)
    flashdecode.flash_attn(qx, kx, vx, **opts).backward(dout)
    return qx.grad, kx.grad, vx.grad


def test_strided_views_of_packed_qkv(gen):
    """q, k, v as views of one (batch, seqlen, 3, heads, headdim) tensor: same results as contiguous copies,
    gradients land in the packed tensor."""
    dtype = KERNEL_DTYPES[0]
    qkv = randn(2, 33, 3, 2, 64, gen=gen, dtype=dtype).requires_grad_()
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out = flashdecode.flash_attn(q, k, v, causal=True)
    dout = randn(*out.shape, gen=gen, dtype=dtype)
    out.backward(dout)
    qc, kc, vc = _leaf(q.contiguous(), k.contiguous(), v.contiguous())
    out_c = flashdecode.flash_attn(qc, kc, vc, causal=True)
    out_c.backward(dout)
    assert torch.equal(out, out_c)
    assert torch.equal(qkv.grad, torch.stack([qc.grad, kc.grad, vc.grad], dim=2))


# ----------------------------------------------------------------------------------------------------------------
# Varlen
# ----------------------------------------------------------------------------------------------------------------

def test_varlen_forward_ragged_lengths(gen):
    lens_q = [1, 300, 0, 37, 129]
    lens_k = [1, 300, 5, 64, 129]
    check_varlen(gen, KERNEL_DTYPES[0], lens_q, lens_k, 4, 2, 64, causal=True)


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(8, 0), softcap=5.0), {}], ids=str)
def test_varlen_backward(gen, opts):
    lens_q = [17, 1, 0, 40]
    lens_k = [17, 9, 3, 33]
    check_varlen(gen, KERNEL_DTYPES[0], lens_q, lens_k, 2, 1, 64, grads=True, **opts)


def test_varlen_matches_dense_per_sequence(gen):
    """Equal lengths: varlen over the flattened batch equals the dense call bit for bit."""
    q, k, v = _inputs(gen, KERNEL_DTYPES[0], (3, 40, 2, 64), (3, 40, 2, 64))
    cu = _cu_seqlens([40, 40, 40])
    dense, lse = flashdecode.flash_attn(q, k, v, causal=True, return_lse=True)
    packed, lse_p = flashdecode.flash_attn_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 40,
                                                  40, causal=True, return_lse=True)
    assert torch.equal(dense.flatten(0, 1), packed)
    assert torch.equal(lse.transpose(0, 1).flatten(1, 2), lse_p)


# ----------------------------------------------------------------------------------------------------------------
# torch.library / torch.compile
# ----------------------------------------------------------------------------------------------------------------

def test_custom_op_schema_and_fake():
    gen = torch.Generator().manual_seed(0)
    q, k, v = _inputs(gen, torch.float16, (1, 17, 2, 64), (1, 17, 1, 64))
    torch.library.opcheck(torch.ops.flashdecode.attn_fwd.default,
                          (q, k, v, None, None, 17, 17, 0.125, -1, 0, 0.0),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiles_without_graph_break(gen):
    """fullgraph=True raises on any graph break; aot_eager runs the fake implementations and autograd."""
    q, k, v = _leaf(*_inputs(gen, KERNEL_DTYPES[0], (1, 33, 4, 64), (1, 33, 2, 64)))

    def step(a, b, c):
        return flashdecode.flash_attn(a, b, c, causal=True).float().square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    q2, k2, v2 = _leaf(q, k, v)
    eager = step(q2, k2, v2)
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-3)
    assert torch.equal(q.grad, q2.grad) and torch.equal(k.grad, k2.grad)


# ----------------------------------------------------------------------------------------------------------------
# Host path: launch plans cached per launch key
# ----------------------------------------------------------------------------------------------------------------

def test_repeated_calls_reuse_the_launch_plan(gen, monkeypatch):
    """A second call with the same launch key neither re-resolves the configuration nor re-checks the tensors nor
    builds a new plan; a new stride (a new key) does, and both give the reference's answer."""
    q, k, v = _inputs(gen, torch.float16, (1, 23, 2, 64), (1, 23, 1, 64))
    first = flashdecode.flash_attn(q, k, v, causal=True)
    work = []
    for owner, name in ((checks, "check_attention_tensors"), (attention_plans, "config_for")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **kw: (work.append(_name),
                                                                                  _real(*a, **kw))[1])
    q2 = q + 1
    again = flashdecode.flash_attn(q2, k, v, causal=True)
    assert work == []
    assert torch.equal(again, flashdecode.flash_attn(q2.contiguous(), k, v, causal=True))
    strided = torch.cat([q2, q2], dim=-1)[..., :64]  # same shape, new strides: a new key
    assert torch.equal(flashdecode.flash_attn(strided, k, v, causal=True), again)
    assert work == ["config_for"]  # same shapes: the tensor checks stay skipped
    ref64 = ref.attention_ref(q.double(), k.double(), v.double(), causal=True)[0]
    assert (first.double() - ref64).abs().max() < 1e-2


def test_direct_launch_passes_the_recorded_argument_tail(monkeypatch):
    """The direct launch calls the compiled kernel's launcher as Triton's JIT does: grid, stream, function,
    metadata, hooks, then every kernel parameter in order - the runtime arguments of this call followed by the
    constexprs recorded at the first launch (the tile the autotuner picked, the plan's flags, defaults)."""
    import triton
    from triton.runtime.jit import JITFunction

    from flashdecode.kernels import bwd as bwd_kernels
    from flashdecode.kernels import fwd as fwd_kernels

    def compiled_form(kernel):  # the interpreter wraps the Python function differently; the GPU has JITFunctions
        return JITFunction(kernel.fn) if not isinstance(kernel, JITFunction) else kernel

    for fn in (fwd_kernels.attn_fwd_kernel, bwd_kernels.attn_bwd_dkdv_kernel, bwd_kernels.attn_bwd_dq_kernel,
               bwd_kernels.attn_bwd_delta_kernel):
        params = compiled_form(fn).params
        first_constexpr = next(i for i, p in enumerate(params) if p.is_constexpr)
        assert all(p.is_constexpr for p in params[first_constexpr:]), fn.__name__  # runtime args come first
    fn = compiled_form(fwd_kernels.attn_fwd_kernel)
    nargs = next(i for i, p in enumerate(fn.params) if p.is_constexpr)
    constexprs = dict(HEAD_DIM=80, HEAD_DIM_PAD=128, IS_VARLEN=False, HAS_LEFT=False, HAS_RIGHT=True, SOFTCAP=False,
                      DOT_PRECISION="tf32", USE_TMA=False)
    kernel = launch_cache.TunedKernel("fwd", fn, ((128, 64, 8, 3),), attention_plans._FWD_TILE, False, constexprs)
    calls = []

    class Compiled:
        function, packed_metadata = "function", "packed"

        def run(self, *args):
            calls.append(args)

        def launch_metadata(self, grid, stream, *args):
            return "metadata"

    class Tuned:
        best_config = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)

    kernel._record(Tuned(), Compiled(), nargs)
    assert kernel.tail == (80, 128, False, False, True, False, "tf32", 128, 64, False, False, False, False, 0)
    assert [p.name for p in fn.params[nargs:]] == list(constexprs)[:-1] + ["BLOCK_M", "BLOCK_N", "USE_TMA", "IS_FP8",
                                                                          "HAS_ALIBI", "FP8_SOFT_ROUND", "PAGE_SIZE"]
    monkeypatch.setattr(launch_cache, "_current_stream", lambda index: 7)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    args = tuple(range(nargs))
    kernel(lambda meta: (meta["BLOCK_M"], 2, 3), args, torch.device("cuda", 0))
    (launched,) = calls
    # no hook registered: no launch metadata, and None for both hooks (the launcher then calls neither chain)
    assert launched[:9] == (128, 2, 3, 7, "function", "packed", None, None, None)
    assert launched[9:] == args + kernel.tail
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)

    def hook(metadata):
        return None
    hooks[0].add(hook)  # a registered hook (Triton's profiler adds one) gets the chains and the metadata
    try:
        kernel(lambda meta: (meta["BLOCK_M"], 2, 3), args, torch.device("cuda", 0))
    finally:
        hooks[0].remove(hook)
    assert calls[1][:9] == (128, 2, 3, 7, "function", "packed", "metadata") + hooks


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("deterministic, fused", [(True, False), (True, True), (False, False)], ids=str)
def test_gpu_direct_launch_matches_the_first_launch(gen, deterministic, fused):
    """After its first launch a key calls the compiled kernel directly: same outputs and gradients bit for bit
    (deterministic modes), dense and varlen."""
    q, k, v = _leaf(*_inputs(gen, torch.bfloat16, (2, 300, 4, 128), (2, 300, 2, 128)))
    dout = randn(2, 300, 4, 128, gen=gen, dtype=q.dtype)
    config = fixed_config(q, k, v, None, deterministic, bwd_fused=fused)
    results = []
    for _ in range(3):
        grads = _grads(q, k, v, dout, causal=True, deterministic=deterministic, config=config)
        results.append((flashdecode.flash_attn(q, k, v, causal=True, config=config), *grads))
    plans = [p for p in attention_plans._FWD_PLANS.values() if p.config == config]
    assert plans and all(p.kernel.compiled is not None for p in plans)
    for a, b in zip(results[1], results[2]):
        assert torch.equal(a, b) or not deterministic
    for a, b in zip(results[0], results[2]):
        torch.testing.assert_close(a, b)
    cu = _cu_seqlens([300, 300])
    flat = [x.detach().flatten(0, 1) for x in (q, k, v)]
    once = flashdecode.flash_attn_varlen(*flat, cu, cu, 300, 300, causal=True)
    assert torch.equal(once, flashdecode.flash_attn_varlen(*flat, cu, cu, 300, 300, causal=True))


# ----------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------

def _ok(dtype=torch.float16, q_shape=(1, 8, 4, 64), kv_shape=(1, 8, 2, 64)):
    gen = torch.Generator().manual_seed(0)
    return _inputs(gen, dtype, q_shape, kv_shape)


def test_rejects_mixed_dtypes():
    q, k, v = _ok()
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        flashdecode.flash_attn(q, k.float(), v)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.float8_e5m2], ids=str)
def test_rejects_unsupported_dtypes(dtype):
    """(float8_e4m3fn is accepted with descales: tests/test_fp8_prefill.py.)"""
    q, k, v = _ok()
    with pytest.raises(TypeError, match="q must be float16, bfloat16, float32 or float8_e4m3fn"):
        flashdecode.flash_attn(q.to(dtype), k.to(dtype), v.to(dtype))


@pytest.mark.parametrize("shapes, match", [
    (((1, 8, 4, 64), (1, 8, 2, 32)), "head dim must equal q's"),
    (((1, 8, 4, 320), (1, 8, 2, 320)), "head dim must be in 1..256"),
    (((1, 8, 6, 64), (1, 8, 4, 64)), "multiple of nheads_kv"),
    (((2, 8, 4, 64), (1, 8, 2, 64)), "batch"),
    (((8, 4, 64), (8, 2, 64)), "q must be 4-D"),
], ids=["headdim", "headdim>256", "gqa", "batch", "ndim"])
def test_rejects_bad_shapes(shapes, match):
    q, k, v = _ok(q_shape=shapes[0], kv_shape=shapes[1])
    with pytest.raises(ValueError, match=match):
        flashdecode.flash_attn(q, k, v)


def test_rejects_3d_inputs_after_a_varlen_call_with_the_same_shapes():
    """The checked-shape cache keys on the layout: a varlen call's (total, heads, dim) shapes passing its check must
    not let flash_attn skip the 4-D check for the same shapes."""
    q, k, v = (x.flatten(0, 1) for x in _ok())
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    flashdecode.flash_attn_varlen(q, k, v, cu, cu, 8, 8)
    with pytest.raises(ValueError, match="q must be 4-D"):
        flashdecode.flash_attn(q, k, v)


def test_rejects_v_shape_mismatch():
    q, k, v = _ok()
    with pytest.raises(ValueError, match="same leading shape"):
        flashdecode.flash_attn(q, k, v[:, :5])


def test_rejects_bad_options():
    q, k, v = _ok()
    with pytest.raises(ValueError, match="window_size"):
        flashdecode.flash_attn(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        flashdecode.flash_attn(q, k, v, softcap=-1.0)
    with pytest.raises(TypeError, match="causal"):
        flashdecode.flash_attn(q, k, v, causal="yes")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flashdecode.flash_attn(q, k, v, deterministic="no")


@pytest.mark.skipif(not HAS_CUDA, reason="needs two devices (cpu + cuda)")
def test_rejects_tensors_on_different_devices():
    q, k, v = _ok()
    with pytest.raises(ValueError, match="one device"):
        flashdecode.flash_attn(q, k.cpu(), v)


def test_rejects_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (x.cpu() for x in _ok())
    with pytest.raises(ValueError, match="CPU tensors"):
        flashdecode.flash_attn(q, k, v)


def _varlen_call(cu_q, cu_k, max_q=8, max_k=8):
    q, k, v = (x.flatten(0, 1) for x in _ok(q_shape=(1, 8, 4, 64), kv_shape=(1, 8, 2, 64)))
    return flashdecode.flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k)


def test_varlen_without_the_seqlens_check_is_exact_and_never_reads_them_on_the_host(gen, monkeypatch):
    """check_seqlens=False (the engine's prefill): no value check, so no host sync; same results."""
    def no_check(cu_checks):
        raise AssertionError("check_seqlens=False must skip the cu_seqlens value check")
    monkeypatch.setattr(checks, "check_cu_seqlens_values", no_check)
    check_varlen(gen, torch.float16, [5, 17], [5, 17], 4, 2, 64, causal=True, kernel_opts={"check_seqlens": False})
    with pytest.raises(TypeError, match="check_seqlens must be a bool"):
        good = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
        q, k, v = (x.flatten(0, 1) for x in _ok(q_shape=(1, 8, 4, 64), kv_shape=(1, 8, 2, 64)))
        flashdecode.flash_attn_varlen(q, k, v, good, good, 8, 8, check_seqlens=None)


def _padded(x: torch.Tensor, pad_rows: int = 7) -> torch.Tensor:
    """x as a view into a buffer whose rows before and after it hold NaN: a kernel reading outside x shows."""
    buf = torch.full((x.shape[0] + 2 * pad_rows,) + tuple(x.shape[1:]), float("nan"), dtype=x.dtype, device=x.device)
    buf[pad_rows:pad_rows + x.shape[0]] = x
    return buf[pad_rows:pad_rows + x.shape[0]]


@pytest.mark.parametrize("cu_q, cu_k, clamped_q, clamped_k", [
    ([0, 5, 30], [0, 20, 40], [0, 5, 12], [0, 10, 10]),  # past the packed tokens
    ([-5, 3, 12], [0, 10, 3], [0, 3, 12], [0, 10, 10]),  # negative start, decreasing pair
], ids=["past_end", "negative_and_decreasing"])
def test_varlen_unchecked_seqlens_stay_inside_the_tensors(gen, cu_q, cu_k, clamped_q, clamped_k):
    """check_seqlens=False with cu_seqlens the host never checks: the kernels clamp each sequence into the packed
    rows (documented), so they read nothing outside q, k, v (NaN around them would show) and the result is that
    of the clamped cu_seqlens, forward and backward."""
    q, k, v = _inputs(gen, torch.float16, (12, 2, 64), (10, 1, 64))
    q, k, v = (_padded(x).requires_grad_() for x in (q, k, v))
    as_cu = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out, lse = flashdecode.flash_attn_varlen(q, k, v, as_cu(cu_q), as_cu(cu_k), 25, 20, causal=True,
                                             return_lse=True, check_seqlens=False)
    out.float().sum().backward()
    assert not out.isnan().any() and not lse.isnan().any()
    assert all(not x.grad.isnan().any() for x in (q, k, v))
    q2, k2, v2 = _leaf(q, k, v)
    out_c, lse_c = flashdecode.flash_attn_varlen(q2, k2, v2, as_cu(clamped_q), as_cu(clamped_k), 25, 20,
                                                 causal=True, return_lse=True)
    out_c.float().sum().backward()
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    assert all(torch.equal(a.grad, b.grad) for a, b in ((q, q2), (k, k2), (v, v2)))


def test_varlen_strided_cu_seqlens(gen):
    """A strided cu_seqlens view (the kernels read it with a unit stride) gives the contiguous tensor's result."""
    q, k, v = _inputs(gen, torch.float16, (12, 2, 64), (12, 1, 64))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    strided = torch.stack([cu, torch.full_like(cu, 99)], 1)[:, 0]
    assert strided.stride(0) == 2
    out = flashdecode.flash_attn_varlen(q, k, v, strided, strided, 7, 7, causal=True)
    assert torch.equal(out, flashdecode.flash_attn_varlen(q, k, v, cu, cu, 7, 7, causal=True))


def test_varlen_compiles_with_one_cu_seqlens_for_q_and_k(gen):
    """The self-attention call (the same tensor as cu_seqlens_q and cu_seqlens_k) under torch.compile(fullgraph=True):
    autograd.Function cannot take one tensor twice, so flash_attn_varlen passes it once."""
    q, k, v = _leaf(*_inputs(gen, KERNEL_DTYPES[0], (10, 2, 64), (10, 1, 64)))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)

    def step(a, b, c, cu_seqlens):
        return flashdecode.flash_attn_varlen(a, b, c, cu_seqlens, cu_seqlens, 6, 6, causal=True).float().sum()

    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, cu)
    loss.backward()
    q2, k2, v2 = _leaf(q, k, v)
    eager = step(q2, k2, v2, cu)
    eager.backward()
    assert torch.equal(loss, eager)
    assert all(torch.equal(a.grad, b.grad) for a, b in ((q, q2), (k, k2), (v, v2)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_gpu_varlen_compiled_self_attention_inductor(gen):
    """The same call compiled by inductor on the GPU (the CPU test uses aot_eager)."""
    q, k, v = _leaf(*_inputs(gen, torch.bfloat16, (300, 4, 128), (300, 2, 128)))
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")

    def step(a, b, c, cu_seqlens):
        return flashdecode.flash_attn_varlen(a, b, c, cu_seqlens, cu_seqlens, 200, 200, causal=True).float().sum()

    loss = torch.compile(step, fullgraph=True)(q, k, v, cu)
    loss.backward()
    q2, k2, v2 = _leaf(q, k, v)
    eager = step(q2, k2, v2, cu)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad)


def test_varlen_rejects_bad_cu_seqlens():
    good = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        _varlen_call(good.long(), good)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and be non-decreasing"):
        _varlen_call(torch.tensor([0, 5, 3], dtype=torch.int32, device=DEVICE), good)
    with pytest.raises(ValueError, match="cu_seqlens_k must have length batch \\+ 1 = 3"):
        _varlen_call(good, good[:2])
    with pytest.raises(ValueError, match="cu_seqlens_k\\[-1\\] = 9 must equal the 8 packed tokens"):
        _varlen_call(good, torch.tensor([0, 3, 9], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="cu_seqlens_q\\[-1\\] = 7 must equal the 8 packed tokens"):
        _varlen_call(torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE), good)  # row 7 in no sequence
    with pytest.raises(ValueError, match="max_seqlen_q = 4 is smaller"):
        _varlen_call(good, good, max_q=4)
    with pytest.raises(TypeError, match="cu_seqlens_k must be an int32 torch.Tensor"):
        _varlen_call(good, [0, 3, 8])


def test_varlen_reads_a_cu_seqlens_tensor_again_only_after_a_write():
    """The value check (a host sync) runs once per cu_seqlens tensor and version: an in-place torch write, another
    max_seqlen or validate=True checks again; a write torch cannot see (.data) is caught by validate=True; an
    inference-mode tensor (no version counter) is checked on every call."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    _varlen_call(cu, cu)
    with pytest.raises(ValueError, match="max_seqlen_q = 4 is smaller"):
        _varlen_call(cu, cu, max_q=4)
    cu.data[2] = 9  # unseen by the version counter: the earlier pass stands (the documented limit)
    _varlen_call(cu, cu)
    with pytest.raises(ValueError, match="cu_seqlens_q\\[-1\\] = 9 must equal the 8 packed tokens"):
        flashdecode.flash_attn_varlen(*(x.flatten(0, 1) for x in _ok(q_shape=(1, 8, 4, 64), kv_shape=(1, 8, 2, 64))),
                                      cu, cu, 8, 8, validate=True)
    cu.data[2] = 8
    _varlen_call(cu, cu)
    cu[2] = 9  # an in-place torch write bumps the version: checked again
    with pytest.raises(ValueError, match="cu_seqlens_q\\[-1\\] = 9"):
        _varlen_call(cu, cu)
    with torch.inference_mode():
        frozen = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
        _varlen_call(frozen, frozen)
        frozen[1] = 9
        with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and be non-decreasing"):
            _varlen_call(frozen, frozen)


# ----------------------------------------------------------------------------------------------------------------
# GPU: large shapes, bf16, every head dim, determinism, the autotuned path
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype, headdim, causal",
                         [(torch.bfloat16, d, True) for d in (64, 80, 96, 128, 192, 256)]
                         + [(torch.bfloat16, 128, False), (torch.float16, 128, True)], ids=str)
def test_gpu_head_dims_fwd_bwd(gen, dtype, headdim, causal):
    check_dense(gen, dtype, 2, 1025, 1025, 4, 2, headdim, causal=causal, grads=True)


@pytest.mark.xdist_group("gpu_bigmem")  # ~11 GB (float64 reference): gpu_check's bigmem part, 4 workers
@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2, 5, 8, 16])
def test_gpu_gqa_ratios_long(gen, ratio):
    check_dense(gen, torch.bfloat16, 1, 4097, 4097, 16 if ratio != 5 else 10, (16 if ratio != 5 else 10) // ratio,
                128, causal=True, grads=True)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(window_size=(256, 0)), dict(window_size=(100, 50)),
                                  dict(softcap=30.0, causal=True)], ids=str)
def test_gpu_window_softcap(gen, opts):
    check_dense(gen, torch.bfloat16, 2, 2049, 3000, 4, 1, 128, grads=True, **opts)


@pytest.mark.xdist_group("gpu_bigmem")  # big tensors: gpu_check's bigmem part, 4 workers
@pytest.mark.gpu
def test_gpu_seqlen_16k_forward(gen):
    check_dense(gen, torch.bfloat16, 1, 16384, 16384, 2, 1, 128, causal=True)


@pytest.mark.gpu
def test_gpu_causal_q_longer_than_k(gen):
    check_dense(gen, torch.bfloat16, 2, 1500, 700, 4, 4, 64, causal=True, grads=True)


@pytest.mark.gpu
def test_gpu_varlen_many_sequences(gen):
    lens = torch.randint(1, 301, (24,), generator=gen).tolist()
    check_varlen(gen, torch.bfloat16, lens, lens, 8, 2, 128, causal=True, grads=True)


@pytest.mark.gpu
def test_gpu_fp32_inputs(gen):
    check_dense(gen, torch.float32, 1, 300, 300, 2, 1, 64, causal=True, grads=True)


@pytest.mark.gpu
def test_gpu_autotuned_path(gen):
    """Forward through the autotuner (every candidate that fits is compiled and timed, the fastest kept)."""
    check_dense(gen, torch.bfloat16, 2, 2048, 2048, 8, 2, 128, causal=True, config_changes=dict(fwd_autotune=True))


@pytest.mark.gpu
@pytest.mark.parametrize("headdim, causal", [(64, True), (128, True), (128, False), (256, True)], ids=str)
def test_gpu_nondeterministic_fwd_bwd(gen, headdim, causal):
    check_dense(gen, torch.bfloat16, 2, 1025, 1025, 4, 2, headdim, causal=causal, grads=True,
                kernel_opts=dict(deterministic=False))


@pytest.mark.xdist_group("gpu_bigmem")  # ~11 GB (float64 reference): gpu_check's bigmem part, 4 workers
@pytest.mark.gpu
def test_gpu_nondeterministic_gqa_long_and_varlen(gen):
    check_dense(gen, torch.bfloat16, 1, 4097, 4097, 16, 4, 128, causal=True, grads=True,
                kernel_opts=dict(deterministic=False))
    lens = torch.randint(1, 301, (24,), generator=gen).tolist()
    check_varlen(gen, torch.bfloat16, lens, lens, 8, 2, 128, causal=True, grads=True,
                 kernel_opts=dict(deterministic=False))


@pytest.mark.gpu
def test_gpu_nondeterministic_autotuned(gen):
    """Through the autotuner: every timed candidate adds into the dQ buffer, which must be re-zeroed after tuning."""
    check_dense(gen, torch.bfloat16, 1, 2048, 2048, 8, 2, 128, causal=True, grads=True,
                kernel_opts=dict(deterministic=False), config_changes=dict(fwd_autotune=True, bwd_autotune=True))


@pytest.mark.gpu
@pytest.mark.parametrize("headdim, deterministic", [(128, True), (128, False), (256, False), (64, False)], ids=str)
def test_gpu_backward_tensor_descriptors(gen, headdim, deterministic):
    """config.bwd_tma forced on: descriptor loads, and the bulk TMA reduction of dQ when not deterministic."""
    check_dense(gen, torch.bfloat16, 2, 1025, 1025, 4, 2, headdim, causal=True, grads=True,
                kernel_opts=dict(deterministic=deterministic), config_changes=dict(bwd_tma=True))


@pytest.mark.gpu
@pytest.mark.parametrize("headdim, candidate", [
    (64, (64, 64, 64, 64, False, 4, 2)), (128, (128, 64, 128, 64, False, 8, 3)),
    (128, (128, 32, 128, 32, False, 8, 3)), (256, (64, 16, 64, 64, False, 8, 2)),
    (256, (128, 32, 64, 64, True, 8, 2)), (256, (128, 64, 64, 64, True, 8, 1))], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_fused_backward(gen, headdim, candidate, causal):
    """The one-launch backward with one given tile candidate (incl. the split dK / dV programs at hd256): GQA,
    ragged lengths, sq != sk; gradients repeat bit for bit."""
    fused = dict(bwd_fused=True, bwd_fused_tiles=(candidate,))
    check_dense(gen, torch.bfloat16, 2, 1000, 1100, 4, 2, headdim, causal=causal, grads=True, config_changes=fused)
    q, k, v = _inputs(gen, torch.bfloat16, (1, 700, 4, headdim), (1, 700, 2, headdim))
    dout = randn(1, 700, 4, headdim, gen=gen, dtype=q.dtype)
    config = fixed_config(q, k, v, **fused)
    first = _grads(q, k, v, dout, causal=causal, config=config)
    assert all(torch.equal(a, b) for a, b in zip(first, _grads(q, k, v, dout, causal=causal, config=config)))


_HOPPER_COMPILE_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashdecode.kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from flashdecode.kernels.fwd import attn_fwd_kernel

MASKS = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, IS_VARLEN=False, HAS_LEFT=False, HAS_RIGHT=True, SOFTCAP=False,
             DOT_PRECISION="tf32")
SCALARS = dict(logit_scales=("fp32", "fp32"), scales=("fp32", "fp32", "fp32"))


def stride_types(path, name, constexprs, attrs, unit=3):
    # what the launcher specializes: unit head-dim strides (the last of each 4-stride tuple; the FP8 forward's
    # V^T has its unit stride along the keys, index 1), other strides divisible by 16
    width = 2 if name in ("lse_strides", "delta_strides") else 4
    types = []
    for j in range(width):
        if width == 4 and j == unit:
            types.append("constexpr")
            constexprs[path + (j,)] = 1
        else:
            types.append("i32")
            attrs[path + (j,)] = [["tt.divisibility", 16]]
    return tuple(types)


# attn_bwd_dkdv_kernel's grouped strides
DKDV_STRIDES = ("q_strides", "k_strides", "v_strides", "do_strides", "dk_strides", "dv_strides", "dq_strides",
                "lse_strides", "delta_strides")


def compile_for_sm90(fn, pointers, consts, num_warps, num_stages):
    # pointers divisible by 16 as the launcher specializes them; strides as stride_types
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}  # as a launch fills them
    consts = dict(defaults, **consts)
    sig, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n] = "constexpr"
            constexprs[(i,)] = consts[n]
        elif n.endswith("_strides"):
            unit = 1 if n == "v_strides" and consts.get("IS_FP8") else 3  # ops/fp8_v_transpose.py's strides
            sig[n] = stride_types((i,), n, constexprs, attrs, unit)
        elif n == "strides":
            sig[n] = tuple(stride_types((i, j), name, constexprs, attrs) for j, name in enumerate(DKDV_STRIDES))
        elif n == "cu_seqlens":  # (cu_seqlens_q, cu_seqlens_k)
            sig[n] = (pointers["cu_seqlens_q"], pointers["cu_seqlens_k"])
            attrs.update({(i, 0): [["tt.divisibility", 16]], (i, 1): [["tt.divisibility", 16]]})
        else:
            sig[n] = pointers.get(n, SCALARS.get(n, "i32"))
            if isinstance(sig[n], str) and sig[n].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                              num_stages=num_stages))


bf16 = dict.fromkeys(["Q", "K", "V", "DO", "DK", "DV", "Out"], "*bf16")
fp32 = dict.fromkeys(["Lse", "Delta", "DQ"], "*fp32")
ints = dict.fromkeys(["cu_seqlens_q", "cu_seqlens_k"], "*i32")
kernel = compile_for_sm90(attn_bwd_dkdv_kernel, bf16 | fp32 | ints,
                          dict(MASKS, BLOCK_N=128, BLOCK_M=64, ATOMIC_DQ=True, USE_TMA=False), 8, 2)
ptx = kernel.asm["ptx"]
assert "atom.global.gpu.relaxed.add.v4.f32" in ptx or "red.global.gpu.relaxed.add.v4.f32" in ptx, "dQ atomics"
assert "wgmma" in ptx, "dK/dV not on wgmma"
kernel = compile_for_sm90(attn_bwd_dkdv_kernel, bf16 | fp32 | ints,
                          dict(MASKS, BLOCK_N=128, BLOCK_M=64, ATOMIC_DQ=True, USE_TMA=True), 8, 2)
assert "cp.reduce.async.bulk.tensor" in kernel.asm["ptx"], "dQ not added by a bulk TMA reduction"
kernel = compile_for_sm90(attn_bwd_dq_kernel, bf16 | ints | dict(Lse="*fp32", Delta="*fp32", DQ="*bf16"),
                          dict(MASKS, BLOCK_M=128, BLOCK_N=64, USE_TMA=True), 8, 3)
assert "cp.async.bulk.tensor" in kernel.asm["ptx"], "dQ pass not on TMA"
kernel = compile_for_sm90(attn_fwd_kernel, bf16 | fp32 | ints, dict(MASKS, BLOCK_M=128, BLOCK_N=128, USE_TMA=True),
                          8, 3)
assert "wgmma" in kernel.asm["ptx"] and "cp.async.bulk.tensor" in kernel.asm["ptx"], "forward not on TMA + wgmma"
# head dim 256: the first large-head-dim tile of each kernel holds its accumulators in registers
import sys
sys.path.insert(0, "tests")
from helpers import spilled_bytes
from flashdecode.heuristics import PREFILL_LARGE_HEAD_DIM_CANDIDATES as BIG
HD256 = dict(MASKS, HEAD_DIM=256, HEAD_DIM_PAD=256)
bm, bn, warps, stages = BIG["fwd"][0]
kernel = compile_for_sm90(attn_fwd_kernel, bf16 | fp32 | ints,
                          dict(HD256, BLOCK_M=bm, BLOCK_N=bn, USE_TMA=True), warps, stages)
assert spilled_bytes(kernel) == 0, "hd256 forward spills"
bm, bn, warps, stages = BIG["bwd_dq"][0]
kernel = compile_for_sm90(attn_bwd_dq_kernel, bf16 | ints | dict(Lse="*fp32", Delta="*fp32", DQ="*bf16"),
                          dict(HD256, BLOCK_M=bm, BLOCK_N=bn, USE_TMA=True), warps, stages)
assert spilled_bytes(kernel) == 0, "hd256 dQ pass spills"
# the one-launch backward at hd256 with split dV / dK programs (the default there)
bn, bm, bm2, bn2, split, warps, stages = BIG["bwd_fused"][1]
kernel = compile_for_sm90(attn_bwd_dkdv_kernel, bf16 | fp32 | ints | dict(DQ="*bf16"),
                          dict(HD256, BLOCK_N=bn, BLOCK_M=bm, BLOCK_M2=bm2, BLOCK_N2=bn2, SPLIT_DKDV=split,
                               FUSED_DQ=True, USE_TMA=True), warps, stages)
assert split and "wgmma" in kernel.asm["ptx"] and kernel.metadata.shared <= 227 * 1024, "fused hd256 backward"
# FP8 forward: both QK^T and PV on e4m3 wgmma (V pre-transposed, so K-major), with descriptors and with pointers
fp8 = dict.fromkeys(["Q", "K", "V"], "*fp8e4nv") | dict(Out="*bf16", Lse="*fp32", fp8_descales=("*fp32", "*fp32"))
for tma in (True, False):
    kernel = compile_for_sm90(attn_fwd_kernel, fp8 | ints, dict(MASKS, BLOCK_M=128, BLOCK_N=128, USE_TMA=tma,
                                                                IS_FP8=True), 8, 3)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in kernel.asm["ptx"], "fp8 forward not on wgmma"
# ALiBi: forward and the dK/dV pass keep wgmma
kernel = compile_for_sm90(attn_fwd_kernel, bf16 | fp32 | ints | dict(AlibiSlopes="*fp32"),
                          dict(MASKS, BLOCK_M=128, BLOCK_N=128, USE_TMA=True, HAS_ALIBI=True), 8, 3)
assert "wgmma" in kernel.asm["ptx"], "alibi forward not on wgmma"
kernel = compile_for_sm90(attn_bwd_dkdv_kernel, bf16 | fp32 | ints | dict(AlibiSlopes="*fp32"),
                          dict(MASKS, BLOCK_N=64, BLOCK_M=64, USE_TMA=False, HAS_ALIBI=True), 4, 2)
assert "wgmma" in kernel.asm["ptx"], "alibi dK/dV not on wgmma"
print("compiled")
'''


def test_kernels_compile_for_hopper_without_a_gpu():
    """The atomic dQ variant of the dK/dV kernel (vector fp32 atomics / bulk TMA reduction, wgmma), the TMA dQ pass
    and the TMA forward compile for sm_90 with Triton's own ptxas, no GPU needed (the interpreter accepts
    code the GPU compiler rejects, and has no descriptor reduction at all); the hd256 tiles compile without spills;
    the FP8 forward runs both matmuls as e4m3 wgmma; ALiBi keeps wgmma."""
    run_sm90_compile_script(_HOPPER_COMPILE_SCRIPT)


@pytest.mark.parametrize("scale", [0.0, -0.4])
def test_zero_and_negative_softmax_scale_are_exact(scale):
    """softmax_scale 0 (uniform weights over the visible keys) and negative scales, causal, against the float64
    reference: no NaN (on Hopper these calls must not take the Gluon kernel, which masks before it scales)."""
    import flashdecode
    from flashdecode.reference import attention_ref

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 70, 4, 64, generator=gen).to(DEVICE, torch.float16) for _ in range(3))
    out = flashdecode.flash_attn(q, k, v, causal=True, softmax_scale=scale)
    ref = attention_ref(q.double(), k.double(), v.double(), causal=True, softmax_scale=scale)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 5e-3
