"""ALiBi in flash_decode / DecodePlan (alibi_slopes (nheads,) or (batch, nheads) fp32, one slope per query head)
against a float64 oracle written here: bias -slope * |qpos - j| for the row at key position qpos (bottom-right
aligned new tokens) and key j, added after the softcap (flash-attn's order). FlashAttention rule, 3x (decode)."""

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import DecodePath
from flashdecode import reference as ref
from flashdecode.ops.decode import decode_config
from helpers import DEVICE, KERNEL_DTYPES, assert_fa_close, randn


def alibi_decode_oracle(q, k, v, lens, slopes, softmax_scale=None, softcap=0.0, window_left=-1):
    """(out, lse) of decode with ALiBi, computed in q's dtype's precision as given (pass float64 for the oracle).

    q (batch, [seqlen_q,] nheads, d); k, v contiguous (batch, max_seqlen, nheads_kv, d); lens (batch,) ints;
    slopes (nheads,) or (batch, nheads). Returns out like q and lse float32/64 (batch, [seqlen_q,] nheads)."""
    squeeze = q.dim() == 3
    q4 = q.unsqueeze(1) if squeeze else q
    b, sq, h, d = q4.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    group = h // k.shape[2]
    slopes2 = (slopes.expand(b, h) if slopes.dim() == 1 else slopes).to(q.dtype)
    out = torch.zeros_like(q4)
    lse = torch.full((b, sq, h), float("-inf"), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                     device=q.device)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        kk = k[i, :n].repeat_interleave(group, dim=1)  # (n, h, d)
        vv = v[i, :n].repeat_interleave(group, dim=1)
        s = torch.einsum("thd,nhd->htn", q4[i], kk) * scale  # (h, sq, n)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(n - sq, n, device=q.device)[:, None]  # (sq, 1)
        j = torch.arange(n, device=q.device)[None, :]
        s = s - slopes2[i][:, None, None] * (qpos - j).abs().to(s.dtype)[None]
        visible = j <= qpos
        if window_left >= 0:
            visible = visible & (j >= qpos - window_left)
        s = s.masked_fill(~visible[None], float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # (h, sq)
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[i] = torch.einsum("htn,nhd->thd", p, vv)
        lse[i] = row_lse.transpose(0, 1).to(lse.dtype)
    return (out[:, 0] if squeeze else out), (lse[:, 0] if squeeze else lse)


def _slopes(batch, nheads, per_sequence, gen):
    """Geometric ALiBi-like slopes in (0, 1], different per head (and per sequence when per_sequence)."""
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / nheads) for i in range(nheads)])
    if per_sequence:
        base = base[None, :] * (0.5 + torch.rand(batch, nheads, generator=gen))
    return base.to(device=DEVICE, dtype=torch.float32)


def _check(gen, dtype, *, batch=3, seqlen_q=1, nheads=4, nheads_kv=2, headdim=32, lens=(45, 0, 70),
           per_sequence=False, page_size=None, softcap=0.0, window_left=-1, tweak=None, plan=False, **kw):
    max_seqlen = max(max(lens), 1) + 3
    q_shape = (batch, nheads, headdim) if seqlen_q == 1 else (batch, seqlen_q, nheads, headdim)
    q = randn(*q_shape, gen=gen, dtype=dtype)
    k = randn(batch, max_seqlen, nheads_kv, headdim, gen=gen, dtype=dtype)
    v = randn(batch, max_seqlen, nheads_kv, headdim, gen=gen, dtype=dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    slopes = _slopes(batch, nheads, per_sequence, gen)
    table = None
    kc, vc = k, v
    if page_size is not None:
        kc, vc, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=2, generator=gen)
    call = dict(block_table=table, softcap=softcap, window_size=(window_left, 0), return_lse=True,
                alibi_slopes=slopes, **kw)
    if tweak is not None:
        resolved = decode_config(q, kc, vc, lens_t, block_table=table, num_splits=kw.get("num_splits"),
                                 window_size=(window_left, 0))
        call["config"] = dataclasses.replace(resolved, **tweak)
    if plan:
        p = flashdecode.DecodePlan(batch, nheads, nheads_kv, headdim, max_seqlen_k=max_seqlen, dtype=dtype,
                                   device=DEVICE, max_seqlen_q=seqlen_q, **kw)
        call.pop("num_splits", None)
        out, lse = p.run(q, kc, vc, lens_t, **{n: x for n, x in call.items() if n != "config"})
    else:
        out, lse = flashdecode.flash_decode(q, kc, vc, lens_t, **call)
    ora = dict(softcap=softcap, window_left=window_left)
    o64, lse64 = alibi_decode_oracle(q.double(), k.double(), v.double(), lens_t, slopes.double(), **ora)
    o_same, lse_same = alibi_decode_oracle(q, k, v, lens_t, slopes, **ora)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-4, name="lse")
    # the bias matters at these sizes: without it the result is clearly different
    plain = ref.decode_ref(q.double(), k.double(), v.double(), lens_t, softcap=softcap,
                           window_size=(window_left, 0))[0]
    assert (plain - o64).abs().max() > 1e-2
    return out


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_slope_shapes_and_splits(gen, dtype, per_sequence, num_splits):
    _check(gen, dtype, per_sequence=per_sequence, num_splits=num_splits)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seqlen_q", [1, 2])
