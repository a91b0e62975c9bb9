"""`flashdecode bench prefill --ragged`: ragged (varlen) prefill - the call engines and packed-sequence training
make - against FlashAttention-3 and FlashInfer's FA2 on the same packed tensors, in one run.

Rows (seeded): random lengths 100..4000 summing to ~16k tokens, 16 x 1k, 64 x 256, 2 x 8k; hd128 with 32 / 8
heads and hd64 with 16 / 16 heads; causal and not. Columns: ours (flash_attn_varlen as a user calls it: the Gluon
kernel on sm_90 where the dispatch sends it), triton (the same call pinned to the Triton kernel through
``config=``), FA3 (FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper(backend="fa3")``), fa2 (its "fa2"
backend), all timed per call with do_bench (median); FlashInfer's plan() stays outside the timed call, as an
engine plans once per batch. ``--variants vtail`` adds gluon_vtail / gluon_novtail: the ragged Gluon forward
launched directly with its V-tail zeroing on and off (GluonFwdConfig.v_tail, an ablation), the cost of the NaN
fix's zeroing; ``--variants vbound`` adds gluon_vbound beside them: the same zeros from the producer's bounded V
descriptors instead (GluonFwdConfig.v_bound). TFLOP/s count each sequence's own 4 * h * lq * lk * d (halved for causal).
Forward + backward (``--modes fwd,fwd+bwd``): ours on the ragged batch beside ours on a dense batch of the same
total tokens (the 16 x 1k row against flash_attn on (16, 1024, ...)); FlashInfer has no backward. Beside them:
gluon_bwd (ours with the backward forced onto the ragged Gluon kernel, ops/gluon_backward.py gluon_varlen_backward
with the resolved GluonBwdConfig, whatever heuristics.PREFILL_RAGGED_GLUON_BWD says; gluon_bwd_unbounded: with
seq_bounded off, the A/B of the per-sequence descriptors), and FlashAttention's own
varlen training call where installed: flash_attn3 (flash-attn's Hopper build, ``flash_attn_interface``) and
flash_attn2 (``flash_attn``), deterministic=False as they default.
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Optional

import torch

ROWS = {"random": None, "16x1k": [1024] * 16, "64x256": [256] * 64, "2x8k": [8192] * 2}
HEADS = {128: (32, 8), 64: (16, 16)}
RANDOM_TOKENS = 16384
RANDOM_RANGE = (100, 4000)
RAGGED_GLUON_BWD_OPT_IN = "FLASHDECODE_RAGGED_GLUON_BWD"  # "1": time the ragged Gluon backward (gluon_bwd)
V_BOUND_OPT_IN = "FLASHDECODE_V_BOUND"  # "1": run the GPU tests of GluonFwdConfig.v_bound (not yet run on a GPU)


def random_lengths(seed: int = 0, tokens: int = RANDOM_TOKENS, lo: int = RANDOM_RANGE[0],
                   hi: int = RANDOM_RANGE[1]) -> list[int]:
    """Seeded lengths in [lo, hi] drawn until they sum to about ``tokens``."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens - lo:
        lengths.append(min(rng.randint(lo, hi), max(lo, tokens - sum(lengths))))
    return lengths


def ragged_flops(lengths: list[int], nheads: int, headdim: int, causal: bool, mode: str) -> float:
    per = sum(4.0 * nheads * n * n * headdim for n in lengths) * (0.5 if causal else 1.0)
    return per * (3.5 if mode == "fwd+bwd" else 1.0)


