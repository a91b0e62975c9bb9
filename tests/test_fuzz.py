"""Property-based fuzz of every public op against the float64 reference (flashdecode.reference), with Hypothesis.

Each test draws a whole case - shapes, dtypes, memory layouts (permuted dense copies and strided views), page sizes
with randomly permuted block tables, ragged lengths including 0, forced split counts, GQA ratios, windows, softcap,
softmax_scale, seqlen_q 1..4 - plus a seed for the tensor values, and checks the FlashAttention rule: the error
against float64 is at most 2x (3x for decode and merges) that of the same-dtype PyTorch reference, never NaN.
append_kv is checked bit-exactly, the whole cache included. 8-bit caches (e4m3, int8; a scale per token and kv head,
per kv head or one) are fuzzed too: decode against the float64 reference on the dequantised cache, append_kv's
quantising writes within the format's step, the rest of the cache (codes and scales) untouched.

Profiles (registered in conftest.py): "ci" (the default) draws conftest.CI_EXAMPLES fresh small cases per op each
run, from one seed printed in the pytest header (and after a failure; `--hypothesis-seed=N` or
FLASHDECODE_HYPOTHESIS_SEED=N repeats a run's cases); ``--hypothesis-profile=long`` runs many more, and on a CUDA
machine at larger sizes and in bf16.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import flashdecode
from flashdecode import reference as ref
from flashdecode.ops import attention as attn_ops
from flashdecode.ops import checks
from flashdecode.ops.kv_quant import QMAX, dequantize_cache
from helpers import DEVICE, HAS_CUDA, assert_fa_close
from quant_helpers import (check_fp8, check_on_dequantised, dequantise, fp8_inputs, paged_quant_cache, quant_step,
                           quantize_float_cache)

# Larger shapes only where they are cheap: the long profile on a GPU (the CPU interpreter stays small).
BIG = HAS_CUDA and settings.default.max_examples >= 100
SIZE = 8 if BIG else 1
# bf16 dots are wrong in the interpreter: CPU cases use fp16/fp32.
DTYPES = [torch.float16, torch.bfloat16, torch.float32] if HAS_CUDA else [torch.float16, torch.float32]
HEADDIMS = [16, 32, 40, 64, 80, 128] if BIG else [16, 32, 40, 64]
PAGE_SIZES = [None, 1, 2, 3, 4, 8, 16, 64] if BIG else [None, 1, 3, 4, 8, 16]


def ci_examples(n: int):
    """Under the "ci" profile (the CPU interpreter), draw ``n`` cases of this property instead of the profile's
    count: the properties whose cases cost well under a second in the interpreter draw more (12 or 20), the two
    whose cases can cost tens of seconds (flash_attn with gradients, the 8-bit decode cache) keep the profile's 10.
    Other profiles keep their own count."""
    if settings.get_current_profile_name() != "ci":
        return lambda test: test
    return settings(max_examples=n)


MEDIUM, CHEAP = 12, 20  # ci_examples of the decode / varlen / fp8 properties and of append_kv / merge_states


@pytest.fixture(autouse=True, scope="module")
def _fixed_attention_config():
    """One flash_attn config per shape (no autotuning): GPU compile counts stay bounded across many cases."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(attn_ops.AUTOTUNE_ENV, "0")
        yield


# ----------------------------------------------------------------------------------------------------------------
# Values and layouts
# ----------------------------------------------------------------------------------------------------------------

