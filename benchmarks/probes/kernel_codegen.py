"""Code generated for the forward, paged prefill, decode and backward kernels, compiled for sm_90 on the CPU (no GPU): a fingerprint per
launch variant, to show that a change of the kernels' argument lists (or of their launchers) leaves the machine
code alone.

Each variant runs the package's own launch code (ops/decode_launch.py's run_decode, ops/attention_launch.py's backward)
on CPU tensors with Triton's JIT launch replaced by a compile for sm_90: Triton's own binder, so pointers, strides
and tuple elements are specialised (divisible by 16, equal to 1) exactly as a GPU launch would, then Triton's
compiler and bundled ptxas. Per kernel it records registers, stack (spill) bytes and shared memory (cuobjdump's
resource usage, Triton's metadata), the PTX and SASS instruction counts per opcode, the kernel's parameter count,
and hashes of the PTX (without debug line information) and of the SASS instructions with their operands.

    python benchmarks/probes/kernel_codegen.py versus BASELINE_CHECKOUT [variant ...]
    PYTHONPATH=CHECKOUT python benchmarks/probes/kernel_codegen.py dump OUT_DIR [variant ...]
    python benchmarks/probes/kernel_codegen.py compare BEFORE_DIR AFTER_DIR

``versus`` dumps the checkout at BASELINE_CHECKOUT (e.g. a worktree of main) and this one, each in a fresh Python
without TRITON_INTERPRET, and prints one row per variant and kernel: registers, stack, shared memory, parameters,
PTX and SASS instruction counts (before -> after where they differ), and whether PTX and SASS are identical
(``renumbered``: the PTX is equal once parameters and registers are numbered by first use; ``same opcodes``: the
SASS opcode sequence is equal). It exits 1 when any kernel's code differs beyond that. About a minute on two cores
(Triton's cache makes a rerun faster).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

# ------------------------------------------------------------------------------------------------------------------
# Compile instead of launch
# ------------------------------------------------------------------------------------------------------------------

_COMPILED: list = []  # (kernel name, CompiledKernel) of the current variant, in launch order


def _compile_for_sm90(jit_fn, args, kwargs):
    """What JITFunction.run compiles for these arguments on an sm_90 GPU (its binder, specialisation and options),
    without a GPU: Triton's own launch path up to the compile, for GPUTarget("cuda", 90, 32)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", jit_fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(jit_fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def _install_compile_only():
    """Every JITFunction launch compiles for sm_90 and records the kernel instead of running; the prefill op's
    launch wrapper goes through its (single-config) autotuner as without FLASHDECODE autotuning, minus the CUDA
    device handling; CPU tensors pass the device checks."""
    from triton.runtime.jit import JITFunction

    from flashdecode.ops import checks, launch_cache

    def run(self, *args, grid, warmup, **kwargs):
        kernel = _compile_for_sm90(self, args, kwargs)
        _COMPILED.append((self.fn.__name__, kernel))
        return None  # nothing launched: the launch cache records no direct launcher (it would need a driver)

    def kernel_call(self, grid_fn, args, device):
        tuned = launch_cache.tuned(self.fn, self.tiles, self.names, False, self.reset_dq)
        tuned[grid_fn](*args, **self.constexprs)

    JITFunction.run = run
    launch_cache.TunedKernel.__call__ = kernel_call
    checks.check_kernel_device = lambda name, x: None


# ------------------------------------------------------------------------------------------------------------------
# Variants: forward and backward through the prefill ops, paged prefill, decode through run_decode
# ------------------------------------------------------------------------------------------------------------------

HOPPER = dict(num_sms=132, interpret=False, hopper=True, pdl=True)


