"""A NaN or inf in one sequence of a packed batch reaches exactly the rows that read it, never a neighbour.

A kernel that loads whole blocks over packed rows reads the next sequence's rows in a sequence's last key block
(and query block): their scores are masked by position, but their zero probabilities times a NaN or inf value
would still be NaN in P V. Sequence 1 of a packed batch holds one NaN / inf in a value, a key or a query row that
sequence 0's last key block or query tile reads (lengths not multiples of any block); sequence 0 and 2 must match
the float64 reference, sequence 1 must be non-finite exactly where the reference is (element for element, out and
lse), and the backward gives sequence 0 and 2 the reference's gradients.

Paths: the Triton forward and backward (the CPU interpreter runs them; on a GPU with the ragged Gluon dispatch off)
and, on sm_90, the ragged Gluon forward in every launch family its resolver returns, the public dispatch to it, and
the fixed-length Gluon forward over a batch whose keys end inside a block (the same packed rows), and the dense Gluon
backward over such a batch (its tiles read through descriptors that end at their batch element)."""

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import heuristics
from flashdecode.reference import attention_ref
from helpers import DEVICE, HAS_CUDA, assert_fa_close, needs_v_bound_opt_in, randn

NAN, INF = float("nan"), float("inf")
# the interpreter's numpy reductions warn on rows of NaN
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

# (which tensor, row within sequence 1, head (kv head for k / v), dim): every one inside the rows that sequence
# 0's last key block (any block of 16..128 keys: sequence 0's lengths are no multiples of 16) or last query tile
# reads past its end
SPOTS = {"v": (3, 1, 5), "k": (2, 0, 7), "q": (4, 2, 1)}


def _packed(lens_q, lens_k, h, hkv, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = randn(sum(lens_q), h, d, gen=gen, dtype=dtype, device=device)
    k = randn(sum(lens_k), hkv, d, gen=gen, dtype=dtype, device=device)
    v = randn(sum(lens_k), hkv, d, gen=gen, dtype=dtype, device=device)
    cu = [torch.tensor([0] + list(lens), device=device).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1]


def _poison(q, k, v, cu_q, cu_k, which: str, value: float):
    """Put ``value`` into SPOTS[which] of sequence 1."""
    row, head, dim = SPOTS[which]
    x, base = {"q": (q, cu_q), "k": (k, cu_k), "v": (v, cu_k)}[which]
    x[int(base[1]) + row, head, dim] = value


def _reference(q, k, v, cu_q, cu_k, causal):
    """Per-sequence float64 and same-dtype references: out (total_q, h, d), lse (h, total_q)."""
    outs, lses, sames, same_lses = [], [], [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks, vs = q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]]
        o64, l64 = attention_ref(qs.double(), ks.double(), vs.double(), causal=causal)
        same, same_lse = attention_ref(qs, ks, vs, causal=causal)
        outs.append(o64[0]), lses.append(l64[0]), sames.append(same[0]), same_lses.append(same_lse[0])
    return torch.cat(outs), torch.cat(lses, -1), torch.cat(sames), torch.cat(same_lses, -1)


def _assert_only_its_rows(out, lse, reference, cu_q, value):
    """out / lse non-finite exactly where the float64 reference is (value NaN: NaN exactly where it has NaN; an inf
    input may give NaN where the reference's softmax gives inf - inf / inf -, both non-finite); the other
    sequences' rows (0 and 2) within the FlashAttention rule of the reference (out) and 1e-3 (lse); sequence 1's
    finite entries too."""
    o64, l64, o_same, l_same = reference
    out, lse = out.cpu(), lse.cpu()
    o64, l64, o_same = o64.cpu(), l64.cpu(), o_same.cpu()
    exact = value != value
    for got, want, name in ((out, o64, "out"), (lse, l64, "lse")):
        wrong = torch.isnan if exact else lambda x: ~torch.isfinite(x)
        assert torch.equal(wrong(got), wrong(want)), (
            f"{name}: {'NaN' if exact else 'non-finite'} at {wrong(got).nonzero().tolist()[:8]}, reference at "
            f"{wrong(want).nonzero().tolist()[:8]}")
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), f"{name}: non-finite pattern"
    s1 = slice(int(cu_q[1]), int(cu_q[2]))
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[s1] = False
    assert_fa_close(out[others], o64[others], o_same[others], name="out of the neighbours")
    assert torch.isfinite(lse[:, others]).all()
    assert (lse[:, others] - l64[:, others]).abs().max().item() < 1e-3, "lse of the neighbours"
    ok = torch.isfinite(o64)
    ok[others] = False
    if ok.any():
        assert_fa_close(out[ok], o64[ok], o_same[ok], name="finite out of sequence 1")


