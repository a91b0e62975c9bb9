"""Prefill over a paged KV cache on the Gluon kernel (sm_90; attn_fwd_ws_paged_kernel through
flash_attn_varlen(block_table=, seqused_k=, config=GluonFwdConfig) or the dispatch switch
heuristics.PREFILL_PAGED_GLUON): against the float64 reference with the FlashAttention rule and against the Triton
paged prefill - pages of 64, 128 and 256 with shuffled block tables, query chunks shorter than the keys (prefix pages
already written), lengths 0 and 1, GQA 32 / 8, head dims 64 and 128, causal or not, sliding windows, softcap, lse -
NaN in one key reaching exactly the rows that see it (and NaN in page tails and unused pages reaching none), and
the dispatch itself."""

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import flash_attn_interface, heuristics
from flashdecode import reference as ref
from flashdecode.config import GluonFwdConfig
from flashdecode.ops import attention_config, gluon_plan
from helpers import HAS_CUDA, assert_fa_close, max_err

pytestmark = pytest.mark.gpu

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is built for sm_90 only")


@pytest.fixture(autouse=True)
def _no_autotuning(monkeypatch):
    """The Triton kernel that the Gluon one is compared with runs its first tile (as test_paged_prefill)."""
    from flashdecode.ops import attention as attn_ops

    monkeypatch.setenv(attn_ops.AUTOTUNE_ENV, "0")


def _case(lens_q, lens_k, h, hkv, d, page_size, dtype=torch.bfloat16, seed=0):
    """q (sum(lens_q), h, d), randomly permuted pages (two unused) holding each sequence's lens_k keys (its query
    rows are its last positions), the block table, cu_seqlens_q and seqused_k (int32, on the GPU)."""
    gen = torch.Generator().manual_seed(seed)
    batch, cap = len(lens_q), max(max(lens_k), 1)
    k = torch.randn(batch, cap, hkv, d, generator=gen).to("cuda", dtype)
    v = torch.randn(batch, cap, hkv, d, generator=gen).to("cuda", dtype)
    k_pages, v_pages, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=2, generator=gen)
    q = torch.randn(sum(lens_q), h, d, generator=gen).to("cuda", dtype)
    cu_q = torch.tensor([0] + list(lens_q), device="cuda").cumsum(0).to(torch.int32)
    used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    return q, k_pages, v_pages, table, cu_q, used


def _run(x, lens_q, lens_k, config, **opts):
    q, k_pages, v_pages, table, cu_q, used = x
    return flashdecode.flash_attn_varlen(q, k_pages, v_pages, cu_q, None, max(max(lens_q), 1), max(max(lens_k), 1),
                                         block_table=table, seqused_k=used, return_lse=True, config=config, **opts)


def _check(lens_q, lens_k, h, hkv, d, page_size, config, dtype=torch.bfloat16, seed=0, **opts):
    """The Gluon paged prefill (config: the GluonFwdConfig that forces it) against the float64 reference
    (FlashAttention rule for out, 1e-3 for lse, -inf and out 0 on rows without keys), beside the Triton paged
    prefill of the same call on the same rules (which tells a failure of the Gluon kernel from one of the case)."""
    x = _case(lens_q, lens_k, h, hkv, d, page_size, dtype, seed)
    out, lse = _run(x, lens_q, lens_k, config, **opts)
    q, k_pages, v_pages, table, cu_q, used = x
    want, want_lse = ref.paged_prefill_ref(q.double(), k_pages.double(), v_pages.double(), cu_q, used, table,
                                           **opts)
    same, _ = ref.paged_prefill_ref(q, k_pages, v_pages, cu_q, used, table, **opts)
    assert_fa_close(out, want, same, name="out")
    assert not torch.isnan(lse).any()
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "rows without keys must give lse -inf"
    assert max_err(lse[finite], want_lse[finite]) < 1e-3, "lse"
    assert (out.transpose(0, 1)[~finite] == 0).all(), "rows without keys must give out 0"
    triton = attention_config.resolve_config(q, k_pages, v_pages, max(max(lens_k), 1))
    out_t, lse_t = _run(x, lens_q, lens_k, dataclasses.replace(triton, backend="triton"), **opts)
    assert_fa_close(out_t, want, same, name="triton out")
    assert torch.equal(torch.isfinite(lse_t), finite) and max_err(lse_t[finite], want_lse[finite]) < 1e-3
    return out, lse


