"""flashdecode.flash_attn_interface: flash-attn 2.x's functions against the float64 reference, over the parameter
space of flash-attn's own tests (test_flash_attn_output, test_flash_attn_varlen_output, test_flash_attn_kvcache) at
small sizes: packed variants and gradients, GQA, causal/local, softcap, rotary in both layouts (and its position
rule for q), cache_batch_idx, cache_leftpad, paged caches, appending new tokens, int and tensor cache_seqlens,
num_splits; every unsupported argument raises naming it, before any kernel runs.

CPU (Triton interpreter): fp16; the FlashAttention rule (2x forward, 3x gradients and decode).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from flashdecode import flash_attn_interface as fai
from flashdecode import reference as ref
from flashdecode.ops import attention as attn_ops
from helpers import DEVICE, assert_fa_close, randn

DTYPE = torch.float16


@pytest.fixture(autouse=True)
def _fixed_config(monkeypatch):
    """No autotuning on the GPU (fewer compilations): the module flag, or the environment variable read when a
    configuration is resolved, whichever this version of ops/attention.py uses."""
    monkeypatch.setattr(attn_ops, "AUTOTUNE", False, raising=False)
    monkeypatch.setenv("FLASHDECODE_AUTOTUNE", "0")


def test_star_import_gives_flash_attn_names():
    namespace = {}
    exec("from flashdecode.flash_attn_interface import *", namespace)
    for name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
                 "flash_attn_with_kvcache"):
        assert callable(namespace[name]), name


EMPTY = inspect.Parameter.empty
_COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
           ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_VARLEN = [("cu_seqlens_q", EMPTY), ("cu_seqlens_k", EMPTY), ("max_seqlen_q", EMPTY),
           ("max_seqlen_k", EMPTY)]
# flash-attn 2.x's public signatures (flash_attn/flash_attn_interface.py): names, order and defaults
FLASH_ATTN_SIGNATURES = {
    "flash_attn_func": [("q", EMPTY), ("k", EMPTY), ("v", EMPTY)] + _COMMON,
    "flash_attn_qkvpacked_func": [("qkv", EMPTY)] + _COMMON,
    "flash_attn_kvpacked_func": [("q", EMPTY), ("kv", EMPTY)] + _COMMON,
    "flash_attn_varlen_func": [("q", EMPTY), ("k", EMPTY), ("v", EMPTY)] + _VARLEN + _COMMON + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", EMPTY), ("cu_seqlens", EMPTY), ("max_seqlen", EMPTY)] + _COMMON,
    "flash_attn_varlen_kvpacked_func": [("q", EMPTY), ("kv", EMPTY)] + _VARLEN + _COMMON,
    "flash_attn_with_kvcache": [
        ("q", EMPTY), ("k_cache", EMPTY), ("v_cache", EMPTY), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("fn", sorted(FLASH_ATTN_SIGNATURES))
def test_signatures_match_flash_attn(fn):
    params = inspect.signature(getattr(fai, fn)).parameters.values()
    assert [(p.name, p.default) for p in params] == FLASH_ATTN_SIGNATURES[fn]


# ----------------------------------------------------------------------------------------------------------------
# Dense and varlen (test_flash_attn_output / test_flash_attn_varlen_output)
# ----------------------------------------------------------------------------------------------------------------

def _assert_matches(ref_fn, inputs, dout, out, lse, grads):
    """out, lse and the gradients (dq, dk, dv) of an interface call vs ref_fn(q, k, v) -> (out, lse) run in
    float64 (the oracle) and in the inputs' dtype (the FlashAttention rule's baseline)."""
    def reference(xs):
        leaves = [x.detach().requires_grad_() for x in xs]
        o, l = ref_fn(*leaves)
        o.backward(dout.to(o.dtype))
        return o, l, [x.grad for x in leaves]

    o64, lse64, g64 = reference([x.double() for x in inputs])
    o_same, lse_same, g_same = reference(inputs)
    assert_fa_close(out, o64, o_same)
    assert_fa_close(lse, lse64, lse_same, atol=1e-4, name="lse")
    for name, g, g6, gs in zip("qkv", grads, g64, g_same):
        assert_fa_close(g, g6, gs, factor=3.0, atol=1e-4, name=f"d{name}")


DENSE_CASES = [
    dict(sq=17, sk=17, causal=True, window=(-1, -1), softcap=0.0, deterministic=False),
    dict(sq=9, sk=23, causal=False, window=(5, 2), softcap=0.0, deterministic=True),
    dict(sq=23, sk=9, causal=True, window=(-1, -1), softcap=2.5, deterministic=False),
]


# qkv packing needs seqlen_q == seqlen_k
@pytest.mark.parametrize("packing, case", [(p, c) for p in ("none", "kv", "qkv") for c in DENSE_CASES
                                           if p != "qkv" or c["sq"] == c["sk"]])
def test_flash_attn_func_and_packed_match_reference(gen, packing, case):
    b, h, hk, d = 2, 4, 2 if packing != "qkv" else 4, 40
    q = randn(b, case["sq"], h, d, gen=gen, dtype=DTYPE)
    k = randn(b, case["sk"], hk, d, gen=gen, dtype=DTYPE)
    v = randn(b, case["sk"], hk, d, gen=gen, dtype=DTYPE)
    dout = randn(b, case["sq"], h, d, gen=gen, dtype=DTYPE)
    opts = (case["causal"], case["window"], case["softcap"])

    def run(q, k, v):
        """The interface function for this packing, positional arguments like flash-attn's tests; grads land in
        the packed leaves."""
        if packing == "qkv":
            qkv = torch.stack([q, k, v], dim=2).detach().requires_grad_()
            out, lse, s = fai.flash_attn_qkvpacked_func(qkv, 0.0, None, case["causal"], case["window"],
                                                        case["softcap"], None, case["deterministic"], True)
            out.backward(dout)
            return out, lse, s, list(qkv.grad.unbind(2))
        if packing == "kv":
            q = q.detach().requires_grad_()
            kv = torch.stack([k, v], dim=2).detach().requires_grad_()
            out, lse, s = fai.flash_attn_kvpacked_func(q, kv, 0.0, None, case["causal"], case["window"],
                                                       case["softcap"], None, case["deterministic"], True)
            out.backward(dout)
            return out, lse, s, [q.grad, *kv.grad.unbind(2)]
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse, s = fai.flash_attn_func(*leaves, 0.0, None, case["causal"], case["window"], case["softcap"],
                                          None, case["deterministic"], True)
        out.backward(dout)
        return out, lse, s, [x.grad for x in leaves]

    out, lse, s_dmask, grads = run(q, k, v)
    assert s_dmask.shape == (0,) and lse.shape == (b, h, case["sq"]) and lse.dtype == torch.float32

    _assert_matches(lambda *xs: ref.attention_ref(*xs, opts[0], None, opts[1], opts[2]), [q, k, v], dout, out,
                    lse, grads)
    plain = fai.flash_attn_func(q, k, v, causal=case["causal"], window_size=case["window"], softcap=case["softcap"])
    assert torch.is_tensor(plain) and plain.shape == q.shape


@pytest.mark.parametrize("packing", ["none", "kv", "qkv"])
def test_flash_attn_varlen_func_and_packed_match_reference(gen, packing):
    h, hk, d = 4, 2 if packing != "qkv" else 4, 32
    lens_q = [5, 0, 17]
    lens_k = lens_q if packing == "qkv" else [9, 3, 17]
    cu_q = torch.tensor([0, 5, 5, 22], dtype=torch.int32, device=DEVICE)
    cu_k = cu_q if packing == "qkv" else torch.tensor([0, 9, 12, 29], dtype=torch.int32, device=DEVICE)
    q = randn(sum(lens_q), h, d, gen=gen, dtype=DTYPE)
    k = randn(sum(lens_k), hk, d, gen=gen, dtype=DTYPE)
    v = randn(sum(lens_k), hk, d, gen=gen, dtype=DTYPE)
    dout = randn(sum(lens_q), h, d, gen=gen, dtype=DTYPE)
    causal, window = True, (7, -1)
    if packing == "qkv":
        qkv = torch.stack([q, k, v], dim=1).requires_grad_()
        out, lse, _ = fai.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 17, causal=causal, window_size=window,
                                                           return_attn_probs=True)
        out.backward(dout)
        grads = qkv.grad.unbind(1)
    elif packing == "kv":
        ql, kv = q.clone().requires_grad_(), torch.stack([k, v], dim=1).requires_grad_()
        out, lse, _ = fai.flash_attn_varlen_kvpacked_func(ql, kv, cu_q, cu_k, 17, 17, causal=causal,
                                                          window_size=window, return_attn_probs=True)
        out.backward(dout)
        grads = [ql.grad, *kv.grad.unbind(1)]
    else:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse, _ = fai.flash_attn_varlen_func(*leaves, cu_q, cu_k, 17, 17, 0.0, None, causal, window,
                                                 return_attn_probs=True)
        out.backward(dout)
        grads = [x.grad for x in leaves]
    assert lse.shape == (h, sum(lens_q))

    _assert_matches(lambda *xs: ref.attention_varlen_ref(*xs, cu_q, cu_k, causal, None, window), [q, k, v], dout,
                    out, lse, grads)


# ----------------------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache (test_flash_attn_kvcache)
# ----------------------------------------------------------------------------------------------------------------

def rotary_ref(x, cos, sin, positions, interleaved):
    """Rotary embedding on x (b, s, h, d) at integer positions (b, s), written with complex numbers (an
    independent formulation): pairs (2i, 2i+1) (interleaved) or (i, i + rd/2) are the real/imaginary parts."""
    rd = 2 * cos.shape[1]
    angle = torch.complex(cos.double(), sin.double())[positions.long()].unsqueeze(2)  # (b, s, 1, rd/2)
    xr = x[..., :rd].double()
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], rd // 2, 2).contiguous()) * angle
        rotated = torch.view_as_real(z).flatten(-2)
    else:
        z = torch.complex(xr[..., : rd // 2], xr[..., rd // 2:]) * angle
        rotated = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rotated, x[..., rd:].double()], dim=-1).to(x.dtype)


KVCACHE_CASES = [
    # seqlen_q, seqlen_new, causal, window, rotary (None / interleaved bool), layout, int lengths, num_splits
    dict(sq=1, new=1, causal=True, rotary=True),
    dict(sq=1, new=0, causal=False, window=(11, -1), num_splits=3),
    dict(sq=3, new=3, causal=True, rotary=False, layout="paged"),
    dict(sq=3, new=3, causal=False, rotary=True),  # non-causal: q rotated at cache_seqlens for every token
    dict(sq=4, new=2, causal=False, rotary=False, layout="batch_idx"),
    dict(sq=2, new=2, causal=True, window=(6, 0), layout="leftpad", rotary=True),
    dict(sq=1, new=1, causal=False, layout="leftpad_batch_idx", int_lens=False, num_splits=2),
    dict(sq=2, new=2, causal=True, int_lens=True, rotary=False, softcap=3.0, num_splits=1),
    dict(sq=1, new=0, causal=True, layout="paged", num_splits=0),
    dict(sq=1, new=1, causal=True, window=(3, 3), rotary=True, layout="paged"),  # window: q positions consecutive
    dict(sq=1, new=1, causal=True, rotary=False, hk=1, d=40),  # MQA, head dim not a power of two
    dict(sq=5, new=5, causal=True, rotary=True, hk=4, layout="paged"),  # MHA, several new tokens per page
]


@pytest.mark.parametrize("case", KVCACHE_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_flash_attn_with_kvcache_matches_reference(gen, case):
    b, h, cap, rd = 3, 4, 37, 16
    hk, d = case.get("hk", 2), case.get("d", 32)
    sq, new, causal = case["sq"], case["new"], case["causal"]
    window, layout, rotary = case.get("window", (-1, -1)), case.get("layout", "contiguous"), case.get("rotary")
    batch_cache = b + 2 if "batch_idx" in layout else b
    q = randn(b, sq, h, d, gen=gen, dtype=DTYPE)
    k_cache = randn(batch_cache, cap, hk, d, gen=gen, dtype=DTYPE)
    v_cache = randn(batch_cache, cap, hk, d, gen=gen, dtype=DTYPE)
    k_new = randn(b, new, hk, d, gen=gen, dtype=DTYPE) if new else None
    v_new = randn(b, new, hk, d, gen=gen, dtype=DTYPE) if new else None
    if case.get("int_lens"):
        lens_list = [cap - new - 4] * b
        cache_seqlens = lens_list[0]
    else:
        lens_list = torch.randint(0, cap - new + 1, (b,), generator=gen).tolist()
        lens_list[0] = cap - new  # one sequence fills the cache
        cache_seqlens = torch.tensor(lens_list, dtype=torch.int32, device=DEVICE)
    rows = list(range(b))
    kw = {}
    if "batch_idx" in layout:
        rows = torch.randperm(batch_cache, generator=gen)[:b].tolist()
        kw["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    leftpad = [0] * b
    if "leftpad" in layout:
        leftpad = [torch.randint(0, n + 1, (1,), generator=gen).item() for n in lens_list]
        kw["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=DEVICE)
    if rotary is not None:  # rows for every position of the cache's capacity (paged: pages x page size)
        angle = torch.rand(cap + 3, rd // 2, generator=gen, dtype=torch.float64) * 2 * torch.pi
        kw.update(rotary_cos=torch.cos(angle).to(DEVICE, DTYPE), rotary_sin=torch.sin(angle).to(DEVICE, DTYPE),
                  rotary_interleaved=rotary)

    # the reference: rotate, append into a copy of the cache, attend per sequence over keys [leftpad, len + new)
    lens_t = torch.tensor(lens_list)
    q_ro, k_ro = q, k_new
    if rotary is not None:
        consecutive = causal or window != (-1, -1)
        pos_q = lens_t[:, None] + (torch.arange(sq) if consecutive else torch.zeros(sq, dtype=torch.long))
        q_ro = rotary_ref(q, kw["rotary_cos"], kw["rotary_sin"], pos_q, rotary)
        if new:
            k_ro = rotary_ref(k_new, kw["rotary_cos"], kw["rotary_sin"], lens_t[:, None] + torch.arange(new), rotary)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    for i, r in enumerate(rows):
        if new:
            k_ref[r, lens_list[i]:lens_list[i] + new] = k_ro[i]
            v_ref[r, lens_list[i]:lens_list[i] + new] = v_new[i]

    def reference(dtype):
        outs, lses = [], []
        for i, r in enumerate(rows):
            keys = slice(leftpad[i], lens_list[i] + new)
            o, l = ref.attention_ref(q_ro[i:i + 1].to(dtype), k_ref[r:r + 1, keys].to(dtype),
                                     v_ref[r:r + 1, keys].to(dtype), causal, None, window, case.get("softcap", 0.0))
            outs.append(o[0])
            lses.append(l[0])
        return torch.stack(outs), torch.stack(lses)

    if layout == "paged":
        k_in, v_in, kw["block_table"] = ref.paged_from_contiguous(k_cache, v_cache, 5, extra_pages=3, generator=gen)
    else:
        k_in, v_in = k_cache, v_cache
    out, lse = fai.flash_attn_with_kvcache(q, k_in, v_in, k_new, v_new, cache_seqlens=cache_seqlens, causal=causal,
                                           window_size=window, softcap=case.get("softcap", 0.0),
                                           num_splits=case.get("num_splits", 0), return_softmax_lse=True, **kw)
    o64, lse64 = reference(torch.float64)
    o_same, lse_same = reference(DTYPE)
    assert out.shape == q.shape and lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-4, name="lse")
    # the cache was updated in place with the rotated new keys and the new values
    if layout == "paged":
        k_in, v_in = ref.contiguous_from_paged(k_in, v_in, kw["block_table"], cap)
    assert torch.allclose(k_in.float(), k_ref.float(), atol=2e-3, rtol=1e-3)
    assert torch.equal(v_in, v_ref)


def test_kvcache_without_lengths_reads_the_full_cache(gen):
    q = randn(2, 1, 2, 16, gen=gen, dtype=DTYPE)
    k = randn(2, 21, 1, 16, gen=gen, dtype=DTYPE)
    v = randn(2, 21, 1, 16, gen=gen, dtype=DTYPE)
    out = fai.flash_attn_with_kvcache(q, k, v)
    o64, _ = ref.attention_ref(q.double(), k.double(), v.double())
    o_same, _ = ref.attention_ref(q, k, v)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# Unsupported arguments and combinations: ValueError naming them, nothing written
# ----------------------------------------------------------------------------------------------------------------

def _kvcache_inputs(gen):
    q = randn(2, 1, 2, 16, gen=gen, dtype=DTYPE)
    k_cache = randn(2, 8, 1, 16, gen=gen, dtype=DTYPE)
    v_cache = randn(2, 8, 1, 16, gen=gen, dtype=DTYPE)
    k_new = randn(2, 1, 1, 16, gen=gen, dtype=DTYPE)
    return q, k_cache, v_cache, k_new


@pytest.mark.parametrize("kwargs, match", [
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),  # (nheads,) is (2,)
    (dict(rotary_cos=torch.ones(8, 9), rotary_sin=torch.ones(8, 9)), "rotary_dim"),  # 18 > headdim 16
    (dict(rotary_cos=torch.ones(4, 4), rotary_sin=torch.ones(4, 4)), "rotary_cos"),  # fewer rows than the cache
    (dict(rotary_cos=torch.ones(8, 4)), "rotary_sin"),
    (dict(cache_seqlens=8), "capacity"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32), cache_leftpad=torch.zeros(2, dtype=torch.int32)),
     "block_table"),
    (dict(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int64)), "cache_batch_idx"),
    (dict(cache_leftpad=torch.zeros(3, dtype=torch.int32)), "cache_leftpad"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32), batch_strided=True), "batch stride"),
    (dict(num_splits=-1), "num_splits"),
    (dict(num_splits=1025), "num_splits"),  # flash_decode's bound, checked before the append
    (dict(causal=False, window_size=(2, 1), q_len=3), "window_size"),
    (dict(k_only=True), "k and v"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(q_len=0), "q must hold"),
    (dict(k_dtype=torch.float32), "k must have dtype"),
    (dict(q_dtype=torch.float32), "k_cache must have dtype"),
    (dict(k_heads=2), "nheads_k"),
    (dict(cache_seqlens=None), "cache_seqlens"),
])
def test_kvcache_bad_arguments_raise_before_writing(gen, kwargs, match):
    q, k_cache, v_cache, k_new = _kvcache_inputs(gen)
    kwargs = dict(kwargs)
    q = randn(2, kwargs.pop("q_len", 1), 2, 16, gen=gen, dtype=DTYPE)
    v_new = None if kwargs.pop("k_only", False) else k_new.clone()
    if "k_dtype" in kwargs:
        k_new = k_new.to(kwargs.pop("k_dtype"))
    if "q_dtype" in kwargs:
        q = q.to(kwargs.pop("q_dtype"))
    if kwargs.pop("batch_strided", False):  # every other row of a bigger cache: not readable as one-token pages
        k_cache, v_cache = (randn(4, 8, 1, 16, gen=gen, dtype=DTYPE)[::2] for _ in range(2))
    if "k_heads" in kwargs:
        k_new = k_new.expand(-1, -1, kwargs.pop("k_heads"), -1)
        v_new = k_new
    kwargs.setdefault("cache_seqlens", 3)
    kwargs = {name: (x.to(DEVICE) if torch.is_tensor(x) else x) for name, x in kwargs.items()}
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises((ValueError, TypeError), match=match):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_kvcache_kept_checks_never_serve_a_stale_decision(gen, device_resident, monkeypatch):
    """A repeated call skips the wrapper's checks (kept per key, as for CUDA metadata): the same call gives the same
    answer, and a change of an int cache_seqlens, a dtype, a layout or an option is checked again."""
    checked, full_path = [], fai._checked_kvcache_call
    monkeypatch.setattr(fai, "_checked_kvcache_call", lambda *a: checked.append(1) or full_path(*a))
    q, k_cache, v_cache, k_new = _kvcache_inputs(gen)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)

    def call(q=q, k=k_new, **kwargs):
        kc, vc = k_cache.clone(), v_cache.clone()
        kwargs.setdefault("cache_seqlens", lens)
        return fai.flash_attn_with_kvcache(q, kc, vc, k, k.clone(), **kwargs), kc
    (first, kc1), (again, kc2) = call(), call()
    assert torch.equal(first, again) and torch.equal(kc1, kc2) and len(checked) == 1  # the second call: kept
    assert torch.equal(call(cache_seqlens=3)[0], call(cache_seqlens=3)[0])
    with pytest.raises(ValueError, match="capacity"):
        call(cache_seqlens=8)
    with pytest.raises(TypeError, match="k must have dtype"):
        call(k=k_new.float())
    with pytest.raises(ValueError, match="softcap"):
        call(softcap=-1.0)
    strided_q = randn(2, 2, 2, 16, gen=gen, dtype=DTYPE)[:, :1].copy_(q)  # same values, another batch stride
    assert torch.allclose(call(q=strided_q)[0], first, atol=1e-3)
    no_append = fai.flash_attn_with_kvcache(q, kc1, kc1.clone(), cache_seqlens=lens + 1)
    assert torch.equal(no_append, fai.flash_attn_with_kvcache(q, kc1, kc1.clone(), cache_seqlens=lens + 1))


def _kvcache_reference(q, k_cache, v_cache, k_new, v_new, lens, causal: bool, dtype):
    """flash_attn_with_kvcache's out in ``dtype``: the new tokens appended into a copy of the contiguous cache, then
    each sequence attends to its first lens[b] + seqlen_new keys."""
    new = 0 if k_new is None else k_new.shape[1]
    k_ref, v_ref = k_cache.to(dtype), v_cache.to(dtype)
    outs = []
    for i, n in enumerate(lens.tolist()):
        keys, values = k_ref[i:i + 1, :n + new].clone(), v_ref[i:i + 1, :n + new].clone()
        if new:
            keys[0, n:], values[0, n:] = k_new[i].to(dtype), v_new[i].to(dtype)
        outs.append(ref.attention_ref(q[i:i + 1].to(dtype), keys, values, causal)[0][0])
    return torch.stack(outs)


def test_kvcache_direct_route_never_serves_a_stale_decision(gen, device_resident, monkeypatch):
    """A repeated key of the plain decode route launches its kept decisions (no check, no resolution, the append
    writing the lengths the attention sees: no launch of its own for them); reusing the shapes with another layout,
    dtype, page size, head count, fold or without the append decides again, and every call matches the reference."""
    from flashdecode.ops import append_kv as append_ops

    decided, checked = [], []
    decide, full_checks = fai.decide_flash_decode, fai._checked_kvcache_call
    monkeypatch.setattr(fai, "decide_flash_decode", lambda *a, **kw: decided.append(1) or decide(*a, **kw))
    monkeypatch.setattr(fai, "_checked_kvcache_call", lambda *a: checked.append(1) or full_checks(*a))
    add = torch.add
    monkeypatch.setattr(torch, "add", lambda *a, **kw: pytest.fail("a launch for the seen lengths"))
    b, cap = 2, 24
    lens = torch.tensor([5, 17], dtype=torch.int32, device=DEVICE)

    def check(q, k_cache, v_cache, k_new=None, causal=True, page=0, repeats=2, **kw):
        v_new = None if k_new is None else k_new.flip(-1)
        results = []
        for _ in range(repeats):
            k_in, v_in = (torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
                          for x in (k_cache, v_cache))  # fresh copies of the same layouts
            if page:
                k_in, v_in, kw["block_table"] = ref.paged_from_contiguous(k_in, v_in, page, extra_pages=2,
                                                                          generator=torch.Generator().manual_seed(7))
            before = len(decided), len(checked)
            results.append(fai.flash_attn_with_kvcache(q, k_in, v_in, k_new, v_new, cache_seqlens=lens,
                                                       causal=causal, **kw))
            kept = (len(decided), len(checked)) == before
            assert kept == (len(results) > 1), "the first call of a key decides, a repeated one does not"
        o64 = _kvcache_reference(q, k_cache, v_cache, k_new, v_new, lens, causal, torch.float64)
        o_same = _kvcache_reference(q, k_cache, v_cache, k_new, v_new, lens, causal, q.dtype)
        assert all(torch.equal(results[0], r) for r in results[1:])
        assert_fa_close(results[0], o64, o_same, factor=3.0, atol=1e-4)

    q = randn(b, 1, 4, 16, gen=gen, dtype=DTYPE)
    k_cache, v_cache = (randn(b, cap, 2, 16, gen=gen, dtype=DTYPE) for _ in range(2))
    k_new = randn(b, 1, 2, 16, gen=gen, dtype=DTYPE)
    check(q, k_cache, v_cache, k_new, repeats=3)
    check(q, k_cache, v_cache, repeats=3)  # no append: the lengths themselves
    check(randn(b, 3, 4, 16, gen=gen, dtype=DTYPE)[:, 1:2], k_cache, v_cache, k_new)  # q of another batch stride
    check(q, *(randn(b, cap, 4, 32, gen=gen, dtype=DTYPE)[:, :, ::2, :16] for _ in range(2)), k_new)  # strided
    check(q.float(), k_cache.float(), v_cache.float(), k_new.float())  # another dtype, same shapes
    check(q, k_cache, v_cache, k_new, page=4)
    check(q, k_cache, v_cache, k_new, page=8)  # another page size
    check(q, k_cache[:, :, :1].contiguous(), v_cache[:, :, :1].contiguous(), k_new[:, :, :1].contiguous())  # MQA
    check(randn(b, 3, 4, 16, gen=gen, dtype=DTYPE), k_cache, v_cache, randn(b, 3, 2, 16, gen=gen, dtype=DTYPE),
          causal=False)  # three rows folded into the heads
    monkeypatch.setattr(torch, "add", add)
    assert append_ops._SITE.records  # the appends were recorded: their repeated launches go direct


def test_kvcache_mixed_batch_takes_flash_decodes_split_policy(gen, device_resident, monkeypatch):
    """bench decode's "mixed" row (one 131072-token sequence among 15 of 1024, Llama-3-8B heads, bf16, pages of 16),
    device-resident lengths on a Hopper of 132 SMs: flash_attn_with_kvcache (first and repeated call), flash_decode
    and a DecodePlan resolve one config, and it splits (the no-split kernel would run the long sequence alone)."""
    import flashdecode
    from flashdecode.config import DecodePath
    from flashdecode.ops import decode as decode_ops
    from flashdecode.ops import decode_policy

    monkeypatch.setattr(decode_policy, "_interpreting", lambda device=None: False)
    monkeypatch.setattr(decode_policy, "hopper_or_newer", lambda device: True)
    monkeypatch.setattr(decode_policy, "num_sms", lambda device: 132)
    configs = []

    def no_launch(decided, q, *args):  # the decisions only: nothing of this size runs here
        configs.append(decided.config)
        return torch.zeros_like(q), None
    monkeypatch.setattr(decode_ops, "_launch_decode", no_launch)
    lens = [131072] + [1024] * 15
    b, page = len(lens), 16
    q = torch.randn(b, 32, 128, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.zeros(512, page, 8, 128, dtype=torch.bfloat16, device=DEVICE)  # a small pool: ids are not read
    table = torch.randint(0, 512, (b, max(lens) // page), generator=gen, dtype=torch.int32).to(DEVICE)
    lengths = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    flashdecode.flash_decode(q, k, k, lengths, block_table=table)
    for _ in range(2):
        fai.flash_attn_with_kvcache(q.unsqueeze(1), k, k, cache_seqlens=lengths, block_table=table, causal=True)
    plan = flashdecode.DecodePlan(b, 32, 8, 128, max_seqlen_k=max(lens), device=DEVICE)
    configs.append(plan.config_for(q, k, k, lengths, block_table=table))
    assert len(configs) == 4 and all(c == configs[0] for c in configs), configs
    assert configs[0].path is not DecodePath.UNSPLIT and configs[0].num_splits > 1


def test_kvcache_host_index_values_are_checked(gen, monkeypatch):
    """Index tensors that live on the host are range-checked (device ones cannot be without a sync), before any
    kernel runs: everything on the CPU, with the interpreter's device rule also on a GPU machine."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k_cache, v_cache, k_new = (x.cpu() for x in _kvcache_inputs(gen))
    before = k_cache.clone()
    with pytest.raises(ValueError, match="cache_batch_idx"):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=3,
                                    cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_leftpad"):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3,
                                    cache_leftpad=torch.tensor([0, 9], dtype=torch.int32))
    assert torch.equal(k_cache, before)


