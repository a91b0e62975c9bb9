"""What one kernel needs just to stream a decode call's K/V bytes (GPU only; a measurement, not a test).

Decode at batch 1 is a streaming read: the issue's floor is K/V bytes / copy bandwidth. This times Triton kernels
that read exactly those bytes the way stage 1 does (host tensor descriptors, a (kv head, split) grid, BLOCK_N-key
tiles, a pipelined loop) and do (a) nothing but sum the tiles, (b) stage 1's two dot products without the
softmax, or (c) with it, as CUDA-graph replays with the K/V sets rotated beyond L2 (flashdecode.timing) - the same method as
``flashdecode bench decode``. No merge, no partial outputs: what is left above the floor is the launch, the first
loads' latency and the tail of the slowest program, i.e. what no split-KV design built from such loops can avoid.
The paged variants read the same bytes with pointer loads through a block table of 16-key pages, in memory order
or shuffled: what the page order alone costs a paged cache. The torch variants time the library's own copy and
reduction kernels on the same bytes, the read variants a flat read-only sweep by thousands of small programs: what
any kernel pays for a transfer of this size.

    PYTHONPATH=. python3 -m benchmarks.probes.stream [--contexts 4096,32768,65536,131072] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def stream_kernel(K, V, Q, OUT, O_PART, SEQLENS, seqlen, SPLITS: tl.constexpr, HEADDIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, MODE: tl.constexpr, INTERLEAVE: tl.constexpr = False):
    """Program (split s of kv head hk) reads keys [s * chunk, (s + 1) * chunk) of K and V (tensor descriptors over
    (seqlen, nheads_kv * HEADDIM), block (BLOCK_N, HEADDIM)) and writes one float so nothing is optimised away.
    MODE 0: sum the tiles; 1: q @ K^T then s @ V (BLOCK_M query rows, q from Q); 2: stage 1's online softmax
    between the two dots (exp2, running max and sum, rescaled accumulator); 3: also stage 1's epilogue (the
    normalised fp32 partial of the first BLOCK_M // 2 rows into O_PART (programs, BLOCK_M // 2, HEADDIM) and its lse
    into OUT); 4: also the length read from SEQLENS[0] (on the device, as stage 1 does) instead of ``seqlen``.
    INTERLEAVE: split s reads blocks s, s + SPLITS, s + 2 * SPLITS, ... instead of one contiguous chunk, so that at
    any moment the programs of a kv head read neighbouring blocks (one sweep through memory, as a flat read does,
    instead of SPLITS streams far apart)."""
    pid = tl.program_id(0)
    hk = pid // SPLITS
    split = pid % SPLITS
    if MODE >= 4:
        seqlen = tl.load(SEQLENS)
    chunk = tl.cdiv(seqlen, SPLITS * BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)
    STEP: tl.constexpr = SPLITS * BLOCK_N if INTERLEAVE else BLOCK_N
    if INTERLEAVE:
        start = split * BLOCK_N
        end = seqlen
    col = hk * HEADDIM
    if MODE == 0:
        acc = tl.zeros([BLOCK_N, HEADDIM], tl.float32)
        for n in range(start, end, STEP):
            acc += K.load([n, col]).to(tl.float32) + V.load([n, col]).to(tl.float32)
        tl.store(OUT + pid, tl.sum(tl.sum(acc, 1), 0))
    else:
        q = tl.load(Q + tl.arange(0, BLOCK_M)[:, None] * HEADDIM + tl.arange(0, HEADDIM)[None, :])
        acc = tl.zeros([BLOCK_M, HEADDIM], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for n in range(start, end, STEP):
            k = K.load([n, col])
            s = tl.dot(q, tl.trans(k)) * 0.12753
            if MODE >= 2:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
                v = V.load([n, col])
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                v = V.load([n, col])
                acc += tl.dot(s.to(v.dtype), v)
        if MODE >= 3:
            rows = tl.arange(0, BLOCK_M)
            ok = rows < BLOCK_M // 2
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            out_rows = pid * (BLOCK_M // 2) + rows
            tl.store(O_PART + out_rows[:, None] * HEADDIM + tl.arange(0, HEADDIM)[None, :], o, mask=ok[:, None])
            tl.store(OUT + out_rows, m_i + tl.log2(l_i), mask=ok)
        else:
            tl.store(OUT + pid, tl.sum(tl.sum(acc, 1), 0) + tl.sum(l_i, 0))


@triton.jit
def paged_stream_kernel(K, V, Q, OUT, BLOCK_TABLE, seqlen, stride_page, stride_tok, SPLITS: tl.constexpr,
                        HEADDIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr,
                        MODE: tl.constexpr):
    """stream_kernel's MODE 0 (sum) and 2 (two dots and the softmax) with pointer loads, as stage 1 reads pages
    smaller than a block: over a paged cache (num_pages, PAGE, nheads_kv, HEADDIM) each key's row comes from its
    page id (BLOCK_TABLE[key // PAGE], read per block), or PAGE == 0 over a contiguous (seqlen, nheads_kv, HEADDIM)
    cache. The same kernel on the same bytes with an identity and a shuffled block table times what the page order
    alone costs. seqlen must be a multiple of SPLITS * BLOCK_N (no masks)."""
    pid = tl.program_id(0)
    hk = pid // SPLITS
    split = pid % SPLITS
    chunk = seqlen // SPLITS
    start = split * chunk
    offs_d = tl.arange(0, HEADDIM)
    col = hk * HEADDIM + offs_d
    if MODE == 0:
        acc = tl.zeros([BLOCK_N, HEADDIM], tl.float32)
    else:
        q = tl.load(Q + tl.arange(0, BLOCK_M)[:, None] * HEADDIM + offs_d[None, :])
        acc = tl.zeros([BLOCK_M, HEADDIM], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for n in range(start, start + chunk, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        if PAGE == 0:
            rows = offs_n.to(tl.int64) * stride_tok
        else:
            page = tl.load(BLOCK_TABLE + offs_n // PAGE)
            rows = page.to(tl.int64) * stride_page + (offs_n % PAGE) * stride_tok
        ptrs = rows[:, None] + col[None, :]
        if MODE == 0:
            acc += tl.load(K + ptrs).to(tl.float32) + tl.load(V + ptrs).to(tl.float32)
        else:
            k = tl.load(K + ptrs)
            s = tl.dot(q, tl.trans(k)) * 0.12753
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            v = tl.load(V + ptrs)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    tl.store(OUT + pid, tl.sum(tl.sum(acc, 1), 0) + tl.sum(l_i, 0))


@triton.jit
def _fresh_state(Q, BLOCK_M: tl.constexpr, HEADDIM: tl.constexpr):
    """The probes' q tile (BLOCK_M, HEADDIM) from Q (row-major) and an empty softmax state: (q, acc, m_i, l_i)."""
    q = tl.load(Q + tl.arange(0, BLOCK_M)[:, None] * HEADDIM + tl.arange(0, HEADDIM)[None, :])
    return (q, tl.zeros([BLOCK_M, HEADDIM], tl.float32), tl.full([BLOCK_M], float("-inf"), tl.float32),
            tl.zeros([BLOCK_M], tl.float32))


@triton.jit
def _split_bounds(seqlen, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(kv head, split, first key, end key) of this program in a (kv head, split) grid of block-aligned chunks."""
    pid = tl.program_id(0)
    split = pid % SPLITS
    chunk = tl.cdiv(seqlen, SPLITS * BLOCK_N) * BLOCK_N
    start = split * chunk
    return pid // SPLITS, split, start, tl.minimum(start + chunk, seqlen)


@triton.jit
def _four_page_step(acc, m_i, l_i, q, K, V, r0, r1, r2, r3, col):
    """The page-box probes' step: q @ K^T for the four (PAGE, HEADDIM) descriptor boxes at rows r0..r3, one
    online-softmax update over their scores, then the four P @ V products. Returns (acc, m_i, l_i)."""
    s0 = tl.dot(q, tl.trans(K.load([r0, col]))) * 0.12753
    s1 = tl.dot(q, tl.trans(K.load([r1, col]))) * 0.12753
    s2 = tl.dot(q, tl.trans(K.load([r2, col]))) * 0.12753
    s3 = tl.dot(q, tl.trans(K.load([r3, col]))) * 0.12753
    m_new = tl.maximum(tl.maximum(tl.maximum(m_i, tl.max(s0, 1)), tl.maximum(tl.max(s1, 1), tl.max(s2, 1))),
                       tl.max(s3, 1))
    alpha = tl.exp2(m_i - m_new)
    p0 = tl.exp2(s0 - m_new[:, None])
    p1 = tl.exp2(s1 - m_new[:, None])
    p2 = tl.exp2(s2 - m_new[:, None])
    p3 = tl.exp2(s3 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p0, 1) + tl.sum(p1, 1) + tl.sum(p2, 1) + tl.sum(p3, 1)
    v0 = V.load([r0, col])
    v1 = V.load([r1, col])
    v2 = V.load([r2, col])
    v3 = V.load([r3, col])
    acc = acc * alpha[:, None]
    acc += tl.dot(p0.to(v0.dtype), v0) + tl.dot(p1.to(v1.dtype), v1)
    acc += tl.dot(p2.to(v2.dtype), v2) + tl.dot(p3.to(v3.dtype), v3)
    return acc, m_new, l_i


@triton.jit
def page_box_stream_kernel(K, V, Q, OUT, BLOCK_TABLE, seqlen, SPLITS: tl.constexpr, HEADDIM: tl.constexpr,
                           PAGE: tl.constexpr, BLOCK_M: tl.constexpr):
    """stream_kernel's MODE 2 over pages of PAGE keys with one tensor-descriptor load per page: K, V are descriptors
    over the cache viewed as (num_pages * PAGE, nheads_kv * HEADDIM) with (PAGE, HEADDIM) boxes; a step covers 4
    pages (ids read from BLOCK_TABLE), q @ K^T per page, one online-softmax update over the 4 pages' scores, then
    the 4 P @ V products. What a page-sized TMA design would stream at, with the softmax step kept at 4 pages.
    seqlen must be a multiple of SPLITS * 4 * PAGE."""
    pid = tl.program_id(0)
    hk = pid // SPLITS
    split = pid % SPLITS
    chunk = seqlen // SPLITS
    start = split * chunk
    col = hk * HEADDIM
    q, acc, m_i, l_i = _fresh_state(Q, BLOCK_M, HEADDIM)
    for n in range(start, start + chunk, 4 * PAGE):
        page = n // PAGE
        r0 = tl.load(BLOCK_TABLE + page) * PAGE
        r1 = tl.load(BLOCK_TABLE + page + 1) * PAGE
        r2 = tl.load(BLOCK_TABLE + page + 2) * PAGE
        r3 = tl.load(BLOCK_TABLE + page + 3) * PAGE
        acc, m_i, l_i = _four_page_step(acc, m_i, l_i, q, K, V, r0, r1, r2, r3, col)
    tl.store(OUT + pid, tl.sum(tl.sum(acc, 1), 0) + tl.sum(l_i, 0))


@triton.jit
def page_box_preload_kernel(K, V, Q, OUT, BLOCK_TABLE, seqlen, SPLITS: tl.constexpr, HEADDIM: tl.constexpr,
                            PAGE: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_PAGES: tl.constexpr):
    """page_box_stream_kernel with the split's page ids read once before the loop (SPLIT_PAGES = seqlen / (SPLITS *
    PAGE) ids in registers, as stage 1 preloads them) instead of four block-table reads per step: each step picks
    its four ids with one select-and-sum over the (SPLIT_PAGES / 4, 4) table and splits them into scalars for the
    four (PAGE, HEADDIM) descriptor loads. What page-sized TMA boxes stream at without in-loop table reads."""
    pid = tl.program_id(0)
    hk = pid // SPLITS
    split = pid % SPLITS
    chunk = seqlen // SPLITS
    start = split * chunk
    col = hk * HEADDIM
    ids = tl.load(BLOCK_TABLE + start // PAGE + tl.arange(0, SPLIT_PAGES))
    table = tl.reshape(ids, (SPLIT_PAGES // 4, 4))
    q, acc, m_i, l_i = _fresh_state(Q, BLOCK_M, HEADDIM)
    for step in range(0, SPLIT_PAGES // 4):
        quad = tl.sum(tl.where((tl.arange(0, SPLIT_PAGES // 4) == step)[:, None], table, 0), 0)
        even, odd = tl.split(tl.reshape(quad, (2, 2)))  # (ids 0, 2), (ids 1, 3)
        id0, id2 = tl.split(even)
        id1, id3 = tl.split(odd)
        r0 = id0 * PAGE
        r1 = id1 * PAGE
        r2 = id2 * PAGE
        r3 = id3 * PAGE
        acc, m_i, l_i = _four_page_step(acc, m_i, l_i, q, K, V, r0, r1, r2, r3, col)
    tl.store(OUT + pid, tl.sum(tl.sum(acc, 1), 0) + tl.sum(l_i, 0))


def _sets(ctx, nheads_kv, headdim, count, gen):
    return [tuple(torch.randn(ctx, nheads_kv * headdim, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(2)) for _ in range(count)]


def _stream_calls(sets, ctx, nheads_kv, headdim, splits, block_n, stages, block_m, mode, interleave=False):
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = torch.empty(nheads_kv * splits * block_m, device="cuda", dtype=torch.float32)
    o_part = torch.empty(nheads_kv * splits * block_m * headdim, device="cuda", dtype=torch.float32)
    lens = torch.full((1,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(block_m, headdim, device="cuda", dtype=torch.bfloat16)
    calls = []
    for k, v in sets:
        kd, vd = (TensorDescriptor(x, [ctx, nheads_kv * headdim], [nheads_kv * headdim, 1], [block_n, headdim])
                  for x in (k, v))

        def call(kd=kd, vd=vd):
            stream_kernel[(nheads_kv * splits,)](kd, vd, q, out, o_part, lens, ctx, SPLITS=splits, HEADDIM=headdim,
                                                 BLOCK_N=block_n, BLOCK_M=block_m, MODE=mode, INTERLEAVE=interleave,
                                                 num_warps=4, num_stages=stages)
        calls.append(call)
    return calls


VARIANTS = [  # (label, splits per kv head, BLOCK_N, stages, BLOCK_M, MODE of stream_kernel)
    ("sum s64 bn64", 64, 64, 3, 16, 0), ("dot s64 bn64", 64, 64, 3, 16, 1), ("dot s64 bn64 m64", 64, 64, 3, 64, 1),
    ("sm s64 bn64", 64, 64, 3, 16, 2), ("sm s64 bn64 m64", 64, 64, 3, 64, 2), ("dot s128 bn64", 128, 64, 3, 16, 1),
    ("sm s128 bn64", 128, 64, 3, 16, 2), ("dot s64 bn128", 64, 128, 3, 16, 1), ("sm s64 bn128", 64, 128, 3, 16, 2),
    ("sm s64 bn64 st4", 64, 64, 4, 16, 2), ("sm s66 bn64", 66, 64, 3, 16, 2), ("sm s32 bn128", 32, 128, 3, 16, 2),
    ("epi s64 bn64", 64, 64, 3, 16, 3), ("len s64 bn64", 64, 64, 3, 16, 4),
    # many short splits (several programs per SM, the hardware balancing them like a flat read sweep's programs)
    ("epi s128 bn64", 128, 64, 3, 16, 3), ("epi s256 bn64 st2", 256, 64, 2, 16, 3),
    ("epi s512 bn64 st2", 512, 64, 2, 16, 3), ("epi s256 bn128 st2", 256, 128, 2, 16, 3),
    ("epi s1024 bn32 st2", 1024, 32, 2, 16, 3), ("epi s512 bn32 st2", 512, 32, 2, 16, 3),
    ("sm s256 bn64 st1", 256, 64, 1, 16, 2), ("sm s512 bn64 st1", 512, 64, 1, 16, 2),
]


# the same, with each split's blocks interleaved with the other splits' (stream_kernel INTERLEAVE)
INTERLEAVED_VARIANTS = [
    ("sum s64 bn64 il", 64, 64, 3, 16, 0), ("sm s64 bn64 il", 64, 64, 3, 16, 2), ("epi s64 bn64 il", 64, 64, 3, 16, 3),
    ("epi s128 bn64 il", 128, 64, 3, 16, 3), ("sm s64 bn128 il", 64, 128, 3, 16, 2),
    ("sm s64 bn64 st4 il", 64, 64, 4, 16, 2),
]


def _block_table(num_pages, shuffled, gen):
    """int32 (num_pages,) page ids on the GPU: the identity (pages in memory order) or a random permutation."""
    if shuffled:
        return torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    return torch.arange(num_pages, device="cuda", dtype=torch.int32)


def _paged_stream_calls(sets, ctx, nheads_kv, headdim, splits, block_n, stages, block_m, mode, page, shuffled,
                        gen):
    """paged_stream_kernel over the same K/V sets viewed as pages of ``page`` keys (0: contiguous): the block table
    is the identity (the pages in memory order) or a random permutation (``shuffled``), the bytes read the same."""
    out = torch.empty(nheads_kv * splits, device="cuda", dtype=torch.float32)
    q = torch.randn(block_m, headdim, device="cuda", dtype=torch.bfloat16)
    calls = []
    for k, v in sets:
        table = _block_table(ctx // max(page, 1), shuffled, gen)

        def call(k=k, v=v, table=table):
            paged_stream_kernel[(nheads_kv * splits,)](k, v, q, out, table, ctx, page * nheads_kv * headdim,
                                                       nheads_kv * headdim, SPLITS=splits, HEADDIM=headdim,
                                                       BLOCK_N=block_n, BLOCK_M=block_m, PAGE=page, MODE=mode,
                                                       num_warps=4, num_stages=stages)
        calls.append(call)
    return calls


def _page_box_calls(sets, ctx, nheads_kv, headdim, splits, page, stages, block_m, shuffled, gen):
    """page_box_stream_kernel over the same K/V sets as (page, headdim) boxes, identity or shuffled block table."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = torch.empty(nheads_kv * splits, device="cuda", dtype=torch.float32)
    q = torch.randn(block_m, headdim, device="cuda", dtype=torch.bfloat16)
    calls = []
    for k, v in sets:
        table = _block_table(ctx // page, shuffled, gen)
        kd, vd = (TensorDescriptor(x, [ctx, nheads_kv * headdim], [nheads_kv * headdim, 1], [page, headdim])
                  for x in (k, v))

        def call(kd=kd, vd=vd, table=table):
            page_box_stream_kernel[(nheads_kv * splits,)](kd, vd, q, out, table, ctx, SPLITS=splits, HEADDIM=headdim,
                                                          PAGE=page, BLOCK_M=block_m, num_warps=4, num_stages=stages)
        calls.append(call)
    return calls


def _page_box_preload_calls(sets, ctx, nheads_kv, headdim, splits, page, stages, block_m, shuffled, gen):
    """page_box_preload_kernel over the same K/V sets as (page, headdim) boxes, identity or shuffled block table."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = torch.empty(nheads_kv * splits, device="cuda", dtype=torch.float32)
    q = torch.randn(block_m, headdim, device="cuda", dtype=torch.bfloat16)
    split_pages = ctx // (splits * page)
    calls = []
    for k, v in sets:
        table = _block_table(ctx // page, shuffled, gen)
        kd, vd = (TensorDescriptor(x, [ctx, nheads_kv * headdim], [nheads_kv * headdim, 1], [page, headdim])
                  for x in (k, v))

        def call(kd=kd, vd=vd, table=table):
            page_box_preload_kernel[(nheads_kv * splits,)](kd, vd, q, out, table, ctx, SPLITS=splits,
                                                           HEADDIM=headdim, PAGE=page, BLOCK_M=block_m,
                                                           SPLIT_PAGES=split_pages, num_warps=4, num_stages=stages)
        calls.append(call)
    return calls


BOX_PRELOAD_VARIANTS = [  # (label, splits per kv head, page size, stages, BLOCK_M, shuffled)
    ("boxpre sm page16 in order", 64, 16, 3, 16, False), ("boxpre sm page16 shuffled", 64, 16, 3, 16, True),
    ("boxpre sm page16 shuffled st4", 64, 16, 4, 16, True), ("boxpre sm page16 shuffled st2", 64, 16, 2, 16, True),
    ("boxpre sm page32 shuffled", 64, 32, 3, 16, True),
]


BOX_VARIANTS = [  # (label, splits per kv head, page size, stages, BLOCK_M, shuffled)
    ("box4 sm page16 in order", 64, 16, 3, 16, False), ("box4 sm page16 shuffled", 64, 16, 3, 16, True),
    ("box4 sm page16 shuffled st4", 64, 16, 4, 16, True), ("box4 sm page32 shuffled", 64, 32, 3, 16, True),
]


PAGED_VARIANTS = [  # (label, splits per kv head, BLOCK_N, stages, BLOCK_M, MODE, page size (0: contiguous), shuffled)
    ("ptr sum contig", 64, 64, 3, 16, 0, 0, False), ("ptr sum page16 in order", 64, 64, 3, 16, 0, 16, False),
    ("ptr sum page16 shuffled", 64, 64, 3, 16, 0, 16, True), ("ptr sm contig", 64, 64, 3, 16, 2, 0, False),
    ("ptr sm page16 in order", 64, 64, 3, 16, 2, 16, False), ("ptr sm page16 shuffled", 64, 64, 3, 16, 2, 16, True),
    ("ptr sm page64 shuffled", 64, 64, 3, 16, 2, 64, True),
    # register loads (no cp.async pipeline) in many short splits: several programs per SM hide the latency
    ("ptr sm contig s64 st1", 64, 64, 1, 16, 2, 0, False), ("ptr sm contig s128 st1", 128, 64, 1, 16, 2, 0, False),
    ("ptr sm contig s256 st1", 256, 64, 1, 16, 2, 0, False), ("ptr sm contig s512 st1", 512, 64, 1, 16, 2, 0, False),
    ("ptr sm contig s256 st2", 256, 64, 2, 16, 2, 0, False),
]


@triton.jit
def _descriptor_softmax_step(acc, m_i, l_i, q, K, V, n, col):
    """stream_kernel's MODE 2 step over the descriptors' block at row n, column col: q @ K^T, the online softmax,
    then the V load and P @ V. Returns (acc, m_i, l_i)."""
    s = tl.dot(q, tl.trans(K.load([n, col]))) * 0.12753
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = V.load([n, col])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), m_new, l_i


@triton.jit
def rows_stream_kernel(K, V, Q, OUT, O_PART, seqlen, SPLITS: tl.constexpr, WIDTH: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, MODE: tl.constexpr):
    """stream_kernel's MODE 2 / 3 with one program per split for all kv heads at once: K, V are descriptors over
    (seqlen, WIDTH = nheads_kv * HEADDIM) with (BLOCK_N, WIDTH) boxes, i.e. whole cache rows (every head's bytes of
    a key are adjacent in memory), and Q (BLOCK_M, WIDTH) is block-diagonal (each query row is zero outside its kv
    head's columns), so one q @ K^T gives every row its own head's scores and P @ V its head's output among the
    WIDTH columns. What the per-head strided reads cost against reading whole rows."""
    pid = tl.program_id(0)
    chunk = tl.cdiv(seqlen, SPLITS * BLOCK_N) * BLOCK_N
    start = pid * chunk
    end = tl.minimum(start + chunk, seqlen)
    q = tl.load(Q + tl.arange(0, BLOCK_M)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :])
    acc = tl.zeros([BLOCK_M, WIDTH], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for n in range(start, end, BLOCK_N):
        acc, m_i, l_i = _descriptor_softmax_step(acc, m_i, l_i, q, K, V, n, 0)
    if MODE >= 3:
        rows = tl.arange(0, BLOCK_M)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_rows = pid * BLOCK_M + rows
        tl.store(O_PART + out_rows[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :], o)
        tl.store(OUT + out_rows, m_i + tl.log2(l_i))
    else:
        tl.store(OUT + pid, tl.sum(tl.sum(acc, 1), 0) + tl.sum(l_i, 0))


def _rows_stream_calls(sets, ctx, nheads_kv, headdim, splits, block_n, stages, mode):
    """rows_stream_kernel over each rotated K/V set: ``splits`` programs, 8 query rows per kv head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    width = nheads_kv * headdim
    block_m = max(16, 8 * nheads_kv)
    out = torch.empty(splits * block_m, device="cuda", dtype=torch.float32)
    o_part = torch.empty(splits * block_m * width, device="cuda", dtype=torch.float32)
    q = torch.randn(block_m, width, device="cuda", dtype=torch.bfloat16)
    head_of_row = torch.arange(block_m, device="cuda") // 8
    head_of_col = torch.arange(width, device="cuda") // headdim
    q = q * (head_of_row[:, None] == head_of_col[None, :])
    calls = []
    for k, v in sets:
        kd, vd = (TensorDescriptor(x, [ctx, width], [width, 1], [block_n, width]) for x in (k, v))

        def call(kd=kd, vd=vd):
            rows_stream_kernel[(splits,)](kd, vd, q, out, o_part, ctx, SPLITS=splits, WIDTH=width, BLOCK_N=block_n,
                                          BLOCK_M=block_m, MODE=mode, num_warps=4, num_stages=stages)
        calls.append(call)
    return calls


ROWS_VARIANTS = [  # (label, splits, BLOCK_N, stages, MODE of rows_stream_kernel)
    ("rows sm s64 bn32", 64, 32, 3, 2), ("rows sm s128 bn32", 128, 32, 3, 2), ("rows sm s128 bn64 st2", 128, 64, 2, 2),
    ("rows sm s256 bn32 st2", 256, 32, 2, 2), ("rows epi s128 bn32", 128, 32, 3, 3),
    ("rows sm s132 bn32", 132, 32, 3, 2), ("rows sm s128 bn32 st4", 128, 32, 4, 2),
]


@triton.jit
def ws_stream_kernel(K, V, Q, OUT, seqlen, stride_tok, SPLITS: tl.constexpr, HEADDIM: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, WS: tl.constexpr):
    """stream_kernel's MODE 2 with device-side tensor descriptors (what Triton's Hopper warp specialisation needs)
    and the KV loop warp-specialised (WS: a producer warp group issues the TMA loads, the others compute) or not."""
    hk, _, start, end = _split_bounds(seqlen, SPLITS, BLOCK_N)
    kd = tl.make_tensor_descriptor(K + hk * HEADDIM, shape=[seqlen, HEADDIM], strides=[stride_tok, 1],
                                   block_shape=[BLOCK_N, HEADDIM])
    vd = tl.make_tensor_descriptor(V + hk * HEADDIM, shape=[seqlen, HEADDIM], strides=[stride_tok, 1],
                                   block_shape=[BLOCK_N, HEADDIM])
    q, acc, m_i, l_i = _fresh_state(Q, BLOCK_M, HEADDIM)
    for n in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        acc, m_i, l_i = _descriptor_softmax_step(acc, m_i, l_i, q, kd, vd, n, 0)
    tl.store(OUT + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0) + tl.sum(l_i, 0))


def _ws_stream_calls(sets, ctx, nheads_kv, headdim, splits, block_n, stages, block_m, warps, ws):
    """ws_stream_kernel over each rotated K/V set (device-side descriptors: a scratch allocator is installed)."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    out = torch.empty(nheads_kv * splits, device="cuda", dtype=torch.float32)
    q = torch.randn(block_m, headdim, device="cuda", dtype=torch.bfloat16)
    return [lambda k=k, v=v: ws_stream_kernel[(nheads_kv * splits,)](
        k, v, q, out, ctx, nheads_kv * headdim, SPLITS=splits, HEADDIM=headdim, BLOCK_N=block_n, BLOCK_M=block_m,
        WS=ws, num_warps=warps, num_stages=stages) for k, v in sets]


WS_VARIANTS = [  # (label, splits per kv head, BLOCK_N, stages, BLOCK_M, warps, warp-specialised)
    ("dev sm s64 bn64", 64, 64, 3, 16, 4, False), ("ws sm s64 bn64", 64, 64, 3, 16, 4, True),
    ("ws sm s64 bn64 m64", 64, 64, 3, 64, 4, True), ("ws sm s64 bn64 st4", 64, 64, 4, 16, 4, True),
    ("ws sm s64 bn128 st2", 64, 128, 2, 16, 4, True), ("ws sm s64 bn64 w8", 64, 64, 3, 64, 8, True),
]


@triton.jit
def read_kernel(K, V, OUT, BLOCK: tl.constexpr):
    """Program p reads elements [p * BLOCK, (p + 1) * BLOCK) of K and of V (flat, unmasked: the launcher sizes the
    grid to whole blocks) and writes their sum: a read-only sweep with as many small programs as a copy kernel
    launches, i.e. what reading the bytes costs without any decode structure (one program per split and head)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = tl.sum(tl.load(K + offs).to(tl.float32), 0) + tl.sum(tl.load(V + offs).to(tl.float32), 0)
    tl.store(OUT + tl.program_id(0), total)


@triton.jit
def read_loop_kernel(K, V, OUT, numel, chunk, BLOCK: tl.constexpr):
    """Program p reads elements [p * chunk, (p + 1) * chunk) of K and of V (flat) in BLOCK steps and writes their
    sum: the flat sweep with a fixed program count (one or a few per SM) looping, as stage 1 does."""
    start = tl.program_id(0).to(tl.int64) * chunk
    end = tl.minimum(start + chunk, numel)
    acc = tl.zeros([BLOCK], tl.float32)
    for n in range(start, end, BLOCK):
        offs = n + tl.arange(0, BLOCK)
        acc += tl.load(K + offs, mask=offs < end, other=0.0).to(tl.float32)
        acc += tl.load(V + offs, mask=offs < end, other=0.0).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(acc, 0))


def _read_loop_calls(sets, programs, block, warps, stages, out):
    """read_loop_kernel over each rotated K/V set: ``programs`` programs, each a contiguous 1/programs of the
    elements (rounded up to whole blocks); sums into ``out`` (float32, >= programs)."""
    numel = sets[0][0].numel()
    chunk = triton.cdiv(triton.cdiv(numel, programs), block) * block
    return [lambda k=k, v=v: read_loop_kernel[(programs,)](k, v, out, numel, chunk, BLOCK=block, num_warps=warps,
                                                           num_stages=stages)
            for k, v in sets]


READ_LOOP_VARIANTS = [  # (label, programs, BLOCK, warps, stages)
    ("readloop p128 b8192 st1", 128, 8192, 8, 1), ("readloop p128 b8192 st3", 128, 8192, 8, 3),
    ("readloop p528 b8192 st1", 528, 8192, 8, 1), ("readloop p1056 b4096 st1", 1056, 4096, 4, 1),
    ("readloop p132 b16384 st1", 132, 16384, 16, 1),
]


@triton.jit
def read_queue_kernel(K, V, OUT, QUEUE, nblocks, BLOCK: tl.constexpr):
    """A fixed number of programs draw BLOCK-element blocks of K and V (flat) from an atomic counter until none is
    left and write the sum of what they read: the flat sweep's dynamic balance with looping programs. The next
    block's ticket is drawn before the current block is read, so the atomic's round trip overlaps the loads.
    QUEUE: int32 (2,) zeros at rest; the last program to finish (QUEUE[1]) sets both back to 0."""
    blk = tl.atomic_add(QUEUE, 1, sem="relaxed", scope="gpu")
    acc = tl.zeros([BLOCK], tl.float32)
    while blk < nblocks:
        nxt = tl.atomic_add(QUEUE, 1, sem="relaxed", scope="gpu")
        offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(K + offs).to(tl.float32) + tl.load(V + offs).to(tl.float32)
        blk = nxt
    tl.store(OUT + tl.program_id(0), tl.sum(acc, 0))
    done = tl.atomic_add(QUEUE + 1, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(QUEUE, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(QUEUE + 1, 0, sem="relaxed", scope="gpu")


def _whole_blocks(sets, block) -> int:
    """How many ``block``-element blocks the K (and V) tensors of ``sets`` hold; ValueError unless it is whole."""
    numel = sets[0][0].numel()
    if numel % block:
        raise ValueError(f"block must divide the K/V element count {numel}, got {block}")
    return numel // block


def _read_queue_calls(sets, programs, block, warps, out, queue):
    """read_queue_kernel over each rotated K/V set: ``programs`` programs share the int32 (2,) zero ``queue``;
    sums into ``out`` (float32, >= programs)."""
    nblocks = _whole_blocks(sets, block)
    return [lambda k=k, v=v: read_queue_kernel[(programs,)](k, v, out, queue, nblocks, BLOCK=block, num_warps=warps)
            for k, v in sets]


READ_QUEUE_VARIANTS = [  # (label, programs, BLOCK, warps)
    ("readq p528 b8192", 528, 8192, 8), ("readq p1056 b4096", 1056, 4096, 4), ("readq p264 b8192", 264, 8192, 8),
]


def _read_calls(sets, block, warps, out):
    """read_kernel over each rotated K/V set: numel / block programs of ``warps`` warps, sums into ``out`` (float32,
    numel / block)."""
    nblocks = _whole_blocks(sets, block)
    return [lambda k=k, v=v: read_kernel[(nblocks,)](k, v, out, BLOCK=block, num_warps=warps) for k, v in sets]


READ_VARIANTS = [("read b4096 w4", 4096, 4), ("read b8192 w8", 8192, 8), ("read b16384 w8", 16384, 8)]


def _torch_calls(sets, kind):
    """What the GPU's own copy and reduction kernels take for the same bytes at the same size, rotated likewise:
    "copy" copies K into a buffer of its size (read + write = the K/V bytes, the traffic the floor is defined by:
    bytes / copy bandwidth), "sum" reduces K and V (reads the K/V bytes once, two launches)."""
    calls = []
    for k, v in sets:
        if kind == "copy":
            dst = torch.empty_like(k)
            calls.append(lambda k=k, dst=dst: dst.copy_(k))
        else:
            calls.append(lambda k=k, v=v: (k.sum(dtype=torch.float32), v.sum(dtype=torch.float32)))
    return calls


TORCH_VARIANTS = ["torch copy", "torch sum"]


def main() -> int:
    from flashdecode.bench.report import result_stem, write_json
    from flashdecode.timing import copy_bandwidth_bytes_per_s, cuda_graph_time_us, env_info, rotation_count

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,32768,65536,131072")
    parser.add_argument("--variants", default=None, help="comma-separated labels (default: all)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    torch.cuda.set_device(0)
    env = env_info()
    bandwidth = copy_bandwidth_bytes_per_s()
    nheads_kv, headdim = 2, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    chosen = None if args.variants is None else set(args.variants.split(","))
    (variants, interleaved, paged, boxes, box_preloads, reads, read_loops, read_queues, rows_variants,
     ws_variants) = ([v for v in table if chosen is None or v[0] in chosen]
                     for table in (VARIANTS, INTERLEAVED_VARIANTS, PAGED_VARIANTS, BOX_VARIANTS, BOX_PRELOAD_VARIANTS,
                                   READ_VARIANTS, READ_LOOP_VARIANTS, READ_QUEUE_VARIANTS, ROWS_VARIANTS,
                                   WS_VARIANTS))
    torch_kinds = [label for label in TORCH_VARIANTS if chosen is None or label in chosen]
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        kv_bytes = 2 * ctx * nheads_kv * headdim * 2
        sets = _sets(ctx, nheads_kv, headdim, rotation_count(kv_bytes), gen)
        row = {"context": ctx, "floor_us": kv_bytes / bandwidth * 1e6}
        for label, splits, block_n, stages, block_m, mode in variants:
            row[label] = cuda_graph_time_us(_stream_calls(sets, ctx, nheads_kv, headdim, splits, block_n, stages,
                                                          block_m, mode), reps=args.reps)
        for label, splits, block_n, stages, block_m, mode in interleaved:
            row[label] = cuda_graph_time_us(_stream_calls(sets, ctx, nheads_kv, headdim, splits, block_n, stages,
                                                          block_m, mode, interleave=True), reps=args.reps)
        for label, splits, block_n, stages, block_m, mode, page, shuffled in paged:
            row[label] = cuda_graph_time_us(_paged_stream_calls(sets, ctx, nheads_kv, headdim, splits, block_n,
                                                                stages, block_m, mode, page, shuffled, gen),
                                            reps=args.reps)
        for label, splits, page, stages, block_m, shuffled in boxes:
            row[label] = cuda_graph_time_us(_page_box_calls(sets, ctx, nheads_kv, headdim, splits, page, stages,
                                                            block_m, shuffled, gen), reps=args.reps)
        for label, splits, page, stages, block_m, shuffled in box_preloads:
            row[label] = cuda_graph_time_us(_page_box_preload_calls(sets, ctx, nheads_kv, headdim, splits, page,
                                                                    stages, block_m, shuffled, gen), reps=args.reps)
        for label, splits, block_n, stages, mode in rows_variants:
            row[label] = cuda_graph_time_us(_rows_stream_calls(sets, ctx, nheads_kv, headdim, splits, block_n,
                                                               stages, mode), reps=args.reps)
        for label, splits, block_n, stages, block_m, warps, ws in ws_variants:
            try:
                row[label] = cuda_graph_time_us(_ws_stream_calls(sets, ctx, nheads_kv, headdim, splits, block_n,
                                                                 stages, block_m, warps, ws), reps=args.reps)
            except Exception as exc:  # noqa: BLE001 - an experimental compiler path: report, keep timing the rest
                print(f"{label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                row[label] = None
        for label in torch_kinds:
            row[label] = cuda_graph_time_us(_torch_calls(sets, label.split()[1]), reps=args.reps)
        for label, block, warps in reads:
            out = torch.empty(sets[0][0].numel() // block, device="cuda", dtype=torch.float32)
            row[label] = cuda_graph_time_us(_read_calls(sets, block, warps, out), reps=args.reps)
        for label, programs, block, warps, stages in read_loops:
            out = torch.empty(programs, device="cuda", dtype=torch.float32)
            row[label] = cuda_graph_time_us(_read_loop_calls(sets, programs, block, warps, stages, out),
                                            reps=args.reps)
        for label, programs, block, warps in read_queues:
            out = torch.empty(programs, device="cuda", dtype=torch.float32)
            queue = torch.zeros(2, device="cuda", dtype=torch.int32)
            row[label] = cuda_graph_time_us(_read_queue_calls(sets, programs, block, warps, out, queue),
                                            reps=args.reps)
        print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = write_json(out / f"{result_stem('stream_floor', env)}.json", "stream_floor",
                      dict(env, copy_bandwidth_TBps=bandwidth / 1e12), rows,
                      {"variants": [list(v) for v in variants + paged + boxes + box_preloads + reads + read_loops
                                    + read_queues + rows_variants + ws_variants] + torch_kinds})
    print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