def _decode(*, batch=1, nheads=16, nheads_kv=2, headdim=128, seqlen_q=1, live=32768, page=0, kv_dtype=None,
            path=None, alibi=False, softcap=0.0, window=-1, scales="token", **changes):
    """Compile one decode launch: bf16 q, a cache of ``live`` keys per sequence (contiguous or ``page``-token pages,
    bf16 or the torch dtype named ``kv_dtype`` with ``scales`` "token" (per token and kv head, laid out like the
    cache without its head dim) or "scalar" (one float32 scale)), the config resolved for an H100 (132 SMs,
    PDL) with ``path`` and ``changes`` replacing its fields (checked as a config= override is)."""
    import torch

    from flashdecode import heuristics
    from flashdecode.config import DecodePath
    from flashdecode.ops.decode_launch import num_tickets, plan_launch, run_decode
    from flashdecode.ops.decode_policy import _DecodeShape, check_config_fits

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=gen).to(torch.bfloat16)
    lens = torch.full((batch,), live, dtype=torch.int32)
    kv = dict(dtype=torch.bfloat16 if kv_dtype is None else getattr(torch, kv_dtype))
    if page:
        pages_per_seq = -(-live // page)
        shape = (batch * pages_per_seq, page, nheads_kv, headdim)
        table = torch.arange(batch * pages_per_seq, dtype=torch.int32).view(batch, pages_per_seq)
    else:
        shape, table = (batch, live, nheads_kv, headdim), None
    k_cache, v_cache = torch.zeros(shape, **kv), torch.zeros(shape, **kv)
    if kv_dtype is not None:
        scale_shape = shape[:-1] if scales == "token" else ()
        scales = dict(k_scale=torch.ones(scale_shape), v_scale=torch.ones(scale_shape))
    else:
        scales = {}
    shape_ = _DecodeShape(q, k_cache, v_cache, lens, table, None, softcap, (window, -1), **scales)
    shape_.with_alibi(torch.full((nheads,), 0.5) if alibi else None)
    problem = shape_.problem(live)
    config = heuristics.resolve_decode_config(problem, heuristics.DecodeDevice(**HOPPER))
    if path is not None:
        changes["path"] = DecodePath[path]
    config = check_config_fits(dataclasses.replace(config, **changes), problem, heuristics.DecodeDevice(**HOPPER))
    launch = plan_launch(config, problem)
    b, sq, h, d = shape_.q4.shape
    out4 = torch.empty(b, sq, h, d, dtype=torch.bfloat16)
    lse3 = torch.empty(b, sq, h)
    s = config.num_splits
    partial_o = torch.empty(b, sq, h, s, d) if s > 1 else None
    partial_lse = torch.empty(b, sq, h, s) if s > 1 else None
    tickets = torch.zeros(num_tickets(b, sq, h, nheads_kv), dtype=torch.int32)
    run_decode(shape_, launch, q, shape_.alibi_slopes, k_cache, v_cache, lens, table, out4, lse3, partial_o,
               partial_lse, tickets)
    return config


def _backward(*, headdim=128, deterministic=True, varlen=False, window=-1, causal=True, alibi=False, fused=None,
              tma=None, tile=0, seqlen=2048):
    """Compile one backward (the preprocess, the dK/dV kernel, and the dQ kernel where it runs): bf16 (batch 2,
    ``seqlen``, 16 heads, 4 kv heads), the config an H100 resolves with the tile ``tile`` of each list (the first
    is what runs without autotuning), ``fused`` / ``tma`` overriding its one-launch / TMA choices."""
    import torch

    from flashdecode import heuristics
    from flashdecode.config import AttentionProblem
    from flashdecode.ops import attention_config, attention_launch, util

    gen = torch.Generator().manual_seed(0)
    batch, nheads, nheads_kv = 2, 16, 4
    if varlen:
        q, k, v, out, dout = (torch.randn(batch * seqlen, h, headdim, generator=gen).to(torch.bfloat16)
                              for h in (nheads, nheads_kv, nheads_kv, nheads, nheads))
        lse = torch.zeros(nheads, batch * seqlen)
        cu = torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32)
    else:
        q, k, v, out, dout = (torch.randn(batch, seqlen, h, headdim, generator=gen).to(torch.bfloat16)
                              for h in (nheads, nheads_kv, nheads_kv, nheads, nheads))
        lse = torch.zeros(batch, nheads, seqlen)
        cu = None
    problem = AttentionProblem(head_dim_pad=attention_config.head_dim_pad(headdim), elem_bytes=2, max_seqlen_k=seqlen,
                               deterministic=deterministic, tma_layout=util.tma_layout_ok(q, k, v),
                               capability_major=9, smem_limit=227 * 1024, interpret=False, autotune=False)
    config = heuristics.resolve_attention_config(problem)
    if fused is not None:
        config = dataclasses.replace(config, bwd_fused=fused)
    if tma is not None:
        config = dataclasses.replace(config, bwd_tma=tma)
    config = dataclasses.replace(config, **{name: getattr(config, name)[tile:tile + 1] for name in (
        "bwd_dkdv_tiles", "bwd_dq_tiles", "bwd_atomic_tiles", "bwd_fused_tiles")})
    slopes = torch.full((nheads,), 0.25) if alibi else None
    attention_launch._bwd_impl(dout, q, k, v, out, lse, cu, cu, seqlen, seqlen, headdim ** -0.5, window,
                               0 if causal else -1, 0.0, deterministic, attention_config.config_id_of(config),
                               slopes)
    return config


