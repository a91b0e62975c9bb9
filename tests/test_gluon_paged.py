"""The Gluon paged prefill's host side without a GPU (the kernel launch is stubbed, as in test_gluon_launch_cache):
the cache's TMA rows view and the page mapping the producer uses, which calls the Gluon kernel can take and which
stay on the Triton kernel, the resolver and its switch, config= forcing, and the argument list a launch hands the
kernel (attn_fwd_ws_paged_kernel). Its numerics run on the GPU (test_gluon_paged_gpu.py) and its sm_90 build in
test_gluon_compile.py."""

import pytest
import torch

import flashdecode
from flashdecode import heuristics
from flashdecode.config import GluonFwdConfig
from flashdecode.kernels.gluon.attn_fwd import attn_fwd_ws_paged_kernel
from flashdecode.ops import checks
from flashdecode.ops import gluon_attention as ga
from flashdecode.ops import gluon_plan
from helpers import FakeCompiled


@pytest.fixture
def fake_hopper(monkeypatch):
    """CPU tensors on a fake sm_90 outside the interpreter; first launches go to a recording stub."""
    calls, compiled = [], FakeCompiled()

    def fake_jit(grid, args, constexprs, **kernel):
        calls.append((grid, args, constexprs, kernel))
        return compiled

    monkeypatch.setattr(ga, "is_hopper", lambda device: True)
    monkeypatch.setattr(ga, "interpreting", lambda: False)
    monkeypatch.setattr(gluon_plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(gluon_plan, "_jit_launch", fake_jit)
    monkeypatch.setattr(gluon_plan, "_current_stream", lambda index: 7)
    monkeypatch.setattr(gluon_plan, "_current_device", lambda: None)
    gluon_plan.PLANS.clear()
    yield calls, compiled
    gluon_plan.PLANS.clear()


def _cache(num_pages=6, page_size=128, hkv=2, d=128, pad_heads=0, dtype=torch.float16):
    """(k_cache, v_cache) (num_pages, page_size, hkv, d); pad_heads > 0: a view of a cache with that many more
    heads per token (token stride padded, heads still packed)."""
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(num_pages, page_size, hkv + pad_heads, d, generator=gen).to(dtype) for _ in range(2)]
    return tuple(x[:, :, :hkv] for x in full)


def _problem(lens_q=(5, 0, 130), page_size=128, hkv=2, h=8, d=128, num_pages=6, max_pages=2):
    k_cache, v_cache = _cache(num_pages, page_size, hkv, d)
    q = torch.randn(sum(lens_q), h, d).half()
    cu_q = torch.tensor([0, *lens_q], dtype=torch.int32).cumsum(0).to(torch.int32)
    table = torch.randperm(num_pages)[:len(lens_q) * max_pages].view(len(lens_q), max_pages).to(torch.int32)
    used = torch.tensor([200, 0, 256], dtype=torch.int32)[:len(lens_q)]
    return q, k_cache, v_cache, cu_q, used, table