def _values(seed: int, shape, dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


LAYOUTS = st.sampled_from(["contiguous", "permuted", "strided"])


def _in_layout(x: torch.Tensor, layout: str, perm_seed: int, keep_last: bool, fill: float = float("nan")
               ) -> torch.Tensor:
    """x's values in another memory layout. permuted: a dense tensor whose dims lie in memory in a random order
    (e.g. an HF (b, h, s, d) tensor transposed to (b, s, h, d)); strided: a view that takes every other element of
    a wider tensor along one dim, ``fill`` in between (NaN, so that a misread shows). keep_last keeps unit stride on
    the last dim (caches, k_new)."""
    nd = x.dim()
    movable = nd - 1 if keep_last else nd
    if layout == "contiguous" or movable < 1:
        return x
    gen = torch.Generator().manual_seed(perm_seed)
    if layout == "permuted":
        order = torch.randperm(movable, generator=gen).tolist() + list(range(movable, nd))
        inverse = [order.index(i) for i in range(nd)]
        return x.permute(order).contiguous().permute(inverse)
    dim = int(torch.randint(movable, (1,), generator=gen))
    wide_shape = list(x.shape)
    wide_shape[dim] *= 2
    wide = torch.full(wide_shape, fill, dtype=x.dtype, device=x.device)
    index = [slice(None)] * nd
    index[dim] = slice(0, None, 2)
    wide[tuple(index)] = x
    return wide[tuple(index)]


def _laid_out(draw, x: torch.Tensor, keep_last: bool = False) -> torch.Tensor:
    return _in_layout(x, draw(LAYOUTS), draw(st.integers(0, 2**16)), keep_last)


def _lengths(draw, batch: int, hi: int) -> list[int]:
    """Ragged lengths in [0, hi], with the edges (0, hi) drawn often."""
    return [draw(st.one_of(st.just(0), st.just(hi), st.integers(0, hi))) for _ in range(batch)]


def _options(draw, causal_window: bool):
    """softmax_scale, softcap, window_size drawn over their valid ranges (window right only with causal_window)."""
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    softcap = draw(st.one_of(st.just(0.0), st.floats(1.0, 30.0)))
    left = draw(st.one_of(st.just(-1), st.integers(0, 12 * SIZE)))
    right = draw(st.one_of(st.just(-1), st.integers(0, 12 * SIZE))) if causal_window else -1
    return scale, softcap, (left, right)


# ----------------------------------------------------------------------------------------------------------------
# flash_decode and DecodePlan
# ----------------------------------------------------------------------------------------------------------------

@st.composite
def decode_cases(draw):
    nheads_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    seqlen_q = draw(st.integers(1, 4))
    batch = draw(st.integers(1, 4))
    cap = draw(st.integers(1, 48 * SIZE))
    return dict(
        batch=batch, nheads=nheads_kv * group, nheads_kv=nheads_kv, headdim=draw(st.sampled_from(HEADDIMS)),
        seqlen_q=seqlen_q, squeeze_q=seqlen_q == 1 and draw(st.booleans()), cap=cap,
        extra_batch=draw(st.integers(0, 2)), lens=_lengths(draw, batch, cap), dtype=draw(st.sampled_from(DTYPES)),
        page_size=draw(st.sampled_from(PAGE_SIZES)), num_splits=draw(st.one_of(st.none(), st.integers(1, 6))),
        options=_options(draw, causal_window=False), seed=draw(st.integers(0, 2**31 - 1)),
        q_layout=(draw(LAYOUTS), draw(st.integers(0, 2**16))),
        cache_layout=(draw(LAYOUTS), draw(st.integers(0, 2**16))),
        table_pad=draw(st.integers(0, 2)),
    )


def _decode_inputs(case):
    """q (in its layout), the contiguous k/v (for the reference), the cache the op reads (contiguous with extra
    rows, or paged with a permuted table, in its layout), block_table (maybe a column slice) and lengths."""
    b, sq, h, hk, d, dtype = (case[n] for n in ("batch", "seqlen_q", "nheads", "nheads_kv", "headdim", "dtype"))
    seed = case["seed"]
    q = _values(seed, (b, sq, h, d), dtype)
    if case["squeeze_q"]:
        q = q[:, 0]
    k = _values(seed + 1, (b + case["extra_batch"], case["cap"], hk, d), dtype)
    v = _values(seed + 2, (b + case["extra_batch"], case["cap"], hk, d), dtype)
    table = None
    if case["page_size"] is None:
        kc, vc = k, v
    else:
        kc, vc, table = ref.paged_from_contiguous(k[:b], v[:b], case["page_size"], extra_pages=2,
                                                  generator=torch.Generator().manual_seed(seed + 3))
        if case["table_pad"]:  # a view whose rows are longer than the table (row stride > its width)
            wide = torch.full((b, table.shape[1] + case["table_pad"]), -1, dtype=torch.int32, device=DEVICE)
            wide[:, : table.shape[1]] = table
            table = wide[:, : table.shape[1]]
    layout, perm_seed = case["cache_layout"]
    kc = _in_layout(kc, layout, perm_seed, keep_last=True)
    # k and v share strides (a requirement): v gets the same layout
    vc = _in_layout(vc, layout, perm_seed, keep_last=True)
    q = _in_layout(q, *case["q_layout"], keep_last=False)
    lens = torch.tensor(case["lens"], dtype=torch.int32, device=DEVICE)
    return q, k[:b], v[:b], kc, vc, table, lens


def _check_against(reference, out, lse, tensors, *, factor, atol=1e-5, **kw):
    """FlashAttention rule for (out, lse) vs reference(*tensors, **kw) in float64 and in the inputs' own dtype
    (tensors: the float inputs, then any metadata passed through as is)."""
    floats = [t for t in tensors if t.is_floating_point()]
    meta = tensors[len(floats):]
    o64, lse64 = reference(*[t.double() for t in floats], *meta, **kw)
    o_same, lse_same = reference(*floats, *meta, **kw)
    assert out.shape == o64.shape and out.dtype == floats[0].dtype
    assert lse.shape == lse64.shape and lse.dtype == torch.float32
    assert_fa_close(out, o64, o_same, factor=factor, atol=atol)
    assert_fa_close(lse, lse64, lse_same.float(), factor=factor, atol=atol, name="lse")


def _check_decode(out, lse, q, k, v, lens, case):
    scale, softcap, window = case["options"]
    _check_against(ref.decode_ref, out, lse, (q, k, v, lens), factor=3.0, atol=1e-4, softmax_scale=scale,
                   softcap=softcap, window_size=window)


@ci_examples(MEDIUM)
@given(decode_cases())
def test_flash_decode_fuzz(case):
    q, k, v, kc, vc, table, lens = _decode_inputs(case)
    scale, softcap, window = case["options"]
    out, lse = flashdecode.flash_decode(q, kc, vc, lens, block_table=table, softmax_scale=scale, softcap=softcap,
                                        window_size=window, num_splits=case["num_splits"], return_lse=True)
    _check_decode(out, lse, q, k, v, lens, case)


@ci_examples(MEDIUM)
@given(decode_cases(), st.integers(0, 2), st.integers(0, 3), st.booleans())
def test_decode_plan_fuzz(case, spare_batch, spare_q, balance_mixed):
    """A plan sized at or above the call (max_batch, max_seqlen_q), its split count forced or its own; run twice
    with different lengths (the plan's buffers are reused)."""
    q, k, v, kc, vc, table, lens = _decode_inputs(case)
    b, sq = case["batch"], case["seqlen_q"]
    plan = flashdecode.DecodePlan(b + spare_batch, case["nheads"], case["nheads_kv"], case["headdim"],
                                  max_seqlen_k=case["cap"], dtype=case["dtype"], device=DEVICE,
                                  max_seqlen_q=sq + (0 if case["squeeze_q"] else spare_q),
                                  num_splits=case["num_splits"], balance_mixed=balance_mixed)
    scale, softcap, window = case["options"]
    for lengths in (lens, lens.flip(0)):
        out, lse = plan.run(q, kc, vc, lengths, block_table=table, softmax_scale=scale, softcap=softcap,
                            window_size=window, return_lse=True)
        _check_decode(out, lse, q, k, v, lengths, case)


@st.composite
def quant_cases(draw):
    """An 8-bit cache on top of a decode case: its dtype, the scale granularity (one per token and kv head, per kv
    head, one for all), the per-token scales' memory layout, and every k-th token all zeros (scale 0) or none."""
    return dict(kv_dtype=draw(st.sampled_from([torch.float8_e4m3fn, torch.int8])),
                granularity=draw(st.sampled_from(["token", "head", "scalar"])),
                scale_layout=(draw(LAYOUTS), draw(st.integers(0, 2**16))),
                zero_every=draw(st.sampled_from([0, 2, 5])), use_plan=draw(st.booleans()))


def _quant_inputs(case, quant):
    """q (in its layout), the contiguous 8-bit caches and scales (for the reference; per-token scales past each
    length NaN: never read) and what the op reads: the caches contiguous with extra rows or paged with a permuted
    table, in the case's layout, the per-token scales in theirs."""
    b, sq, h, hk, d, dtype = (case[n] for n in ("batch", "seqlen_q", "nheads", "nheads_kv", "headdim", "dtype"))
    seed, kv_dtype = case["seed"], quant["kv_dtype"]
    q = _values(seed, (b, sq, h, d), dtype)
    if case["squeeze_q"]:
        q = q[:, 0]
    q = _in_layout(q, *case["q_layout"], keep_last=False)
    caches = []
    for i in (1, 2):
        x = _values(seed + i, (b + case["extra_batch"], case["cap"], hk, d), torch.float32, scale=2.0)
        if quant["zero_every"]:
            x[:, :: quant["zero_every"]] = 0.0
        cache, scale = quantize_float_cache(x, kv_dtype, quant["granularity"])
        if scale.dim() == 3:  # (the plan also runs the lengths reversed)
            for row, (n, m) in enumerate(zip(case["lens"], reversed(case["lens"]))):
                scale[row, max(n, m):] = float("nan")
        caches += [cache, scale]
    # the batch's rows of the caches and scales (a scalar / per-head scale is the same for every row)
    batch_rows = [x[:b] if x.dim() >= 3 else x for x in caches]
    table = None
    if case["page_size"] is None:
        kc_op, ks_op, vc_op, vs_op = caches
    else:
        kc_op, ks_op, vc_op, vs_op, table = paged_quant_cache(torch.Generator().manual_seed(seed + 3), *batch_rows,
                                                              case["page_size"])
    fill = float("nan") if kv_dtype == torch.float8_e4m3fn else -128
    kc_op, vc_op = (_in_layout(c, *case["cache_layout"], keep_last=True, fill=fill) for c in (kc_op, vc_op))
    if ks_op.dim() == 3:
        ks_op, vs_op = (_in_layout(x, *quant["scale_layout"], keep_last=False) for x in (ks_op, vs_op))
    lens = torch.tensor(case["lens"], dtype=torch.int32, device=DEVICE)
    return q, batch_rows, (kc_op, ks_op, vc_op, vs_op), table, lens


@given(decode_cases(), quant_cases())
def test_flash_decode_8bit_cache_fuzz(case, quant):
    """flash_decode, or a plan run twice with the lengths reversed, on an e4m3 / int8 cache against the float64
    reference on the dequantised cache (FlashAttention rule, 3x; the same-dtype baseline reads the dequantised
    cache in q's dtype)."""
    q, (kc, ks, vc, vs), (kc_op, ks_op, vc_op, vs_op), table, lens = _quant_inputs(case, quant)
    scale, softcap, window = case["options"]
    kw = dict(block_table=table, softmax_scale=scale, softcap=softcap, window_size=window, k_scale=ks_op,
              v_scale=vs_op, return_lse=True)
    if quant["use_plan"]:
        plan = flashdecode.DecodePlan(case["batch"], case["nheads"], case["nheads_kv"], case["headdim"],
                                      max_seqlen_k=case["cap"], dtype=case["dtype"], device=DEVICE,
                                      max_seqlen_q=case["seqlen_q"], num_splits=case["num_splits"],
                                      kv_dtype=quant["kv_dtype"])
        for lengths in (lens, lens.flip(0)):  # (checked before the next run reuses the plan's buffers)
            out, lse = plan.run(q, kc_op, vc_op, lengths, **kw)
            check_on_dequantised(out, lse, q, kc, ks, vc, vs, lengths, softmax_scale=scale, softcap=softcap,
                                 window_size=window)
    else:
        out, lse = flashdecode.flash_decode(q, kc_op, vc_op, lens, num_splits=case["num_splits"], **kw)
        check_on_dequantised(out, lse, q, kc, ks, vc, vs, lens, softmax_scale=scale, softcap=softcap,
                             window_size=window)


# ----------------------------------------------------------------------------------------------------------------
# flash_attn and flash_attn_varlen
# ----------------------------------------------------------------------------------------------------------------

def _qkv(draw, seed, dtype, q_shape, kv_shape):
    """q, k, v with random values, each in a drawn layout."""
    return (_laid_out(draw, _values(seed, q_shape, dtype)), _laid_out(draw, _values(seed + 1, kv_shape, dtype)),
            _laid_out(draw, _values(seed + 2, kv_shape, dtype)))


@st.composite
def attention_heads(draw):
    nheads_kv = draw(st.integers(1, 2))
    return nheads_kv * draw(st.sampled_from([1, 2, 3])), nheads_kv, draw(st.sampled_from(HEADDIMS))


@given(st.data())
def test_flash_attn_fuzz(data):
    draw = data.draw
    h, hk, d = draw(attention_heads())
    b, sq, sk = draw(st.integers(1, 2)), draw(st.integers(1, 40 * SIZE)), draw(st.integers(1, 40 * SIZE))
    dtype, seed, causal = draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31 - 1)), draw(st.booleans())
    scale, softcap, window = _options(draw, causal_window=True)
    q, k, v = _qkv(draw, seed, dtype, (b, sq, h, d), (b, sk, hk, d))
    kw = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)
    if draw(st.booleans()):  # gradients too, through the same layouts
        _check_gradients(lambda *x: flashdecode.flash_attn(*x, **kw), lambda *x: ref.attention_ref(*x, **kw)[0],
                         (q, k, v), seed)
        return
    out, lse = flashdecode.flash_attn(q, k, v, return_lse=True, **kw)
    _check_against(ref.attention_ref, out, lse, (q, k, v), factor=2.0, **kw)