# ----------------------------------------------------------------------------------------------------------------
# The Triton kernels (CPU interpreter; on a GPU with the ragged Gluon dispatch off)
# ----------------------------------------------------------------------------------------------------------------

# sequence 0 ends inside every key block and query tile; sequence 1 shorter than one; dims GPU-legal
TRITON_LENS = ([37, 21, 19], [45, 23, 30])


@pytest.fixture
def triton_only(monkeypatch):
    monkeypatch.setattr(heuristics, "PREFILL_RAGGED_GLUON", False)


@pytest.mark.parametrize("which,value,causal", [(w, NAN, c) for w in SPOTS for c in (False, True)]
                         + [(w, INF, False) for w in SPOTS], ids=str)
def test_triton_varlen_forward_keeps_a_nan_in_its_sequence(triton_only, which, value, causal):
    q, k, v, cu_q, cu_k = _packed(*TRITON_LENS, 4, 2, 16, torch.float16, DEVICE)
    _poison(q, k, v, cu_q, cu_k, which, value)
    out, lse = flashdecode.flash_attn_varlen(q, k, v, cu_q, cu_k, max(TRITON_LENS[0]), max(TRITON_LENS[1]),
                                             causal=causal, return_lse=True)
    _assert_only_its_rows(out, lse, _reference(q, k, v, cu_q, cu_k, causal), cu_q, value)


@pytest.mark.parametrize("which", list(SPOTS))
def test_triton_varlen_backward_keeps_a_nan_in_its_sequence(triton_only, which):
    """dq, dk, dv of sequences 0 and 2 match the reference's (dO finite everywhere; sequence 1's own gradients
    may be NaN: not checked here)."""
    lens_q, lens_k = TRITON_LENS
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 16, torch.float32, DEVICE, seed=1)
    _poison(q, k, v, cu_q, cu_k, which, NAN)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flashdecode.flash_attn_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    dout = randn(*out.shape, gen=torch.Generator().manual_seed(2), dtype=out.dtype, device=DEVICE)
    grads = torch.autograd.grad(out, leaves, dout)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in (0, 2):
        refs = []
        for dtype in (torch.float64, q.dtype):
            seq = [x[a:e].to(dtype).requires_grad_() for x, (a, e) in
                   zip((q, k, v), ((cq[b], cq[b + 1]), (ck[b], ck[b + 1]), (ck[b], ck[b + 1])))]
            o, _ = attention_ref(*(x[None] for x in seq), causal=True)
            refs.append(torch.autograd.grad(o[0], seq, dout[cq[b]:cq[b + 1]].to(dtype)))
        for name, got, rows, want, same in zip(("dq", "dk", "dv"), grads, ((cq[b], cq[b + 1]), (ck[b], ck[b + 1]),
                                                                         (ck[b], ck[b + 1])), *refs):
            assert_fa_close(got[rows[0]:rows[1]], want, same, factor=3.0, atol=1e-4, name=f"{name} of sequence {b}")


# ----------------------------------------------------------------------------------------------------------------
# The Gluon forwards (sm_90)
# ----------------------------------------------------------------------------------------------------------------

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is built for sm_90 only")
# sequence 0 ends inside a 128-key block and a 128- or 192-row tile; sequence 1 within one block and tile (so that
# its own rows all read the poisoned block, causal or not: the reference's rows); sequence 2 long
GLUON_LENS = ([200, 77, 1000], [300, 90, 1000])


def _gluon_varlen_configs():
    from flashdecode.ops.gluon_attention import GluonFwdConfig, resolve_gluon_varlen_config

    resolved = [(d, causal, resolve_gluon_varlen_config(d, causal, keys)) for d in (64, 128)
                for causal in (False, True) for keys in (256, 4096, 16384)]
    forced = [(128, False, GluonFwdConfig()), (128, True, GluonFwdConfig(overlap=True, split_release=True))]
    return list(dict.fromkeys(resolved + forced))  # each launch once


def _v_bound_configs():
    """Resolved launches with GluonFwdConfig.v_bound: the zeros past a sequence's keys from the producer's
    bounded V descriptors (an experiment: its tests run with FLASHDECODE_V_BOUND=1, helpers.py)."""
    from flashdecode.ops.gluon_attention import resolve_gluon_varlen_config

    return [(d, causal, dataclasses.replace(resolve_gluon_varlen_config(d, causal, keys), v_bound=True))
            for d, causal, keys in [(128, True, 256), (128, False, 4096), (64, True, 16384)]]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("d,causal,config", _gluon_varlen_configs() if HOPPER else [], ids=str)
