"""Host time of eager calls (``bench decode --host`` / ``bench prefill --host``) and transformers generate with our
attention backend against "sdpa" (``--generate``).

Host table: per op, a loop of ``calls`` eager calls after 10 warm-ups, time.perf_counter around the loop (host =
CPU time per call while the GPU runs behind, no sync inside the loop) and after one torch.cuda.synchronize at the
end (wall per call: kernel plus whatever gap the host leaves). Llama-3-8B heads (32 / 8, head dim 128), bf16,
batch 4, cache lengths 8000 / 17 / 3000 / 8192 (contiguous cache of 8192 rows); flash_attn on 128 tokens at batch 1;
SDPA's per-call time is the eager reference. Target (H100): each host call <= 20 us, flash_attn forward <= 15 us,
forward + backward <= 40 us.

Generate (``--generate``): a Llama-3-8B-shaped model of ``--layers`` layers (default 8), random bf16 weights (vocab
32000), greedy, 64 new tokens, our attention backend against "sdpa" on one model (its attention switched). Rows
(``--rows``, default all): eager DynamicCache at batch 1 x 512 / 4k / 32k and batch 8 x 2k ("dynamic:BxCTX"), and
StaticCache with generate's compiled decode step (CompileConfig fullgraph=True, mode="reduce-overhead": CUDA graphs)
at batch 1 x 4k and 64k ("static:BxCTX"). Per backend: a warm-up generate (compiles, captures), then the wall time
of generate with 1 new token (the prefill) and with 64; decode tokens/s = batch x 63 / (t64 - t1), end-to-end
tokens/s = batch x 64 / t64. Targets (H100, decode tokens/s vs SDPA): eager >= 1.0x at batch 1 (512, 4k) and batch
8 (2k), >= 1.05x at batch 1, 32k; compiled >= 1.0x at 4k and >= 1.1x at batch 1, 64k. The record is
``hf_generate_<device>_<date>.json`` (flashdecode/bench/report.py's format; scripts/write_benchmarks_md.py --add).

    python -m flashdecode.bench.host --generate --no-host [--rows dynamic:1x512,static:1x65536] [--out DIR]

CPU proxy (``--cpu``, no GPU): the decode host table's ops on CPU tensors of the same shapes, the launch policy
told it runs on a Hopper of 132 SMs with device-resident metadata, every kernel launch stubbed where the compiled
kernel's C launcher would be called (``stub_launches``): the Python each eager call runs (checks, the host
records, the launch cache's direct launch - through Triton's own descriptor-handling launcher where the kernel
takes host tensor descriptors and no direct launcher knows it, as on the GPU -, the outputs' CPU allocation), CPU
us per call in a loop of ``--calls`` (cpu_us_per_call), and the ratio of ``flash_attn_with_kvcache`` to
``flash_decode`` on the same inputs (rows "uniform", the table's batch, and "mixed", one 128k sequence among 15
short ones in pages of 16). Ratios are the claim; absolute numbers are the CPU's. The descriptor launcher
(direct_launch.DESCRIPTOR_LAUNCHER) follows its gate here as on the GPU.

    python -m flashdecode.bench.host --cpu [--calls 200]
"""

from __future__ import annotations

import time
from typing import Callable

import torch

# bench decode's load-balance row: one 128k sequence among 15 short ones (Llama shape, pages of 16 in the peer sweep)
MIXED_LENS = [131072] + [1024] * 15

LENGTHS = (8000, 17, 3000, 8192)
HEADS, HEADS_KV, HEADDIM = 32, 8, 128
GENERATE_ROWS = ("dynamic:1x512", "dynamic:1x4096", "dynamic:1x32768", "dynamic:8x2048", "static:1x4096",
                 "static:1x65536")  # cache:batchxcontext (module doc)
NEW_TOKENS = 64
VOCAB = 32000


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


