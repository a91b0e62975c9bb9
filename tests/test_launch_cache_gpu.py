"""The decode launch cache on the GPU: after a key's first (JIT) launch, flash_decode, DecodePlan.run, append_kv
and merge_states launch the compiled kernels directly (the direct launchers count their launches), with Triton's
specialisation checked on every launch (launch_cache.check_keys), and stay correct across layouts, dtypes, page
sizes, out=, other streams and CUDA-graph capture; flash_attn_with_kvcache runs the config flash_decode runs."""

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import flash_attn_interface as fai
from flashdecode.ops import decode_host, launch_cache
from flashdecode.ops.decode import decode_config
from flashdecode.reference import decode_ref
from helpers import HAS_CUDA, randn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")]


@pytest.fixture(autouse=True)
def _checked_keys():
    before = launch_cache.check_keys(True)
    yield
    launch_cache.check_keys(before)


def _direct_launches() -> int:
    return sum(r.launches for site in launch_cache.sites() for r in site.records.values())


def _cache(gen, dtype, page_size, b=4, cap=2048, hk=8, d=128):
    if page_size:
        pages = b * cap // page_size
        k, v = (randn(pages, page_size, hk, d, gen=gen, dtype=dtype) for _ in range(2))
        table = torch.randperm(pages, generator=gen).view(b, -1).to(torch.int32).cuda()
        return k, v, table
    return randn(b, cap, hk, d, gen=gen, dtype=dtype), randn(b, cap, hk, d, gen=gen, dtype=dtype), None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [0, 16, 64])
def test_repeated_decode_calls_launch_directly_and_stay_correct(dtype, page_size):
    gen = torch.Generator().manual_seed(0)
    k, v, table = _cache(gen, dtype, page_size)
    lens = torch.tensor([2000, 17, 1500, 2048], dtype=torch.int32, device="cuda")
    q = randn(4, 32, 128, gen=gen, dtype=dtype)
    ref, ref_lse = decode_ref(q.double(), k.double(), v.double(), lens, block_table=table)
    plan = flashdecode.DecodePlan(4, 32, 8, 128, max_seqlen_k=2048, dtype=dtype)
    for call in (lambda o: flashdecode.flash_decode(q, k, v, lens, block_table=table, out=o, return_lse=True),
                 lambda o: plan.run(q, k, v, lens, block_table=table, out=o, return_lse=True)):
        for out in (None, torch.empty(4, 32, 2, 128, dtype=dtype, device="cuda")[:, :, 0]):
            before = _direct_launches()
            for _ in range(3):
                got, lse = call(out)
                torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-3, rtol=1e-3)
            assert _direct_launches() > before  # the later calls skipped Triton's launch path


def test_decode_on_another_stream_and_in_a_graph():
    gen = torch.Generator().manual_seed(1)
    k, v, _ = _cache(gen, torch.bfloat16, 0)
    lens = torch.tensor([2000, 17, 1500, 2048], dtype=torch.int32, device="cuda")
    q = randn(4, 32, 128, gen=gen, dtype=torch.bfloat16)
    ref = flashdecode.flash_decode(q, k, v, lens)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = flashdecode.flash_decode(q, k, v, lens)
    side.synchronize()
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    plan = flashdecode.DecodePlan(4, 32, 8, 128, max_seqlen_k=2048)
    plan.run(q, k, v, lens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan.run(q, k, v, lens)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, plan.run(q, k, v, lens), atol=0, rtol=0)


def test_kvcache_interface_runs_flash_decodes_config_on_a_mixed_batch():
    """One long sequence among short ones, pages of 16: flash_attn_with_kvcache and flash_decode resolve the same
    config (the issue's 8x gap was the kvcache interface falling to the unsplit kernel)."""
    gen = torch.Generator().manual_seed(2)
    b, cap = 8, 16384
    k, v, table = _cache(gen, torch.bfloat16, 16, b=b, cap=cap)
    lens = torch.tensor([cap] + [300] * (b - 1), dtype=torch.int32, device="cuda")
    q = randn(b, 32, 128, gen=gen, dtype=torch.bfloat16)
    decode_host.clear()
    flashdecode.flash_decode(q, k, v, lens, block_table=table)
    configs = {e.config for e in decode_host._CALLS.values()}
    got = fai.flash_attn_with_kvcache(q.unsqueeze(1), k, v, cache_seqlens=lens, block_table=table)
    assert {e.config for e in decode_host._CALLS.values()} == configs  # the same config, nothing new resolved
    torch.testing.assert_close(got[:, 0], flashdecode.flash_decode(q, k, v, lens, block_table=table), atol=0, rtol=0)


