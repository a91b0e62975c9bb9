"""ALiBi in flash_attn / flash_attn_varlen (forward and backward kernels) against the float64 reference: flash-attn's
bias -slope * |i + seqlen_k - seqlen_q - j| after the softcap, slopes (nheads,) or (batch, nheads), causal /
non-causal / window, GQA, varlen, every backward mode (FlashAttention rule: 2x for out and lse, 3x for gradients).
Also the reference's own ALiBi (attention_ref, attention_varlen_ref, decode_ref agree) and bad input.
"""

from __future__ import annotations

import pytest
import torch

import flashdecode
from flashdecode import reference as ref
from helpers import DEVICE, HAS_CUDA, KERNEL_DTYPES
from test_attention import _inputs, _ok, check_dense, check_varlen

CASE_DTYPES = [torch.bfloat16] if HAS_CUDA else KERNEL_DTYPES


def slopes(gen, *shape):
    """Random positive slopes in [0.05, 1): larger than a model's 2**(-8 h / nheads) so the bias dominates some
    rows (a wrong sign or offset shows at once)."""
    return (torch.rand(*shape, generator=gen) * 0.95 + 0.05).to(device=DEVICE, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _no_autotuning(monkeypatch):
    from flashdecode.ops import attention as attn_ops

    monkeypatch.setenv(attn_ops.AUTOTUNE_ENV, "0")


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, options, per-batch slopes)
CASES = [
    (2, 40, 40, 4, 2, 64, dict(causal=True), False),
    (2, 33, 70, 4, 1, 64, {}, True),
    (1, 70, 33, 2, 2, 32, dict(causal=True), True),  # seqlen_q > seqlen_k: empty rows stay (0, -inf)
    (1, 40, 97, 2, 1, 64, dict(window_size=(20, 3)), False),
    (1, 65, 70, 2, 2, 64, dict(softcap=2.0, causal=True), True),
]


@pytest.mark.parametrize("dtype", CASE_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[:6]}{c[6]}{'b' if c[7] else ''}")
def test_alibi_forward_backward(gen, dtype, case):
    batch, nheads, per_batch = case[0], case[3], case[7]
    alibi = slopes(gen, *((batch, nheads) if per_batch else (nheads,)))
    out, lse, _ = check_dense(gen, dtype, *case[:6], grads=True, alibi_slopes=alibi, **case[6])
    if case[1] > case[2] and case[6].get("causal"):
        assert torch.all(lse[:, :, :case[1] - case[2]] == float("-inf"))


def test_alibi_varlen(gen):
    lens_q, lens_k = [5, 0, 40, 17], [9, 3, 40, 30]
    check_varlen(gen, KERNEL_DTYPES[0], lens_q, lens_k, 4, 2, 64, grads=True, causal=True,
                 alibi_slopes=slopes(gen, 4, 4))
    check_varlen(gen, KERNEL_DTYPES[0], lens_q, lens_k, 4, 2, 64, alibi_slopes=slopes(gen, 4))


@pytest.mark.parametrize("mode", ["atomic", "fused", "descriptors"])
def test_alibi_in_every_backward_mode(gen, mode):
    """deterministic=False (dQ by atomics), the one-launch backward, and the descriptor (TMA) paths."""
    kernel_opts, changes = {}, {}
    if mode == "atomic":
        kernel_opts = dict(deterministic=False)
    elif mode == "fused":
        changes = dict(bwd_fused=True)
    else:
        changes = dict(fwd_tma=True, bwd_tma=True)
    check_dense(gen, KERNEL_DTYPES[0], 2, 50, 61, 4, 2, 64, grads=True, causal=True, kernel_opts=kernel_opts,
                config_changes=changes, alibi_slopes=slopes(gen, 2, 4))


def test_alibi_slopes_get_no_gradient_and_zero_slopes_change_nothing(gen):
    q, k, v = _inputs(gen, KERNEL_DTYPES[0], (1, 33, 2, 64), (1, 33, 2, 64))
    alibi = slopes(gen, 2).requires_grad_()
    qx = q.clone().requires_grad_()
    flashdecode.flash_attn(qx, k, v, causal=True, alibi_slopes=alibi).sum().backward()
    assert alibi.grad is None and qx.grad is not None
    plain = flashdecode.flash_attn(q, k, v, causal=True)
    zero = flashdecode.flash_attn(q, k, v, causal=True, alibi_slopes=torch.zeros(2, device=DEVICE))
    assert torch.equal(plain, zero)