def cpu_us_per_call(fns: dict, calls: int = 200, rounds: int = 5, warmup: int = 10) -> dict:
    """{name: CPU us per call} of each function in ``fns``: the best of ``rounds`` loops of ``calls``, the loops of
    every function taking turns round by round (so a busy machine's drift hits them alike), timed with the
    process's CPU clock (time spent waiting for a core does not count): the CPU proxy (module doc)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.process_time()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], time.process_time() - start)
    return {name: t / calls * 1e6 for name, t in best.items()}


def _decode_calls(device, reference: bool = True) -> dict:
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
    calls = {
        "flash_decode": lambda: flashdecode.flash_decode(q, k, v, lens),
        "DecodePlan.run": lambda: plan.run(q, k, v, lens),
        "flash_attn_with_kvcache": lambda: fai.flash_attn_with_kvcache(q.unsqueeze(1), k, v, cache_seqlens=lens),
        "flash_attn_with_kvcache +append": lambda: fai.flash_attn_with_kvcache(
            q.unsqueeze(1), k, v, k=k_new, v=v_new, cache_seqlens=before),
        "append_kv": lambda: flashdecode.append_kv(k, v, k_new, v_new, before),
        "merge_states": lambda: flashdecode.merge_states(o, lse, o, lse),
    }
    if reference:
        k_sdpa = k.transpose(1, 2).repeat_interleave(HEADS // HEADS_KV, 1)  # (b, h, cap, d), the whole cache
        v_sdpa = v.transpose(1, 2).repeat_interleave(HEADS // HEADS_KV, 1)
        calls["SDPA decode (reference)"] = lambda: torch.nn.functional.scaled_dot_product_attention(
            q_sdpa, k_sdpa, v_sdpa)
    return calls


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


class _StubRun:
    """A compiled kernel's launcher (CudaLauncher's attributes as direct_launch.PlainLauncher reads them) whose C
    launch does nothing."""

    global_scratch_size = profile_scratch_size = 0
    global_scratch_align, num_ctas = 1, 1
    launch_cooperative_grid = launch_pdl = False

    @staticmethod
    def launch(*args):
        return None


class _StubCompiled:
    """Stands in for Triton's CompiledKernel: what LaunchSite records for a direct launch."""

    function, packed_metadata, run = 0, (4, 1, 0), _StubRun()


class _StubTmaDriver:
    """triton.runtime.driver.active as Triton's make_tensordesc_arg reads it: fill_tma_descriptor (a C call that
    encodes a CUtensorMap on the GPU) returns a stand-in."""

    def __init__(self):
        self.utils = self

    @staticmethod
    def fill_tma_descriptor(ptr, swizzle, elem_size, elem_type, block_size, shape, strides, padding):
        return ptr


def _stub_compiled_with_descriptors(arg_names: tuple, kwargs: dict):
    """A stub compiled kernel whose launcher is Triton's own CudaLauncher (its __call__ and wrap_handle_tensordesc,
    which fills a CUtensorMap per descriptor and launch) around a C launch that does nothing, for a kernel launched
    with host tensor descriptors: what a GPU's first launch records for decode stage 1 over a TMA-read cache."""
    from triton.backends.nvidia import driver as nv
    from triton.tools.tensor_descriptor import TensorDescriptor

    signature = {i: ("tensordesc<bf16[64,128]>" if isinstance(kwargs.get(name), TensorDescriptor) else "i32")
                 for i, name in enumerate(arg_names)}
    metas = [dict(swizzle=128, elem_size=2, elem_type=10, block_size=list(kwargs[name].block_shape),
                  fp4_padded=False) for name in arg_names if isinstance(kwargs.get(name), TensorDescriptor)]
    run = nv.CudaLauncher.__new__(nv.CudaLauncher)  # its constructor compiles the C launcher: not here
    for name in ("global_scratch_size", "profile_scratch_size", "global_scratch_align", "num_ctas",
                 "launch_cooperative_grid", "launch_pdl"):
        setattr(run, name, getattr(_StubRun, name))
    run.profile_scratch_align = 1
    run.launch = nv.wrap_handle_tensordesc(_StubRun.launch, signature, metas)
    compiled = _StubCompiled()
    compiled.run = run
    return compiled