def _prefill_config(q, k, v, headdim: int, seqlen: int, *, tma=None, tile=0):
    """The AttentionConfig an H100 resolves for a bf16 / fp8 prefill of q, k, v, pinned to the Triton kernels
    (the Gluon dispatch needs a real sm_90 device) with the ``tile``-th forward tile alone, ``tma`` overriding its
    descriptor choice."""
    from flashdecode import heuristics
    from flashdecode.config import AttentionProblem
    from flashdecode.ops import attention_config, util

    problem = AttentionProblem(head_dim_pad=attention_config.head_dim_pad(headdim), elem_bytes=q.element_size(),
                               max_seqlen_k=seqlen, deterministic=True, tma_layout=util.tma_layout_ok(q, k, v),
                               capability_major=9, smem_limit=227 * 1024, interpret=False, autotune=False)
    config = dataclasses.replace(heuristics.resolve_attention_config(problem), backend="triton")
    config = dataclasses.replace(config, fwd_tiles=config.fwd_tiles[tile:tile + 1])
    if tma is not None:
        config = dataclasses.replace(config, fwd_tma=tma)
    return config


def _forward(*, headdim=128, causal=True, window=-1, softcap=0.0, alibi=False, varlen=False, fp8=False, tma=None,
             seqlen=2048):
    """Compile one Triton forward through the prefill op's forward (ops/attention_launch.py): bf16 (or e4m3 with
    descales) (batch 2, ``seqlen``, 16 heads, 4 kv heads), dense or packed, the H100's config (_prefill_config)."""
    import torch

    from flashdecode.ops import attention_config, attention_launch

    gen = torch.Generator().manual_seed(0)
    batch, nheads, nheads_kv = 2, 16, 4
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    lead = (batch * seqlen,) if varlen else (batch, seqlen)
    q, k, v = (torch.randn(*lead, h, headdim, generator=gen).to(dtype) for h in (nheads, nheads_kv, nheads_kv))
    cu = torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32) if varlen else None
    qk_descale = torch.ones(batch, nheads) if fp8 else None
    v_descale = torch.ones(batch, nheads_kv) if fp8 else None
    slopes = torch.full((nheads,), 0.25) if alibi else None
    config_id = attention_config.config_id_of(_prefill_config(q, k, v, headdim, seqlen, tma=tma))
    attention_launch._fwd_impl(q, k, v, cu, cu, seqlen, seqlen, headdim ** -0.5, window, 0 if causal else -1,
                               softcap, config_id, qk_descale, v_descale, slopes)


def _paged_prefill(*, page=16, headdim=128, causal=True, window=-1, softcap=0.0, alibi=False, kv_dtype=None,
                   tma=None, seqlen=2048, new=256):
    """Compile one paged prefill (ops/paged_prefill.py): ``new`` bf16 query tokens per sequence (batch 2, 16 heads,
    4 kv heads) against ``seqlen`` cached keys in ``page``-token pages (bf16, or ``kv_dtype`` with per-token
    scales)."""
    import torch

    from flashdecode.ops import paged_prefill

    gen = torch.Generator().manual_seed(0)
    batch, nheads, nheads_kv = 2, 16, 4
    pages_per_seq = -(-seqlen // page)
    q = torch.randn(batch * new, nheads, headdim, generator=gen).to(torch.bfloat16)
    shape = (batch * pages_per_seq, page, nheads_kv, headdim)
    kv = dict(dtype=torch.bfloat16 if kv_dtype is None else getattr(torch, kv_dtype))
    k_cache, v_cache = torch.zeros(shape, **kv), torch.zeros(shape, **kv)
    scales = {} if kv_dtype is None else dict(k_scale=torch.ones(shape[:-1]), v_scale=torch.ones(shape[:-1]))
    table = torch.arange(batch * pages_per_seq, dtype=torch.int32).view(batch, pages_per_seq)
    cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32)
    seqused = torch.full((batch,), seqlen, dtype=torch.int32)
    config = _prefill_config(q, q[:, :nheads_kv], q[:, :nheads_kv], headdim, seqlen, tma=tma)
    paged_prefill.paged_prefill(q, k_cache, v_cache, cu, seqused, table, new, seqlen, causal=causal,
                                window_size=(window, -1), softcap=softcap,
                                alibi_slopes=torch.full((nheads,), 0.25) if alibi else None,
                                config=config, **scales)