def test_reference_alibi_is_consistent():
    """attention_ref's bias by hand; varlen and decode_ref (new tokens at the end of the cache) agree with it."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 9, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 9, 2, 16, generator=gen, dtype=torch.float64)
    alibi = torch.rand(2, 4, generator=gen)
    out, lse = ref.attention_ref(q, k, v, causal=True, alibi_slopes=alibi)
    kk, vv = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * 16 ** -0.5
    i = torch.arange(3)[:, None] + 6
    j = torch.arange(9)[None, :]
    s = s - alibi.double()[:, :, None, None] * (i - j).abs() + torch.where(j <= i, 0.0, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv))
    cu_q, cu_k = torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([0, 9, 18], dtype=torch.int32)
    out_v, _ = ref.attention_varlen_ref(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, causal=True,
                                        alibi_slopes=alibi)
    torch.testing.assert_close(out_v, out.flatten(0, 1))
    cache_k = torch.cat([k, torch.randn(2, 4, 2, 16, generator=gen, dtype=torch.float64)], 1)
    cache_v = torch.cat([v, torch.randn(2, 4, 2, 16, generator=gen, dtype=torch.float64)], 1)
    out_d, _ = ref.decode_ref(q, cache_k, cache_v, torch.tensor([9, 9]), alibi_slopes=alibi)
    torch.testing.assert_close(out_d, out)
    out_1, _ = ref.decode_ref(q[:, -1], cache_k, cache_v, torch.tensor([9, 9]), alibi_slopes=alibi[0])
    out_full, _ = ref.attention_ref(q[:, -1:], k, v, alibi_slopes=alibi[0])
    torch.testing.assert_close(out_1, out_full[:, 0])


def test_alibi_rejects_bad_slopes():
    q, k, v = _ok()  # batch 1, 4 heads
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        flashdecode.flash_attn(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(nheads,\)"):
        flashdecode.flash_attn(q, k, v, alibi_slopes=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flashdecode.flash_attn(q, k, v, alibi_slopes=torch.ones(2, 4, device=DEVICE))
    with pytest.raises(TypeError, match="alibi_slopes must be a float32 torch.Tensor"):
        flashdecode.flash_attn(q, k, v, alibi_slopes=[0.5] * 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flashdecode.flash_attn_varlen(q[0], k[0], v[0], cu, cu, 8, 8, alibi_slopes=torch.ones(3, 4, device=DEVICE))


@pytest.mark.skipif(not HAS_CUDA, reason="needs two devices (cpu + cuda)")
def test_alibi_rejects_slopes_on_another_device():
    q, k, v = _ok()
    with pytest.raises(ValueError, match="alibi_slopes is on"):
        flashdecode.flash_attn(q, k, v, alibi_slopes=torch.ones(4))


@pytest.mark.xdist_group("gpu_bigmem")  # ~6 GB (float64 reference): gpu_check's bigmem part, 4 workers
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_alibi_long(gen, causal):
    """Long sequences with model-like slopes (2**(-8 h / nheads)) and per-batch slopes, fwd + bwd, bf16."""
    model = torch.tensor([2 ** (-8 * (h + 1) / 8) for h in range(8)], device=DEVICE)
    check_dense(gen, torch.bfloat16, 2, 1000, 1100, 8, 2, 128, grads=True, causal=causal, alibi_slopes=model)
    check_dense(gen, torch.bfloat16, 2, 3000, 3000, 8, 8, 64, causal=causal, alibi_slopes=slopes(gen, 2, 8) * 0.1)


def test_alibi_and_fp8_compile_without_graph_break(gen):
    """The slopes and descales cross the torch.library ops: fullgraph compiles (aot_eager runs the fakes) match
    eager, gradients included for ALiBi; the FP8 fake gives a bf16 output."""
    from test_attention import _leaf

    q, k, v = _leaf(*_inputs(gen, KERNEL_DTYPES[0], (1, 33, 4, 64), (1, 33, 2, 64)))
    alibi = slopes(gen, 4)

    def step(a, b, c):
        return flashdecode.flash_attn(a, b, c, causal=True, alibi_slopes=alibi).float().square().sum()

    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    q2, k2, v2 = _leaf(q, k, v)
    eager = step(q2, k2, v2)
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-3) and torch.equal(q.grad, q2.grad)

    q8, k8, v8 = (x.detach().to(torch.float8_e4m3fn) for x in (q, k, v))
    ones = torch.ones(1, 2, device=DEVICE)

    def fp8_step(a, b, c):
        return flashdecode.flash_attn(a, b, c, causal=True, q_descale=ones, k_descale=ones, v_descale=ones)

    compiled = torch.compile(fp8_step, fullgraph=True, backend="aot_eager")(q8, k8, v8)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, fp8_step(q8, k8, v8))
