"""The executable specification of flashdecode, in plain PyTorch.

Every kernel in ``flashdecode.kernels`` is tested against these functions evaluated in float64. They are written to
read like the math in docs/algorithms.md (the seeds' notation): S = scale * Q K^T, P = softmax(S), O = P V, and
lse = log(sum_j exp(S_ij)). They run in whatever dtype the inputs have, so the same function also gives the
"same-dtype PyTorch implementation" error that the FlashAttention tolerance rule compares against, and serves as the
engine's CPU ("torch") attention backend.

Conventions (flash-attn compatible; docs/architecture.md):
  q (batch, seqlen_q, nheads, headdim); k, v (batch, seqlen_k, nheads_kv, headdim); nheads % nheads_kv == 0 and
  query head h reads kv head h // (nheads // nheads_kv).
  Causal and window masks are bottom-right aligned: query row i sits at key position i + seqlen_k - seqlen_q.
  lse is the natural-log log-sum-exp, float32 unless the inputs are float64, shaped (batch, nheads, seqlen_q).
  A row with no visible key has out = 0 and lse = -inf, never NaN.
  ALiBi (``alibi_slopes``, float32 (nheads,) or (batch, nheads)): flash-attn's bias -slope * |i + seqlen_k -
  seqlen_q - j| for query row i and key j, added to the scaled logits after the softcap.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "alibi_bias",
    "attention_ref",
    "attention_fp8_ref",
    "attention_blockwise_ref",
    "attention_varlen_ref",
    "paged_prefill_ref",
    "decode_ref",
    "decode_split_ref",
    "merge_states_ref",
    "merge_states_many_ref",
    "split_bounds",
    "paged_from_contiguous",
    "contiguous_from_paged",
]


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv_heads(x: torch.Tensor, nheads: int) -> torch.Tensor:
    """(b, s, nheads_kv, d) -> (b, s, nheads, d): repeat each kv head for its query group (GQA/MQA)."""
    group = nheads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1),
                 device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k): True where query row i may attend to key j.

    Bottom-right aligned: row i is at key position i + seqlen_k - seqlen_q. ``causal`` is window right = 0.
    window_size=(left, right), -1 meaning unbounded on that side.
    """
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= cols <= rows + right
    if left >= 0:
        mask &= cols >= rows - left
    return mask


def alibi_bias(alibi_slopes: torch.Tensor, seqlen_q: int, seqlen_k: int, dtype=torch.float64, device=None):
    """ALiBi bias (batch or 1, nheads, seqlen_q, seqlen_k): -slope * |i + seqlen_k - seqlen_q - j| (bottom-right
    aligned like the masks). alibi_slopes: (nheads,) or (batch, nheads)."""
    slopes = alibi_slopes.to(dtype=dtype, device=device)
    if slopes.dim() == 1:
        slopes = slopes[None]
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return -slopes[:, :, None, None] * (rows - cols).abs().to(dtype)


def _add_alibi(s: torch.Tensor, alibi_slopes) -> torch.Tensor:
    """s (b, h, sq, sk) + the ALiBi bias (after the softcap), or s unchanged without slopes."""
    if alibi_slopes is None:
        return s
    return s + alibi_bias(alibi_slopes, s.shape[2], s.shape[3], s.dtype, s.device)


def _scores(q, k, softmax_scale, softcap):
    """S = scale * Q K^T, optionally soft-capped: softcap * tanh(S / softcap). q (b,sq,h,d), k (b,sk,h,d) -> (b,h,sq,sk).

    tanh saturates at +-1, so logits of any magnitude stay finite (no overflow, unlike exp-based formulas).
    """
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap > 0.0:
        s = softcap * torch.tanh(s / softcap)
    return s