class _StubJit:
    """Stands in for a @triton.jit kernel: ``kernel[grid](**kwargs)`` returns the stub compiled kernel (with Triton's
    descriptor-handling launcher where a kwarg is a host tensor descriptor)."""

    def __init__(self, arg_names: tuple):
        self.arg_names = arg_names

    def __getitem__(self, grid):
        return self._compiled

    def _compiled(self, *args, **kwargs):
        from triton.tools.tensor_descriptor import TensorDescriptor

        if any(isinstance(x, TensorDescriptor) for x in kwargs.values()):
            return _stub_compiled_with_descriptors(self.arg_names, kwargs)
        return _StubCompiled()


class _ForTheProcess:
    """stub_launches' default way to patch: plain assignments, kept for the rest of the process."""

    @staticmethod
    def setattr(obj, name: str, value) -> None:
        setattr(obj, name, value)

    @staticmethod
    def setitem(mapping, name: str, value) -> None:
        mapping[name] = value


def stub_launches(patch=_ForTheProcess) -> None:
    """Patches that make CPU tensors take the GPU's eager host path (module doc, ``--cpu``): the kernels run nowhere
    (TRITON_INTERPRET off, CPU tensors accepted), the decode policy sees a Hopper of 132 SMs, metadata counts as
    device-resident (never read on the host, as CUDA tensors), and every launch site's first launch of a key
    records a stub kernel whose C launch does nothing (behind Triton's own descriptor-handling launcher where the
    launch passes host tensor descriptors, the CUtensorMap encoding stubbed too: triton.runtime.driver's active
    driver is replaced), so later launches take the direct launch (direct_launch.PlainLauncher, DescriptorLauncher,
    else Triton's launcher) as on the GPU. ``patch``: what applies them (setattr / setitem; default for the rest of
    the process, a test's pytest.MonkeyPatch undoes them)."""
    import os

    import triton

    import flashdecode.ops.decode  # noqa: F401 - every decode launch site exists before the patches below
    import flashdecode.ops.merge  # noqa: F401
    from flashdecode.ops import append_kv, checks, decode_policy, direct_launch, launch_cache

    patch.setitem(os.environ, "TRITON_INTERPRET", "0")
    cpu = torch.device("cpu")
    device_arg = checks.check_device_arg
    for obj, name, value in (
            (checks, "interpreting", lambda device=None: False),
            (checks, "kernels_run_on", lambda device: device.type in ("cpu", "cuda")),
            (checks, "host_resident", lambda x: False),
            (checks, "check_device_arg", lambda name, value: cpu if str(value) == "cpu" else device_arg(name, value)),
            (decode_policy, "_interpreting", lambda device=None: False),
            (append_kv, "_interpreting", lambda device=None: False),
            (decode_policy, "hopper_or_newer", lambda device: True),
            (decode_policy, "num_sms", lambda device: 132),
            (direct_launch, "current_device", lambda: None),  # a CPU tensor's device index
            (launch_cache, "_current_device", lambda: None),
            (direct_launch, "current_stream", lambda index: 0),
            (launch_cache, "_current_stream", lambda index: 0),
            (triton.runtime.driver, "_active", _StubTmaDriver())):
        patch.setattr(obj, name, value)
    for site in launch_cache.sites():
        patch.setattr(site, "fn", _StubJit(site.param_names))