VARIANTS = {
    # forward (Triton): causal / plain / softcap / ALiBi / window, dense and packed, fp8, with and without TMA
    "fwd_hd128_causal": lambda: _forward(tma=False),
    "fwd_hd128_causal_tma": lambda: _forward(tma=True),
    "fwd_hd128_full_softcap": lambda: _forward(causal=False, softcap=30.0),
    "fwd_hd64_causal_alibi": lambda: _forward(headdim=64, alibi=True),
    "fwd_hd128_window_softcap_alibi_tma": lambda: _forward(window=256, softcap=30.0, alibi=True, tma=True),
    "fwd_hd96_varlen_window": lambda: _forward(headdim=96, varlen=True, window=256),
    "fwd_hd128_fp8_causal": lambda: _forward(fp8=True),
    "fwd_hd128_fp8_softcap_tma": lambda: _forward(fp8=True, causal=False, softcap=30.0, tma=True),
    # paged prefill: pages of 16 (pointers) and 128 (descriptors), ALiBi / softcap / window, an e4m3 cache
    "paged_page16_causal": lambda: _paged_prefill(),
    "paged_page128_tma_softcap_alibi": lambda: _paged_prefill(page=128, softcap=30.0, alibi=True, tma=True),
    "paged_page16_window": lambda: _paged_prefill(window=512),
    "paged_fp8_page16_causal_softcap": lambda: _paged_prefill(kv_dtype="float8_e4m3fn", softcap=30.0),
    # stage 1 + merge (split grid), as resolved for b1 16/2 hd128 at 32k keys: contiguous (TMA), pages of 16
    "split_contig": lambda: _decode(path="SPLIT_GRID"),
    "split_page16": lambda: _decode(page=16, path="SPLIT_GRID"),
    "split_page16_spec": lambda: _decode(page=16, path="SPLIT_GRID", spec_pages=True, prefetch_blocks=2),
    "split_contig_2tok_softcap_window_alibi": lambda: _decode(seqlen_q=2, softcap=30.0, window=1000, alibi=True,
                                                              path="SPLIT_GRID", use_tma=False),
    "unsplit_b16_4k": lambda: _decode(batch=16, live=4096, path="UNSPLIT", num_splits=1),
    "device_split_page16": lambda: _decode(batch=4, page=16, live=4096, path="DEVICE_SPLIT_GRID",
                                           device_split_slots=132, prefetch_blocks=2),
    "persistent_contig": lambda: _decode(batch=8, live=8192, path="PERSISTENT", persistent_programs=132),
    "persistent_queue_page16": lambda: _decode(batch=8, live=8192, page=16, path="PERSISTENT_QUEUE",
                                               persistent_programs=132, persistent_slots=2, queue_splits=4),
    "split_fp8_page16": lambda: _decode(page=16, kv_dtype="float8_e4m3fn", path="SPLIT_GRID"),
    "split_int8_contig": lambda: _decode(kv_dtype="int8", path="SPLIT_GRID"),
    # 8-bit caches as resolved for b1 16/2 hd128 at 32k keys: e4m3 with per-token-head scales (contiguous, pages of
    # 1 and 128) and one scalar scale (contiguous, page 16); int8 on pages of 16
    "split_fp8_contig": lambda: _decode(kv_dtype="float8_e4m3fn", path="SPLIT_GRID"),
    # the same at two programs per SM: 8 warps under a 128-register cap (DecodeConfig.max_registers), 4 warps
    "split_fp8_contig_r128": lambda: _decode(kv_dtype="float8_e4m3fn", path="SPLIT_GRID", max_registers=128),
    "split_fp8_contig_w4": lambda: _decode(kv_dtype="float8_e4m3fn", path="SPLIT_GRID", num_warps=4),
    "split_fp8_page1": lambda: _decode(page=1, kv_dtype="float8_e4m3fn", path="SPLIT_GRID"),
    "split_fp8_page128": lambda: _decode(page=128, kv_dtype="float8_e4m3fn", path="SPLIT_GRID"),
    "split_fp8_scalar_contig": lambda: _decode(kv_dtype="float8_e4m3fn", scales="scalar", path="SPLIT_GRID"),
    "split_fp8_scalar_page16": lambda: _decode(page=16, kv_dtype="float8_e4m3fn", scales="scalar",
                                               path="SPLIT_GRID"),
    "split_int8_page16": lambda: _decode(page=16, kv_dtype="int8", path="SPLIT_GRID"),
    # the score transform in both decode loops: the shared one and the 8-bit warp-split one
    "split_fp8_contig_2tok_softcap_window_alibi": lambda: _decode(seqlen_q=2, kv_dtype="float8_e4m3fn", softcap=30.0,
                                                                  window=1000, alibi=True, path="SPLIT_GRID",
                                                                  quant_warp_split=False),
    "split_fp8_warps_2tok_softcap_window_alibi": lambda: _decode(seqlen_q=2, kv_dtype="float8_e4m3fn", softcap=30.0,
                                                                 window=1000, alibi=True, path="SPLIT_GRID",
                                                                 quant_warp_split=True),
    # the Llama-3-8B shape (32 / 8 heads) at batch 16, 8k keys, e4m3 on pages of 16: the path it resolves to
    "llama_b16_fp8_page16": lambda: _decode(batch=16, nheads=32, nheads_kv=8, live=8192, page=16,
                                            kv_dtype="float8_e4m3fn"),
    "persistent_fp8_page128": lambda: _decode(batch=8, live=8192, page=128, kv_dtype="float8_e4m3fn",
                                              path="PERSISTENT", persistent_programs=132),
    # page ids read in the KV loop (absent pages masked by their ids) and paged TMA, as resolved: the Llama-3-8B
    # shape at b16 (pages of 16 at 8k and 32k, pages of 128 at 32k), b1 pages of 128 and 3, e4m3 pages of 16
    # without the preload
    "llama_b16_page16": lambda: _decode(batch=16, nheads=32, nheads_kv=8, live=8192, page=16),
    "llama_b16_page16_32k": lambda: _decode(batch=16, nheads=32, nheads_kv=8, live=32768, page=16),
    "llama_b16_page128_32k": lambda: _decode(batch=16, nheads=32, nheads_kv=8, live=32768, page=128),
    "split_page128": lambda: _decode(page=128),
    "split_page3": lambda: _decode(page=3, path="SPLIT_GRID"),
    "split_page16_ids_in_loop": lambda: _decode(page=16, path="SPLIT_GRID", preload_gather_max=0),
    "split_fp8_page16_ids_in_loop": lambda: _decode(page=16, kv_dtype="float8_e4m3fn", path="SPLIT_GRID",
                                                    preload_gather_max=0),
    "split_page128_pointer_ids_in_loop": lambda: _decode(page=128, path="SPLIT_GRID", use_tma=False,
                                                         preload_pages_max=0),
    "split_fp8_page128_ids_in_loop": lambda: _decode(page=128, kv_dtype="float8_e4m3fn", path="SPLIT_GRID",
                                                     preload_pages_max=0),
    # backward: deterministic (as resolved) at hd64 / hd128, the other deterministic form, the atomic-dQ form,
    # varlen with a window and ALiBi
    "bwd_hd64": lambda: _backward(headdim=64),
    "bwd_hd128": lambda: _backward(headdim=128),
    "bwd_hd128_two_pass": lambda: _backward(headdim=128, fused=False),
    "bwd_hd128_fused": lambda: _backward(headdim=128, fused=True),
    "bwd_hd128_atomic": lambda: _backward(headdim=128, deterministic=False),
    "bwd_hd64_varlen_window_alibi": lambda: _backward(headdim=64, varlen=True, window=256, alibi=True),
    # the second tile of each list (128-key dK/dV tiles at 8 warps) through tensor descriptors
    "bwd_hd128_tile2_tma": lambda: _backward(headdim=128, tile=1, tma=True),
    "bwd_hd64_tile2_tma_fused": lambda: _backward(headdim=64, tile=1, tma=True, fused=True),
    "bwd_hd128_tile2_tma_atomic": lambda: _backward(headdim=128, tile=1, tma=True, deterministic=False),
}