FP8_GPU_MAX_LOGIT = 64.0  # test_flash_attn_fp8_fuzz's logit range on the GPU


def _max_abs_logit(q8, k8, qd, kd, softmax_scale) -> float:
    """The largest |q . k| * softmax_scale of the dequantised e4m3 inputs (before any softcap), every head pair."""
    q, k = dequantise(q8.cpu(), qd.cpu()), dequantise(k8.cpu(), kd.cpu())
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return (torch.einsum("bqhd,bkhd->bhqk", q, k).abs().amax().item() * scale) if q.numel() and k.numel() else 0.0


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # the softcap's saturating tanh
@ci_examples(MEDIUM)
@given(st.data())
def test_flash_attn_fp8_fuzz(data):
    """flash_attn on e4m3 q / k / v with FA3's descales (per kv head, or q's per query head), each input in a drawn
    layout, every score option: the rule of tests/test_fp8_prefill.py (2x the error of the same rounding in
    PyTorch, reference.attention_fp8_ref, against float64 on the dequantised inputs; lse to fp32 accuracy)."""
    draw = data.draw
    h, hk, d = draw(attention_heads())
    b, sq, sk = draw(st.integers(1, 2)), draw(st.integers(1, 40 * SIZE)), draw(st.integers(1, 40 * SIZE))
    seed, causal = draw(st.integers(0, 2**31 - 1)), draw(st.booleans())
    scale, softcap, window = _options(draw, causal_window=True)
    inputs = fp8_inputs(torch.Generator().manual_seed(seed), b, sq, sk, h, hk, d, q_per_head=draw(st.booleans()),
                        scale=draw(st.sampled_from([0.1, 1.0, 30.0])))
    if inputs[0].is_cuda:
        # Hopper's e4m3 MMAs add their products with ~14 mantissa bits, so a logit of magnitude L is off by up to
        # ~L * 2**-13, an absolute error the fp32-logit yardstick does not make; beyond FP8_GPU_MAX_LOGIT the rule
        # measures that hardware limit, not the kernel (docs/decisions.md, "FP8 forward: logit range on the GPU")
        assume(_max_abs_logit(*inputs[:2], inputs[3], inputs[4], scale) <= FP8_GPU_MAX_LOGIT)
    q8, k8, v8 = (_laid_out(draw, x) for x in inputs[:3])
    check_fp8(q8, k8, v8, *inputs[3:], causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)


