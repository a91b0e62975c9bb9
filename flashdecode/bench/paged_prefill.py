"""Paged-KV prefill rows of ``bench prefill --paged``: a chunk of new tokens per sequence attending (causal) to the
keys already in cache pages plus its own, the engine's chunked-prefill / prefix-cache-hit call.

Per row (page size, chunk, cached tokens; bf16, 32 q / 8 kv heads, hd128, ``PAGED["batch"]`` sequences, randomly
permuted pages): ours through flash_attn_varlen(block_table=, seqused_k=) on the Triton kernel ("triton",
backend="triton") and on the Gluon kernel ("gluon", config= its resolved GluonFwdConfig; skipped where the page holds
no whole key block), "paged" = the one of the two the default dispatch takes (``paged_backend``: the Gluon kernel
only while heuristics.PREFILL_PAGED_GLUON is on), the same problem on a packed contiguous k/v through
flash_attn_varlen ("contig"), and FlashInfer's BatchPrefillWithPagedKVCacheWrapper ("FI", backend fa3 where it
plans, else fa2) when importable. TFLOP/s count the visible (query, key) pairs: 4 * d * h *
(chunk * cached + chunk * (chunk + 1) / 2) per sequence. Metadata lives on the device (no host sync in any call).
"""

from __future__ import annotations

from typing import Callable, Optional

import dataclasses

import torch

PAGED = dict(batch=4, nheads=32, nheads_kv=8, headdim=128, page_sizes=(16, 64, 128), chunks=(512, 2048),
             cached=(0, 8192, 32768))
PAGED_PEERS = ("triton", "gluon", "contig", "FI")