# (query chunk lengths, key counts): chunks over prefix pages, lengths 0 and 1, ragged, more queries than a page,
# more queries than keys (causal rows that see no key)
LENGTHS = [([512, 512], [512, 2048]), ([1, 0, 300, 77], [1, 0, 1000, 77]), ([200, 5, 1000], [3000, 400, 1000]),
           ([64, 129, 3], [64, 700, 3]), ([0, 0, 50], [10, 0, 50]), ([300, 20], [100, 20])]


@needs_hopper
@pytest.mark.parametrize("page_size", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", LENGTHS, ids=lambda x: "-".join(map(str, x[0])) + "_k" + "-".join(map(str, x[1])))
def test_gluon_paged_matches_reference_hd128(lens, causal, page_size):
    _check(*lens, 32, 8, 128, page_size, causal=causal, config=GluonFwdConfig(
        block_n=heuristics.gluon_paged_block_n(page_size)))


@needs_hopper
@pytest.mark.parametrize("page_size", [64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_paged_matches_reference_hd64(causal, page_size):
    _check([300, 1, 700], [1500, 1, 700], 32, 8, 64, page_size, causal=causal,
           config=GluonFwdConfig(block_n=heuristics.gluon_paged_block_n(page_size), num_stages=3))


WINDOWS_SOFTCAP = [(128, dict(window_size=(256, 0))), (128, dict(window_size=(100, 37))),
                   (128, dict(window_size=(-1, 64))), (128, dict(softcap=20.0, causal=True)),
                   (128, dict(softcap=5.0, window_size=(300, 0), softmax_scale=0.2)),
                   (64, dict(window_size=(256, 0))), (64, dict(softcap=20.0, window_size=(100, 37)))]


@needs_hopper
@pytest.mark.parametrize("d,opts", WINDOWS_SOFTCAP, ids=str)
def test_gluon_paged_windows_and_softcap(d, opts):
    _check([400, 1, 0, 900], [2000, 1, 0, 900], 32, 8, d, 128, dtype=torch.float16, seed=4,
           config=GluonFwdConfig(num_stages=2 if d == 128 else 3), **opts)


@needs_hopper
@pytest.mark.parametrize("config", [GluonFwdConfig(persistent=True, q_buffers=2),
                                    GluonFwdConfig(persistent=True, q_buffers=2, tile_order="pairs"),
                                    GluonFwdConfig(overlap=True, split_release=True),
                                    GluonFwdConfig(num_consumers=3, consumer_regs=160, num_stages=3)], ids=str)
def test_gluon_paged_config_families(config):
    d = 64 if config.num_consumers == 3 else 128
    _check([700, 1, 0, 2000, 333], [1800, 1, 0, 2000, 400], 32, 8, d, 128, causal=not config.overlap, seed=3,
           config=config)


@needs_hopper
@pytest.mark.parametrize("page_size", [64, 256])
def test_nan_reaches_exactly_the_rows_that_see_it(page_size):
    """A NaN in one key's K of one kv head reaches exactly the query rows (of that sequence and kv group) whose mask
    lets them see that key; NaN in the pages' rows past each sequence's keys and in unused pages reaches none."""
    lens_q, lens_k = [300, 200], [1000, 700]
    x = _case(lens_q, lens_k, 32, 8, 128, page_size, seed=7)
    q, k_pages, v_pages, table, cu_q, used = x
    on_table = set(table.flatten().tolist())
    for p in set(range(k_pages.shape[0])) - on_table:  # unused pages
        k_pages[p], v_pages[p] = float("nan"), float("nan")
    for b, n in enumerate(lens_k):  # the rows of each sequence's pages past its keys
        for key in range(n, table.shape[1] * page_size):
            page = int(table[b, key // page_size])
            k_pages[page, key % page_size], v_pages[page, key % page_size] = float("nan"), float("nan")
    clean, _ = _run(x, lens_q, lens_k, GluonFwdConfig(block_n=64 if page_size == 64 else 128), causal=True)
    assert not torch.isnan(clean).any(), "keys past seqused_k and unused pages must not reach any row"
    b, key, kv_head = 1, 600, 3  # sequence 1 (rows 300..499): causal row i sees key 600 from i = 600 - (700 - 200)
    page = int(table[b, key // page_size])
    k_pages[page, key % page_size, kv_head, 5] = float("nan")
    out, _ = _run(x, lens_q, lens_k, GluonFwdConfig(block_n=64 if page_size == 64 else 128), causal=True)
    nan_rows = torch.isnan(out).any(-1)  # (total_q, nheads)
    expected = torch.zeros_like(nan_rows)
    group = 32 // 8
    first_row = 300 + max(key - (lens_k[b] - lens_q[b]), 0)
    expected[first_row:300 + lens_q[b], kv_head * group:(kv_head + 1) * group] = True
    assert torch.equal(nan_rows, expected)


@needs_hopper
def test_dispatch_switch_config_and_direct_launch(monkeypatch):
    """Switch off (the default): the paged call keeps the Triton kernel; on: it takes a paged Gluon plan (pages of
    128) and its repeated (direct) launch gives the same bits; backend="triton" still pins the Triton kernel; pages
    of 16 stay on the Triton kernel; a forced launch whose blocks the pages cannot hold raises ValueError;
    flash_attn_with_kvcache's long chunks reach the Gluon kernel too."""
    lens_q, lens_k = [512, 100], [4096, 1000]
    x = _case(lens_q, lens_k, 32, 8, 128, 128, seed=11)

    def paged_plans():
        return {key for key, plan in gluon_plan.PLANS.items() if key[0] == "paged" and plan}

    before = paged_plans()
    monkeypatch.setattr(heuristics, "PREFILL_PAGED_GLUON", False)
    off, _ = _run(x, lens_q, lens_k, None, causal=True)
    assert paged_plans() == before
    monkeypatch.setattr(heuristics, "PREFILL_PAGED_GLUON", True)
    on, _ = _run(x, lens_q, lens_k, None, causal=True)
    assert paged_plans() - before
    again, _ = _run(x, lens_q, lens_k, None, causal=True)
    assert torch.equal(on, again), "the direct launch must give the first call's answer"
    q, k_pages, v_pages, table, cu_q, used = x
    want, _ = ref.paged_prefill_ref(q.double(), k_pages.double(), v_pages.double(), cu_q, used, table, causal=True)
    same, _ = ref.paged_prefill_ref(q, k_pages, v_pages, cu_q, used, table, causal=True)
    assert_fa_close(on, want, same, name="gluon")
    assert_fa_close(off, want, same, name="triton")
    seen = paged_plans()
    small = _case(lens_q, lens_k, 32, 8, 128, 16, seed=11)
    _run(small, lens_q, lens_k, None, causal=True)
    assert paged_plans() == seen, "pages of 16 hold no whole key block: the Triton kernel"
    with pytest.raises(ValueError, match="config.block_n"):  # a forced launch never falls back silently
        _run(_case(lens_q, lens_k, 32, 8, 128, 64, seed=11), lens_q, lens_k, GluonFwdConfig(block_n=128))
    # flash_attn_with_kvcache: a chunk of 128 new tokens per sequence appended to the cache, then attended
    batch, chunk, cached = 2, 128, 1000
    k_pages, v_pages, table = x[1].clone(), x[2].clone(), x[3]
    qn = torch.randn(batch, chunk, 32, 128, device="cuda", dtype=torch.bfloat16)
    kn, vn = (torch.randn(batch, chunk, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((batch,), cached, dtype=torch.int32, device="cuda")
    out = flash_attn_interface.flash_attn_with_kvcache(qn, k_pages, v_pages, kn, vn, cache_seqlens=lengths,
                                                       block_table=table, causal=True)
    assert paged_plans() - seen, "flash_attn_with_kvcache's chunk must take the paged Gluon plan"
    used = torch.full((batch,), cached + chunk, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, (batch + 1) * chunk, chunk, dtype=torch.int32, device="cuda")
    qf = qn.flatten(0, 1)
    want, _ = ref.paged_prefill_ref(qf.double(), k_pages.double(), v_pages.double(), cu, used, table, causal=True)
    same, _ = ref.paged_prefill_ref(qf, k_pages, v_pages, cu, used, table, causal=True)
    assert_fa_close(out.flatten(0, 1), want, same, name="with_kvcache")
