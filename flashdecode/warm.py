"""Compile, before the first request, the kernel variants a model shape needs.

    import flashdecode
    flashdecode.warmup(nheads=32, nheads_kv=8, headdim=128, dtype=torch.bfloat16)   # or:
    python -m flashdecode warmup --model DIR                                        # reads DIR/config.json

Each variant compiles on its first call (Triton's JIT; seconds each without Triton's disk cache, tens of ms with
it); the calls here are those first calls, on small dummy tensors whose metadata picks the same kernels as the
real calls: decode at each batch size (one kernel variant per split path and tile, chosen from the cache capacity
and the batch), append_kv, and prefill (flash_attn causal, forward, and backward where asked). Variants compile in a
thread pool: Triton's compiler spends most of its time in C++ passes and ptxas, outside the GIL, so a few threads
overlap them; workers=1 compiles one after another.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import time
from typing import Sequence

import torch

__all__ = ["warmup", "model_shape"]


def _decode_variant(batch, nheads, nheads_kv, headdim, dtype, device, capacity, page_size):
    from flashdecode.ops.decode import append_kv, flash_decode

    q = torch.zeros(batch, nheads, headdim, dtype=dtype, device=device)
    if page_size:
        pages = batch * -(-capacity // page_size)
        k = torch.zeros(pages, page_size, nheads_kv, headdim, dtype=dtype, device=device)
        table = torch.arange(pages, dtype=torch.int32, device=device).view(batch, -1)
    else:
        k, table = torch.zeros(batch, capacity, nheads_kv, headdim, dtype=dtype, device=device), None
    lens = torch.full((batch,), capacity, dtype=torch.int32, device=device)
    new = torch.zeros(batch, 1, nheads_kv, headdim, dtype=dtype, device=device)
    append_kv(k, k, new, new, lens - 1, table)
    flash_decode(q, k, k, lens, block_table=table)


def _prefill_variant(nheads, nheads_kv, headdim, dtype, device, seqlen, backward):
    from flashdecode.ops.attention import flash_attn

    q = torch.zeros(1, seqlen, nheads, headdim, dtype=dtype, device=device, requires_grad=backward)
    k = torch.zeros(1, seqlen, nheads_kv, headdim, dtype=dtype, device=device, requires_grad=backward)
    v = torch.zeros_like(k, requires_grad=backward)
    out = flash_attn(q, k, v, causal=True)
    if backward:
        out.backward(torch.zeros_like(out))


def warmup(nheads: int, nheads_kv: int, headdim: int, *, dtype=torch.bfloat16, device="cuda",
           batches: Sequence[int] = (1, 8, 32), capacities: Sequence[int] = (4096,), page_size: int = 0,
           prefill_seqlens: Sequence[int] = (512,), backward: bool = False, workers: int = 4) -> dict:
    """Run the first call of every kernel variant a model of these heads needs (module doc). Returns
    {variant: seconds} (wall time of each first call, in its thread)."""
    from flashdecode.ops.checks import full_device, interpreting

    device = full_device(device)  # "cuda" -> "cuda:<current>": the worker threads set it (set_device needs an index)
    jobs = {}
    for capacity in capacities:
        for batch in batches:
            jobs[f"decode b{batch} cap{capacity} page{page_size}"] = (
                _decode_variant, (batch, nheads, nheads_kv, headdim, dtype, device, capacity, page_size))
    for seqlen in prefill_seqlens:
        jobs[f"prefill {seqlen}{' +bwd' if backward else ''}"] = (
            _prefill_variant, (nheads, nheads_kv, headdim, dtype, device, seqlen, backward))

    def timed(fn, args):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        start = time.perf_counter()
        fn(*args)
        return time.perf_counter() - start

    if workers <= 1 or interpreting(device):  # the CPU interpreter patches triton.language globally: one thread
        return {name: timed(fn, args) for name, (fn, args) in jobs.items()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(timed, fn, args) for name, (fn, args) in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def model_shape(model_dir) -> dict:
    """(nheads, nheads_kv, headdim, dtype) of a Hugging Face model folder's config.json, as warmup's keywords."""
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    nheads = int(config["num_attention_heads"])
    headdim = int(config.get("head_dim") or config["hidden_size"] // nheads)
    dtype = {"float16": torch.float16, "float32": torch.float32}.get(str(config.get("torch_dtype")),
                                                                     torch.bfloat16)
    return dict(nheads=nheads, nheads_kv=int(config.get("num_key_value_heads", nheads)), headdim=headdim,
                dtype=dtype)


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="a Hugging Face model folder (its config.json)")
    parser.add_argument("--batches", default="1,8,32", help="comma list of decode batch sizes")
    parser.add_argument("--capacity", type=int, default=4096, help="decode cache capacity in tokens")
    parser.add_argument("--page-size", type=int, default=0, help="0: contiguous cache")
    parser.add_argument("--workers", type=int, default=4, help="compile threads (1: one after another)")


def run(args) -> int:
    if not torch.cuda.is_available():
        print("warmup needs a CUDA GPU")
        return 1
    shape = model_shape(args.model)
    start = time.perf_counter()
    times = warmup(**shape, batches=[int(b) for b in args.batches.split(",") if b],
                   capacities=(args.capacity,), page_size=args.page_size, workers=args.workers)
    for name, seconds in times.items():
        print(f"  {name}: {seconds:.2f} s")
    print(f"warm-up of {len(times)} variants: {time.perf_counter() - start:.2f} s")
    return 0