def test_kvcache_bad_page_in_the_read_range_raises_before_the_append(gen, monkeypatch):
    """The appended token's page is valid, an earlier page the attention reads is not: ValueError naming
    block_table, and the cache as it was (the append used to land first, so a retry appended twice)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k_cache, v_cache, k_new = (x.cpu() for x in _kvcache_inputs(gen))  # two pages of 8 tokens
    table = torch.tensor([[5, 0], [0, 1]], dtype=torch.int32)  # row 0 writes position 9 (page 0), reads page 5
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match="block_table"):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=9, block_table=table)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


# A paged call of KVCACHE_PREFILL_MIN_QUERIES query tokens (the paged prefill route) appending 2 keys per sequence
# into pages of 4 (capacity 12): each bad value that route checks, the message it must name.
PREFILL_ROUTE_BAD = [
    ("bad read page", dict(block_table=[[9, 1, 2], [3, 4, 5]]), "block_table"),  # row 0 writes page 1, reads 9
    ("q requires grad", dict(q_grad=True), "q requires grad"),  # the prefill kernel is forward only
    ("lengths past capacity", dict(cache_seqlens=[5, 11]), "cache_seqlens"),  # 11 + 2 > 12
    ("num_splits", dict(num_splits=1025), "num_splits"),  # ignored by the route, still beyond any call's bound
]


@pytest.mark.parametrize("case, change, match", PREFILL_ROUTE_BAD, ids=[c[0] for c in PREFILL_ROUTE_BAD])
def test_kvcache_prefill_route_checks_everything_before_the_append(gen, monkeypatch, case, change, match):
    """seqlen_q >= KVCACHE_PREFILL_MIN_QUERIES with k / v on a paged cache: every check of the paged prefill runs
    before append_kv writes (it used to run after, so a caller that retried appended twice). Host metadata, as on
    the CPU, so its values are checked also on a GPU machine."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from flashdecode import heuristics

    change = dict(change)
    q = randn(2, heuristics.KVCACHE_PREFILL_MIN_QUERIES, 4, 16, gen=gen, dtype=DTYPE, device="cpu")
    q.requires_grad_(change.pop("q_grad", False))
    k_cache, v_cache = (randn(8, 4, 2, 16, gen=gen, dtype=DTYPE, device="cpu") for _ in range(2))
    k_new, v_new = (randn(2, 2, 2, 16, gen=gen, dtype=DTYPE, device="cpu") for _ in range(2))
    kwargs = dict(cache_seqlens=[5, 8], block_table=[[0, 1, 2], [3, 4, 5]], causal=True)
    kwargs.update(change)
    kwargs = {n: torch.tensor(x, dtype=torch.int32) if isinstance(x, list) else x for n, x in kwargs.items()}
    before = [x.clone().view(torch.uint8) for x in (k_cache, v_cache)]
    with pytest.raises((ValueError, TypeError), match=match):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
    assert all(torch.equal(x.view(torch.uint8), b) for x, b in zip((k_cache, v_cache), before)), \
        "the cache was written before the call raised"