# the kernels whose code is fingerprinted (the others a variant launches - merge, bwd preprocess - are skipped)
KERNELS = ("attn_fwd_kernel", "decode_split_kernel", "decode_persistent_kernel", "merge_many_kernel", "attn_bwd_dkdv_kernel",
           "attn_bwd_dq_kernel")


# ------------------------------------------------------------------------------------------------------------------
# Fingerprints
# ------------------------------------------------------------------------------------------------------------------

def _tool(name: str) -> str:
    import triton.backends.nvidia as nv

    return os.path.join(os.path.dirname(nv.__file__), "bin", name)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def _resources(cubin: bytes) -> dict:
    """cuobjdump's resource usage of the kernel: REG, STACK (spill bytes), SHARED, LOCAL ..."""
    usage = _cuobjdump(cubin, "--dump-resource-usage").split("Resource usage:")[-1]
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", usage)}


def _sass_instructions(sass: str) -> list[str]:
    """The SASS instructions with their operands (registers, constant-bank offsets of the parameters), without
    addresses and encodings."""
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)]


def _sass_opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def _ptx_code(ptx: str, name: str) -> tuple[list[str], int]:
    """(the kernel's PTX lines from its opening brace on, as emitted but without debug line information (.loc,
    .file, $L__tmp / $L__func labels, the debug sections); its parameter count). The parameter declarations are
    left out: a trailing parameter that nothing reads may go without changing the code."""
    entry = re.split(r"\n\s*\.section\b", ptx[ptx.index(f".entry {name}"):])[0]
    header, body = entry.split("\n{", 1)
    nparams = len(re.findall(rf"\.param .*{name}_param_\d+", header))
    lines = [ln for ln in ("{" + body).splitlines()
             if not re.match(r"\s*\.(loc|file)\b", ln) and not re.match(r"\$L__(tmp|func)", ln)]
    return lines, nparams


