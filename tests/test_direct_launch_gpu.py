"""flash_attn's direct launches on the GPU (the dense call cache's hit path): repeated calls compute what the first
(JIT) call computed, with or without lse; calls on other streams, on two streams at once and inside CUDA graphs stay
correct (the Triton forward's global scratch is per stream and fresh under capture; an unwanted lse goes to a shared
buffer nobody reads). Paths: the Gluon kernel (sm_90, bf16/fp16, head dim 128) and the Triton kernel (head dim 96,
or fp32)."""

import pytest
import torch

import flashdecode
from flashdecode.reference import attention_ref
from helpers import HAS_CUDA, assert_fa_close, max_err, randn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")]

# (dtype, head dim): Gluon on Hopper for bf16 hd128; the Triton kernel for hd96 and fp32
PATHS = [(torch.bfloat16, 128), (torch.bfloat16, 96), (torch.float32, 64)]


def _qkv(dtype, d, seed, b=2, sq=300, sk=333, h=4, hkv=2):
    gen = torch.Generator().manual_seed(seed)
    return (randn(b, sq, h, d, gen=gen, dtype=dtype), randn(b, sk, hkv, d, gen=gen, dtype=dtype),
            randn(b, sk, hkv, d, gen=gen, dtype=dtype))


def _assert_correct(out, q, k, v, causal, lse=None):
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    same, _ = attention_ref(q, k, v, causal=causal)
    assert_fa_close(out, ref, same, name="out")
    if lse is not None:
        assert max_err(lse, ref_lse) < 1e-3, "lse"


@pytest.mark.parametrize("dtype, d", PATHS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_repeated_calls_match_the_first_with_or_without_lse(dtype, d, causal):
    q, k, v = _qkv(dtype, d, seed=1)
    first, first_lse = flashdecode.flash_attn(q, k, v, causal=causal, return_lse=True)
    _assert_correct(first, q, k, v, causal, first_lse)
    for _ in range(3):
        assert torch.equal(flashdecode.flash_attn(q, k, v, causal=causal), first)
    out, lse = flashdecode.flash_attn(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(out, first) and torch.equal(lse, first_lse)
    q2, k2, v2 = _qkv(dtype, d, seed=2)  # new tensors, same key
    _assert_correct(flashdecode.flash_attn(q2, k2, v2, causal=causal), q2, k2, v2, causal)


@pytest.mark.parametrize("dtype, d", PATHS, ids=str)
def test_two_streams_at_once(dtype, d):
    """Calls alternate between two streams with no sync between them: each stream's outputs are right."""
    inputs = [_qkv(dtype, d, seed=10 + i) for i in range(2)]
    flashdecode.flash_attn(*inputs[0])  # the key's first launch
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = [[], []]
    for _ in range(8):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[i].append(flashdecode.flash_attn(*inputs[i]))
    torch.cuda.synchronize()
    for i in range(2):
        _assert_correct(outs[i][0], *inputs[i], False)
        assert all(torch.equal(o, outs[i][0]) for o in outs[i])


@pytest.mark.parametrize("dtype, d", PATHS, ids=str)
def test_direct_launches_in_a_cuda_graph(dtype, d):
    """A cache hit captured into a CUDA graph (no lse wanted, and with lse), replayed on new data while eager calls
    of the same key run on another stream."""
    q, k, v = _qkv(dtype, d, seed=20)
    flashdecode.flash_attn(q, k, v, causal=True)  # the key's first launch, outside the capture
    flashdecode.flash_attn(q, k, v, causal=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashdecode.flash_attn(q, k, v, causal=True)
        out2, lse2 = flashdecode.flash_attn(q, k, v, causal=True, return_lse=True)
    q.copy_(_qkv(dtype, d, seed=21)[0])
    eager_in = _qkv(dtype, d, seed=22)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph.replay()
    with torch.cuda.stream(side):
        eager = [flashdecode.flash_attn(*eager_in, causal=True) for _ in range(4)]
    torch.cuda.synchronize()
    _assert_correct(out, q, k, v, True)
    _assert_correct(out2, q, k, v, True, lse2)
    _assert_correct(eager[-1], *eager_in, True)