@pytest.mark.parametrize("new", [0, 2])
def test_kvcache_wholly_left_padded_row_sees_no_cached_key(gen, new):
    """cache_leftpad == seqlen_cache (an empty row, as flash-attn accepts): that row attends to no cached key
    (out 0, lse -inf; the keys it appends sit before its padding, so it sees none of them either); the other
    rows match the reference over keys [leftpad, cache_seqlens + new)."""
    b, cap, h, hk, d = 3, 9, 4, 2, 16
    q = randn(b, 1, h, d, gen=gen, dtype=DTYPE)
    k_cache, v_cache = (randn(b, cap, hk, d, gen=gen, dtype=DTYPE) for _ in range(2))
    k_new, v_new = ((randn(b, new, hk, d, gen=gen, dtype=DTYPE) for _ in range(2)) if new else (None, None))
    lens, leftpad = [cap - new, 4, cap - new], [cap, 1, 0]
    out, lse = fai.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                           cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                           cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=DEVICE),
                                           causal=True, return_softmax_lse=True)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
    for i in range(1, b):
        keys, vals = k_cache[i:i + 1, leftpad[i]:lens[i] + new], v_cache[i:i + 1, leftpad[i]:lens[i] + new]
        o64, l64 = ref.attention_ref(q[i:i + 1].double(), keys.double(), vals.double(), True)
        o_same, l_same = ref.attention_ref(q[i:i + 1], keys, vals, True)
        assert_fa_close(out[i:i + 1], o64, o_same, factor=3.0, atol=1e-4)
        assert_fa_close(lse[i:i + 1], l64, l_same, factor=3.0, atol=1e-4, name="lse")


