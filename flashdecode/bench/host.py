"""Host time of eager calls (``bench decode --host`` / ``bench prefill --host``) and transformers generate with our
attention backend against "sdpa" (``--generate``).

Host table: per op, a loop of ``calls`` eager calls after 10 warm-ups, time.perf_counter around the loop (host =
CPU time per call while the GPU runs behind, no sync inside the loop) and after one torch.cuda.synchronize at the
end (wall per call: kernel plus whatever gap the host leaves). Llama-3-8B heads (32 / 8, head dim 128), bf16,
batch 4, cache lengths 8000 / 17 / 3000 / 8192 (contiguous cache of 8192 rows); flash_attn on 128 tokens at batch 1;
SDPA's per-call time is the eager reference. Target (H100): each host call <= 20 us, flash_attn forward <= 15 us,
forward + backward <= 40 us.

Generate: a Llama-3-8B-shaped model of ``layers`` layers and random bf16 weights, greedy, 64 new tokens after a
warm-up generate of the same length; eager DynamicCache, and StaticCache with torch.compile (fullgraph,
mode="reduce-overhead"); tokens per second of ours and of "sdpa" (one model, its attention switched), and their
ratio.

    python -m flashdecode bench decode --host --generate --out DIR    (or python -m flashdecode.bench.host)
"""

from __future__ import annotations

import time
from typing import Callable

import torch

LENGTHS = (8000, 17, 3000, 8192)
HEADS, HEADS_KV, HEADDIM = 32, 8, 128
GENERATE_POINTS = ((1, 512), (1, 4096), (1, 32768), (8, 2048))  # (batch, context), eager DynamicCache
COMPILED_POINTS = ((1, 4096),)  # StaticCache + torch.compile (each compiles and captures: about a minute)