def _check_gradients(run, reference, inputs, seed):
    """dq, dk, dv of run(*inputs) (leaves that keep the inputs' layouts) vs the reference in float64 and in the
    inputs' dtype, FlashAttention rule at 3x; the forward output at 2x."""
    ours = [x.detach().requires_grad_() for x in inputs]
    r64 = [x.detach().double().requires_grad_() for x in inputs]
    same = [x.detach().clone().requires_grad_() for x in inputs]
    out = run(*ours)
    dout = _values(seed + 7, out.shape, out.dtype)
    outs = (out, reference(*r64), reference(*same))
    assert_fa_close(outs[0], outs[1], outs[2], factor=2.0)
    for o in outs:
        o.backward(dout.to(o.dtype))
    for name, a, b_, c in zip(("dq", "dk", "dv"), ours, r64, same):
        assert a.grad.shape == a.shape and a.grad.dtype == a.dtype
        assert_fa_close(a.grad, b_.grad, c.grad, factor=3.0, atol=1e-4, name=name)


@ci_examples(MEDIUM)
@given(st.data())
def test_flash_attn_varlen_fuzz(data):
    draw = data.draw
    h, hk, d = draw(attention_heads())
    batch = draw(st.integers(1, 3))
    lens_q, lens_k = _lengths(draw, batch, 24 * SIZE), _lengths(draw, batch, 24 * SIZE)
    dtype, seed, causal = draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31 - 1)), draw(st.booleans())
    scale, softcap, window = _options(draw, causal_window=True)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    q, k, v = _qkv(draw, seed, dtype, (sum(lens_q), h, d), (sum(lens_k), hk, d))
    kw = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)
    out, lse = flashdecode.flash_attn_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **kw)
    _check_against(ref.attention_varlen_ref, out, lse, (q, k, v, cu_q, cu_k), factor=2.0, **kw)