def _renumbered(lines: list[str], name: str) -> str:
    """The PTX with parameters and virtual registers numbered in order of first use, so that a reordering of the
    kernel's arguments alone (LLVM numbers some registers by parameter position) leaves it unchanged."""
    names: dict = {}
    counts: collections.Counter = collections.Counter()

    def rename(m):
        kind = "P" if m.group(1) is None else m.group(1)
        if m.group(0) not in names:
            names[m.group(0)] = f"%{kind}{counts[kind]}"
            counts[kind] += 1
        return names[m.group(0)]
    return re.sub(rf"(?:{name}_param_\d+|%([a-z]+)\d+\b)", rename, "\n".join(lines))


def _ptx_opcodes(lines: list[str]) -> collections.Counter:
    ops = collections.Counter()
    for line in lines:
        m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s", line)
        if m and not line.strip().startswith((".reg", ".shared", ".local", "//")):
            ops[m.group(1)] += 1
    return ops


def fingerprint(tag: str, kernel) -> tuple[dict, str, str]:
    """(the kernel's record, its PTX code, its SASS listing)."""
    cubin, name = kernel.asm["cubin"], kernel.metadata.name
    resources = _resources(cubin)
    sass = _cuobjdump(cubin, "-sass")
    sass_instructions = _sass_instructions(sass)
    sass_ops = [_sass_opcode(i) for i in sass_instructions]
    ptx_lines, nparams = _ptx_code(kernel.asm["ptx"], name)
    ptx_ops = _ptx_opcodes(ptx_lines)
    record = dict(kernel=tag, regs=resources.get("REG"), stack=resources.get("STACK"), shared=kernel.metadata.shared,
                  params=nparams, ptx_instructions=sum(ptx_ops.values()), sass_instructions=len(sass_ops),
                  ptx_ops=dict(ptx_ops), sass_ops=dict(collections.Counter(sass_ops)),
                  ptx_text_hash=_hash("\n".join(ptx_lines)), ptx_body_hash=_hash(_renumbered(ptx_lines, name)),
                  sass_text_hash=_hash("\n".join(sass_instructions)),
                  sass_sequence_hash=_hash(" ".join(sass_ops)))
    return record, "\n".join(ptx_lines), sass