def _check_common(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (batch, seqlen, heads, headdim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"nheads ({q.shape[2]}) must be a multiple of nheads_kv ({k.shape[2]})")


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                  alibi_slopes: torch.Tensor | None = None):
    """Naive attention: materialise S, softmax it, multiply by V.

    Args:
        q: (batch, seqlen_q, nheads, headdim), any float dtype; the math runs in this dtype.
        k, v: (batch, seqlen_k, nheads_kv, headdim), same dtype.
        alibi_slopes: None, or (nheads,) / (batch, nheads): the ALiBi bias joins the logits (module docstring).
    Returns:
        out: (batch, seqlen_q, nheads, headdim) in q's dtype; 0 on rows with no visible key.
        lse: (batch, nheads, seqlen_q) float32 (float64 for float64 inputs), natural log; -inf on empty rows.
    """
    _check_common(q, k, v)
    nheads, headdim = q.shape[2], q.shape[3]
    scale = headdim ** -0.5 if softmax_scale is None else softmax_scale
    k, v = _expand_kv_heads(k, nheads), _expand_kv_heads(v, nheads)
    s = _add_alibi(_scores(q, k, scale, softcap), alibi_slopes)
    mask = visible_mask(q.shape[1], k.shape[1], causal, window_size, device=q.device)
    return _softmax_pv(s.masked_fill(~mask, float("-inf")), v)


def _softmax_pv(s, v):
    """Masked scores s (b, h, sq, sk) (-inf = hidden) and v (b, sk, h, d) -> out (b, sq, h, d), lse (b, h, sq)."""
    if s.shape[-1] == 0:  # no keys at all: every row is empty
        m = torch.zeros(s.shape[:-1] + (1,), dtype=s.dtype, device=s.device)
    else:
        m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # empty rows: exp(-inf - 0) = 0, not NaN
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhqk,bkhd->bqhd", p / torch.where(l > 0, l, torch.ones_like(l)), v)
    lse = (m + torch.log(l)).squeeze(-1)  # log(0) = -inf on empty rows
    return out, lse.to(_lse_dtype(v.dtype))


# The FP8 forward's rule for P (kernels/fwd.py FP8_P_LOG2_SCALE): P * 2**8 rounded to e4m3, then / 2**8.
FP8_P_SCALE = 256.0


def attention_fp8_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                      alibi_slopes: torch.Tensor | None = None):
    """The FP8 forward's precision in plain PyTorch: the same-precision implementation its tests compare with.

    q, k, v: the dequantised FP8 inputs (x_fp8 * descale, exact in float32), shapes as attention_ref. Logits in
    float32 from them (the kernel's fp8 dot accumulates the exact products in fp32, the descales folded into the
    scale); P = exp(S - rowmax) multiplied by 2**8, rounded to float8_e4m3fn (nearest, ties to even) and divided
    back, times V in float32, over the float32 row sum of the unrounded P; out rounded to bfloat16 (the kernel's
    output dtype). Returns (out bfloat16, lse float32).
    """
    _check_common(q, k, v)
    q, k, v = q.float(), k.float(), v.float()
    nheads, headdim = q.shape[2], q.shape[3]
    scale = headdim ** -0.5 if softmax_scale is None else softmax_scale
    k, v = _expand_kv_heads(k, nheads), _expand_kv_heads(v, nheads)
    s = _add_alibi(_scores(q, k, scale, softcap), alibi_slopes)
    mask = visible_mask(q.shape[1], k.shape[1], causal, window_size, device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True) if s.shape[-1] else s.new_zeros(s.shape[:-1] + (1,))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    p8 = (p * FP8_P_SCALE).to(torch.float8_e4m3fn).float() / FP8_P_SCALE
    out = torch.einsum("bhqk,bkhd->bqhd", p8 / torch.where(l > 0, l, torch.ones_like(l)), v)
    return out.to(torch.bfloat16), (m + torch.log(l)).squeeze(-1)