@pytest.mark.parametrize("which", list(SPOTS))
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_gluon_varlen_keeps_a_nan_in_its_sequence(d, causal, config, which, value):
    from flashdecode.ops.gluon_attention import gluon_varlen_forward_into

    q, k, v, cu_q, cu_k = _packed(*GLUON_LENS, 4, 2, d, torch.bfloat16, "cuda", seed=3)
    _poison(q, k, v, cu_q, cu_k, which, value)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], device="cuda", dtype=torch.float32)
    took = gluon_varlen_forward_into(q, k, v, out, lse, cu_q, cu_k, max(GLUON_LENS[0]), d ** -0.5,
                                     window_right=0 if causal else -1, config=config)
    assert took, "the ragged Gluon kernel did not take a supported call"
    _assert_only_its_rows(out, lse, _reference(q, k, v, cu_q, cu_k, causal), cu_q, value)


@pytest.mark.gpu
@needs_hopper
@needs_v_bound_opt_in
@pytest.mark.parametrize("d,causal,config", _v_bound_configs() if HOPPER else [], ids=str)
@pytest.mark.parametrize("which", list(SPOTS))
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_gluon_varlen_v_bound_keeps_a_nan_in_its_sequence(d, causal, config, which, value):
    test_gluon_varlen_keeps_a_nan_in_its_sequence(d, causal, config, which, value)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_on_gluon_keeps_a_nan_in_its_sequence(monkeypatch, causal):
    """The public call with the ragged Gluon dispatch on (its default) and a NaN value in sequence 1."""
    from flashdecode.ops import gluon_plan

    monkeypatch.setattr(heuristics, "PREFILL_RAGGED_GLUON", True)
    q, k, v, cu_q, cu_k = _packed(*GLUON_LENS, 8, 2, 128, torch.bfloat16, "cuda", seed=4)
    _poison(q, k, v, cu_q, cu_k, "v", NAN)
    out, lse = flashdecode.flash_attn_varlen(q, k, v, cu_q, cu_k, max(GLUON_LENS[0]), max(GLUON_LENS[1]),
                                             causal=causal, return_lse=True)
    assert any(key[0] == "ragged" and key[1] == q.shape and key[3] == k.shape and key[13] == causal
               and gluon_plan.PLANS[key] for key in list(gluon_plan.PLANS)), "the call took no ragged Gluon plan"
    _assert_only_its_rows(out, lse, _reference(q, k, v, cu_q, cu_k, causal), cu_q, NAN)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("d,causal,keys", [(128, False, 300), (128, True, 300), (64, False, 300),
                                           (128, False, 16500), (128, True, 16500), (64, True, 16500)])
@pytest.mark.parametrize("which", ["v", "k"])
def test_gluon_dense_batch_keeps_a_nan_in_its_sequence(d, causal, keys, which):
    """Fixed-length batches over the same packed rows (keys not a multiple of the key block): a NaN in batch 1's
    first value / key row stays in batch 1 (the launch's resolved config, V_TAIL on)."""
    from flashdecode.ops.gluon_attention import gluon_attention_forward

    gen = torch.Generator().manual_seed(6)
    q, k, v = (randn(3, n, h, d, gen=gen, dtype=torch.bfloat16, device="cuda")
               for n, h in ((min(keys, 1000), 4), (keys, 2), (keys, 2)))
    {"v": v, "k": k}[which][1, 2, 1, 5] = NAN
    out, lse = gluon_attention_forward(q, k, v, causal=causal)
    o64, l64 = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    same, _ = attention_ref(q, k, v, causal=causal)
    assert torch.equal(torch.isnan(out), torch.isnan(o64)) and torch.equal(torch.isnan(lse), torch.isnan(l64))
    for b in (0, 2):
        assert_fa_close(out[b], o64[b], same[b], name=f"out of batch {b}")
        assert (lse[b] - l64[b]).abs().max().item() < 1e-3


def _launch_recorder():
    """Stands in for the dense Gluon backward's launch site of attn_bwd_ws_kernel: records each launch's grid,
    runtime arguments by name and constexprs."""
    from flashdecode.kernels.gluon import attn_bwd
    from flashdecode.ops.launch_cache import LaunchSite

    class Recorder(LaunchSite):
        def launch(self, key, grid, runtime, constexprs, device):
            self.launches.append((grid, dict(zip(self.runtime_names, runtime)), constexprs()))

    recorder = Recorder(attn_bwd.attn_bwd_ws_kernel, "recorded gluon bwd")
    recorder.launches = []
    return recorder


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,seq_bounded,bounded", [
    (1, 300, 300, True, False),  # one element: tiles run only past the tensor's end (TMA reads zeros there)
    (2, 256, 128, True, False),  # whole blocks: no tile crosses into the next element
    (2, 300, 256, True, True), (2, 256, 300, True, True), (3, 1, 300, True, True),
    (2, 300, 300, False, False)])  # the option off (an ablation)