def _hash(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dump(out_dir: str, names: list[str]):
    os.makedirs(out_dir, exist_ok=True)
    _install_compile_only()
    import flashdecode

    print("flashdecode from", os.path.dirname(flashdecode.__file__), flush=True)
    for variant in names or VARIANTS:
        _COMPILED.clear()
        VARIANTS[variant]()
        records = []
        seen = collections.Counter()
        for kname, kernel in _COMPILED:
            if kname not in KERNELS:
                continue
            tag = f"{kname}#{seen[kname]}" if seen[kname] else kname
            seen[kname] += 1
            record, ptx, sass = fingerprint(tag, kernel)
            records.append(record)
            with open(os.path.join(out_dir, f"{variant}.{tag}.ptx"), "w") as f:
                f.write(ptx)
            with open(os.path.join(out_dir, f"{variant}.{tag}.sass"), "w") as f:
                f.write(sass)
        with open(os.path.join(out_dir, f"{variant}.json"), "w") as f:
            json.dump(records, f, indent=1)
        print(variant, " ".join(f"{r['kernel']}: {r['regs']} regs {r['stack']} stack {r['shared']} smem "
                                f"{r['ptx_instructions']} ptx {r['sass_instructions']} sass" for r in records),
              flush=True)


def _verdict(a: dict, b: dict, exact: str, normalised: str, near: str) -> str:
    """identical (as emitted), ``near`` (PTX: equal once parameters and registers are numbered by first use; SASS:
    the same opcode sequence) or DIFF."""
    if a[exact] == b[exact]:
        return "identical"
    return near if a[normalised] == b[normalised] else "DIFF"


def compare(before_dir: str, after_dir: str) -> bool:
    """Print the before -> after table (one row per variant and kernel); True when no kernel's code differs beyond
    the numbering of parameters and registers: same registers, stack, shared memory and opcode counts."""
    same_all = True
    head = ("variant", "kernel", "regs", "stack", "smem", "params", "PTX instr", "SASS instr", "PTX", "SASS")
    rows = [head]
    for fname in sorted(os.listdir(before_dir)):
        if not fname.endswith(".json"):
            continue
        with open(os.path.join(before_dir, fname)) as f:
            before = json.load(f)
        with open(os.path.join(after_dir, fname)) as f:
            after = json.load(f)
        if [k["kernel"] for k in before] != [k["kernel"] for k in after]:  # e.g. a launch path without a merge
            same_all = False
            rows.append((fname[:-5], "launches " + ",".join(k["kernel"] for k in before) + " -> "
                         + ",".join(k["kernel"] for k in after), "", "", "", "", "", "", "", "DIFF"))
            continue
        for b, a in zip(before, after, strict=True):
            def pair(key):
                return f"{b[key]}" if b[key] == a[key] else f"{b[key]} -> {a[key]}"
            ptx = _verdict(a, b, "ptx_text_hash", "ptx_body_hash", "renumbered")
            sass = _verdict(a, b, "sass_text_hash", "sass_sequence_hash", "same opcodes")
            same_all &= "DIFF" not in ptx + sass and all(a[k] == b[k] for k in ("regs", "stack", "shared",
                                                                                "ptx_ops", "sass_ops"))
            rows.append((fname[:-5], b["kernel"], pair("regs"), pair("stack"), pair("shared"), pair("params"),
                         pair("ptx_instructions"), pair("sass_instructions"), ptx, sass))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    for r in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return same_all


def versus(baseline: str, names: list[str]) -> bool:
    """Dump the checkout at ``baseline`` and this one (each in its own Python), then compare them."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        for root, out in ((baseline, "before"), (here, "after")):
            subprocess.run([sys.executable, os.path.abspath(__file__), "dump", os.path.join(tmp, out), *names],
                           env=dict(env, PYTHONPATH=os.path.abspath(root)), check=True)
        return compare(os.path.join(tmp, "before"), os.path.join(tmp, "after"))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_codegen compiles for sm_90: run it without TRITON_INTERPRET=1")
    if len(sys.argv) >= 3 and sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(0 if compare(sys.argv[2], sys.argv[3]) else 1)
    elif len(sys.argv) >= 3 and sys.argv[1] == "versus":
        sys.exit(0 if versus(sys.argv[2], sys.argv[3:]) else 1)
    else:
        sys.exit(__doc__)
