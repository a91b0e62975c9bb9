"""`flashdecode bench prefill --ragged`: ragged (varlen) prefill - the call engines and packed-sequence training
make - against FlashAttention-3 and FlashInfer's FA2 on the same packed tensors, in one run.

Rows (seeded): random lengths 100..4000 summing to ~16k tokens, 16 x 1k, 64 x 256, 2 x 8k; hd128 with 32 / 8
heads and hd64 with 16 / 16 heads; causal and not. Columns: ours (flash_attn_varlen as a user calls it: the Gluon
kernel on sm_90 where the dispatch sends it), triton (the same call pinned to the Triton kernel through
``config=``), FA3 (FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper(backend="fa3")``), fa2 (its "fa2"
backend), all timed per call with do_bench (median); FlashInfer's plan() stays outside the timed call, as an
engine plans once per batch. TFLOP/s count each sequence's own 4 * h * lq * lk * d (halved for causal).
Forward + backward (``--modes fwd,fwd+bwd``): ours on the ragged batch beside ours on a dense batch of the same
total tokens (the 16 x 1k row against flash_attn on (16, 1024, ...)); FlashInfer has no backward.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

import torch

ROWS = {"random": None, "16x1k": [1024] * 16, "64x256": [256] * 64, "2x8k": [8192] * 2}
HEADS = {128: (32, 8), 64: (16, 16)}
RANDOM_TOKENS = 16384
RANDOM_RANGE = (100, 4000)


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


BUILDERS = {"ours": _ours(False), "triton": _ours(True), "FA3": _flashinfer("fa3"), "fa2": _flashinfer("fa2")}


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
        if mode == "fwd+bwd" and peer not in ("ours", "triton"):
            continue
        forward = BUILDERS[peer](q, k, v, cu, max(lengths), causal)
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            ms, why = _time(forward if mode == "fwd" else _fwd_bwd(forward), rep_ms)
        row[f"{peer}_ms"] = ms
        row[peer] = None if ms is None else flops / (ms * 1e-3) / 1e12
        if why:
            row[f"{peer}_skipped"] = why
    if mode == "fwd+bwd" and len(set(lengths)) == 1:  # the dense batch of the same tokens beside it
        row["dense"] = _dense_fwd_bwd(len(lengths), lengths[0], nheads, nheads_kv, headdim, causal, rep_ms, flops)
    for peer in ("FA3", "fa2", "triton", "dense"):
        if row.get("ours") and row.get(peer):
            row[f"ours/{peer}"] = row["ours"] / row[peer]
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


def peers_available() -> list[str]:
    peers = ["ours", "triton"]
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return peers
    return peers + ["FA3", "fa2"] if torch.cuda.get_device_capability()[0] == 9 else peers + ["fa2"]


def run_ragged(args) -> int:
    from flashdecode.bench.report import markdown_table, result_stem, results_dir, write_json
    from flashdecode.timing import env_info

    modes = (args.modes or "fwd").split(",")
    headdims = [int(x) for x in (args.headdims or "128,64").split(",")]
    peers = peers_available()
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
                                           ["row", "mode", "headdim", "causal"] + peers + ["dense", "ours/FA3"]
                                           if c in row), flush=True)
    ratios = [r for r in ("ours/FA3", "ours/fa2", "ours/triton", "ours/dense") if any(r in row for row in rows)]
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