def test_paged(gen, page_size, seqlen_q):
    _check(gen, KERNEL_DTYPES[0], page_size=page_size, seqlen_q=seqlen_q, num_splits=2, per_sequence=True)


@pytest.mark.parametrize("nheads, nheads_kv", [(8, 2), (6, 1), (3, 3)])
def test_gqa_rows_of_one_group_get_their_own_slopes(gen, nheads, nheads_kv):
    _check(gen, KERNEL_DTYPES[0], nheads=nheads, nheads_kv=nheads_kv, seqlen_q=2, num_splits=2)


@pytest.mark.parametrize("softcap, window_left", [(5.0, -1), (0.0, 20), (8.0, 7)])
def test_softcap_and_window(gen, softcap, window_left):
    _check(gen, KERNEL_DTYPES[0], softcap=softcap, window_left=window_left, seqlen_q=2, num_splits=3)


@pytest.mark.parametrize("path", [DecodePath.PERSISTENT, DecodePath.PERSISTENT_QUEUE, DecodePath.DEVICE_SPLIT_GRID])
def test_device_paths(gen, path):
    tweak = dict(path=path, num_splits=3, persistent_programs=3, persistent_slots=2, device_split_slots=8)
    _check(gen, KERNEL_DTYPES[0], batch=4, lens=(45, 0, 70, 17), num_splits=3, tweak=tweak, per_sequence=True)


def test_plan_and_batch_invariant(gen):
    _check(gen, KERNEL_DTYPES[0], plan=True, num_splits=3, per_sequence=True)
    _check(gen, KERNEL_DTYPES[0], batch_invariant=True)


@pytest.mark.parametrize("slopes, word", [
    (torch.ones(3), "alibi_slopes"), (torch.ones(2, 4), "alibi_slopes"),
    (torch.ones(4, dtype=torch.float16), "alibi_slopes"), ([1.0] * 4, "alibi_slopes")])
def test_bad_slopes_name_the_argument(gen, slopes, word):
    q = randn(3, 4, 32, gen=gen)
    k = randn(3, 16, 2, 32, gen=gen)
    lens = torch.tensor([4, 5, 6], dtype=torch.int32, device=DEVICE)
    if isinstance(slopes, torch.Tensor):
        slopes = slopes.to(DEVICE)
    with pytest.raises((ValueError, TypeError), match=word):
        flashdecode.flash_decode(q, k, k, lens, alibi_slopes=slopes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [None, 16, 128])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_alibi_every_path(gen, dtype, page_size, batch):
    lens = tuple(int(x) for x in torch.randint(0, 5000, (batch,), generator=gen))
    _check(gen, dtype, batch=batch, nheads=32, nheads_kv=8, headdim=128, lens=lens, page_size=page_size,
           per_sequence=True)


