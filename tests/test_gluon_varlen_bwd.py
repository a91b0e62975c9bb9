"""The ragged (varlen) Gluon backward's host side on the CPU: its preprocess and dQ kernels (plain Triton, run in the
interpreter) against torch, the padded-row contract between them and the kernel (an emulation of
attn_bwd_ws_varlen_kernel's documented reads and writes, whole query tiles included, through the real host glue),
the dispatch rule (heuristics.PREFILL_RAGGED_GLUON_BWD, config= forcing, what falls back to the Triton path) and
flash_attn_varlen's backward reaching it. The kernel itself compiles in tests/test_gluon_bwd_compile.py and runs
in tests/test_gluon_varlen_bwd_gpu.py."""

import contextlib
import dataclasses
import math

import pytest
import torch

import flashdecode
from flashdecode import heuristics
from flashdecode.config import GluonBwdConfig
from flashdecode.kernels.gluon import attn_bwd, bwd_rows
from flashdecode.ops import gluon_backward
from flashdecode.ops import gluon_attention as ga
from flashdecode.reference import attention_varlen_ref

LENS = [0, 1, 70, 130, 5]  # empty and one-row sequences, a sequence of several 64-row blocks
BLOCK_M = 64


def _cu(lens):
    return torch.tensor([0] + lens).cumsum(0).to(torch.int32)