@pytest.mark.parametrize("fn", ["func", "varlen"])
@pytest.mark.parametrize("kwargs, match", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),  # (nheads,) is (2,)
    (dict(return_attn_probs=1), "return_attn_probs"),
])
def test_prefill_unsupported_arguments_raise(gen, fn, kwargs, match):
    q = randn(1, 4, 2, 16, gen=gen, dtype=DTYPE)
    with pytest.raises((ValueError, TypeError), match=match):
        if fn == "func":
            fai.flash_attn_func(q, q, q, **kwargs)
        else:
            cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
            fai.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, **kwargs)


def test_varlen_block_table_and_bad_packing_raise(gen):
    q = randn(4, 2, 16, gen=gen, dtype=DTYPE)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache"):  # paged k/v are (num_pages, page_size, nheads_k, headdim)
        fai.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="qkv"):
        fai.flash_attn_qkvpacked_func(randn(1, 4, 2, 2, 16, gen=gen, dtype=DTYPE))
    with pytest.raises(ValueError, match="kv"):
        fai.flash_attn_varlen_kvpacked_func(q, randn(4, 3, 2, 16, gen=gen, dtype=DTYPE), cu, cu, 4, 4)


@pytest.mark.gpu
def test_kvcache_decode_step_captured_in_a_cuda_graph(gen):
    """A decode step (rotary, append of one token, tensor cache_seqlens, num_splits=0 = heuristic) captured once
    and replayed with other lengths and inputs gives what the same eager call gives on a fresh copy of the cache,
    and appends at the live lengths."""
    b, h, hk, d, cap, dtype = 4, 8, 2, 128, 4096, torch.bfloat16
    k0 = randn(b, cap, hk, d, gen=gen, dtype=dtype)
    v0 = randn(b, cap, hk, d, gen=gen, dtype=dtype)
    angle = torch.rand(cap, d // 2, generator=gen) * 2 * torch.pi
    rot = dict(rotary_cos=torch.cos(angle).to(DEVICE, dtype), rotary_sin=torch.sin(angle).to(DEVICE, dtype))
    static = dict(q=randn(b, 1, h, d, gen=gen, dtype=dtype), k=randn(b, 1, hk, d, gen=gen, dtype=dtype),
                  v=randn(b, 1, hk, d, gen=gen, dtype=dtype),
                  lens=torch.tensor([5, 100, 2000, 4000], dtype=torch.int32, device=DEVICE))
    k_cache, v_cache = k0.clone(), v0.clone()

    def step(kc, vc, x):
        return fai.flash_attn_with_kvcache(x["q"], kc, vc, x["k"], x["v"], cache_seqlens=x["lens"], causal=True,
                                           return_softmax_lse=True, **rot)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels outside the capture
        step(k_cache, v_cache, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step(k_cache, v_cache, static)
    for lens in ([4095, 1, 17, 3000], [0, 2048, 4095, 511]):
        fresh = dict(q=randn(b, 1, h, d, gen=gen, dtype=dtype), k=randn(b, 1, hk, d, gen=gen, dtype=dtype),
                     v=randn(b, 1, hk, d, gen=gen, dtype=dtype),
                     lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE))
        for name, x in fresh.items():
            static[name].copy_(x)
        k_cache.copy_(k0)
        v_cache.copy_(v0)
        graph.replay()
        k_eager, v_eager = k0.clone(), v0.clone()
        out_e, lse_e = step(k_eager, v_eager, fresh)
        torch.cuda.synchronize()
        torch.testing.assert_close(out_g, out_e, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse_g, lse_e, atol=1e-3, rtol=1e-3)
        assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
