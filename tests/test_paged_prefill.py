"""Prefill over a paged KV cache (flash_attn_varlen(..., block_table=, seqused_k=) and flash_attn_with_kvcache with
seqlen_q > 1) against the float64 reference (FlashAttention rule: 2x a same-dtype PyTorch implementation for out and
lse), bad input, and the device-side masking of metadata the host never checked.

CPU (Triton interpreter): small shapes in fp16/fp32 (the interpreter's one 32 x 32 tile). GPU (`gpu` marker):
larger shapes, pages of 16/64/256, bf16 too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import flash_attn_interface as fai
from flashdecode import reference as ref
from flashdecode.ops import attention as attn_ops
from flashdecode.ops import checks
from flashdecode.ops import paged_prefill as paged_ops
from helpers import DEVICE, HAS_CUDA, KERNEL_DTYPES, assert_fa_close, randn, run_sm90_compile_script

CASE_DTYPES = [torch.bfloat16] if HAS_CUDA else KERNEL_DTYPES


@pytest.fixture(autouse=True)
def _no_autotuning(monkeypatch):
    monkeypatch.setenv(attn_ops.AUTOTUNE_ENV, "0")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _cu(lengths):
    return _int32([0] + torch.tensor(lengths).cumsum(0).tolist())


def paged_inputs(gen, dtype, lens_q, lens_k, nheads, nheads_kv, headdim, page_size, extra_pages=3):
    """q packed (sum(lens_q), nheads, headdim), a cache of randomly permuted pages holding each sequence's lens_k keys
    (the rest of its pages random), the block table, cu_seqlens_q and seqused_k."""
    batch, cap = len(lens_q), max(max(lens_k), 1)
    k = randn(batch, cap, nheads_kv, headdim, gen=gen, dtype=dtype, device="cpu")
    v = randn(batch, cap, nheads_kv, headdim, gen=gen, dtype=dtype, device="cpu")
    k_pages, v_pages, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=extra_pages, generator=gen)
    q = randn(sum(lens_q), nheads, headdim, gen=gen, dtype=dtype)
    return q, k_pages.to(DEVICE), v_pages.to(DEVICE), table.to(DEVICE), _cu(lens_q), _int32(lens_k)


def check_paged(gen, dtype, lens_q, lens_k, nheads, nheads_kv, headdim, page_size, *, kernel_opts=None, **opts):
    """flash_attn_varlen over the paged cache against paged_prefill_ref in float64 and in dtype; returns (out, lse)."""
    q, kp, vp, table, cu_q, used = paged_inputs(gen, dtype, lens_q, lens_k, nheads, nheads_kv, headdim, page_size)
    out, lse = flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, max(lens_q), max(lens_k), block_table=table,
                                             seqused_k=used, return_lse=True, **(kernel_opts or {}), **opts)
    o64, lse64 = ref.paged_prefill_ref(q.double(), kp.double(), vp.double(), cu_q, used, table, **opts)
    o_same, lse_same = ref.paged_prefill_ref(q, kp, vp, cu_q, used, table, **opts)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (nheads, q.shape[0]) and lse.dtype == torch.float32
    assert_fa_close(out, o64, o_same, name="out")
    assert_fa_close(lse, lse64, lse_same, name="lse")
    return out, lse


# ----------------------------------------------------------------------------------------------------------------
# Forward against the reference (CPU-sized)
# ----------------------------------------------------------------------------------------------------------------

# new tokens per sequence (0 and 1 among them) and keys (new tokens included; 0 cached keys, no keys at all, fewer
# keys than new tokens: rows that see no key under causal)
LENS_Q = [5, 0, 1, 17, 3, 4]
LENS_K = [5, 9, 40, 37, 0, 2]


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_pages_gqa(gen, page_size, causal):
    out, lse = check_paged(gen, CASE_DTYPES[0], LENS_Q, LENS_K, 4, 2, 32, page_size, causal=causal)
    # sequence 4 has no keys: out 0 and lse -inf; under causal, sequence 5's first two rows see none either
    rows = slice(sum(LENS_Q[:4]), sum(LENS_Q[:5]))
    assert torch.all(out[rows] == 0) and torch.all(torch.isneginf(lse[:, rows]))


@pytest.mark.parametrize("opts", [
    dict(causal=True, window_size=(7, 0)),
    dict(window_size=(5, 3)),
    dict(causal=True, softcap=2.0),
    dict(causal=True, softmax_scale=0.3),
], ids=["causal-window", "window", "softcap", "scale"])
def test_windows_softcap_scale(gen, opts):
    check_paged(gen, CASE_DTYPES[0], [6, 1, 19], [30, 4, 45], 4, 1, 32, 16, **opts)


def _descriptor_config(q, k_pages, max_seqlen_k):
    """The resolved configuration with descriptors allowed (the interpreter runs them; off the GPU the resolver
    leaves them off)."""
    return dataclasses.replace(attn_ops.resolve_config(q, k_pages, k_pages, max_seqlen_k), fwd_tma=True)


@pytest.mark.parametrize("page_size", [32, 64, 3])
def test_descriptor_path(gen, page_size, monkeypatch):
    """Q / Out through descriptors; K / V too where pages hold whole KV blocks (32 and 64 with the interpreter's
    32-key blocks), through pointers otherwise (3); a block table the host never checked still masks absent pages
    by their ids (non-causal: the reference drops those keys)."""
    lens_q, lens_k = [5, 0, 33], [40, 7, 70]
    q, kp, vp, table, cu_q, used = paged_inputs(gen, CASE_DTYPES[0], lens_q, lens_k, 2, 1, 32, page_size)
    config = _descriptor_config(q, kp, 70)
    plans = len(paged_ops._PLANS)
    out, lse = flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, 33, 70, block_table=table, seqused_k=used,
                                             causal=True, config=config, return_lse=True)
    (plan,) = list(paged_ops._PLANS.values())[plans:]
    # the cache's layout allows descriptors; the kernel takes them for K/V where PAGE_SIZE % BLOCK_N == 0
    assert plan.kernel.constexprs["USE_TMA"]
    o64, lse64 = ref.paged_prefill_ref(q.double(), kp.double(), vp.double(), cu_q, used, table, causal=True)
    o_same, lse_same = ref.paged_prefill_ref(q, kp, vp, cu_q, used, table, causal=True)
    assert_fa_close(out, o64, o_same, name="out")
    assert_fa_close(lse, lse64, lse_same, name="lse")

    monkeypatch.setattr(checks, "host_resident", lambda x: False)  # as if on the device: not checked
    bad = table.clone()
    bad[2, 0] = kp.shape[0] + 1  # sequence 2 loses its first page's keys
    out = flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, 33, 70, block_table=bad, seqused_k=used,
                                        config=config)
    keys, values = ref.contiguous_from_paged(kp.double(), vp.double(), table)
    rows, kept = slice(5, 38), slice(page_size, 70)
    o64, _ = ref.attention_ref(q[None, rows].double(), keys[2:3, kept], values[2:3, kept])
    o_same, _ = ref.attention_ref(q[None, rows], keys[2:3, kept].to(q.dtype), values[2:3, kept].to(q.dtype))
    assert_fa_close(out[rows], o64[0], o_same[0], name="out without the absent page")


@pytest.mark.parametrize("dtype8, granularity, page_size", [
    (torch.float8_e4m3fn, "token", 16), (torch.int8, "token", 3), (torch.float8_e4m3fn, "head", 64),
    (torch.int8, "scalar", 16)])
def test_8bit_cache(gen, dtype8, granularity, page_size):
    """An 8-bit cache with its scales (as append_kv writes it): against the reference on the dequantised cache."""
    from quant_helpers import dequant, paged_quant_cache, quantize_float_cache

    lens_q, lens_k, dtype = [4, 1, 19], [30, 9, 45], CASE_DTYPES[0]
    batch, cap = len(lens_q), max(lens_k)
    kc, ks = quantize_float_cache(randn(batch, cap, 2, 32, gen=gen), dtype8, granularity)
    vc, vs = quantize_float_cache(randn(batch, cap, 2, 32, gen=gen), dtype8, granularity)
    kp, ks, vp, vs, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
    q = randn(sum(lens_q), 4, 32, gen=gen, dtype=dtype)
    cu_q, used = _cu(lens_q), _int32(lens_k)
    out, lse = flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, max(lens_q), max(lens_k), block_table=table,
                                             seqused_k=used, k_scale=ks, v_scale=vs, causal=True, return_lse=True)
    k_deq, v_deq = dequant(kp, ks), dequant(vp, vs)
    o64, lse64 = ref.paged_prefill_ref(q.double(), k_deq.double(), v_deq.double(), cu_q, used, table, causal=True)
    o_same, lse_same = ref.paged_prefill_ref(q, k_deq.to(dtype), v_deq.to(dtype), cu_q, used, table, causal=True)
    assert_fa_close(out, o64, o_same, name="out")
    assert_fa_close(lse, lse64, lse_same, name="lse")


def test_8bit_cache_needs_its_scales(gen):
    from quant_helpers import quantize_float_cache

    q, kp, vp, table, cu_q, used = paged_inputs(gen, torch.float16, [3], [6], 2, 1, 16, 4)
    k8, scale = quantize_float_cache(kp, torch.float8_e4m3fn, "head")
    call = dict(cu_seqlens_q=cu_q, cu_seqlens_k=None, max_seqlen_q=3, max_seqlen_k=6, block_table=table,
                seqused_k=used)
    with pytest.raises(ValueError, match="k_scale"):
        flashdecode.flash_attn_varlen(q, k8, k8, **call)
    with pytest.raises(ValueError, match="k_scale"):
        flashdecode.flash_attn_varlen(q, kp, vp, **call, k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError, match="k_scale"):
        flashdecode.flash_attn_varlen(q, k8, k8, **call, k_scale=torch.ones(3, device=DEVICE), v_scale=scale)


def test_fp32_odd_head_dim_mha(gen):
    check_paged(gen, torch.float32, [3, 11], [20, 11], 2, 2, 40, 3, causal=True)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(gen, per_batch):
    nheads, batch = 4, 3
    shape = (batch, nheads) if per_batch else (nheads,)
    slopes = (torch.rand(shape, generator=gen) * 0.3).to(DEVICE)
    check_paged(gen, CASE_DTYPES[0], [4, 9, 1], [21, 9, 33], nheads, 2, 32, 16, causal=True, alibi_slopes=slopes)


def test_sinks(gen):
    q, kp, vp, table, cu_q, used = paged_inputs(gen, CASE_DTYPES[0], [4, 7], [12, 30], 2, 1, 32, 16)
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    out, lse = flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, 7, 30, block_table=table, seqused_k=used,
                                             causal=True, sinks=sinks, return_lse=True)
    o64, lse64 = ref.paged_prefill_ref(q.double(), kp.double(), vp.double(), cu_q, used, table, causal=True)
    want_out, want_lse = flashdecode.apply_sinks(o64, lse64, sinks.double(), "varlen")
    o_same, lse_same = ref.paged_prefill_ref(q, kp, vp, cu_q, used, table, causal=True)
    same_out, same_lse = flashdecode.apply_sinks(o_same, lse_same, sinks, "varlen")
    assert_fa_close(out, want_out, same_out, name="out")
    assert_fa_close(lse, want_lse, same_lse, name="lse")


def test_cu_seqlens_k_gives_the_lengths(gen):
    """flash-attn 2's paged varlen form: cu_seqlens_k's differences are the key counts (no seqused_k)."""
    q, kp, vp, table, cu_q, used = paged_inputs(gen, CASE_DTYPES[0], [3, 5], [10, 5], 2, 1, 32, 16)
    out = fai.flash_attn_varlen_func(q, kp, vp, cu_q, _cu([10, 5]), 5, 10, causal=True, block_table=table)
    want = flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, 5, 10, block_table=table, seqused_k=used,
                                         causal=True)
    assert torch.equal(out, want)


def test_matches_the_contiguous_varlen_call(gen):
    """The same problem on a packed (contiguous) k/v gives the same answer to rounding."""
    lens_q, lens_k = [6, 2, 20], [6, 25, 33]
    q, kp, vp, table, cu_q, used = paged_inputs(gen, torch.float32, lens_q, lens_k, 2, 1, 32, 3)
    keys, values = ref.contiguous_from_paged(kp, vp, table)
    k = torch.cat([keys[i, :n] for i, n in enumerate(lens_k)])
    v = torch.cat([values[i, :n] for i, n in enumerate(lens_k)])
    paged = flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, 20, 33, block_table=table, seqused_k=used,
                                          causal=True)
    packed = flashdecode.flash_attn_varlen(q, k, v, cu_q, _cu(lens_k), 20, 33, causal=True)
    torch.testing.assert_close(paged, packed, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: new k/v appended to the pages, then attended
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size, seqlen_q, opts", [
    (16, 64, dict(causal=True)),  # a chunk long enough for the prefill kernel by length
    (3, 5, dict(window_size=(4, 2))),  # a mask only the prefill kernel expresses
], ids=["chunk", "window"])
def test_with_kvcache_appends_then_attends(gen, monkeypatch, page_size, seqlen_q, opts):
    import flashdecode.ops.paged_prefill as paged_ops

    ran = []
    forward = paged_ops._forward
    monkeypatch.setattr(paged_ops, "_forward", lambda *args: ran.append(1) or forward(*args))
    dtype, batch, nheads, nheads_kv, headdim = CASE_DTYPES[0], 2, 2, 1, 32
    cached = [7, 0]
    cap = max(cached) + seqlen_q + 5
    k_cont = randn(batch, cap, nheads_kv, headdim, gen=gen, dtype=dtype, device="cpu")
    v_cont = randn(batch, cap, nheads_kv, headdim, gen=gen, dtype=dtype, device="cpu")
    k_pages, v_pages, table = (x.to(DEVICE) for x in ref.paged_from_contiguous(k_cont, v_cont, page_size,
                                                                                 extra_pages=2, generator=gen))
    q = randn(batch, seqlen_q, nheads, headdim, gen=gen, dtype=dtype)
    k_new = randn(batch, seqlen_q, nheads_kv, headdim, gen=gen, dtype=dtype)
    v_new = randn(batch, seqlen_q, nheads_kv, headdim, gen=gen, dtype=dtype)
    out, lse = fai.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=_int32(cached),
                                           block_table=table, return_softmax_lse=True, **opts)
    assert ran == [1] and out.shape == q.shape and lse.shape == (batch, nheads, seqlen_q)
    keys, values = ref.contiguous_from_paged(k_pages, v_pages, table)
    for b, n in enumerate(cached):  # the new tokens landed after the cached ones
        assert torch.equal(keys[b, n:n + seqlen_q], k_new[b]) and torch.equal(values[b, n:n + seqlen_q], v_new[b])

    def reference(dt):
        outs, lses = zip(*(ref.attention_ref(q[b:b + 1].to(dt), keys[b:b + 1, :n + seqlen_q].to(dt),
                                             values[b:b + 1, :n + seqlen_q].to(dt), **opts)
                           for b, n in enumerate(cached)))
        return torch.cat(outs), torch.cat(lses)

    o64, lse64 = reference(torch.float64)
    o_same, lse_same = reference(dtype)
    assert_fa_close(out, o64, o_same, name="out")
    assert_fa_close(lse, lse64, lse_same, name="lse")


def test_with_kvcache_short_chunks_stay_on_the_decode_kernels(gen, monkeypatch):
    """A causal chunk below KVCACHE_PREFILL_MIN_QUERIES tokens runs the split-KV decode kernels, not the paged
    prefill kernel."""
    import flashdecode.ops.paged_prefill as paged_ops

    def refuse(*args, **kwargs):
        raise AssertionError("the paged prefill kernel ran")

    monkeypatch.setattr(paged_ops, "_forward", refuse)
    q = randn(1, 2, 2, 32, gen=gen, dtype=CASE_DTYPES[0])
    k_pages = randn(4, 16, 1, 32, gen=gen, dtype=CASE_DTYPES[0])
    out = fai.flash_attn_with_kvcache(q, k_pages, k_pages, cache_seqlens=_int32([20]), causal=True,
                                      block_table=_int32([[2, 0]]))
    assert out.shape == q.shape and not torch.isnan(out).any()


# ----------------------------------------------------------------------------------------------------------------
# Bad input: ValueError / TypeError naming the argument
# ----------------------------------------------------------------------------------------------------------------

def _bad_call(gen, **changes):
    """A valid paged call (two sequences, pages of 4) with ``changes`` applied to its arguments; validate=True so
    that metadata on a GPU is read too (host-resident metadata is checked either way)."""
    q, kp, vp, table, cu_q, used = paged_inputs(gen, torch.float16, [3, 2], [6, 9], 2, 1, 16, 4, extra_pages=0)
    args = dict(q=q, k=kp, v=vp, cu_seqlens_q=cu_q, cu_seqlens_k=None, max_seqlen_q=3, max_seqlen_k=9,
                block_table=table, seqused_k=used, validate=True)
    args.update(changes)
    return flashdecode.flash_attn_varlen(**args)


@pytest.mark.parametrize("changes, error, match", [
    (dict(cu_seqlens_q=_int32([1, 3, 5])), ValueError, "cu_seqlens_q"),  # not from 0
    (dict(cu_seqlens_q=_int32([0, 4, 3])), ValueError, "cu_seqlens_q"),  # decreasing
    (dict(cu_seqlens_q=_int32([0, 3, 7])), ValueError, "cu_seqlens_q"),  # past the packed rows
    (dict(cu_seqlens_q=_int32([0, 3, 4])), ValueError, "cu_seqlens_q"),  # short of them
    (dict(seqused_k=_int32([6, 13])), ValueError, "seqused_k"),  # above the 3 pages x 4 keys the table gives
    (dict(seqused_k=_int32([-1, 9])), ValueError, "seqused_k"),
    (dict(block_table=_int32([[0, 1, 2], [3, 4, 99]])), ValueError, "block_table"),  # id outside the cache
    (dict(block_table=_int32([[0, -1, 2], [3, 4, 5]])), ValueError, "block_table"),
    (dict(max_seqlen_q=2), ValueError, "max_seqlen_q"),
    (dict(max_seqlen_k=8), ValueError, "max_seqlen_k"),
    (dict(seqused_k=None), ValueError, "seqused_k"),
    (dict(seqused_k=_int32([6, 9, 1])), ValueError, "seqused_k"),
    (dict(seqused_k=_int32([6, 9]).long()), TypeError, "seqused_k"),
    (dict(block_table=_int32([[0, 1, 2], [3, 4, 5]]).long()), TypeError, "block_table"),
    (dict(block_table=_int32([[0, 1, 2]])), ValueError, "block_table"),
    (dict(max_seqlen_k=-1), TypeError, "max_seqlen_k"),
], ids=lambda x: None if isinstance(x, (dict, type)) else x)
def test_bad_metadata_raises_naming_it(gen, changes, error, match):
    # (the good table of _bad_call is a permutation of pages 0..5; bad ones replace it)
    with pytest.raises(error, match=match):
        _bad_call(gen, **changes)


def test_bad_tensors_raise_naming_them(gen):
    q, kp, vp, table, cu_q, used = paged_inputs(gen, torch.float16, [3], [6], 2, 1, 16, 4)
    call = dict(cu_seqlens_q=cu_q, cu_seqlens_k=None, max_seqlen_q=3, max_seqlen_k=6, block_table=table,
                seqused_k=used)
    with pytest.raises(TypeError, match="k_cache"):
        flashdecode.flash_attn_varlen(q, kp.float(), vp, **call)
    with pytest.raises(ValueError, match="k_cache"):
        flashdecode.flash_attn_varlen(q, kp[:, :, :, :8], vp[:, :, :, :8], **call)
    with pytest.raises(ValueError, match="nheads"):
        flashdecode.flash_attn_varlen(q[:, :1].repeat(1, 3, 1), torch.cat([kp, kp], 2), torch.cat([vp, vp], 2),
                                      **call)
    with pytest.raises(ValueError, match="strides"):
        flashdecode.flash_attn_varlen(q, kp, vp.transpose(0, 1).contiguous().transpose(0, 1), **call)
    with pytest.raises(ValueError, match="q_descale"):
        flashdecode.flash_attn_varlen(q, kp, vp, **call, q_descale=torch.ones(1, 1, device=DEVICE))


def test_gradients_are_refused(gen):
    q, kp, vp, table, cu_q, used = paged_inputs(gen, torch.float16, [3], [6], 2, 1, 16, 4)
    with pytest.raises(ValueError, match="forward only"):
        flashdecode.flash_attn_varlen(q.requires_grad_(), kp, vp, cu_q, None, 3, 6, block_table=table,
                                      seqused_k=used)
    with torch.no_grad():  # fine without autograd
        flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, 3, 6, block_table=table, seqused_k=used)


def test_seqused_k_without_block_table_raises(gen):
    q = randn(4, 2, 16, gen=gen, dtype=torch.float16)
    cu = _int32([0, 4])
    with pytest.raises(ValueError, match="seqused_k"):
        flashdecode.flash_attn_varlen(q, q, q, cu, cu, 4, 4, seqused_k=_int32([4]))


# ----------------------------------------------------------------------------------------------------------------
# Device-resident metadata: never read on the host unless validate=True; bad values masked inside the kernel
# ----------------------------------------------------------------------------------------------------------------

@pytest.fixture
def device_metadata(monkeypatch):
    """Metadata treated as device-resident (CPU interpreter tensors standing in for GPU ones); returns a list that
    records each host copy of it."""
    copies = []
    to_host = checks.to_host_once

    def counting(*tensors):
        copies.append(len(tensors))
        return to_host(*tensors)
    monkeypatch.setattr(checks, "host_resident", lambda x: False)
    monkeypatch.setattr(checks, "to_host_once", counting)
    return copies


def test_device_metadata_is_not_read_unless_validate(gen, device_metadata):
    q, kp, vp, table, cu_q, used = paged_inputs(gen, torch.float16, [3, 2], [6, 9], 2, 1, 16, 4)
    call = dict(block_table=table, seqused_k=used)
    flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, 3, 9, **call)
    assert device_metadata == []
    with pytest.raises(ValueError, match="max_seqlen_k"):
        flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, 3, 8, validate=True, **call)
    assert device_metadata == [3]  # one copy of cu_seqlens_q, seqused_k and block_table together
    bad = table.clone()
    bad[1, 2] = kp.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]"):
        flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, 3, 9, validate=True, block_table=bad, seqused_k=used)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        flashdecode.flash_attn_varlen(q, kp, vp, _int32([0, 6, 5]), None, 3, 9, validate=True, **call)


def test_unchecked_bad_pages_are_absent_keys(gen, device_metadata):
    """Ids outside the cache (a table the host never checked): those keys are masked, nothing outside the cache is
    read, no NaN; lengths past the table are clamped to it. Non-causal, so the reference drops those keys."""
    page, lens_q, lens_k = 4, [3, 5], [10, 12]
    q, kp, vp, table, cu_q, used = paged_inputs(gen, torch.float32, lens_q, lens_k, 2, 1, 16, page, extra_pages=0)
    bad = table.clone()
    bad[0, 1] = kp.shape[0] + 7  # keys 4..7 of sequence 0
    bad[1, 0] = -3  # keys 0..3 of sequence 1
    used_long = _int32([10, 40])  # sequence 1 asks past its 3 pages: clamped to 12 keys
    out, lse = flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, 5, 40, block_table=bad, seqused_k=used_long,
                                             return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    keys, values = ref.contiguous_from_paged(kp.double(), vp.double(), table)
    kept = [torch.cat([torch.arange(0, 4), torch.arange(8, 10)]), torch.arange(4, 12)]
    for b, idx in enumerate(kept):
        rows = slice(sum(lens_q[:b]), sum(lens_q[:b + 1]))
        o64, lse64 = ref.attention_ref(q[None, rows].double(), keys[b:b + 1, idx], values[b:b + 1, idx])
        torch.testing.assert_close(out[rows].double(), o64[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[:, rows].double(), lse64[0], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# sm_90 compile on the CPU (Triton's ptxas, no GPU)
# ----------------------------------------------------------------------------------------------------------------

_PAGED_COMPILE_SCRIPT = '''
import sys
from flashdecode.kernels.fwd import attn_fwd_kernel  # before helpers (its conftest sets TRITON_INTERPRET)
sys.path.insert(0, "tests")
from helpers import compile_for_sm90, spilled_bytes
S4 = ("i32",) * 4
types = dict(Q="*bf16", K="*bf16", V="*bf16", Out="*bf16", Lse="*fp32", cu_seqlens_q="*i32", q_strides=S4,
             k_strides=S4, v_strides=S4, o_strides=S4, lse_strides=("i32", "i32"),
             logit_scales=("fp32", "fp32"), kv_pages=("*i32", "*i32", ("i32", "i32"), "i32", "i32"))
bulk = {}
for page in (16, 128):  # K/V by pointers, one page id per key / by descriptors, one page id per 128-key block
    consts = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, IS_VARLEN=True, HAS_LEFT=False, HAS_RIGHT=True, SOFTCAP=False,
                  DOT_PRECISION="tf32", BLOCK_M=128, BLOCK_N=128, USE_TMA=True, PAGE_SIZE=page, cu_seqlens_k=None,
                  fp8_descales=None, AlibiSlopes=None)
    kernel = compile_for_sm90(attn_fwd_kernel, types, consts, num_stages=3, num_warps=8)
    ptx = kernel.asm["ptx"]
    assert "wgmma" in ptx, f"paged forward (pages of {page}) not on wgmma"
    assert kernel.metadata.shared <= 227 * 1024
    bulk[page] = ptx.count("cp.async.bulk.tensor")
assert spilled_bytes(kernel) == 0, "paged forward with descriptors spills"
assert bulk[128] > bulk[16], "K/V of whole-block pages not through descriptors"
print("compiled")
'''


def test_paged_forward_compiles_for_hopper_without_a_gpu():
    """The paged forward (pages smaller than a KV block: pointers; pages of whole blocks: descriptors) compiles for
    sm_90 with its dots on wgmma and within shared memory; whole-block pages without spills."""
    run_sm90_compile_script(_PAGED_COMPILE_SCRIPT)


# ----------------------------------------------------------------------------------------------------------------
# GPU: larger shapes, bf16, pages of 16 / 64 / 256
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(), dict(causal=True, window_size=(300, 0), softcap=30.0)],
                         ids=["causal", "full", "window-softcap"])
def test_gpu_ragged_pages(gen, dtype, page_size, opts):
    lens_q = [512, 0, 1, 777, 128, 2048]
    lens_k = [512, 3000, 1, 1800, 4500, 2048 + 333]
    check_paged(gen, dtype, lens_q, lens_k, 32, 8, 128, page_size, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim, nheads, nheads_kv", [(64, 16, 16), (256, 8, 1), (80, 8, 2)])
def test_gpu_head_dims(gen, headdim, nheads, nheads_kv):
    check_paged(gen, torch.bfloat16, [300, 1, 1025], [300, 700, 4000], nheads, nheads_kv, headdim, 16, causal=True)


@pytest.mark.gpu
def test_gpu_with_kvcache_chunk_and_repeated_calls(gen):
    """A 512-token chunk through flash_attn_with_kvcache (the prefill kernel), twice: the second call takes the
    recorded direct launch and gives the same bits."""
    dtype, batch, sq, cached = torch.bfloat16, 3, 512, [0, 1000, 5000]
    cap = max(cached) + sq
    k_cont = randn(batch, cap, 8, 128, gen=gen, dtype=dtype, device="cpu")
    k_pages, v_pages, table = (x.to(DEVICE) for x in ref.paged_from_contiguous(k_cont, k_cont.flip(0), 64,
                                                                                 generator=gen))
    q = randn(batch, sq, 32, 128, gen=gen, dtype=dtype)
    k_new = randn(batch, sq, 8, 128, gen=gen, dtype=dtype)
    lens = _int32(cached)
    out = fai.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, k_new, cache_seqlens=lens, block_table=table,
                                      causal=True)
    again = fai.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens + sq, block_table=table,
                                        causal=True)
    assert torch.equal(out, again)
    keys, values = ref.contiguous_from_paged(k_pages, v_pages, table)
    for b, n in enumerate(cached):
        o64, _ = ref.attention_ref(q[b:b + 1].double(), keys[b:b + 1, :n + sq].double(),
                                   values[b:b + 1, :n + sq].double(), causal=True)
        o_same, _ = ref.attention_ref(q[b:b + 1], keys[b:b + 1, :n + sq], values[b:b + 1, :n + sq], causal=True)
        assert_fa_close(out[b:b + 1], o64, o_same)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype8", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("page_size", [16, 256])
def test_gpu_8bit_cache(gen, dtype8, page_size):
    from quant_helpers import dequant, paged_quant_cache, quantize_float_cache

    lens_q, lens_k = [512, 1, 700], [3000, 1, 700]
    batch, cap = len(lens_q), max(lens_k)
    kc, ks = quantize_float_cache(randn(batch, cap, 8, 128, gen=gen), dtype8, "token")
    vc, vs = quantize_float_cache(randn(batch, cap, 8, 128, gen=gen), dtype8, "token")
    kp, ks, vp, vs, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
    q = randn(sum(lens_q), 32, 128, gen=gen, dtype=torch.bfloat16)
    cu_q, used = _cu(lens_q), _int32(lens_k)
    out, lse = flashdecode.flash_attn_varlen(q, kp, vp, cu_q, None, max(lens_q), max(lens_k), block_table=table,
                                             seqused_k=used, k_scale=ks, v_scale=vs, causal=True, return_lse=True)
    k_deq, v_deq = dequant(kp, ks), dequant(vp, vs)
    o64, lse64 = ref.paged_prefill_ref(q.double(), k_deq.double(), v_deq.double(), cu_q, used, table, causal=True)
    o_same, lse_same = ref.paged_prefill_ref(q, k_deq.to(q.dtype), v_deq.to(q.dtype), cu_q, used, table, causal=True)
    assert_fa_close(out, o64, o_same, name="out")
    assert_fa_close(lse, lse64, lse_same, name="lse")