# ----------------------------------------------------------------------------------------------------------------
# append_kv (bit-exact, whole cache)
# ----------------------------------------------------------------------------------------------------------------

def _append_case(draw):
    """An append's shape: (batch, nheads_kv, headdim, capacity, dtype, seed, varlen, page_size (None: contiguous),
    the lengths before, the new tokens per sequence (all equal unless varlen))."""
    batch, hk, d = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.sampled_from(HEADDIMS))
    cap, dtype, seed = draw(st.integers(1, 40 * SIZE)), draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31 - 1))
    varlen, page_size = draw(st.booleans()), draw(st.sampled_from(PAGE_SIZES))
    before = _lengths(draw, batch, cap)
    if varlen:
        news = [draw(st.integers(0, cap - n)) for n in before]
    else:
        news = [draw(st.integers(0, cap - max(before)))] * batch
    return batch, hk, d, cap, dtype, seed, varlen, page_size, before, news


def _new_tokens(rows_k, rows_v, news, varlen):
    """(k_new, v_new, append_kv's varlen keywords): each sequence's new rows (n, nheads_kv, headdim) packed
    (varlen, with cu_seqlens_new) or stacked (batch, n, ...)."""
    if not varlen:
        return torch.stack(rows_k), torch.stack(rows_v), {}
    cu = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return torch.cat(rows_k), torch.cat(rows_v), dict(cu_seqlens_new=cu)