def _acc_rows(lens, block_m=BLOCK_M):
    """For each sequence: (first packed row, first padded row, rows its query blocks cover)."""
    cu = _cu(lens).tolist()
    return [(cu[b], gluon_backward.varlen_acc_row(cu[b], b, block_m), -(-n // block_m) * block_m)
            for b, n in enumerate(lens)]


@pytest.mark.parametrize("lens,block_m", [(LENS, 64), ([1, 17, 200, 0, 1000, 1], 128), ([3, 129, 2, 250], 128)])
def test_padded_rows_leave_slack_and_start_16_byte_aligned(lens, block_m):
    """Each sequence's padded rows: its query blocks end before the next sequence's (or rows_pad), and they start
    at a multiple of 4 rows - the kernel loads each query block's lse2 / delta (1, BLOCK_M) float32 tile by TMA at
    column acc_row + m * BLOCK_M, and TMA faults ("illegal instruction") on an innermost coordinate that is not
    16-byte aligned (acc_row = cu_q[b] + b * BLOCK_M was not, for lengths 1, 17, ...)."""
    rows = _acc_rows(lens, block_m)
    rows_pad = gluon_backward.varlen_rows_pad(sum(lens), len(lens), block_m)
    assert rows_pad % 4 == 0  # (a row vector's 16-byte TMA row stride)
    for b, (_, acc, covered) in enumerate(rows):
        assert acc % 4 == 0, f"sequence {b}'s row tiles start unaligned"
        end = rows[b + 1][1] if b + 1 < len(rows) else rows_pad
        assert acc + covered <= end, f"sequence {b}'s last query block runs into the next one's rows"


def test_varlen_preprocess_writes_padded_rows():
    """attn_bwd_varlen_prep_kernel (interpreter): D = rowsum(dO * O) and lse2 = lse * log2(e) (+inf for -inf) at
    each sequence's padded rows, the rows past its length but inside its last query block D 0 / lse2 +inf, the
    slack past those untouched; strided O."""
    gen = torch.Generator().manual_seed(0)
    heads, d, total = 3, 64, sum(LENS)
    out = torch.randn(heads, total, d, generator=gen).to(torch.float16).transpose(0, 1)  # (total, h, d) strided
    dout = torch.randn(total, heads, d, generator=gen).to(torch.float16)
    lse = torch.randn(heads, total, generator=gen)
    lse[:, 3] = -math.inf  # a row that sees no key
    rows_pad = gluon_backward.varlen_rows_pad(total, len(LENS), BLOCK_M)
    lse2 = torch.full((heads, rows_pad), math.nan)
    delta = torch.full_like(lse2, math.nan)
    grid = (-(-max(LENS) // BLOCK_M), heads, len(LENS))
    bwd_rows.attn_bwd_varlen_prep_kernel[grid](out, dout, lse, lse2, delta, _cu(LENS), out.stride(), dout.stride(),
                                               total, rows_pad, HEAD_DIM=d, BLOCK_M=BLOCK_M)
    want_delta = (out.double() * dout.double()).sum(-1).transpose(0, 1)
    want_lse2 = torch.where(lse == -math.inf, math.inf, lse * 1.4426950408889634)
    written = torch.zeros(rows_pad, dtype=torch.bool)
    for (q_row, acc, covered), n in zip(_acc_rows(LENS), LENS):
        torch.testing.assert_close(delta[:, acc:acc + n].double(), want_delta[:, q_row:q_row + n], rtol=1e-5,
                                   atol=1e-4)
        torch.testing.assert_close(lse2[:, acc:acc + n], want_lse2[:, q_row:q_row + n])
        assert (delta[:, acc + n:acc + covered] == 0).all() and (lse2[:, acc + n:acc + covered] == math.inf).all()
        written[acc:acc + covered] = True
    assert delta[:, ~written].isnan().all() and lse2[:, ~written].isnan().all(), "wrote outside the query blocks"


def test_varlen_dq_kernel_takes_each_sequence_out_of_the_padded_rows():
    """attn_bwd_varlen_dq_kernel (interpreter): dq[cu_q[b] + r] = dq_acc[varlen_acc_row(cu_q[b], b) + r] cast to
    dq's dtype; no other row of dq written."""
    gen = torch.Generator().manual_seed(1)
    heads, d, total = 2, 64, sum(LENS)
    rows_pad = gluon_backward.varlen_rows_pad(total, len(LENS), BLOCK_M)
    dq_acc = torch.randn(rows_pad, heads, d, generator=gen)
    dq = torch.full((total + 3, heads, d), math.nan, dtype=torch.float16)  # 3 rows no sequence holds
    grid = (-(-max(LENS) // BLOCK_M), heads, len(LENS))
    bwd_rows.attn_bwd_varlen_dq_kernel[grid](dq_acc, dq, _cu(LENS), NUM_HEADS=heads, HEAD_DIM=d, BLOCK_M=BLOCK_M)
    for (q_row, acc, _), n in zip(_acc_rows(LENS), LENS):
        torch.testing.assert_close(dq[q_row:q_row + n], dq_acc[acc:acc + n].to(torch.float16))
    assert dq[total:].isnan().all()


class _EmulatedVarlenKernel:
    """attn_bwd_ws_varlen_kernel's contract in float64 torch, for the host glue's test: per sequence and query
    head, whole query tiles of BLOCK_M rows of q / dO (rows past the sequence zeros, as its per-sequence
    descriptors read them) with lse2 / delta from the padded row vectors; dQ added at the padded rows (the
    tile's rows past the sequence into its slack), dK / dV summed over the GQA group and stored at the sequence's
    key rows only. The packed tensors themselves come as q_ptr, do_ptr, k_ptr, v_ptr. SEQ_BOUNDED off: the q / dO
    rows past the sequence are the next sequence's (zeros past the tensor), as the host descriptors read them."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.launch

    def launch(self, q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, kh_desc, dq_desc, dk, dv, dq_acc, sem,
               seqlen_q, seqlen_k, qk_scale_log2, sm_scale, cu_q, cu_k, q, do, k, v, window_left, window_right,
               softcap_scale, softcap_log2, NUM_HEADS, GROUP, CAUSAL, SEQ_BOUNDED, WINDOW, SOFTCAP, **_):
        block_m = q_desc.block_shape[0]
        assert all(x.base.data_ptr() == t.data_ptr() for x, t in ((q_desc, q), (do_desc, do), (k_desc, k),
                                                                 (v_desc, v)))
        lse2, delta = lse_desc.base, delta_desc.base
        x_rows = q.shape[0]
        dk.zero_(), dv.zero_()
        for b in range(cu_q.numel() - 1):
            q_row, len_q = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b])
            kv_row, len_k = int(cu_k[b]), int(cu_k[b + 1] - cu_k[b])
            acc, rows = gluon_backward.varlen_acc_row(q_row, b, block_m), -(-len_q // block_m) * block_m
            assert acc % 4 == 0, "a row tile's TMA load starts unaligned"
            pos = torch.arange(rows)
            keys, diag = torch.arange(len_k)[None, :], pos[:, None] + len_k - len_q
            visible = torch.ones(rows, len_k, dtype=torch.bool)
            if CAUSAL:
                visible = keys <= diag
            if WINDOW:
                assert not CAUSAL
                visible = ((keys >= diag - window_left) | (window_left < 0)) & ((keys <= diag + window_right)
                                                                                 | (window_right < 0))
            for h in range(NUM_HEADS):
                hk = h // GROUP
                # SEQ_BOUNDED: zeros past the sequence; else the packed rows (zeros past the tensor)
                read = len_q if SEQ_BOUNDED else min(rows, x_rows - q_row)
                qt, dot = (torch.nn.functional.pad(x[q_row:q_row + read, h], (0, 0, 0, rows - read)).double()
                           for x in (q, do))
                kt, vt = k[kv_row:kv_row + len_k, hk].double(), v[kv_row:kv_row + len_k, hk].double()
                s = qt @ kt.T * qk_scale_log2
                if SOFTCAP:  # the kernel's form: softcap_log2 * tanh, tanh from exp2 of the doubled argument
                    tanh = torch.tanh(qt @ kt.T * softcap_scale / (2 * math.log2(math.e)))
                    s = tanh * softcap_log2
                p = torch.where(visible, torch.exp2(s - lse2[h, acc:acc + rows, None].double()), 0.0)
                ds = p * (dot @ vt.T - delta[h, acc:acc + rows, None].double())
                if SOFTCAP:
                    ds = ds * (1 - tanh * tanh)
                dq_acc[acc:acc + rows, h] += (sm_scale * ds @ kt).float()
                dk[kv_row:kv_row + len_k, hk] += (sm_scale * ds.T @ qt).to(dk.dtype)
                dv[kv_row:kv_row + len_k, hk] += (p.T @ dot).to(dv.dtype)


@pytest.mark.parametrize("window,softcap,seq_bounded", [((-1, -1), 0.0, True), ((-1, 0), 0.0, True),
                                                        ((-1, 0), 0.0, False), ((16, 4), 0.0, True),
                                                        ((-1, 8), 0.0, True), ((-1, 0), 2.0, True)], ids=str)
def test_host_glue_gives_reference_gradients_through_the_padded_rows(window, softcap, seq_bounded, monkeypatch):
    """gluon_varlen_backward's launches with the kernel emulated (_EmulatedVarlenKernel) and the preprocess and dQ
    kernels in the interpreter: dq, dk, dv match the float64 reference - the tiles' rows past each sequence
    (zeros, or with seq_bounded off the next sequence's) contribute exactly nothing through lse2 = +inf, delta = 0
    and the slack rows; lengths 0 and 1, more queries than keys, GQA; causal as the CAUSAL flag, other windows as
    WINDOW with their bounds, softcap as SOFTCAP with its two constants."""
    lens_q, lens_k = [3, 0, 1, 70, 40], [3, 5, 1, 90, 20]
    gen = torch.Generator().manual_seed(2)
    heads, heads_kv, d = 4, 2, 64
    q = torch.randn(sum(lens_q), heads, d, generator=gen).to(torch.float16)
    k, v = (torch.randn(sum(lens_k), heads_kv, d, generator=gen).to(torch.float16) for _ in range(2))
    dout = torch.randn_like(q)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = attention_varlen_ref(*leaves, cu_q, cu_k, window_size=window, softcap=softcap)
    want = torch.autograd.grad(ref_out, leaves, dout.double())
    emulated = _EmulatedVarlenKernel()
    monkeypatch.setattr(attn_bwd, "attn_bwd_ws_varlen_kernel", emulated)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    cfg = GluonBwdConfig(seq_bounded=seq_bounded)
    dq, dk, dv = gluon_backward._varlen_backward(dout, q, k, v, ref_out.detach().to(q.dtype),
                                                 ref_lse.detach().float(), cu_q, cu_k, max(lens_q), max(lens_k),
                                                 d ** -0.5, window, softcap, True, cfg)
    assert emulated.grids == [(-(-max(lens_k) // 128), heads_kv, len(lens_q))]
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert got.dtype == torch.float16 and got.shape == ref.shape, name
        torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-2, msg=name)


@pytest.fixture
def fake_hopper(monkeypatch):
    """The dispatch as on an sm_90 device off the interpreter; the launches replaced by a recorder (returns the
    sentinel grads)."""
    calls = []
    for module in (ga, gluon_backward):
        monkeypatch.setattr(module, "is_hopper", lambda device: True)
    monkeypatch.setattr(gluon_backward, "interpreting", lambda device=None: False)

    def launches(*args):
        calls.append(args)
        return ("grads", )
    monkeypatch.setattr(gluon_backward, "_varlen_backward", launches)
    return calls


def _packed(lens, heads=4, heads_kv=2, d=64, dtype=torch.float16):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens), heads, d, generator=gen).to(dtype)
    k, v = (torch.randn(sum(lens), heads_kv, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, torch.randn_like(q), _cu(lens)


def _varlen_backward(q, k, v, dout, cu, config=None, **options):
    lse = torch.zeros(q.shape[1], q.shape[0])
    opts = dict(window_left=-1, window_right=-1, softcap=0.0, deterministic=True) | options
    scale = opts.pop("scale", q.shape[-1] ** -0.5)
    return gluon_backward.gluon_varlen_backward(dout, q, k, v, q, lse, cu, cu, 130, 130, scale, config=config,
                                                **opts)


def test_dispatch_is_off_by_default_and_config_forces_it(fake_hopper, monkeypatch):
    """PREFILL_RAGGED_GLUON_BWD (False) decides for calls without a config; a GluonBwdConfig takes the kernel
    regardless, with its own launch; the switch on, the resolved config (resolve_gluon_bwd_config)."""
    assert heuristics.PREFILL_RAGGED_GLUON_BWD is False
    args = _packed(LENS)
    assert _varlen_backward(*args) is None and not fake_hopper
    forced = GluonBwdConfig(num_stages=3)
    assert _varlen_backward(*args, config=forced) == ("grads", )
    assert fake_hopper[-1][-1] is forced and fake_hopper[-1][-4] == (-1, -1)  # (cfg; the window: none)
    monkeypatch.setattr(heuristics, "PREFILL_RAGGED_GLUON_BWD", True)
    assert _varlen_backward(*args, window_right=0, deterministic=False) == ("grads", )
    *_, window, softcap, deterministic, cfg = fake_hopper[-1]
    assert window == (-1, 0) and softcap == 0.0 and not deterministic
    assert cfg == heuristics.resolve_gluon_bwd_config(64)
    assert _varlen_backward(*args, window_left=32, window_right=0, softcap=30.0) == ("grads", )  # windows, softcap
    assert fake_hopper[-1][-4:-2] == ((32, 0), 30.0)


@pytest.mark.parametrize("change", [dict(softcap=-1.0), dict(scale=0.0), dict(scale=-0.1), "fp32", "hd80",
                                    "cu_int64", "cu_shape", "heads", "dout_shape"], ids=str)
def test_calls_outside_the_kernel_fall_back(fake_hopper, change):
    """What the ragged kernel does not take returns None (the Triton path), even when forced by config=: a
    negative softcap, a non-positive scale, fp32, head dims other than 64 / 128, cu_seqlens not int32 or of
    different lengths, query heads not a multiple of the kv heads, dout not shaped like q."""
    q, k, v, dout, cu = _packed(LENS, d=80 if change == "hd80" else 64,
                                dtype=torch.float32 if change == "fp32" else torch.float16)
    options = change if isinstance(change, dict) else {}
    cu_k = cu
    if change == "cu_int64":
        cu = cu.long()
    if change == "heads":
        k, v = k[:, :1].expand(-1, 3, -1).contiguous(), v[:, :1].expand(-1, 3, -1).contiguous()
    if change == "dout_shape":
        dout = dout[:, :2]
    if change == "cu_shape":
        cu_k = cu[:-1]
    lse = torch.zeros(q.shape[1], q.shape[0])
    opts = dict(window_left=-1, window_right=-1, softcap=0.0) | options
    scale = opts.pop("scale", 0.125)
    assert gluon_backward.gluon_varlen_backward(dout, q, k, v, q, lse, cu, cu_k, 130, 130, scale,
                                                config=GluonBwdConfig(), **opts) is None
    assert not fake_hopper


def test_expanded_dout_is_made_contiguous(fake_hopper):
    """autograd's dout of out.sum() is an expanded tensor TMA cannot read: the launch gets a contiguous copy."""
    q, k, v, _, cu = _packed(LENS)
    dout = torch.ones(1, 1, 1, dtype=q.dtype).expand(q.shape)
    assert _varlen_backward(q, k, v, dout, cu, config=GluonBwdConfig()) == ("grads", )
    launched = fake_hopper[-1][0]
    assert launched.is_contiguous() and torch.equal(launched, dout)


@pytest.mark.parametrize("backend", [None, "triton", "gluon"])
def test_flash_attn_varlen_backward_reaches_the_dispatch(backend, monkeypatch):
    """flash_attn_varlen's backward asks gluon_varlen_backward (with the call's options and the max lengths)
    wherever config= allows the Gluon kernels (none, or backend "gluon"; the switch is its own decision, above);
    where it declines, the Triton backward's gradients are the reference's (interpreter, fp16)."""
    from flashdecode.ops.attention import resolve_config

    asked = []

    def spy(*args):
        asked.append(args)
        return None  # decline: the Triton path runs
    monkeypatch.setattr(gluon_backward, "gluon_varlen_backward", spy)
    lens = [5, 0, 17]
    q, k, v, dout, cu = _packed(lens, d=32)
    config = None
    if backend:
        config = dataclasses.replace(resolve_config(q[None], k[None], v[None]), backend=backend)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flashdecode.flash_attn_varlen(*leaves, cu, cu, max(lens), max(lens), causal=True, config=config)
    grads = torch.autograd.grad(out, leaves, dout)
    assert len(asked) == (0 if backend == "triton" else 1)
    if asked:
        (*_, max_q, max_k, scale, left, right, softcap, deterministic) = asked[0]
        assert (max_q, max_k, scale, left, right, softcap, deterministic) == (17, 17, 32 ** -0.5, -1, 0, 0.0, True)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = attention_varlen_ref(*ref_leaves, cu, cu, causal=True)
    want = torch.autograd.grad(ref, ref_leaves, dout.double())
    for got, ref_grad in zip(grads, want):
        torch.testing.assert_close(got.double(), ref_grad, rtol=2e-2, atol=2e-2)