class _Problem:
    """The data of one row: q (batch * chunk, nheads, headdim), the paged cache and its table, the same keys
    packed contiguously, and the metadata of both forms (int32, on the GPU)."""

    def __init__(self, page_size: int, chunk: int, cached: int, gen: torch.Generator):
        p, dev, dtype = PAGED, "cuda", torch.bfloat16
        batch, hk, d = p["batch"], p["nheads_kv"], p["headdim"]
        self.page_size, self.chunk, self.keys = page_size, chunk, cached + chunk
        self.pages_per_seq = -(-self.keys // page_size)
        num_pages = batch * self.pages_per_seq
        self.q = torch.randn(batch * chunk, p["nheads"], d, device=dev, dtype=dtype, generator=gen)
        self.k_cache, self.v_cache = (torch.randn(num_pages, page_size, hk, d, device=dev, dtype=dtype,
                                                  generator=gen) for _ in range(2))
        perm = torch.randperm(num_pages, device=dev, generator=gen).to(torch.int32)
        self.table = perm.view(batch, self.pages_per_seq)
        rows = (self.table.long()[:, :, None] * page_size
                + torch.arange(page_size, device=dev)[None, None, :]).flatten(1)[:, :self.keys].flatten()
        self.k, self.v = (x.flatten(0, 1)[rows] for x in (self.k_cache, self.v_cache))  # packed, in key order
        self.cu_q = torch.arange(0, (batch + 1) * chunk, chunk, dtype=torch.int32, device=dev)
        self.cu_k = torch.arange(0, (batch + 1) * self.keys, self.keys, dtype=torch.int32, device=dev)
        self.used = torch.full((batch,), self.keys, dtype=torch.int32, device=dev)

    def flops(self) -> float:
        p = PAGED
        pairs = self.chunk * (self.keys - self.chunk) + self.chunk * (self.chunk + 1) / 2
        return 4.0 * p["headdim"] * p["nheads"] * p["batch"] * pairs


def _paged_call(x: _Problem, config) -> Callable:
    import flashdecode

    return lambda: flashdecode.flash_attn_varlen(x.q, x.k_cache, x.v_cache, x.cu_q, None, x.chunk, x.keys,
                                                 block_table=x.table, seqused_k=x.used, causal=True, config=config)


def _triton(x: _Problem) -> Callable:
    """The Triton paged prefill: the resolved AttentionConfig pinned to backend "triton"."""
    from flashdecode.ops.attention_config import resolve_config

    config = resolve_config(x.q, x.k_cache, x.v_cache, x.keys)
    return _paged_call(x, dataclasses.replace(config, backend="triton"))


def _gluon(x: _Problem) -> Callable:
    """The Gluon paged prefill with the launch its resolver gives (whatever PREFILL_PAGED_GLUON says)."""
    from flashdecode import heuristics

    config = heuristics.resolve_gluon_paged_config(PAGED["headdim"], True, x.page_size, x.keys)
    if config is None:
        raise ValueError(f"pages of {x.page_size} hold no whole key block (the Triton kernel's)")
    return _paged_call(x, config)


def _gluon_applies(x: _Problem) -> bool:
    from flashdecode import heuristics

    return heuristics.resolve_gluon_paged_config(PAGED["headdim"], True, x.page_size, x.keys) is not None


def _default_backend(x: _Problem) -> str:
    """The kernel the default dispatch gives this row (ops/gluon_attention.py gluon_paged_forward_into)."""
    from flashdecode import heuristics

    return "gluon" if heuristics.PREFILL_PAGED_GLUON and _gluon_applies(x) else "triton"


def _contig(x: _Problem) -> Callable:
    import flashdecode

    return lambda: flashdecode.flash_attn_varlen(x.q, x.k, x.v, x.cu_q, x.cu_k, x.chunk, x.keys, causal=True,
                                                 check_seqlens=False)


def _flashinfer(x: _Problem) -> tuple[Callable, str]:
    """FlashInfer's paged prefill: the fa3 backend where its plan accepts the problem, else fa2."""
    import flashinfer

    p = PAGED
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    indptr = torch.arange(0, (p["batch"] + 1) * x.pages_per_seq, x.pages_per_seq, dtype=torch.int32,
                          device="cuda")
    last = torch.full((p["batch"],), x.keys - (x.pages_per_seq - 1) * x.page_size, dtype=torch.int32,
                      device="cuda")
    errors = []
    for backend in ("fa3", "fa2"):
        try:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
            wrapper.plan(x.cu_q, indptr, x.table.flatten(), last, p["nheads"], p["nheads_kv"], p["headdim"],
                         x.page_size, causal=True, q_data_type=x.q.dtype, kv_data_type=x.k_cache.dtype)
            fn = (lambda w: (lambda: w.run(x.q, (x.k_cache, x.v_cache))))(wrapper)
            fn()
            return fn, backend
        except Exception as e:  # this backend cannot take the problem here: try the next
            errors.append(f"{backend}: {type(e).__name__}")
    raise RuntimeError("; ".join(errors))


def _time(build: Callable, x: _Problem, rep_ms: int) -> tuple[Optional[float], Optional[str], Optional[str]]:
    """(median ms, backend or None, why it could not run or None)."""
    from flashdecode.timing import do_bench_ms

    try:
        built = build(x)
        fn, backend = built if isinstance(built, tuple) else (built, None)
        with torch.no_grad():
            fn()  # compile / autotune outside the timed window
            torch.cuda.synchronize()
            return do_bench_ms(fn, warmup_ms=25, rep_ms=rep_ms), backend, None
    except Exception as e:  # a peer that cannot run this shape is reported, not fatal
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


def bench_rows(rep_ms: int, with_flashinfer: bool) -> list[dict]:
    """One row per (page size, chunk, cached tokens) of PAGED; prints each row's summary as it goes."""
    builders = {"triton": _triton, "gluon": _gluon, "contig": _contig}
    if with_flashinfer and flashinfer_available():
        builders["FI"] = _flashinfer
    rows = []
    for page_size in PAGED["page_sizes"]:
        for chunk in PAGED["chunks"]:
            for cached in PAGED["cached"]:
                gen = torch.Generator(device="cuda").manual_seed(page_size * 100003 + chunk * 7 + cached)
                x = _Problem(page_size, chunk, cached, gen)
                row = dict(mode="paged fwd", dtype="bf16", headdim=PAGED["headdim"], nheads=PAGED["nheads"],
                           nheads_kv=PAGED["nheads_kv"], batch=PAGED["batch"], page_size=page_size, chunk=chunk,
                           cached=cached, causal=True)
                for name, build in builders.items():
                    ms, backend, why = _time(build, x, rep_ms)
                    row[f"{name}_ms"] = ms
                    row[name] = None if ms is None else x.flops() / (ms * 1e-3) / 1e12
                    if backend:
                        row[f"{name}_backend"] = backend
                    if why:
                        row[f"{name}_skipped"] = why
                row["paged_backend"], row["gluon_applies"] = _default_backend(x), _gluon_applies(x)
                row["paged"] = row.get(row["paged_backend"])
                if row["paged"] is None:
                    row["paged_skipped"] = row.get(f"{row['paged_backend']}_skipped", "?")
                for ours, peer in (("paged", "contig"), ("paged", "FI"), ("gluon", "triton"), ("gluon", "contig"),
                                   ("gluon", "FI")):
                    if row.get(ours) and row.get(peer):
                        row[f"{ours}/{peer}"] = row[ours] / row[peer]
                rows.append(row)
                print("  " + summary_line(row), flush=True)
                del x
                torch.cuda.empty_cache()
    return rows


def failed(r: dict) -> bool:
    """Ours failed on row r: the default dispatch's kernel, or the Gluon one where its resolver takes the row."""
    return r.get("paged") is None or (r.get("gluon_applies", False) and r.get("gluon") is None)


def summary_line(r: dict) -> str:
    """'paged fwd page128 chunk512 +32768 cached: ours (triton) 310 TFLOP/s vs contig 330 (0.94x), FI(fa3) 290
    (1.07x); gluon 400 (1.29x triton, 1.38x FI)'."""
    head = f"paged fwd page{r['page_size']} chunk{r['chunk']} +{r['cached']} cached"
    if r.get("paged") is None:
        return f"{head}: ours failed ({r.get('paged_skipped', '?')})"
    kernel = f" ({r['paged_backend']})" if r.get("paged_backend") else ""  # (records before the Gluon column)
    s = f"{head}: ours{kernel} {r['paged']:.0f} TFLOP/s"
    for peer in ("contig", "FI"):
        if r.get(peer):
            label = f"FI({r.get('FI_backend')})" if peer == "FI" else peer
            s += f", {label} {r[peer]:.0f} ({r[f'paged/{peer}']:.2f}x)"
        elif r.get(f"{peer}_skipped"):
            s += f", {peer} skipped ({r[f'{peer}_skipped']})"
    if r.get("gluon"):
        ratios = ", ".join(f"{r[f'gluon/{p}']:.2f}x {p}" for p in ("triton", "FI") if r.get(f"gluon/{p}"))
        s += f"; gluon {r['gluon']:.0f} ({ratios})"
    elif r.get("gluon_skipped"):
        s += f"; gluon skipped ({r['gluon_skipped']})"
    return s


TABLE_COLUMNS = ["page_size", "chunk", "cached", "batch", "paged_backend", "paged", "triton", "gluon", "contig", "FI",
                 "FI_backend", "paged/contig", "paged/FI", "gluon/triton", "gluon/FI"]
TABLE_FORMATS = {"paged": ".0f", "triton": ".0f", "gluon": ".0f", "contig": ".0f", "FI": ".0f",
                 "paged/contig": ".2f", "paged/FI": ".2f", "gluon/triton": ".2f", "gluon/FI": ".2f"}
