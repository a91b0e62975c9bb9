"""benchmarks/probes/stream.py's probe kernel (the streaming floor of a split-KV stage 1) computes what it claims:
each program's attention over its chunk of keys (modes 3 and 4, against the float64 reference) or the sum of its K/V
tiles (mode 0). It is a measurement tool, but its numbers are only a floor if it does the same work as stage 1."""

import pytest
import torch

from helpers import DEVICE, HAS_CUDA, randn

pytestmark = pytest.mark.probes

SPLITS, HEADDIM, BLOCK_N, BLOCK_M, NHEADS_KV, CTX = 4, 32, 16, 16, 2, 256
SCORE_SCALE = 0.12753  # the probe's fixed logit scale, in log2 units


def _run(mode, gen, dtype, interleave=False):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.probes.stream import stream_kernel

    k, v = (randn(CTX, NHEADS_KV * HEADDIM, gen=gen, dtype=dtype) for _ in range(2))
    q = randn(BLOCK_M, HEADDIM, gen=gen, dtype=dtype)
    out = torch.full((NHEADS_KV * SPLITS * BLOCK_M,), float("nan"), device=DEVICE)
    o_part = torch.full((NHEADS_KV * SPLITS * BLOCK_M // 2, HEADDIM), float("nan"), device=DEVICE)
    lens = torch.tensor([CTX], dtype=torch.int32, device=DEVICE)
    kd, vd = (TensorDescriptor(x, [CTX, NHEADS_KV * HEADDIM], [NHEADS_KV * HEADDIM, 1], [BLOCK_N, HEADDIM])
              for x in (k, v))
    # mode 4 reads the length from lens: pass a wrong one as the argument to prove it
    stream_kernel[(NHEADS_KV * SPLITS,)](kd, vd, q, out, o_part, lens, CTX if mode != 4 else 1, SPLITS=SPLITS,
                                         HEADDIM=HEADDIM, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, MODE=mode,
                                         INTERLEAVE=interleave)
    return q, k, v, out, o_part


def _chunks(x, interleave=False):
    """(programs, CTX // SPLITS, HEADDIM) views of K or V per (kv head, split), the kernel's program order: one
    contiguous chunk per split, or (interleave) blocks s, s + SPLITS, ... of BLOCK_N keys."""
    def keys(s):
        if interleave:
            return x.view(CTX // (SPLITS * BLOCK_N), SPLITS, BLOCK_N, -1)[:, s].reshape(CTX // SPLITS, -1)
        return x[s * (CTX // SPLITS):(s + 1) * (CTX // SPLITS)]
    return torch.stack([keys(s)[:, hk * HEADDIM:(hk + 1) * HEADDIM] for hk in range(NHEADS_KV) for s in range(SPLITS)])


def _attention(q, k, v, dtype):
    s = torch.einsum("md,pnd->pmn", q.to(dtype), k.to(dtype)) * SCORE_SCALE
    p = torch.softmax(s * torch.log(torch.tensor(2.0, dtype=dtype)), dim=-1)
    return torch.einsum("pmn,pnd->pmd", p, v.to(dtype))


@pytest.mark.parametrize("mode,interleave", [(3, False), (4, False), (3, True)])
def test_stream_probe_attends_over_its_chunk(mode, interleave):
    gen = torch.Generator().manual_seed(mode)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16  # the interpreter's bf16 dot is wrong
    q, k, v, out, o_part = _run(mode, gen, dtype, interleave)
    kc, vc = _chunks(k, interleave), _chunks(v, interleave)
    ref = _attention(q, kc, vc, torch.float64)[:, : BLOCK_M // 2].reshape(-1, HEADDIM)
    same = _attention(q, kc, vc, dtype).float()[:, : BLOCK_M // 2].reshape(-1, HEADDIM)
    err, base = (o_part.double().cpu() - ref.cpu()).abs().max(), (same.double().cpu() - ref.cpu()).abs().max()
    assert not torch.isnan(o_part).any() and err <= 3 * base + 1e-5, (err, base)


def test_stream_probe_sums_its_tiles():
    gen = torch.Generator().manual_seed(0)
    _, k, v, out, _ = _run(0, gen, torch.float16)
    ref = (_chunks(k).double() + _chunks(v).double()).sum(dim=(1, 2))
    torch.testing.assert_close(out[: NHEADS_KV * SPLITS].double().cpu(), ref.cpu(), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("page", [0, 8])
def test_paged_stream_probe_sums_the_keys_its_block_table_names(page):
    """The paged probe reads logical key i of a program's chunk from page table[i // page] (shuffled), row i % page:
    its per-program sums match those of the keys the table names (page 0: the contiguous cache)."""
    from benchmarks.probes.stream import paged_stream_kernel

    gen = torch.Generator().manual_seed(page)
    k, v = (randn(CTX, NHEADS_KV * HEADDIM, gen=gen, dtype=torch.float16) for _ in range(2))
    table = torch.randperm(CTX // max(page, 1), generator=gen).to(torch.int32)
    out = torch.full((NHEADS_KV * SPLITS,), float("nan"), device=DEVICE)
    paged_stream_kernel[(NHEADS_KV * SPLITS,)](k, v, k, out, table.to(DEVICE), CTX, page * NHEADS_KV * HEADDIM,
                                               NHEADS_KV * HEADDIM, SPLITS=SPLITS, HEADDIM=HEADDIM, BLOCK_N=BLOCK_N,
                                               BLOCK_M=BLOCK_M, PAGE=page, MODE=0)
    logical = torch.arange(CTX)
    physical = logical if page == 0 else table.long()[logical // page] * page + logical % page
    ref = _chunks(k.cpu()[physical].double() + v.cpu()[physical].double()).sum(dim=(1, 2))
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-4, atol=1e-2)


def test_page_box_probe_attends_over_the_pages_its_block_table_names():
    """The page-box probe (one descriptor load per page, 4 pages per softmax step) computes each program's softmax
    sum plus its unnormalised output sum over the keys its shuffled block table names, as the float64 reference."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.probes.stream import page_box_stream_kernel

    page = 16  # the P @ V dots' inner size: >= 16 on the GPU
    gen = torch.Generator().manual_seed(7)
    k, v = (randn(CTX, NHEADS_KV * HEADDIM, gen=gen, dtype=torch.float16) for _ in range(2))
    q = randn(BLOCK_M, HEADDIM, gen=gen, dtype=torch.float16)
    table = torch.randperm(CTX // page, generator=gen).to(torch.int32)
    out = torch.full((NHEADS_KV * SPLITS,), float("nan"), device=DEVICE)
    kd, vd = (TensorDescriptor(x, [CTX, NHEADS_KV * HEADDIM], [NHEADS_KV * HEADDIM, 1], [page, HEADDIM])
              for x in (k, v))
    page_box_stream_kernel[(NHEADS_KV * SPLITS,)](kd, vd, q, out, table.to(DEVICE), CTX, SPLITS=SPLITS,
                                                  HEADDIM=HEADDIM, PAGE=page, BLOCK_M=BLOCK_M)
    logical = torch.arange(CTX)
    physical = table.long()[logical // page] * page + logical % page
    kc, vc = _chunks(k.cpu()[physical].double()), _chunks(v.cpu()[physical].double())
    s = torch.einsum("md,pnd->pmn", q.cpu().double(), kc) * SCORE_SCALE
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp2(s - m)
    ref = torch.einsum("pmn,pnd->pmd", p, vc).sum(dim=(1, 2)) + p.sum(dim=(1, 2))
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-3, atol=1e-2)


def test_torch_reference_calls_move_the_bytes_they_name():
    """The library-kernel references: "copy" copies K (one buffer per rotated set, so every call writes fresh
    memory), "sum" reduces K and V."""
    from benchmarks.probes.stream import _torch_calls

    gen = torch.Generator().manual_seed(3)
    sets = [tuple(randn(64, NHEADS_KV * HEADDIM, gen=gen, dtype=torch.float16) for _ in range(2)) for _ in range(2)]
    copies = [call() for call in _torch_calls(sets, "copy")]
    assert all(torch.equal(dst, k) and dst.data_ptr() != k.data_ptr() for dst, (k, _) in zip(copies, sets))
    assert copies[0].data_ptr() != copies[1].data_ptr()
    for (ks, vs), (k, v) in zip((call() for call in _torch_calls(sets, "sum")), sets):
        torch.testing.assert_close(ks, k.float().sum())
        torch.testing.assert_close(vs, v.float().sum())


def test_read_sweep_sums_every_block_of_k_and_v():
    """The flat read-only reference: program p's output is the sum of block p of K plus block p of V."""
    from benchmarks.probes.stream import _read_calls

    gen = torch.Generator().manual_seed(4)
    k, v = (randn(64, NHEADS_KV * HEADDIM, gen=gen, dtype=torch.float16) for _ in range(2))
    block = 512
    out = torch.full((k.numel() // block,), float("nan"), device=DEVICE)
    (call,) = _read_calls([(k, v)], block, 4, out)
    call()
    ref = (k.double().reshape(-1, block) + v.double().reshape(-1, block)).sum(1)
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=1e-4, atol=1e-2)
    with pytest.raises(ValueError, match="block"):
        _read_calls([(k, v)], 1000, 4, out)


def test_read_loop_sums_each_programs_chunk():
    """The looping read reference: program p sums its contiguous chunk of K and V, the last chunk cut at the end."""
    from benchmarks.probes.stream import _read_loop_calls

    gen = torch.Generator().manual_seed(5)
    k, v = (randn(50, NHEADS_KV * HEADDIM, gen=gen, dtype=torch.float16) for _ in range(2))
    programs, block = 3, 256
    out = torch.full((programs,), float("nan"), device=DEVICE)
    (call,) = _read_loop_calls([(k, v)], programs, block, 4, 1, out)
    call()
    chunk = -(-(-(-k.numel() // programs)) // block) * block
    flat = k.double().flatten() + v.double().flatten()
    ref = torch.stack([flat[p * chunk:(p + 1) * chunk].sum() for p in range(programs)])
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=1e-4, atol=1e-2)


def test_read_queue_reads_every_block_once_and_resets_its_counter():
    """The queue reference: whatever blocks each program draws, the programs' sums add up to the sum of K and V
    (every block read once), and the counter is back at zero for the next launch (two launches, same result)."""
    from benchmarks.probes.stream import _read_queue_calls

    gen = torch.Generator().manual_seed(6)
    k, v = (randn(64, NHEADS_KV * HEADDIM, gen=gen, dtype=torch.float16) for _ in range(2))
    programs, block = 3, 512
    queue = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    ref = k.double().sum() + v.double().sum()
    for _ in range(2):
        out = torch.full((programs,), float("nan"), device=DEVICE)
        (call,) = _read_queue_calls([(k, v)], programs, block, 4, out, queue)
        call()
        torch.testing.assert_close(out.double().sum().cpu(), ref.cpu(), rtol=1e-4, atol=1e-2)
        assert queue.tolist() == [0, 0]


def test_whole_row_probe_gives_each_row_its_own_heads_attention():
    """rows_stream_kernel reads whole cache rows (every kv head's columns of a key) with a block-diagonal q: each
    query row's partial, in its own kv head's columns, is that head's attention over the program's chunk."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.probes.stream import rows_stream_kernel

    gen = torch.Generator().manual_seed(7)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16  # the interpreter's bf16 dot is wrong
    width, group = NHEADS_KV * HEADDIM, BLOCK_M // NHEADS_KV
    k, v = (randn(CTX, width, gen=gen, dtype=dtype) for _ in range(2))
    head_of_row = torch.arange(BLOCK_M, device=DEVICE) // group
    q = randn(BLOCK_M, width, gen=gen, dtype=dtype) * (head_of_row[:, None] == torch.arange(
        width, device=DEVICE)[None, :] // HEADDIM)
    out = torch.full((SPLITS * BLOCK_M,), float("nan"), device=DEVICE)
    o_part = torch.full((SPLITS * BLOCK_M, width), float("nan"), device=DEVICE)
    kd, vd = (TensorDescriptor(x, [CTX, width], [width, 1], [BLOCK_N, width]) for x in (k, v))
    rows_stream_kernel[(SPLITS,)](kd, vd, q, out, o_part, CTX, SPLITS=SPLITS, WIDTH=width, BLOCK_N=BLOCK_N,
                                  BLOCK_M=BLOCK_M, MODE=3)
    o_part = o_part.view(SPLITS, NHEADS_KV, group, NHEADS_KV, HEADDIM)
    got = torch.stack([o_part[:, hk, :, hk] for hk in range(NHEADS_KV)], 1).reshape(-1, group, HEADDIM)
    q_heads = torch.stack([q[hk * group:(hk + 1) * group, hk * HEADDIM:(hk + 1) * HEADDIM]
                           for hk in range(NHEADS_KV)])
    kc, vc = _chunks(k), _chunks(v)  # (kv head, split) order

    def per_head(dt):
        return torch.stack([_attention(q_heads[hk], kc[hk * SPLITS:(hk + 1) * SPLITS],
                                       vc[hk * SPLITS:(hk + 1) * SPLITS], dt) for hk in range(NHEADS_KV)], 1)

    ref = per_head(torch.float64).reshape(-1, group, HEADDIM)  # (split, kv head) order, as got
    same = per_head(dtype).float().reshape(-1, group, HEADDIM)
    err, base = (got.double().cpu() - ref.cpu()).abs().max(), (same.double().cpu() - ref.cpu()).abs().max()
    assert not torch.isnan(got).any() and err <= 3 * base + 1e-5, (err, base)


def test_device_descriptor_probe_matches_the_host_descriptor_probe():
    """ws_stream_kernel (device-side tensor descriptors, what Triton's Hopper warp specialisation needs; WS is
    ignored by the interpreter) writes the same per-program value as stream_kernel's MODE 2 on the same inputs."""
    import triton

    from benchmarks.probes.stream import ws_stream_kernel

    gen = torch.Generator().manual_seed(3)
    q, k, v, out, _ = _run(2, gen, torch.float16)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device=DEVICE, dtype=torch.int8))
    ws_out = torch.full((NHEADS_KV * SPLITS,), float("nan"), device=DEVICE)
    ws_stream_kernel[(NHEADS_KV * SPLITS,)](k, v, q, ws_out, CTX, NHEADS_KV * HEADDIM, SPLITS=SPLITS,
                                            HEADDIM=HEADDIM, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, WS=False)
    torch.testing.assert_close(ws_out, out[: NHEADS_KV * SPLITS], rtol=1e-3, atol=1e-2)


def test_page_box_preload_probe_attends_over_the_pages_its_block_table_names():
    """The page-box probe with the split's page ids preloaded (one select-and-sum per step, split into four
    scalars) computes what the in-loop-read version does: each program's softmax sum plus its unnormalised output
    sum over the keys its shuffled block table names (8 pages per split: the step picks row 0 or 1 of the ids)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.probes.stream import page_box_preload_kernel

    page, ctx = 16, 2 * CTX
    split_pages = ctx // (SPLITS * page)
    gen = torch.Generator().manual_seed(8)
    k, v = (randn(ctx, NHEADS_KV * HEADDIM, gen=gen, dtype=torch.float16) for _ in range(2))
    q = randn(BLOCK_M, HEADDIM, gen=gen, dtype=torch.float16)
    table = torch.randperm(ctx // page, generator=gen).to(torch.int32)
    out = torch.full((NHEADS_KV * SPLITS,), float("nan"), device=DEVICE)
    kd, vd = (TensorDescriptor(x, [ctx, NHEADS_KV * HEADDIM], [NHEADS_KV * HEADDIM, 1], [page, HEADDIM])
              for x in (k, v))
    page_box_preload_kernel[(NHEADS_KV * SPLITS,)](kd, vd, q, out, table.to(DEVICE), ctx, SPLITS=SPLITS,
                                                   HEADDIM=HEADDIM, PAGE=page, BLOCK_M=BLOCK_M,
                                                   SPLIT_PAGES=split_pages)
    logical = torch.arange(ctx)
    physical = table.long()[logical // page] * page + logical % page
    kp, vp = k.cpu()[physical].double(), v.cpu()[physical].double()
    chunk = ctx // SPLITS
    kc, vc = (torch.stack([x[s * chunk:(s + 1) * chunk, hk * HEADDIM:(hk + 1) * HEADDIM]
                           for hk in range(NHEADS_KV) for s in range(SPLITS)]) for x in (kp, vp))
    s = torch.einsum("md,pnd->pmn", q.cpu().double(), kc) * SCORE_SCALE
    p = torch.exp2(s - s.amax(dim=-1, keepdim=True))
    ref = torch.einsum("pmn,pnd->pmd", p, vc).sum(dim=(1, 2)) + p.sum(dim=(1, 2))
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-3, atol=1e-2)


@pytest.mark.parametrize("balanced", [False, True])
def test_timeline_probes_stream_every_block_exactly_once(balanced):
    """benchmarks/probes/timeline.py's split probe and its balanced variant (a static share per split, the rest drawn from a
    per-kv-head atomic pool): the merged partials equal attention over all keys (check_partials, the check the GPU
    run prints), and a partial left out shows as a large error, so the check would catch a block missed or read
    twice. The balanced kernel drew the pool dry and zeroed the previous call's counters."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.probes.timeline import check_partials, timed_balanced_kernel, timed_split_kernel

    gen = torch.Generator().manual_seed(9)
    k, v = (randn(CTX, NHEADS_KV * HEADDIM, gen=gen, dtype=torch.float16) for _ in range(2))
    q = randn(BLOCK_M, HEADDIM, gen=gen, dtype=torch.float16)
    programs = NHEADS_KV * SPLITS
    o_part = torch.full((programs * BLOCK_M // 2 * HEADDIM,), float("nan"), device=DEVICE)
    lse = torch.full((programs * BLOCK_M // 2,), float("nan"), device=DEVICE)
    times = torch.zeros(programs, 5, dtype=torch.int64, device=DEVICE)
    kd, vd = (TensorDescriptor(x, [CTX, NHEADS_KV * HEADDIM], [NHEADS_KV * HEADDIM, 1], [BLOCK_N, HEADDIM])
              for x in (k, v))
    if balanced:
        counters = torch.zeros(NHEADS_KV, dtype=torch.int32, device=DEVICE)
        last = torch.tensor([5, 7], dtype=torch.int32, device=DEVICE)
        # 16 blocks per kv head: 3 per split static (12/16), a pool of 4 drawn 2 at a time
        timed_balanced_kernel[(programs,)](kd, vd, q, o_part, lse, times, counters, last, CTX, SPLITS=SPLITS,
                                           HEADDIM=HEADDIM, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, STATIC_SIXTEENTHS=12,
                                           GRAB=2, TIMED=False)
        assert last.tolist() == [0, 0] and all(c >= 4 for c in counters.tolist())
    else:
        timed_split_kernel[(programs,)](kd, vd, q, o_part, lse, times, CTX, SPLITS=SPLITS, HEADDIM=HEADDIM,
                                        BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, TIMED=False)
    args = (k.cpu(), v.cpu(), q.cpu(), o_part.cpu(), lse.cpu(), NHEADS_KV, SPLITS, HEADDIM)
    err = check_partials(*args)
    assert err < 2e-3, err
    dropped = lse.cpu().clone()
    dropped[: BLOCK_M // 2] = float("-inf")  # kv head 0's split 0 contributes nothing
    assert check_partials(*args[:4], dropped, *args[5:]) > 20 * max(err, 1e-4)


def test_timeline_summary_reads_program_records():
    """summarize / _gaps on hand-made records: 4 programs on 2 SMs, starts and ends in ns, clocks at 2 GHz."""
    from benchmarks.probes.timeline import _gaps, summarize

    us = 1000
    g0 = [0, 0, 32, 1 * us]
    g1 = [4 * us, 10 * us, 6 * us, 9 * us]
    c0 = [0, 0, 0, 0]
    c1 = [2 * (b - a) for a, b in zip(g0, g1)]  # 2 cycles per ns
    rec = torch.tensor(list(zip([0, 0, 1, 1], c0, c1, g0, g1)), dtype=torch.int64)
    got = summarize(rec, clock_ghz=2.0)
    assert got["programs"] == 4 and got["sms_used"] == 2 and got["globaltimer_min_step_ns"] == 32
    assert got["span_us"] == 10.0 and got["end_us"][0.0] == 4.0 and got["start_us"][1.0] == 1.0
    assert got["duration_us"][1.0] == 10.0 and got["sm_programs"][1.0] == 2
    assert got["sm_busy_us"][1.0] == 14.0 and got["sm_last_end_us"][0.0] == 9.0
    # a second call 12 us later: its first program starts 2 us after the first call's last one ended
    times = torch.stack([rec, rec + torch.tensor([0, 0, 0, 12 * us, 12 * us])])
    assert _gaps(times, [0, 1]) == [2.0]