def _cache_slot(b, pos, table, page_size):
    """The (row, position) index of sequence b's token pos in a contiguous cache (table None) or a paged one."""
    return (b, pos) if table is None else (int(table[b, pos // page_size]), pos % page_size)


@ci_examples(CHEAP)
@given(st.data())
def test_append_kv_fuzz(data):
    draw = data.draw
    batch, hk, d, cap, dtype, seed, varlen, page_size, before, news = _append_case(draw)
    k = _values(seed, (batch, cap, hk, d), dtype)
    v = _values(seed + 1, (batch, cap, hk, d), dtype)
    rows_k = [_values(seed + 2 + b, (n, hk, d), dtype) for b, n in enumerate(news)]
    rows_v = [_values(seed + 100 + b, (n, hk, d), dtype) for b, n in enumerate(news)]
    k_new, v_new, kw = _new_tokens(rows_k, rows_v, news, varlen)
    if varlen:
        kw["max_seqlen_new"] = draw(st.sampled_from([None, max(news)]))
    k_new = _laid_out(draw, k_new, keep_last=True)
    v_new = _laid_out(draw, v_new, keep_last=True)
    table = None
    if page_size is None:
        kc, vc = k.clone(), v.clone()
    else:
        kc, vc, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=2,
                                                  generator=torch.Generator().manual_seed(seed))
    expected_k, expected_v = kc.clone(), vc.clone()
    for b, n in enumerate(news):
        for i in range(n):
            slot = _cache_slot(b, before[b] + i, table, page_size)
            expected_k[slot], expected_v[slot] = rows_k[b][i], rows_v[b][i]
    lens = torch.tensor(before, dtype=torch.int32, device=DEVICE)
    flashdecode.append_kv(kc, vc, k_new, v_new, lens, table, **kw)
    assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v)
    assert lens.tolist() == before  # not modified


@ci_examples(CHEAP)
@given(st.data())
def test_append_kv_8bit_fuzz(data):
    """append_kv quantising into an e4m3 / int8 cache (contiguous or paged, dense or varlen new tokens in any
    layout, some all zero): per-token-head scales are written (absmax / QMAX) and the written tokens read back
    within the format's step; a per-kv-head or scalar scale is read, never written, and the tokens saturate at
    +-QMAX; every other code and scale of the cache keeps its value."""
    draw = data.draw
    batch, hk, d, cap, dtype, seed, varlen, page_size, before, news = _append_case(draw)
    kv_dtype = draw(st.sampled_from([torch.float8_e4m3fn, torch.int8]))
    granularity = draw(st.sampled_from(["token", "head", "scalar"]))
    zero_every = draw(st.sampled_from([0, 3]))
    rows_k = [_values(seed + 2 * i, (n, hk, d), dtype, scale=4.0) for i, n in enumerate(news)]
    rows_v = [_values(seed + 2 * i + 1, (n, hk, d), dtype, scale=4.0) for i, n in enumerate(news)]
    if zero_every:
        for r in rows_k:
            r[::zero_every] = 0.0
    k_new, v_new, kw = _new_tokens(rows_k, rows_v, news, varlen)
    k_new, v_new = _laid_out(draw, k_new, keep_last=True), _laid_out(draw, v_new, keep_last=True)
    table = None
    if page_size is None:
        shape = (batch, cap, hk, d)
    else:  # the block table only: every cache slot starts at code 7 below
        slots = torch.zeros(batch, cap, 1, 1, device=DEVICE)
        pages, _, table = ref.paged_from_contiguous(slots, slots, page_size, extra_pages=2,
                                                    generator=torch.Generator().manual_seed(seed))
        shape = (pages.shape[0], page_size, hk, d)
    caches = [torch.full(shape, 7.0, device=DEVICE).to(kv_dtype) for _ in range(2)]
    if granularity == "token":
        scales = [torch.full(shape[:-1], -1.0, device=DEVICE) for _ in range(2)]
    else:
        scales = [(torch.rand(hk if granularity == "head" else (), generator=torch.Generator().manual_seed(seed + j))
                   * 0.05 + 0.005).to(DEVICE) for j in (0, 1)]
    given_scales = [x.clone() for x in scales]
    lens = torch.tensor(before, dtype=torch.int32, device=DEVICE)
    flashdecode.append_kv(*caches, k_new, v_new, lens, table, k_scale=scales[0], v_scale=scales[1], **kw)
    written = torch.zeros(shape[:2], dtype=torch.bool, device=DEVICE)
    want = [torch.zeros(shape, device=DEVICE) for _ in range(2)]
    for b, n in enumerate(news):
        for i in range(n):
            slot = _cache_slot(b, before[b] + i, table, page_size)
            written[slot] = True
            want[0][slot], want[1][slot] = rows_k[b][i].float(), rows_v[b][i].float()
    for cache, scale, given, x in zip(caches, scales, given_scales, want):
        assert (cache[~written].float() == 7).all()
        x = x[written]
        if granularity == "token":
            assert (scale[~written] == -1).all()
            got_scale = scale[written]
            torch.testing.assert_close(got_scale, x.abs().amax(-1) / QMAX[kv_dtype], rtol=1e-6, atol=0)
        else:
            assert torch.equal(scale, given)
            got_scale = scale.expand(x.shape[:-1])
            x = (x / got_scale[..., None]).clamp(-QMAX[kv_dtype], QMAX[kv_dtype]) * got_scale[..., None]
        err = (dequantize_cache(cache[written], got_scale) - x).abs()
        assert (err <= quant_step(kv_dtype, got_scale[..., None])(x)).all()
    assert lens.tolist() == before


# ----------------------------------------------------------------------------------------------------------------
# merge_states / merge_states_many
# ----------------------------------------------------------------------------------------------------------------

@ci_examples(CHEAP)
@given(st.data())
def test_merge_states_fuzz(data):
    draw = data.draw
    n = draw(st.integers(1, 6))
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    h, d = draw(st.integers(1, 4)), draw(st.sampled_from(HEADDIMS + [8, 100]))
    dtype, seed = draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31 - 1))
    outs = _values(seed, (n, *lead, h, d), dtype)
    lses = _values(seed + 1, (n, *lead, h), torch.float32, scale=draw(st.floats(0.1, 20.0)))
    empty = _values(seed + 2, lses.shape, torch.float32) > draw(st.floats(-1.0, 2.0))  # empty states: -inf
    lses = lses.masked_fill(empty, float("-inf"))
    outs = outs.masked_fill(empty[..., None], float("nan"))  # an empty state's o is never read
    as_list = draw(st.booleans())
    states = [_laid_out(draw, outs[i]) for i in range(n)] if as_list else _laid_out(draw, outs)
    weights = [_laid_out(draw, lses[i]) for i in range(n)] if as_list else _laid_out(draw, lses)
    o, lse = flashdecode.merge_states_many(states, weights)
    clean = outs.nan_to_num()
    _check_against(ref.merge_states_many_ref, o, lse, (clean, lses), factor=3.0)
    if n >= 2:
        o2, lse2 = flashdecode.merge_states(_laid_out(draw, outs[0]), _laid_out(draw, lses[0]),
                                            _laid_out(draw, outs[1]), _laid_out(draw, lses[1]))
        _check_against(ref.merge_states_ref, o2, lse2, (clean[0], lses[0], clean[1], lses[1]), factor=3.0)