def mixed_calls(device) -> dict:
    """flash_decode and flash_attn_with_kvcache on bench decode's "mixed" row: one 131072-token sequence among 15
    of 1024 (Llama-3-8B heads, bf16, pages of 16, a shuffled block table, device-resident lengths)."""
    import flashdecode
    from flashdecode.flash_attn_interface import flash_attn_with_kvcache

    dt, b, page = torch.bfloat16, len(MIXED_LENS), 16
    pages_per_seq = -(-max(MIXED_LENS) // page)
    q = torch.randn(b, HEADS, HEADDIM, dtype=dt, device=device)
    k = torch.empty(b * pages_per_seq, page, HEADS_KV, HEADDIM, dtype=dt, device=device)
    v = torch.empty_like(k)
    table = torch.randperm(b * pages_per_seq, device=device).view(b, pages_per_seq).to(torch.int32)
    lens = torch.tensor(MIXED_LENS, dtype=torch.int32, device=device)
    q4 = q.unsqueeze(1)
    return {"flash_decode": lambda: flashdecode.flash_decode(q, k, v, lens, block_table=table),
            "flash_attn_with_kvcache": lambda: flash_attn_with_kvcache(q4, k, v, cache_seqlens=lens,
                                                                       block_table=table, causal=True)}


def cpu_host_rows(calls: int = 200) -> list[dict]:
    """The CPU proxy of the host table (module doc, ``--cpu``): rows {table, op, host_us}, printed with the ratios
    of flash_attn_with_kvcache (with and without appending) to flash_decode."""
    stub_launches()
    device = torch.device("cpu")
    rows = []
    for table, fns in (("uniform", _decode_calls(device, reference=False)), ("mixed", mixed_calls(device))):
        rows += [{"table": table, "op": name, "host_us": us} for name, us in cpu_us_per_call(fns, calls).items()]
    base = {r["table"]: r["host_us"] for r in rows if r["op"] == "flash_decode"}
    print(f"CPU proxy: launches stubbed, a faked Hopper of 132 SMs, torch {torch.__version__}; process CPU time, "
          f"best of 5 loops of {calls} calls")
    print("| table | op | host us/call | vs flash_decode |")
    print("|---|---|---|---|")
    for r in rows:
        r["vs_flash_decode"] = r["host_us"] / base[r["table"]]
        print(f"| {r['table']} | {r['op']} | {r['host_us']:.1f} | {r['vs_flash_decode']:.2f}x |", flush=True)
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


def _llama(layers: int, max_positions: int, device):
    """A Llama-3-8B-shaped model of ``layers`` layers, random bf16 weights, built on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS_KV, num_hidden_layers=layers, vocab_size=VOCAB,
                         max_position_embeddings=max_positions, rope_theta=500000.0, pad_token_id=0,
                         eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def parse_rows(spec: str) -> list[tuple[str, int, int]]:
    """"dynamic:1x512,static:1x65536" -> [(cache, batch, context), ...] (ValueError naming a bad entry)."""
    rows = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        cache, _, size = item.partition(":")
        batch, _, context = size.partition("x")
        if cache not in ("dynamic", "static") or not (batch.isdigit() and context.isdigit()):
            raise ValueError(f"--rows entry {item!r} is not dynamic:BxCTX or static:BxCTX")
        rows.append((cache, int(batch), int(context)))
    return rows


def _generate_seconds(model, ids, new_tokens: int, cache) -> float:
    """Wall seconds of one greedy generate of ``new_tokens``: with ``cache`` None a DynamicCache, eager; else that
    StaticCache (emptied first; one cache per row, so every generate of the row replays one captured step) and
    generate's compiled decode step (fullgraph, CUDA graphs)."""
    from transformers import CompileConfig

    from flashdecode.bench.hf_peer import hf_cache_kwarg

    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if cache is not None:
        kw.update({hf_cache_kwarg(model): cache}, compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    else:
        kw["disable_compile"] = True
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        if cache is not None:
            cache.reset()  # (its tensors are inference tensors: written in inference mode only)
        model.generate(ids, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _measure(model, attn: str, cache_kind: str, batch: int, context: int, new_tokens: int) -> dict:
    """{prefill_s, decode_tok_s, e2e_tok_s} of one backend on one row (module doc)."""
    from transformers import StaticCache

    model.set_attn_implementation(attn)
    cache = None
    if cache_kind == "static":  # a fresh compile per (backend, row): generate keeps its compiled call on the model
        torch._dynamo.reset()
        if hasattr(model, "_compiled_call"):
            del model._compiled_call
        cache = StaticCache(config=model.config, max_cache_len=context + new_tokens)
    ids = torch.randint(1, VOCAB, (batch, context), device=model.device)
    _generate_seconds(model, ids, new_tokens, cache)  # warm-up: kernels compile, the decode step is captured
    first = _generate_seconds(model, ids, 1, cache)
    full = _generate_seconds(model, ids, new_tokens, cache)
    return {"prefill_s": first, "decode_tok_s": batch * (new_tokens - 1) / max(full - first, 1e-9),
            "e2e_tok_s": batch * new_tokens / full}


def generate_rows(layers: int = 8, rows=None, new_tokens: int = NEW_TOKENS, on_row=None) -> list[dict]:
    """Rows of transformers generate, our backend vs "sdpa" (module doc); rows: [(cache, batch, context)].
    on_row(rows so far) after each row (the caller writes its record then: a run cut short keeps its rows)."""
    from flashdecode.integrations.transformers import register

    ours = register()
    rows = parse_rows(",".join(GENERATE_ROWS)) if rows is None else rows
    longest = max(context for _, _, context in rows) + new_tokens
    model = _llama(layers, max(8192, longest), "cuda")
    out = []
    for cache, batch, context in rows:
        row = {"cache": cache, "batch": batch, "context": context, "layers": layers, "new_tokens": new_tokens}
        for name, attn in (("ours", ours), ("sdpa", "sdpa")):
            start = time.perf_counter()
            try:
                for key, value in _measure(model, attn, cache, batch, context, new_tokens).items():
                    row[f"{name}_{key}"] = value
            except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the others still run
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"  [{time.strftime('%H:%M:%S')}] {cache} {batch}x{context} {name}: "
                  f"{row.get(f'{name}_decode_tok_s', float('nan')):.1f} decode tok/s "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            torch.cuda.empty_cache()
        if row.get("ours_decode_tok_s") and row.get("sdpa_decode_tok_s"):
            row["ours_vs_sdpa"] = row["ours_decode_tok_s"] / row["sdpa_decode_tok_s"]
            row["ours_vs_sdpa_e2e"] = row["ours_e2e_tok_s"] / row["sdpa_e2e_tok_s"]
        print(f"  {row}", flush=True)
        out.append(row)
        if on_row is not None:
            on_row(out)
    return out


def main(argv=None) -> int:
    import argparse
    import json
    import pathlib

    from flashdecode.bench.report import free_path, result_stem, results_dir, write_json
    from flashdecode.timing import env_info

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the records (default $OUT, else the latest folder)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--no-host", action="store_true", help="skip the host tables and first-call latency")
    parser.add_argument("--generate", action="store_true", help="the transformers generate comparison")
    parser.add_argument("--cpu", action="store_true", help="the CPU proxy of the decode host table (launches "
                        "stubbed; no GPU)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", default=",".join(GENERATE_ROWS),
                        help="generate rows, cache:BATCHxCONTEXT comma-separated (cache dynamic or static)")
    args = parser.parse_args(argv)
    rows = parse_rows(args.rows)
    if args.cpu:
        cpu_host_rows(args.calls)
        return 0
    if not torch.cuda.is_available():
        print("the host table needs a CUDA GPU")
        return 1
    out_dir = results_dir(args.out)
    env = env_info()
    if not args.no_host:
        result = {"device": torch.cuda.get_device_name(), "first_call": first_call_ms()}
        print(result["first_call"], flush=True)
        result["decode"] = host_rows("decode", args.calls)
        result["prefill"] = host_rows("prefill", args.calls)
        path = pathlib.Path(out_dir) / "host_time.json"
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {path}", flush=True)
    if args.generate:
        print(f"# transformers generate, {args.layers} layers, rows {args.rows} on {env['device']}", flush=True)
        path = free_path(pathlib.Path(out_dir) / f"{result_stem('hf_generate', env)}.json")
        generate_rows(args.layers, rows, on_row=lambda done: print(
            f"wrote {write_json(path, 'hf_generate', env, done, overwrite=True)} ({len(done)} of {len(rows)} rows)",
            flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