def test_append_and_merge_launch_directly():
    gen = torch.Generator().manual_seed(3)
    k, v, _ = _cache(gen, torch.bfloat16, 0)
    new = randn(4, 1, 8, 128, gen=gen, dtype=torch.bfloat16)
    lens = torch.tensor([5, 6, 7, 8], dtype=torch.int32, device="cuda")
    before = _direct_launches()
    for _ in range(3):
        flashdecode.append_kv(k, v, new, new, lens)
    torch.testing.assert_close(k[torch.arange(4), lens.long()], new[:, 0], atol=0, rtol=0)
    o, lse = randn(4, 32, 128, gen=gen), randn(4, 32, gen=gen)
    for _ in range(3):
        out, out_lse = flashdecode.merge_states(o, lse, o, lse)
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(out_lse, lse + torch.log(torch.tensor(2.0)), atol=1e-5, rtol=1e-5)
    assert _direct_launches() >= before + 4


def test_kvcache_append_and_attend_launch_directly_in_and_out_of_a_graph():
    """A repeated flash_attn_with_kvcache call with k / v: the append (which also writes the lengths the attention
    sees) and the attention launch directly, with no JIT launch and no check; the same as append_kv then flash_decode;
    a call captured in a CUDA graph (another capture state: decided again) replays the same, and eager calls after
    it are right too."""
    gen = torch.Generator().manual_seed(4)
    k, v, _ = _cache(gen, torch.bfloat16, 0)
    lens = torch.tensor([5, 600, 2000, 0], dtype=torch.int32, device="cuda")
    q = randn(4, 1, 32, 128, gen=gen, dtype=torch.bfloat16)
    k_new, v_new = (randn(4, 1, 8, 128, gen=gen, dtype=torch.bfloat16) for _ in range(2))
    k_ref, v_ref = k.clone(), v.clone()
    flashdecode.append_kv(k_ref, v_ref, k_new, v_new, lens)
    ref = flashdecode.flash_decode(q[:, 0], k_ref, v_ref, lens + 1)

    def call():
        return fai.flash_attn_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=lens)[:, 0]
    torch.testing.assert_close(call(), ref)  # the key's first call: checked, decided, launched through the JIT
    jit, direct = sum(site.jit_launches for site in launch_cache.sites()), _direct_launches()
    for _ in range(3):
        torch.testing.assert_close(call(), ref)
    assert sum(site.jit_launches for site in launch_cache.sites()) == jit and _direct_launches() >= direct + 6
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, ref)
    torch.testing.assert_close(call(), ref)


def test_tma_read_cache_launches_stage1_through_the_descriptor_launcher(monkeypatch):
    """A dense bf16 cache read through tensor descriptors (sm_90: stage 1's K and V are host descriptors): stage 1's
    record launches through direct_launch.DescriptorLauncher, which fills one CUtensorMap per cache address and
    extent (not one per call, as Triton's own launcher does), and a cache that grows by a new dense tensor per step
    (another address and extent each) stays correct step by step."""
    from flashdecode.ops import decode_launch, direct_launch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need sm_90")
    monkeypatch.setattr(direct_launch, "DESCRIPTOR_LAUNCHER", True)  # the gate this test opens (direct_launch.py)
    gen = torch.Generator().manual_seed(3)
    launch_cache.clear()
    decode_host.clear()
    q = randn(4, 32, 128, gen=gen, dtype=torch.bfloat16)
    k, v, _ = _cache(gen, torch.bfloat16, 0)
    lens = torch.tensor([2000, 17, 1500, 2048], dtype=torch.int32, device="cuda")
    ref, _ = decode_ref(q.double(), k.double(), v.double(), lens)
    config = dataclasses.replace(decode_config(q, k, v, lens), use_tma=True)  # (the policy's, read so)
    for _ in range(4):
        got = flashdecode.flash_decode(q, k, v, lens, config=config)
        torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)
    launchers = [r.direct for r in decode_launch._STAGE1.records.values()]
    assert launchers and all(isinstance(x, direct_launch.DescriptorLauncher) for x in launchers)
    assert launchers[0].launches == 3 and launchers[0].fills == 2  # K and V, once
    buf_k, buf_v = (randn(2, 1100, 8, 128, gen=gen, dtype=torch.bfloat16) for _ in range(2))
    for length in range(1000, 1004):
        k, v = buf_k[:, :length].contiguous(), buf_v[:, :length].contiguous()
        q = randn(2, 32, 128, gen=gen, dtype=torch.bfloat16)
        lens = torch.tensor([length, length - 300], dtype=torch.int32, device="cuda")
        ref, _ = decode_ref(q.double(), k.double(), v.double(), lens)
        torch.testing.assert_close(flashdecode.flash_decode(q, k, v, lens).double(), ref, atol=2e-2, rtol=2e-2)