@ci_examples(CHEAP)
@given(st.data())
def test_append_kv_device_metadata_fuzz(data):
    """Device-resident metadata is not validated (no sync), so the kernel alone must keep every access inside the
    tensors: block tables with ids outside [0, num_pages) (-1, num_pages, 2**30, ...) and lengths / cu_seqlens_new
    that run past the cache or k_new, decrease or start below 0. Caches and k_new sit between NaN guards; the
    guards must stay untouched, and every changed cache row must hold a row of k_new."""
    from unittest import mock

    draw = data.draw
    batch, page_size, pages_per_seq = draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 4, 8])), 3
    num_pages, total, hk, d = batch * pages_per_seq + 1, draw(st.integers(1, 12)), 1, 16
    bad_ids = st.sampled_from([-1, -2**31, num_pages, num_pages + 7, 2**30, 2**31 - 1])
    table = [[draw(st.one_of(st.integers(0, num_pages - 1), bad_ids)) for _ in range(pages_per_seq)]
             for _ in range(batch)]
    lens = [draw(st.integers(-20, pages_per_seq * page_size + 2)) for _ in range(batch)]
    cu = [draw(st.integers(-4, total + 4)) for _ in range(batch + 1)]
    seed = draw(st.integers(0, 2**31 - 1))
    pool = _values(seed, (2, num_pages + 2, page_size, hk, d), torch.float32)
    kc, vc = pool[0, 1:-1], pool[1, 1:-1]
    src = torch.full((2, total + 8, hk, d), float("nan"), device=DEVICE)
    src[:, 4: 4 + total] = _values(seed + 1, (2, total, hk, d), torch.float32)
    k_new, v_new = src[0, 4: 4 + total], src[1, 4: 4 + total]  # NaN rows on both sides of k_new
    before = pool.clone()
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    with mock.patch.object(checks, "host_resident", lambda x: False):
        flashdecode.append_kv(kc, vc, k_new, v_new, as_i32(lens), as_i32(table), cu_seqlens_new=as_i32(cu))
    assert not torch.isnan(pool).any()
    assert torch.equal(pool[:, [0, -1]], before[:, [0, -1]])  # guard pages
    changed = (pool != before).any(-1).any(-1)  # (2, pages, page_size) rows that changed
    rows = pool[0][changed[0]].reshape(-1, hk * d)
    if rows.numel():
        assert (rows[:, None, :] == k_new.reshape(1, total, hk * d)).all(-1).any(-1).all()