def attention_blockwise_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                            block_n: int = 16):
    """FlashAttention-2's online softmax: stream over KV blocks of ``block_n`` keys keeping per row
    the running max m, the running sum l and the *unnormalised* accumulator acc; divide once at the end.

    For each block j:  m_new = max(m, rowmax(S_j));  alpha = exp(m - m_new);  P_j = exp(S_j - m_new)
                       l = alpha * l + rowsum(P_j);  acc = alpha * acc + P_j V_j;  m = m_new
    At the end: out = acc / l, lse = m + log(l).  Same signature and results as ``attention_ref``.
    """
    _check_common(q, k, v)
    b, sq, nheads, headdim = q.shape
    sk = k.shape[1]
    scale = headdim ** -0.5 if softmax_scale is None else softmax_scale
    k, v = _expand_kv_heads(k, nheads), _expand_kv_heads(v, nheads)
    mask = visible_mask(sq, sk, causal, window_size, device=q.device)
    m = torch.full((b, nheads, sq, 1), float("-inf"), dtype=q.dtype, device=q.device)
    l = torch.zeros((b, nheads, sq, 1), dtype=q.dtype, device=q.device)
    acc = torch.zeros((b, nheads, sq, v.shape[-1]), dtype=q.dtype, device=q.device)
    for start in range(0, sk, block_n):
        end = min(start + block_n, sk)
        s = _scores(q, k[:, start:end], scale, softcap).masked_fill(~mask[:, start:end], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        # Rows that have seen no key yet keep m = -inf; shift by 0 there so exp(-inf - -inf) never happens.
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        l = alpha * l + p.sum(dim=-1, keepdim=True)
        acc = alpha * acc + torch.einsum("bhqk,bkhd->bhqd", p, v[:, start:end])
        m = m_new
    out = (acc / torch.where(l > 0, l, torch.ones_like(l))).transpose(1, 2)
    lse = torch.where(l > 0, m + torch.log(l), torch.full_like(l, float("-inf"))).squeeze(-1)
    return out.contiguous(), lse.to(_lse_dtype(q.dtype))


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Packed ragged batch: q (total_q, nheads, headdim), k/v (total_k, nheads_kv, headdim), int32 cu_seqlens
    (batch + 1,). Returns out (total_q, nheads, headdim) and lse (nheads, total_q) like flash-attn's varlen lse.
    alibi_slopes: None, (nheads,) or (batch, nheads); positions count within each sequence."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        slopes = alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, lse = attention_ref(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]],
                               causal, softmax_scale, window_size, softcap, slopes)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, -1)


