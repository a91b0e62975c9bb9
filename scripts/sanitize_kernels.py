"""Page ids outside the pool in device-resident block tables, for compute-sanitizer's memcheck.

    compute-sanitizer --tool memcheck python3 scripts/sanitize_kernels.py      (gpu_check.py's ``sanitize`` part)
    TRITON_INTERPRET=1 python3 scripts/sanitize_kernels.py --device cpu          (a smoke run of the script itself)

Block tables that live on the device are not read by the host (that would sync), so flash_decode and append_kv
must mask bad ids in the kernels. Each table here holds, among valid ids, -1, num_pages (one past the pool) and
2**30 (far past it, and past any int32 byte offset). The script runs flash_decode with split counts None / 1 / 4,
one and two query rows, pages of 1, 16, 64 and 128 keys, a DecodePlan, and append_kv writing into the bad pages.

What a clean run proves: under memcheck (with PyTorch's caching allocator off, so that every tensor is its own
allocation), ERROR SUMMARY 0 means no kernel read or wrote outside its tensors; and every output is finite (a bad
page reads as absent keys, never as garbage). A non-finite output exits with status 1.
On the CPU (``--device cpu``, Triton's interpreter) the tables are treated as device-resident too, as the tests'
``device_resident`` fixture does, and the sizes shrink so that the interpreter finishes in seconds; fp16 there
because the interpreter's bf16 dot is wrong.
"""

from __future__ import annotations

import sys

import torch

import flashdecode
from flashdecode.ops import checks

PAGE_SIZES = (1, 16, 64, 128)
SPLITS = (None, 1, 4)
SEQLENS_Q = (1, 2)
APPENDED = 4  # tokens append_kv writes at the end of every sequence


def _device_from_argv(argv: list[str]) -> torch.device:
    """``--device NAME`` (default cuda); anything else is a usage error."""
    if not argv:
        return torch.device("cuda")
    if len(argv) == 2 and argv[0] == "--device":
        return torch.device(argv[1])
    raise SystemExit(f"usage: {sys.argv[0]} [--device cuda|cpu]; got {argv}")


def _bad_table(num_pages: int, batch: int, pages_per_seq: int, device: torch.device, gen: torch.Generator):
    """int32 (batch, pages_per_seq) of random valid ids with -1, num_pages and 2**30 planted in rows 0, 1, 2."""
    table = torch.randint(0, num_pages, (batch, pages_per_seq), generator=gen, dtype=torch.int32)
    table[0, 0] = -1
    table[1, -1] = num_pages
    table[2, 1 % pages_per_seq] = 2**30
    return table.to(device)


def _require_finite(out: torch.Tensor, what: str) -> bool:
    if torch.isfinite(out.float()).all():
        return True
    print(f"NON-FINITE output: {what}")
    return False


def run(device: torch.device) -> bool:
    """Every case once; True when every output is finite."""
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float16
    num_pages, batch, nheads_kv = 40, 3, 2
    nheads, headdim, keys = (16, 128, 2048) if on_gpu else (4, 64, 64)
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    ok = True
    for page in PAGE_SIZES:
        pages_per_seq = max(2, keys // page) if page < 64 else max(2, 8 * keys // 2048)
        k, v = randn(num_pages, page, nheads_kv, headdim), randn(num_pages, page, nheads_kv, headdim)
        table = _bad_table(num_pages, batch, pages_per_seq, device, gen)
        lens = torch.full((batch,), pages_per_seq * page, dtype=torch.int32, device=device)
        for seqlen_q in SEQLENS_Q:
            q = randn(batch, seqlen_q, nheads, headdim)
            for splits in SPLITS:
                out = flashdecode.flash_decode(q, k, v, lens, block_table=table, num_splits=splits)
                ok &= _require_finite(out, f"flash_decode page={page} seqlen_q={seqlen_q} num_splits={splits}")
            plan = flashdecode.DecodePlan(batch, nheads, nheads_kv, headdim, max_seqlen_k=pages_per_seq * page,
                                          dtype=dtype, device=device, max_seqlen_q=seqlen_q)
            out = plan.run(q, k, v, lens, block_table=table)
            ok &= _require_finite(out, f"DecodePlan page={page} seqlen_q={seqlen_q}")
        k_new = randn(batch, APPENDED, nheads_kv, headdim)
        flashdecode.append_kv(k, v, k_new, k_new.clone(), lens - APPENDED, block_table=table)
        ok &= _require_finite(k, f"k cache after append_kv page={page}")
    if on_gpu:
        torch.cuda.synchronize()
    return ok


def main(argv: list[str]) -> int:
    device = _device_from_argv(argv)
    if device.type == "cpu":
        checks.host_resident = lambda x: False  # the kernels' masking, not the host checks, as on a GPU
    ok = run(device)
    print("sanitize_kernels: every output finite" if ok else "sanitize_kernels: NON-FINITE outputs")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