def test_rows_view_maps_a_key_block_to_its_page_rows():
    """The producer's K/V descriptor reads the cache as (num_pages * page_size, nheads_kv * headdim) rows
    (gluon_plan.rows_view); key block ``key`` of a sequence starts at row table[key // page_size] * page_size +
    key % page_size (fwd_tiles.KVPages.row), and kv head h is columns h * d on: every row of the block is the
    sequence's key at that position, for a padded token stride too and for blocks of 64 in pages of 256."""
    for page_size, block_n, pad in ((128, 128, 0), (256, 64, 1), (64, 64, 3)):
        k_cache, _ = _cache(num_pages=5, page_size=page_size, hkv=2, d=64, pad_heads=pad)
        assert ga._pages_are_rows(k_cache)
        shape, strides = gluon_plan.rows_view(k_cache)
        rows = k_cache.as_strided(shape, strides)
        assert shape == [5 * page_size, 2 * 64] and strides == [k_cache.stride(1), 1]
        table = torch.tensor([3, 0, 4], dtype=torch.int32)
        for key in range(0, 3 * page_size, block_n):
            page = int(table[key // page_size])
            row = page * page_size + key % page_size
            for h in range(2):
                block = rows[row:row + block_n, h * 64:(h + 1) * 64]
                assert torch.equal(block, k_cache[page, key % page_size:key % page_size + block_n, h])


def test_block_n_and_resolver():
    assert [heuristics.gluon_paged_block_n(p) for p in (1, 16, 32, 64, 128, 192, 256, 384)] == [
        0, 0, 0, 64, 128, 64, 128, 128]
    cfg = heuristics.resolve_gluon_paged_config(128, True, 128, 4096)
    assert cfg.block_n == 128 and cfg.tile_order != "lpt"
    assert heuristics.resolve_gluon_paged_config(128, True, 64, 4096).block_n == 64
    assert heuristics.resolve_gluon_paged_config(128, True, 64, 4096).num_stages == 2 * cfg.num_stages
    assert heuristics.resolve_gluon_paged_config(128, False, 16, 4096) is None  # pages of 16: the Triton kernel
    assert heuristics.resolve_gluon_paged_config(96, False, 128, 4096) is None
    assert heuristics.resolve_gluon_paged_config(64, False, 128, 256) is None  # gluon_pays: hd64 short keys
    plain = heuristics.resolve_gluon_paged_config(128, False, 256, 2048)  # the ragged resolver's overlapped one
    assert heuristics.resolve_gluon_varlen_config(128, False, 2048).overlap
    assert not plain.overlap and not plain.split_release and plain.block_n == 128
    assert heuristics.PREFILL_PAGED_GLUON is True  # on: tests/test_gluon_paged_gpu.py passed on the H100


def test_window_arguments():
    big = ga.PAGED_INDEX_BOUND
    assert ga.paged_window_args(-1, -1) == (False, False, 0, 0)
    assert ga.paged_window_args(-1, 0) == (True, False, 0, 0)  # causal: the causal tile loop
    assert ga.paged_window_args(7, 0) == (False, True, 7, 0)
    assert ga.paged_window_args(-1, 5) == (False, True, big, 5)
    assert ga.paged_window_args(2**31 - 1, 3) == (False, True, big, 3)


def test_what_the_gluon_paged_kernel_takes(fake_hopper):
    q, k_cache, v_cache, cu_q, used, table = _problem()
    assert ga.paged_unsupported(q, k_cache, v_cache, table) is None
    padded = _cache(pad_heads=1)
    assert ga.paged_unsupported(q, *padded, table) is None  # token stride padded: still a rows view
    cases = {
        "q: fp16": (q.float(), k_cache, v_cache, table),
        "head dim": (q[..., :96], k_cache[..., :96], v_cache[..., :96], table),
        "k_cache, v_cache: q's dtype": (q, k_cache, v_cache.bfloat16(), table),
        "pages back to back": (q, k_cache.transpose(1, 2).contiguous().transpose(1, 2), v_cache, table),
        "no whole key block": (q, *_cache(page_size=16), table),
        "multiple of the cache's nheads_kv": (q[:, :3], k_cache, v_cache, table),
    }
    for phrase, args in cases.items():
        why = ga.paged_unsupported(*args)
        assert why is not None and phrase in why, (phrase, why)
    heads_apart = torch.randn(6, 128, 2, 2, 128).half()[:, :, :, 0]  # stride(2) = 2 * headdim
    assert "packed heads" in ga.paged_unsupported(q, heads_apart, heads_apart, table)
    assert "config.block_n" in ga.paged_unsupported(q, *_cache(page_size=64), table, GluonFwdConfig())
    lpt = GluonFwdConfig(persistent=True, q_buffers=2, tile_order="lpt")
    assert "tile_order" in ga.paged_unsupported(q, k_cache, v_cache, table, lpt)
    # the paged kernel always zeroes a page's tail: the ragged kernel's ablation is refused, naming it
    assert "config.v_tail" in ga.paged_unsupported(q, k_cache, v_cache, table, GluonFwdConfig(v_tail=False))


def test_switch_off_keeps_the_triton_kernel(fake_hopper, monkeypatch):
    calls, _ = fake_hopper
    monkeypatch.setattr(heuristics, "PREFILL_PAGED_GLUON", False)
    q, k_cache, v_cache, cu_q, used, table = _problem()
    out, lse = torch.empty_like(q), torch.empty(8, q.shape[0])
    assert not ga.gluon_paged_forward_into(q, k_cache, v_cache, out, lse, cu_q, used, table, 130, 256, 0.1)
    assert not calls and not gluon_plan.PLANS


def test_launch_hands_the_kernel_its_paged_arguments(fake_hopper, monkeypatch):
    """The first launch of a key goes through the JIT with the paged kernel's full argument list (the cache's rows
    view as K/V descriptors, the metadata tensors and scalars after qk_scale_log2, the page size and score
    constexprs); the next ones launch the compiled kernel directly with the same values as addresses."""
    calls, compiled = fake_hopper
    monkeypatch.setattr(heuristics, "PREFILL_PAGED_GLUON", True)
    q, k_cache, v_cache, cu_q, used, table = _problem()
    for window, softcap in (((-1, 0), 0.0), ((16, 0), 30.0)):
        out, lse = torch.empty_like(q), torch.empty(8, q.shape[0])
        for _ in range(2):
            assert ga.gluon_paged_forward_into(q, k_cache, v_cache, out, lse, cu_q, used, table, 130, 256, 0.1,
                                               *window, softcap)
        grid, args, constexprs, kernel = calls[-1]
        names = attn_fwd_ws_paged_kernel.arg_names
        assert kernel == dict(paged=True) and len(args) + len(constexprs) == len(names)
        assert set(constexprs) == set(names[len(args):])
        assert constexprs["PAGE_SIZE"] == 128 and constexprs["GROUP"] == 4 and constexprs["NUM_HEADS"] == 8
        causal, windowed, left, right = ga.paged_window_args(*window)
        assert (constexprs["CAUSAL"], constexprs["WINDOW"], constexprs["SOFTCAP"]) == (causal, windowed,
                                                                                       softcap > 0)
        cfg = heuristics.resolve_gluon_paged_config(128, causal, 128, 256)
        num_tiles = -(-130 // cfg.block_m) * 3 * 8
        scale, cap = (0.1 / softcap, softcap * checks.LOG2E) if softcap else (0.1 * checks.LOG2E, 0.0)
        assert args[5:9] == (num_tiles, 130, q.shape[0], scale)
        assert args[9] is cu_q and args[10] is used and args[11] is table
        assert args[12:] == (2, 2, 6, left, right, cap)
        for desc, x in zip(args[:3], (q, k_cache, v_cache)):
            assert desc.base.data_ptr() == x.data_ptr()
        assert list(args[1].shape) == [6 * 128, 2 * 128] and list(args[1].strides) == [2 * 128, 1]
        assert list(args[1].block_shape) == [cfg.block_n, 128]
        direct = compiled.launches[-1][9:]
        assert direct[5:18] == (num_tiles, 130, q.shape[0], scale, cu_q.data_ptr(), used.data_ptr(),
                                table.data_ptr(), 2, 2, 6, left, right, cap)
        assert direct[18:] == tuple(constexprs[n] for n in names[18:])


def test_forced_config_raises_where_the_gluon_kernel_cannot_run():
    """config=GluonFwdConfig forces the Gluon kernel: on the CPU (the interpreter, no sm_90) the call raises a
    ValueError naming config before anything runs; an AttentionConfig keeps its meaning."""
    q, k_cache, v_cache, cu_q, used, table = _problem()
    with pytest.raises(ValueError, match="config: a GluonFwdConfig runs the Gluon paged kernel"):
        flashdecode.flash_attn_varlen(q, k_cache, v_cache, cu_q, None, 130, 256, block_table=table,
                                      seqused_k=used, config=GluonFwdConfig())


def test_public_call_with_a_gluon_config_reaches_the_kernel(fake_hopper):
    """flash_attn_varlen(block_table=, config=GluonFwdConfig) on a (fake) sm_90: the call's checks, then one launch
    of the paged kernel with that config's constexprs, the normalised window as its bounds and the softcap split into
    tanh's scale and the cap in log2 units; lse (nheads, total_q) comes back as the kernel's output."""
    calls, _ = fake_hopper
    q, k_cache, v_cache, cu_q, used, table = _problem()
    config = GluonFwdConfig(num_stages=3)
    out, lse = flashdecode.flash_attn_varlen(q, k_cache, v_cache, cu_q, None, 130, 256, block_table=table,
                                             seqused_k=used, window_size=(16, 4), softcap=30.0, softmax_scale=0.25,
                                             return_lse=True, config=config)
    (grid, args, constexprs, kernel), = calls
    assert kernel == dict(paged=True) and out.shape == q.shape and lse.shape == (8, q.shape[0])
    assert args[3] is out and args[4] is lse
    assert constexprs["NUM_STAGES"] == 3 and constexprs["WINDOW"] and constexprs["SOFTCAP"]
    assert not constexprs["CAUSAL"] and args[8] == 0.25 / 30.0 and args[17] == 30.0 * checks.LOG2E
    assert args[15:17] == (16, 4)
    with pytest.raises(ValueError, match="alibi_slopes"):  # what the Gluon kernel does not take: refused up front
        flashdecode.flash_attn_varlen(q, k_cache, v_cache, cu_q, None, 130, 256, block_table=table, seqused_k=used,
                                      alibi_slopes=torch.ones(8), config=config)
    assert len(calls) == 1