def time_calls(fn: Callable[[], object], calls: int = 200, warmup: int = 10) -> tuple[float, float]:
    """(host us per call, wall us per call) of ``calls`` eager calls of ``fn`` (module doc)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return host / calls * 1e6, wall / calls * 1e6


def _decode_calls(device) -> dict:
    import flashdecode
    from flashdecode import flash_attn_interface as fai

    dt, b, cap = torch.bfloat16, len(LENGTHS), max(LENGTHS)
    q = torch.randn(b, HEADS, HEADDIM, dtype=dt, device=device)
    k = torch.randn(b, cap, HEADS_KV, HEADDIM, dtype=dt, device=device)
    v = torch.randn_like(k)
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device=device)
    before = lens - 1  # the appending calls write the last token again: the cache never grows
    k_new = torch.randn(b, 1, HEADS_KV, HEADDIM, dtype=dt, device=device)
    v_new = torch.randn_like(k_new)
    plan = flashdecode.DecodePlan(b, HEADS, HEADS_KV, HEADDIM, max_seqlen_k=cap, dtype=dt, device=device)
    o = torch.randn(b, HEADS, HEADDIM, dtype=dt, device=device)
    lse = torch.randn(b, HEADS, device=device)
    q_sdpa = q.view(b, HEADS, 1, HEADDIM)
    k_sdpa = k.transpose(1, 2).repeat_interleave(HEADS // HEADS_KV, 1)  # (b, h, cap, d), the whole cache
    v_sdpa = v.transpose(1, 2).repeat_interleave(HEADS // HEADS_KV, 1)
    return {
        "flash_decode": lambda: flashdecode.flash_decode(q, k, v, lens),
        "DecodePlan.run": lambda: plan.run(q, k, v, lens),
        "flash_attn_with_kvcache": lambda: fai.flash_attn_with_kvcache(q.unsqueeze(1), k, v, cache_seqlens=lens),
        "flash_attn_with_kvcache +append": lambda: fai.flash_attn_with_kvcache(
            q.unsqueeze(1), k, v, k=k_new, v=v_new, cache_seqlens=before),
        "append_kv": lambda: flashdecode.append_kv(k, v, k_new, v_new, before),
        "merge_states": lambda: flashdecode.merge_states(o, lse, o, lse),
        "SDPA decode (reference)": lambda: torch.nn.functional.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa),
    }


def _prefill_calls(device) -> dict:
    import flashdecode

    dt = torch.bfloat16
    q, k, v = (torch.randn(1, 128, 16, 128, dtype=dt, device=device) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)

    def fwd_bwd():
        flashdecode.flash_attn(qg, kg, vg, causal=True).backward(dout)

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)

    def sdpa_fwd_bwd():
        torch.nn.functional.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
                                                         is_causal=True).backward(dout.transpose(1, 2))

    return {"flash_attn fwd": lambda: flashdecode.flash_attn(q, k, v, causal=True), "flash_attn fwd+bwd": fwd_bwd,
            "SDPA fwd (reference)": sdpa, "SDPA fwd+bwd (reference)": sdpa_fwd_bwd}


def host_rows(which: str = "decode", calls: int = 200) -> list[dict]:
    """Rows {op, host_us, wall_us} of the host table: ``which`` "decode" or "prefill"."""
    device = torch.device("cuda")
    fns = _decode_calls(device) if which == "decode" else _prefill_calls(device)
    rows = []
    for name, fn in fns.items():
        host, wall = time_calls(fn, calls)
        rows.append({"op": name, "host_us": host, "wall_us": wall})
        print(f"  {name}: host {host:.1f} us, wall {wall:.1f} us per call", flush=True)
    return rows


def first_call_ms() -> dict:
    """Milliseconds of the first flash_decode and flash_attn call of a shape this process has not run (Triton's
    disk cache decides whether that compiles) and of the second (the launch cache)."""
    import flashdecode

    device, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(2, HEADS, HEADDIM, dtype=dt, device=device)
    k = torch.randn(2, 1024, HEADS_KV, HEADDIM, dtype=dt, device=device)
    lens = torch.tensor([1000, 7], dtype=torch.int32, device=device)
    qa = torch.randn(1, 256, 16, 128, dtype=dt, device=device)
    out = {}
    for name, fn in (("flash_decode", lambda: flashdecode.flash_decode(q, k, k, lens)),
                     ("flash_attn", lambda: flashdecode.flash_attn(qa, qa, qa, causal=True))):
        for attempt in ("first", "second"):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out[f"{name} {attempt} ms"] = (time.perf_counter() - start) * 1e3
    return out


def _llama(layers: int, device):
    """A Llama-3-8B-shaped model of ``layers`` layers, random bf16 weights, built on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS_KV, num_hidden_layers=layers, vocab_size=32000,
                         max_position_embeddings=65536 + 128, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _tokens_per_s(model, attn: str, batch: int, context: int, new_tokens: int, compiled: bool) -> float:
    model.set_attn_implementation(attn)
    ids = torch.randint(0, 32000, (batch, context), device=model.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    forward = model.forward
    if compiled:
        kw["cache_implementation"] = "static"
        model.forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    try:
        with torch.inference_mode():
            model.generate(ids, **kw)  # warm-up (compiles, captures)
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
        return batch * new_tokens / (time.perf_counter() - start)
    finally:
        model.forward = forward


def generate_rows(layers: int = 8, new_tokens: int = 64, points=GENERATE_POINTS,
                  compiled_points=COMPILED_POINTS) -> list[dict]:
    """Tokens per second of transformers generate, our backend vs "sdpa" (module doc): eager DynamicCache at
    ``points``, StaticCache + torch.compile at ``compiled_points``."""
    from flashdecode.integrations.transformers import register

    ours = register()
    model = _llama(layers, "cuda")
    rows = []
    for cache, where in (("dynamic", points), ("static+compile", compiled_points)):
        for batch, context in where:
            row = {"cache": cache, "batch": batch, "context": context}
            for name, attn in (("ours", ours), ("sdpa", "sdpa")):
                try:
                    row[name] = _tokens_per_s(model, attn, batch, context, new_tokens, cache != "dynamic")
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the others still run
                    row[name] = None
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                torch.cuda.empty_cache()
            if row.get("ours") and row.get("sdpa"):
                row["ours_vs_sdpa"] = row["ours"] / row["sdpa"]
            print(f"  {row}", flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    import argparse
    import json
    import os
    import pathlib

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--generate", action="store_true", help="also the transformers generate comparison")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--no-compile", action="store_true", help="generate: eager DynamicCache only")
    parser.add_argument("--long", action="store_true", help="generate: also StaticCache + compile at batch 1, 64k")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the host table needs a CUDA GPU")
        return 1
    result = {"device": torch.cuda.get_device_name(), "first_call": first_call_ms()}
    print(result["first_call"], flush=True)
    result["decode"] = host_rows("decode", args.calls)
    result["prefill"] = host_rows("prefill", args.calls)
    if args.generate:
        compiled = () if args.no_compile else COMPILED_POINTS + (((1, 65536),) if args.long else ())
        result["generate"] = generate_rows(args.layers, compiled_points=compiled)
    if args.out:
        path = pathlib.Path(args.out) / "host_time.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