def _decode_ref_with_absent_keys(q, k, v, lens, present, **kw):
    """decode_ref where keys with present[b, j] False do not exist (their page id was out of range): the float64
    reference the kernels' masking must match. q (b, [sq,] h, d); present (b, capacity) bool."""
    q4 = q if q.dim() == 4 else q[:, None]
    sq = q4.shape[1]
    outs, lses = [], []
    for b, length in enumerate(lens.tolist()):
        mask = ref.visible_mask(sq, length, True, kw.get("window_size", (-1, -1))).to(present.device)
        mask = mask & present[b, None, :length]
        o, lse = ref._masked_attention(q4[b:b + 1], k[b:b + 1, :length], v[b:b + 1, :length], mask,
                                       kw.get("softmax_scale"), kw.get("softcap", 0.0))
        outs.append(o)
        lses.append(lse.transpose(1, 2))
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if q.dim() == 4 else (out[:, 0], lse[:, 0])


@ci_examples(MEDIUM)
@given(decode_cases(), st.data())
def test_flash_decode_device_page_ids_fuzz(case, data):
    """Device-resident block tables are not validated (no sync): ids outside [0, num_pages) must read as absent
    keys - never memory outside the cache - and every other key attends as usual."""
    from unittest import mock

    if case["page_size"] is None:
        case["page_size"] = 4
    q, k, v, kc, vc, table, lens = _decode_inputs(case)
    num_pages = kc.shape[0]
    bad_ids = st.sampled_from([-1, -2**31, num_pages, num_pages + 5, 2**30, 2**31 - 1])
    table = table.clone()
    present = torch.ones(case["batch"], table.shape[1] * case["page_size"], dtype=torch.bool, device=DEVICE)
    for b in range(case["batch"]):
        for j in range(table.shape[1]):
            if data.draw(st.integers(0, 3)) == 0:
                table[b, j] = data.draw(bad_ids)
                present[b, j * case["page_size"]: (j + 1) * case["page_size"]] = False
    scale, softcap, window = case["options"]
    kw = dict(softmax_scale=scale, softcap=softcap, window_size=window)
    with mock.patch.object(checks, "host_resident", lambda x: False):
        out, lse = flashdecode.flash_decode(q, kc, vc, lens, block_table=table, num_splits=case["num_splits"] or 2,
                                            return_lse=True, **kw)
    o64, lse64 = _decode_ref_with_absent_keys(q.double(), k.double(), v.double(), lens, present, **kw)
    o_same, lse_same = _decode_ref_with_absent_keys(q, k, v, lens, present, **kw)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-4, name="lse")
