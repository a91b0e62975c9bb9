"""Pure launch-policy functions (no kernels, no tensors): device facts and split counts. Unit-tested on the CPU."""

from __future__ import annotations

import functools

# The SM count we assume when there is no GPU (CPU interpreter runs): the H100 we target, so the CPU makes the
# same policy decisions the GPU would.
DEFAULT_NUM_SMS = 132


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device=None) -> int:
    """Streaming multiprocessors of ``device`` (a torch.device, str or None); DEFAULT_NUM_SMS off the GPU."""
    import torch

    device = torch.device(device) if device is not None else None
    if device is None:
        if not torch.cuda.is_available():
            return DEFAULT_NUM_SMS
        return _cuda_sm_count(torch.cuda.current_device())
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def decode_num_splits(batch: int, nheads_kv: int, max_seqlen_k: int, num_sms: int, *,
                      block_n: int = 64, min_blocks_per_split: int = 2, max_splits: int = 64,
                      waves: float = 1.0) -> int:
    """How many programs share one sequence's KV range in Flash-Decoding.

    Enough splits that batch * nheads_kv * splits programs cover ``waves`` waves of the SMs, but never so many
    that a split gets fewer than ``min_blocks_per_split`` KV blocks (the merge and the per-program prologue cost
    more than they save), and never more than ``max_splits`` (the workspace is sized for it).
    ``max_seqlen_k`` is the longest *live* length, never the cache capacity.
    """
    if batch <= 0 or nheads_kv <= 0 or max_seqlen_k <= 0:
        return 1
    programs = batch * nheads_kv
    want = cdiv(int(num_sms * waves), programs)
    blocks = cdiv(max_seqlen_k, block_n)
    by_length = max(1, blocks // min_blocks_per_split)
    return max(1, min(want, by_length, max_splits))


# ----------------------------------------------------------------------------------------------------------------
# Prefill (flash_attn): autotune candidates, shared-memory pruning, shape buckets
# ----------------------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages). Forward: Q rows per program x KV rows per step. BLOCK_M is a multiple
# of 64 and num_warps of 4 so Hopper's wgmma is used (KERNEL_NOTES.md).
PREFILL_FWD_CANDIDATES = ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3))
# Backward dK/dV program: (BLOCK_N kv rows held, BLOCK_M q rows per step, warps, stages); dQ program: (BLOCK_M q rows
# held, BLOCK_N kv rows per step, warps, stages).
PREFILL_BWD_KV_CANDIDATES = ((128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3))
PREFILL_BWD_Q_CANDIDATES = ((128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3))
# One small fixed config for the CPU interpreter (speed there scales with the number of ops, not the tile size).
PREFILL_INTERPRET_BLOCKS = (32, 32)


def prefill_shared_bytes(block_rows: int, block_stream: int, head_dim_pad: int, num_stages: int, elem_bytes: int,
                         streamed_tensors: int = 2, held_tensors: int = 1) -> int:
    """Rough shared memory of an attention program: the tiles it holds once plus ``num_stages`` copies of the
    tiles it streams (K and V in the forward)."""
    held = held_tensors * block_rows * head_dim_pad
    streamed = num_stages * streamed_tensors * block_stream * head_dim_pad
    return (held + streamed) * elem_bytes


def prefill_configs_that_fit(candidates, head_dim_pad: int, elem_bytes: int, smem_limit: int,
                             streamed_tensors: int = 2, held_tensors: int = 1):
    """Candidates whose tiles fit in ``smem_limit`` bytes; the smallest candidate if none does."""
    fits = [c for c in candidates
            if prefill_shared_bytes(c[0], c[1], head_dim_pad, c[3], elem_bytes, streamed_tensors,
                                    held_tensors) <= smem_limit]
    if fits:
        return fits
    return [min(candidates, key=lambda c: prefill_shared_bytes(c[0], c[1], head_dim_pad, c[3], elem_bytes,
                                                                 streamed_tensors, held_tensors))]


def seqlen_bucket(n: int) -> int:
    """Autotune key for a length: its power-of-two ceiling capped at 16k, so a growing prompt re-tunes at most
    log2 times and never recompiles (lengths themselves are runtime arguments)."""
    return min(next_power_of_2(max(1, n)), 16384)