def test_dense_gluon_backward_bounds_its_tiles_where_they_cross(monkeypatch, batch, seqlen_q, seqlen_k, seq_bounded,
                                                                 bounded):
    """The dense Gluon backward's launch (host side; its Triton preprocess runs on DEVICE, the warp-specialised
    kernel is recorded, not run): SEQ_BOUNDED with q, dout, k, v as the descriptors' tensors exactly where a query
    tile (64 rows) or key block (128) would read the next batch element's rows; elsewhere no pointers (None: the
    kernel compiles as without the option)."""
    import contextlib

    from flashdecode.config import GluonBwdConfig
    from flashdecode.ops import gluon_backward
    from flashdecode.ops.gluon_backward import gluon_attention_backward

    recorder = _launch_recorder()
    prep_site = gluon_backward._launch_sites()[0]
    monkeypatch.setattr(gluon_backward, "_launch_sites", lambda: (prep_site, recorder))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    gen = torch.Generator().manual_seed(9)
    q, dout, out = (randn(batch, seqlen_q, 2, 64, gen=gen, dtype=torch.float16, device=DEVICE) for _ in range(3))
    k, v = (randn(batch, seqlen_k, 1, 64, gen=gen, dtype=torch.float16, device=DEVICE) for _ in range(2))
    lse = torch.zeros(batch, 2, seqlen_q, device=DEVICE)
    gluon_attention_backward(dout, q, k, v, out, lse, 0.125, config=GluonBwdConfig(seq_bounded=seq_bounded))
    [(grid, args, constexprs)] = recorder.launches
    assert constexprs["SEQ_BOUNDED"] == bounded
    pointers = [args[name] for name in ("q_ptr", "do_ptr", "k_ptr", "v_ptr")]
    assert all(p is want for p, want in zip(pointers, (q, dout, k, v) if bounded else (None, ) * 4))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 300), (256, 300), (300, 256)])
def test_gluon_dense_backward_keeps_a_nan_in_its_sequence(which, value, causal, seqlen_q, seqlen_k):
    """The dense Gluon backward over a batch whose query or key count ends inside a block (the launch's
    SEQ_BOUNDED): a NaN / inf in batch 1's third row of q, k, v or dout leaves batches 0 and 2's gradients at the
    reference's (out and lse as the float64 reference has them)."""
    _check_dense_backward_neighbours(which, value, causal, seqlen_q, seqlen_k)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("variant", ["atomic_dq", "nondeterministic"])
def test_gluon_dense_backward_variants_keep_a_nan_in_its_sequence(which, variant):
    """The same with dQ added by the consumers' atomics (dq_tma off: K's column halves through a bounded
    descriptor too) and without the deterministic order."""
    import dataclasses

    from flashdecode.heuristics import resolve_gluon_bwd_config

    config = resolve_gluon_bwd_config(128)
    if variant == "atomic_dq":
        config = dataclasses.replace(config, dq_tma=False)
    _check_dense_backward_neighbours(which, NAN, True, 300, 300, config=config,
                                     deterministic=variant != "nondeterministic")


def _check_dense_backward_neighbours(which, value, causal, seqlen_q, seqlen_k, **options):
    """gluon_attention_backward over batch 3 (4 query heads on 2, hd128, bf16) with value at batch 1's row 2
    (head 1, dim 5) of which: batches 0 and 2's dq, dk, dv within the FlashAttention rule (3x) of the float64
    reference's."""
    from flashdecode.ops.gluon_backward import gluon_attention_backward

    gen = torch.Generator().manual_seed(8)
    q, dout = (randn(3, seqlen_q, 4, 128, gen=gen, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k, v = (randn(3, seqlen_k, 2, 128, gen=gen, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    {"q": q, "k": k, "v": v, "dout": dout}[which][1, 2, 1, 5] = value
    o64, l64 = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    grads = gluon_attention_backward(dout, q, k, v, o64.to(q.dtype), l64.float(), 128 ** -0.5, causal=causal,
                                     **options)
    for b in (0, 2):
        refs = []
        for dtype in (torch.float64, q.dtype):
            leaves = [x[b:b + 1].detach().to(dtype).requires_grad_() for x in (q, k, v)]
            out, _ = attention_ref(*leaves, causal=causal)
            refs.append(torch.autograd.grad(out, leaves, dout[b:b + 1].to(dtype)))
        for name, g, want, same in zip(("dq", "dk", "dv"), grads, *refs):
            assert_fa_close(g[b:b + 1], want, same, factor=3.0, atol=1e-4, name=f"{name} of batch {b}")