# ----------------------------------------------------------------------------------------------------------------
# Through flashdecode.flash_attn_interface (flash-attn 2.x names)
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_flash_attn_with_kvcache_alibi(gen, page_size, per_sequence):
    """New k/v appended at cache_seqlens, causal, GQA: out and softmax_lse vs the oracle on the appended cache."""
    from flashdecode import flash_attn_interface as fai

    dtype, b, sq, h, hk, d, cap = KERNEL_DTYPES[0], 3, 2, 4, 2, 32, 64
    q = randn(b, sq, h, d, gen=gen, dtype=dtype)
    k = randn(b, cap, hk, d, gen=gen, dtype=dtype)
    v = randn(b, cap, hk, d, gen=gen, dtype=dtype)
    k_new, v_new = randn(b, sq, hk, d, gen=gen, dtype=dtype), randn(b, sq, hk, d, gen=gen, dtype=dtype)
    cached = torch.tensor([40, 0, 17], dtype=torch.int32, device=DEVICE)
    slopes = _slopes(b, h, per_sequence, gen)
    kc, vc, table = k.clone(), v.clone(), None
    if page_size is not None:
        kc, vc, table = ref.paged_from_contiguous(k, v, page_size, generator=gen)
    out, lse = fai.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=cached, block_table=table,
                                           causal=True, alibi_slopes=slopes, num_splits=2, return_softmax_lse=True)
    for i in range(b):  # the appended contiguous cache the oracle reads
        n = int(cached[i])
        k[i, n:n + sq], v[i, n:n + sq] = k_new[i], v_new[i]
    lens = cached + sq
    o64, lse64 = alibi_decode_oracle(q.double(), k.double(), v.double(), lens, slopes.double())
    o_same, lse_same = alibi_decode_oracle(q, k, v, lens, slopes)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
    assert_fa_close(lse, lse64.transpose(1, 2), lse_same.transpose(1, 2), factor=3.0, atol=1e-4, name="lse")


def test_flash_attn_with_kvcache_alibi_refusals(gen):
    from flashdecode import flash_attn_interface as fai

    q = randn(1, 2, 2, 16, gen=gen, dtype=KERNEL_DTYPES[0])
    kc = randn(1, 8, 1, 16, gen=gen, dtype=KERNEL_DTYPES[0])
    before = kc.clone()
    slopes = torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="alibi_slopes"):  # non-causal rows would need keys after themselves
        fai.flash_attn_with_kvcache(q, kc, kc.clone(), kc[:, :2], kc[:, :2], cache_seqlens=3, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="alibi_slopes"):  # checked before the append writes anything
        fai.flash_attn_with_kvcache(q, kc, kc.clone(), kc[:, :2].clone(), kc[:, :2].clone(), cache_seqlens=3,
                                    causal=True, alibi_slopes=torch.ones(3, device=DEVICE))
    assert torch.equal(kc, before)


@pytest.mark.parametrize("packed", [False, True])
def test_prefill_functions_pass_alibi_only_where_the_op_takes_it(gen, monkeypatch, packed):
    """Without alibi_slopes in flashdecode.flash_attn's signature: ValueError naming it; with it (as after the
    prefill kernels gain ALiBi): passed through unchanged."""
    import inspect

    from flashdecode import flash_attn_interface as fai

    q = randn(1, 4, 2, 16, gen=gen, dtype=KERNEL_DTYPES[0])
    slopes = torch.ones(2, device=DEVICE)
    if "alibi_slopes" not in inspect.signature(fai.flash_attn).parameters:
        with pytest.raises(ValueError, match="alibi_slopes"):
            fai.flash_attn_func(q, q, q, alibi_slopes=slopes)
    seen = {}

    def fake_flash_attn(q, k, v, *, return_lse=False, alibi_slopes=None, **kw):
        seen["alibi_slopes"] = alibi_slopes
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(fai, "flash_attn", fake_flash_attn)
    if packed:
        fai.flash_attn_qkvpacked_func(torch.stack([q, q, q], dim=2), alibi_slopes=slopes)
    else:
        fai.flash_attn_func(q, q, q, alibi_slopes=slopes)
    assert seen["alibi_slopes"] is slopes


def test_with_sinks(gen):
    """alibi_slopes and sinks together: the sink joins the ALiBi-biased softmax denominator (ops/sinks.py)."""
    from flashdecode.ops.sinks import apply_sinks

    dtype, lens = KERNEL_DTYPES[0], torch.tensor([45, 0, 70], dtype=torch.int32, device=DEVICE)
    q = randn(3, 4, 32, gen=gen, dtype=dtype)
    k, v = randn(3, 73, 2, 32, gen=gen, dtype=dtype), randn(3, 73, 2, 32, gen=gen, dtype=dtype)
    slopes, sinks = _slopes(3, 4, True, gen), randn(4, gen=gen)
    out, lse = flashdecode.flash_decode(q, k, v, lens, alibi_slopes=slopes, sinks=sinks, num_splits=2,
                                        return_lse=True)
    o64, lse64 = apply_sinks(*alibi_decode_oracle(q.double(), k.double(), v.double(), lens, slopes.double()),
                             sinks.double(), "decode")
    o_same, lse_same = apply_sinks(*alibi_decode_oracle(q, k, v, lens, slopes), sinks, "decode")
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-4, name="lse")