def paged_prefill_ref(q, k_pages, v_pages, cu_seqlens_q, seqused_k, block_table, causal=False, softmax_scale=None,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Prefill over a paged KV cache: q (total_q, nheads, headdim) packed by int32 cu_seqlens_q (batch + 1,);
    k_pages, v_pages (num_pages, page_size, nheads_kv, headdim); block_table int32 (batch, max_pages); seqused_k
    int (batch,): sequence b's keys are the first seqused_k[b] positions of its pages, its query rows the last
    positions (bottom-right aligned). Returns out (total_q, nheads, headdim), lse (nheads, total_q)."""
    lens = [int(n) for n in seqused_k.tolist()]
    keys, values = contiguous_from_paged(k_pages, v_pages, block_table)
    k = torch.cat([keys[i, :n] for i, n in enumerate(lens)], 0)  # packed as a varlen batch
    v = torch.cat([values[i, :n] for i, n in enumerate(lens)], 0)
    cu_seqlens_k = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    return attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window_size, softcap,
                                alibi_slopes)


# ----------------------------------------------------------------------------------------------------------------
# Decode: Flash-Decoding's three steps (split the KV sequence, attend per split, merge by log-sum-exp)
# ----------------------------------------------------------------------------------------------------------------

def _as_4d_query(q: torch.Tensor):
    """Decode q may be (batch, nheads, headdim) or (batch, seqlen_q, nheads, headdim)."""
    if q.dim() == 3:
        return q[:, None], True
    if q.dim() == 4:
        return q, False
    raise ValueError(f"q must be (batch, nheads, headdim) or (batch, seqlen_q, nheads, headdim); got {tuple(q.shape)}")


def _gather_cache(k_cache, v_cache, block_table):
    """Return contiguous (batch, max_seqlen, nheads_kv, headdim) views of a contiguous or paged cache."""
    if block_table is None:
        return k_cache, v_cache
    return contiguous_from_paged(k_cache, v_cache, block_table)


def split_bounds(seqlen: int, num_splits: int):
    """Flash-Decoding's partition of ``seqlen`` live keys into ``num_splits`` contiguous chunks of
    ceil(seqlen / num_splits) keys; trailing chunks may be empty. Returns a list of (start, end)."""
    chunk = -(-seqlen // num_splits) if seqlen > 0 else 0
    return [(min(s * chunk, seqlen), min((s + 1) * chunk, seqlen)) for s in range(num_splits)]


def decode_split_ref(q, k_cache, v_cache, cache_seqlens, num_splits: int, block_table=None,
                     softmax_scale=None, softcap=0.0, window_size=(-1, -1), alibi_slopes=None):
    """Step 2 of Flash-Decoding: each split of the live KV range attends on its own.

    Args:
        q: (batch, nheads, headdim) or (batch, seqlen_q, nheads, headdim); the seqlen_q new tokens are the last
           positions of each sequence and are causal among themselves (bottom-right aligned).
        k_cache, v_cache: contiguous (batch, max_seqlen, nheads_kv, headdim), or paged
           (num_pages, page_size, nheads_kv, headdim) with block_table int32 (batch, max_pages_per_seq).
        cache_seqlens: int (batch,), live keys per sequence (0 allowed).
        alibi_slopes: None, (nheads,) or (batch, nheads): ALiBi over each sequence's live keys (the new tokens
           at its last positions), as attention_ref.
    Returns:
        out_s: (num_splits, *q.shape), lse_s: (num_splits, batch, [seqlen_q,] nheads), each split's normalised
        partial output and log-sum-exp; an empty split (or a split whose keys are all masked) is (0, -inf).
    """
    q4, squeeze = _as_4d_query(q)
    k_all, v_all = _gather_cache(k_cache, v_cache, block_table)
    outs = torch.zeros((num_splits,) + q4.shape, dtype=q.dtype, device=q.device)
    lses = torch.full((num_splits, q4.shape[0], q4.shape[1], q4.shape[2]), float("-inf"),
                      dtype=_lse_dtype(q.dtype), device=q.device)
    sq = q4.shape[1]
    for b, seqlen in enumerate(cache_seqlens.tolist()):
        full = visible_mask(sq, seqlen, True, window_size, device=q.device)  # (sq, seqlen)
        bias = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
            bias = alibi_bias(slopes, sq, seqlen, q.dtype, q.device)  # (1, nheads, sq, seqlen)
        for s, (start, end) in enumerate(split_bounds(seqlen, num_splits)):
            if end <= start:
                continue
            o, lse = _masked_attention(q4[b:b + 1], k_all[b:b + 1, start:end], v_all[b:b + 1, start:end],
                                       full[:, start:end], softmax_scale, softcap,
                                       None if bias is None else bias[..., start:end])
            outs[s, b] = o[0]
            lses[s, b] = lse[0].transpose(0, 1)
    if squeeze:
        return outs[:, :, 0], lses[:, :, 0]
    return outs, lses


def _masked_attention(q, k, v, mask, softmax_scale, softcap, bias=None):
    """attention_ref with an explicit (seqlen_q, seqlen_k) visibility mask instead of causal/window flags, and an
    optional additive bias (broadcastable to (batch, nheads, seqlen_q, seqlen_k)) after the softcap."""
    nheads, headdim = q.shape[2], q.shape[3]
    scale = headdim ** -0.5 if softmax_scale is None else softmax_scale
    k, v = _expand_kv_heads(k, nheads), _expand_kv_heads(v, nheads)
    s = _scores(q, k, scale, softcap)
    if bias is not None:
        s = s + bias
    return _softmax_pv(s.masked_fill(~mask, float("-inf")), v)


def merge_states_many_ref(outs: torch.Tensor, lses: torch.Tensor):
    """Step 3 of Flash-Decoding: merge N partial states along dim 0.

    outs (N, ..., nheads, headdim), lses (N, ..., nheads) natural log. With M = max_i lse_i:
        lse = M + log(sum_i exp(lse_i - M)),  out = sum_i exp(lse_i - lse) * out_i.
    States with lse = -inf weigh 0; if all are -inf the result is (0, -inf).
    """
    m = lses.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m_safe)  # (N, ..., nheads); 0 for -inf states
    total = w.sum(dim=0)
    lse = m_safe + torch.log(total)  # -inf when every state is empty
    scale = w / torch.where(total > 0, total, torch.ones_like(total))
    out = (scale.unsqueeze(-1).to(outs.dtype) * outs).sum(dim=0)
    return out, lse.to(lses.dtype)


def merge_states_ref(o_a, lse_a, o_b, lse_b):
    """Two-way merge of attention states (o (..., nheads, headdim), lse (..., nheads)); -inf on one side returns
    the other side unchanged."""
    return merge_states_many_ref(torch.stack([o_a, o_b]), torch.stack([lse_a, lse_b]))


def decode_ref(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None, softcap=0.0,
               window_size=(-1, -1), alibi_slopes=None):
    """Decode attention without splitting: q attends to the first cache_seqlens[b] keys of its sequence.

    Shapes as in ``decode_split_ref``. Returns out like q and lse (batch, [seqlen_q,] nheads) (float32 unless
    float64) - the (..., nheads) layout of flash_decode and merge_states.
    """
    out, lse = decode_split_ref(q, k_cache, v_cache, cache_seqlens, 1, block_table, softmax_scale, softcap,
                                window_size, alibi_slopes)
    return out[0], lse[0]


# ----------------------------------------------------------------------------------------------------------------
# Paged KV cache helpers (vLLM/FlashInfer "NHD" layout)
# ----------------------------------------------------------------------------------------------------------------

def paged_from_contiguous(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int,
                          extra_pages: int = 0, generator: torch.Generator | None = None):
    """Scatter a contiguous cache into randomly permuted pages.

    Args:
        k_cache, v_cache: (batch, max_seqlen, nheads_kv, headdim).
        page_size: tokens per page (>= 1). max_seqlen is padded up to a page multiple with random values.
        extra_pages: unused pages, filled with random values, that no block table points to (catches wrong indexing).
    Returns:
        k_pages, v_pages: (num_pages, page_size, nheads_kv, headdim), num_pages = batch * pages_per_seq + extra_pages.
        block_table: int32 (batch, pages_per_seq), a random permutation of page ids.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    b, s, hk, d = k_cache.shape
    pages_per_seq = max(1, -(-s // page_size))
    num_pages = b * pages_per_seq + extra_pages
    perm = torch.randperm(num_pages, generator=generator)[: b * pages_per_seq].to(k_cache.device)
    block_table = perm.view(b, pages_per_seq).to(torch.int32)

    def scatter(x):
        pages = torch.randn((num_pages, page_size, hk, x.shape[-1]), generator=generator).to(x)
        padded = torch.randn((b, pages_per_seq * page_size, hk, x.shape[-1]), generator=generator).to(x)
        padded[:, :s] = x
        pages[block_table.long().flatten()] = padded.view(b * pages_per_seq, page_size, hk, x.shape[-1])
        return pages

    return scatter(k_cache), scatter(v_cache), block_table


def contiguous_from_paged(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                          max_seqlen: int | None = None):
    """Gather pages back into a contiguous cache: (batch, pages_per_seq * page_size [cut to max_seqlen], hk, d)."""
    idx = block_table.long()
    b, pages_per_seq = idx.shape
    page_size = k_pages.shape[1]

    def gather(pages):
        x = pages[idx.flatten()].view(b, pages_per_seq * page_size, *pages.shape[2:])
        return x if max_seqlen is None else x[:, :max_seqlen]

    return gather(k_pages), gather(v_pages)
