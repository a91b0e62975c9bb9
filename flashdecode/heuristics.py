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