def _inputs(lengths, nheads, nheads_kv, headdim, dtype, seed, grad=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, nheads, headdim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(total, nheads_kv, headdim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(total, nheads_kv, headdim, device="cuda", dtype=dtype, generator=gen)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    return [x.requires_grad_(grad) for x in (q, k, v)], cu


def _ours(pin_triton: bool):
    def build(q, k, v, cu, max_len, causal):
        import flashdecode
        from flashdecode.ops.attention import resolve_config

        config = None
        if pin_triton:
            config = dataclasses.replace(resolve_config(q[None], k[None], v[None]), backend="triton")
        return lambda: flashdecode.flash_attn_varlen(q, k, v, cu, cu, max_len, max_len, causal=causal,
                                                     config=config)
    return build


def _flashinfer(backend: str):
    def build(q, k, v, cu, max_len, causal):
        import flashinfer

        workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)
        wrapper.plan(cu, cu, q.shape[1], k.shape[1], q.shape[2], causal=causal, q_data_type=q.dtype)
        return lambda: wrapper.run(q, k, v)
    return build


class _GluonRaggedBackward(torch.autograd.Function):
    """flash_attn_varlen's forward (its dispatch), then the backward on the ragged Gluon kernel, forced with a
    GluonBwdConfig (a benchmark peer: the switch heuristics.PREFILL_RAGGED_GLUON_BWD stays as it is)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, causal, config):
        import flashdecode

        out, lse = flashdecode.flash_attn_varlen(q, k, v, cu, cu, max_len, max_len, causal=causal, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.options = (max_len, causal, config)
        return out

    @staticmethod
    def backward(ctx, dout):
        from flashdecode.ops.gluon_backward import gluon_varlen_backward

        q, k, v, out, lse, cu = ctx.saved_tensors
        max_len, causal, config = ctx.options
        grads = gluon_varlen_backward(dout, q, k, v, out, lse, cu, cu, max_len, max_len, q.shape[-1] ** -0.5, -1,
                                      0 if causal else -1, 0.0, True, config)
        if grads is None:
            raise RuntimeError("the ragged Gluon backward does not take this call")
        return (*grads, None, None, None, None)


def _gluon_bwd(seq_bounded: bool):
    """The gluon_bwd peers: the resolved GluonBwdConfig (seq_bounded, per-sequence descriptors) or it with
    seq_bounded off (the host's descriptors: the A/B of that option)."""
    def build(q, k, v, cu, max_len, causal):
        from flashdecode.heuristics import resolve_gluon_bwd_config

        config = dataclasses.replace(resolve_gluon_bwd_config(q.shape[-1]), seq_bounded=seq_bounded)
        return lambda: _GluonRaggedBackward.apply(q, k, v, cu, max_len, causal, config)
    return build


def _gluon_fwd(v_tail: bool, v_bound: bool = False):
    """The gluon_vtail / gluon_novtail / gluon_vbound peers: the ragged Gluon forward launched directly
    (ops/gluon_attention.py gluon_varlen_forward_into, the launch flash_attn_varlen's dispatch resolves) with its
    V-tail zeroing on or off (GluonFwdConfig.v_tail, a timing ablation), or its last V blocks read through bounded
    descriptors (v_bound): the A/B of what zeroing the last key block's V rows costs."""
    def build(q, k, v, cu, max_len, causal):
        from flashdecode.heuristics import resolve_gluon_varlen_config
        from flashdecode.ops.gluon_attention import gluon_varlen_forward_into

        batch = cu.shape[0] - 1
        config = dataclasses.replace(resolve_gluon_varlen_config(q.shape[-1], causal, -(-k.shape[0] // batch)),
                                     v_tail=v_tail, v_bound=v_bound)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)

        def step():
            if not gluon_varlen_forward_into(q, k, v, out, lse, cu, cu, max_len, q.shape[-1] ** -0.5, -1,
                                             0 if causal else -1, 0.0, config):
                raise RuntimeError("the ragged Gluon forward does not take this call")
            return out
        return step
    return build


def _flash_attn(module: str):
    """FlashAttention's varlen call (forward and backward): flash-attn's Hopper build (flash_attn_interface) or
    its FA2 package (flash_attn); the first output where it returns (out, lse)."""
    def build(q, k, v, cu, max_len, causal):
        import importlib

        func = importlib.import_module(module).flash_attn_varlen_func

        def step():
            out = func(q, k, v, cu, cu, max_len, max_len, causal=causal)
            return out[0] if isinstance(out, tuple) else out
        return step
    return build


BUILDERS = {"ours": _ours(False), "triton": _ours(True), "FA3": _flashinfer("fa3"), "fa2": _flashinfer("fa2"),
            "gluon_bwd": _gluon_bwd(True), "gluon_bwd_unbounded": _gluon_bwd(False),
            "gluon_vtail": _gluon_fwd(True), "gluon_novtail": _gluon_fwd(False),
            "gluon_vbound": _gluon_fwd(False, v_bound=True),
            "flash_attn3": _flash_attn("flash_attn_interface"), "flash_attn2": _flash_attn("flash_attn")}
# the peers with a backward
TRAINING_PEERS = ("ours", "triton", "gluon_bwd", "gluon_bwd_unbounded", "flash_attn3", "flash_attn2")


def _time(step, rep_ms: int) -> tuple[Optional[float], Optional[str]]:
    from flashdecode.timing import do_bench_ms

    try:
        step()  # compile / plan / JIT outside the timed window
        torch.cuda.synchronize()
        return do_bench_ms(step, warmup_ms=25, rep_ms=rep_ms), None
    except Exception as e:  # a peer that cannot run this shape is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _fwd_bwd(forward):
    def step():
        out = forward()
        out.backward(torch.ones_like(out))
    return step


def ragged_point(name: str, lengths: list[int], headdim: int, causal: bool, mode: str, peers: list[str],
                 rep_ms: int, seed: int = 0) -> dict:
    nheads, nheads_kv = HEADS[headdim]
    row = dict(row=name, mode=mode, headdim=headdim, nheads=nheads, nheads_kv=nheads_kv, causal=causal,
               batch=len(lengths), tokens=sum(lengths), max_len=max(lengths))
    flops = ragged_flops(lengths, nheads, headdim, causal, mode)
    (q, k, v), cu = _inputs(lengths, nheads, nheads_kv, headdim, torch.bfloat16, seed, grad=mode == "fwd+bwd")
    for peer in peers:
        if (mode == "fwd+bwd") != (peer in TRAINING_PEERS) and peer not in ("ours", "triton"):
            continue  # FlashInfer and the V-tail A/B: forward only; gluon_bwd, FlashAttention's: fwd+bwd only
        forward = BUILDERS[peer](q, k, v, cu, max(lengths), causal)
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            ms, why = _time(forward if mode == "fwd" else _fwd_bwd(forward), rep_ms)
        row[f"{peer}_ms"] = ms
        row[peer] = None if ms is None else flops / (ms * 1e-3) / 1e12
        if why:
            row[f"{peer}_skipped"] = why
    if mode == "fwd+bwd" and len(set(lengths)) == 1:  # the dense batch of the same tokens beside it
        row["dense"] = _dense_fwd_bwd(len(lengths), lengths[0], nheads, nheads_kv, headdim, causal, rep_ms, flops)
    for peer in ("FA3", "fa2", "triton", "dense", "flash_attn3"):
        if row.get("ours") and row.get(peer):
            row[f"ours/{peer}"] = row["ours"] / row[peer]
    for peer in ("triton", "flash_attn3", "flash_attn2"):
        if row.get("gluon_bwd") and row.get(peer):
            row[f"gluon_bwd/{peer}"] = row["gluon_bwd"] / row[peer]
    for peer in ("gluon_vtail", "gluon_vbound"):
        if row.get(peer) and row.get("gluon_novtail"):
            row[f"{peer}/gluon_novtail"] = row[peer] / row["gluon_novtail"]
    del q, k, v
    torch.cuda.empty_cache()
    return row


def _dense_fwd_bwd(batch, seqlen, nheads, nheads_kv, headdim, causal, rep_ms, flops) -> Optional[float]:
    import flashdecode

    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(batch, seqlen, h, headdim, device="cuda", dtype=torch.bfloat16, generator=gen)
               .requires_grad_() for h in (nheads, nheads_kv, nheads_kv))
    ms, _ = _time(_fwd_bwd(lambda: flashdecode.flash_attn(q, k, v, causal=causal)), rep_ms)
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def peers_available(modes: tuple = ("fwd", ), variants: tuple = ()) -> list[str]:
    """The peers this machine has: ours, triton, FlashInfer's FA3 (sm_90) and FA2; on sm_90 with "vtail" in
    variants the forward's V-tail A/B (gluon_vtail, gluon_novtail; "vbound": gluon_vbound too); for fwd+bwd (in
    modes) also gluon_bwd (sm_90, with FLASHDECODE_RAGGED_GLUON_BWD=1 set) and FlashAttention's packages where
    importable."""
    import importlib.util

    hopper = torch.cuda.get_device_capability()[0] == 9
    peers = ["ours", "triton"]
    if importlib.util.find_spec("flashinfer") is not None:
        peers += ["FA3", "fa2"] if hopper else ["fa2"]
    if hopper and ("vtail" in variants or "vbound" in variants) and "fwd" in modes:
        peers += ["gluon_vtail", "gluon_novtail"] + (["gluon_vbound"] if "vbound" in variants else [])
    if "fwd+bwd" in modes:
        # the ragged Gluon backward once hit an illegal instruction on the H100 (docs/decisions.md); timed only once
        # a run opts in until its GPU tests pass whole, since a fault ends the process's CUDA context
        if hopper and os.environ.get(RAGGED_GLUON_BWD_OPT_IN) == "1":
            peers += ["gluon_bwd", "gluon_bwd_unbounded"]
        peers += [name for name in ("flash_attn3", "flash_attn2")
                  if importlib.util.find_spec({"flash_attn3": "flash_attn_interface",
                                               "flash_attn2": "flash_attn"}[name]) is not None]
    return peers


def run_ragged(args) -> int:
    from flashdecode.bench.report import markdown_table, result_stem, results_dir, write_json
    from flashdecode.timing import env_info

    modes = (args.modes or "fwd").split(",")
    headdims = [int(x) for x in (args.headdims or "128,64").split(",")]
    peers = peers_available(tuple(modes), tuple((args.variants or "").split(",")))
    env = env_info()
    print(f"# ragged prefill on {env['device']} (torch {env['torch']}, triton {env['triton']}, {env['date']}); "
          f"peers: {', '.join(peers)}")
    rows = []
    for mode in modes:
        for headdim in headdims:
            for causal in (True, False):
                for name, lengths in ROWS.items():
                    lengths = lengths or random_lengths()
                    row = ragged_point(name, lengths, headdim, causal, mode, peers, args.rep_ms)
                    rows.append(row)
                    print("  " + "  ".join(f"{c}={row[c]:.3g}" if isinstance(row.get(c), float) else
                                           f"{c}={row.get(c)}" for c in
                                           ["row", "mode", "headdim", "causal"] + peers
                                           + ["dense", "ours/FA3", "gluon_bwd/triton", "gluon_bwd/flash_attn3"]
                                           if c in row), flush=True)
    ratios = [r for r in ("ours/FA3", "ours/fa2", "ours/triton", "ours/dense", "ours/flash_attn3",
                          "gluon_bwd/triton", "gluon_bwd/flash_attn3", "gluon_bwd/flash_attn2",
                          "gluon_vtail/gluon_novtail", "gluon_vbound/gluon_novtail")
              if any(r in row for row in rows)]
    columns = ["row", "mode", "headdim", "nheads", "causal", "tokens"] + peers + ["dense"] + ratios
    table = markdown_table(rows, columns, {p: ".0f" for p in peers + ["dense"]} | {r: ".2f" for r in ratios})
    out_dir = results_dir(args.out)
    stem = result_stem("prefill_ragged", env)
    path = write_json(out_dir / f"{stem}.json", "prefill_ragged", env, rows,
                      {"peers": peers, "flops": "sum over sequences of 4*h*lq*lk*d, /2 causal, x3.5 fwd+bwd",
                       "table": table})
    print()
    print(table)
    print(f"\nwrote {path}")
    return 1 if any(row.get("ours") is None for row in rows) else 0
