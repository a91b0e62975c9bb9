"""Small device helpers the engine benchmarks share: wait for the GPU, hand cached memory back, time one call."""

from __future__ import annotations

import gc
import time

import torch


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release() -> None:
    """Free what the last measurement left behind (Python garbage, then the CUDA caching allocator's free blocks),
    so that the next point starts with the same free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(device: torch.device, fn):
    """(seconds, result) of ``fn()``: CUDA events around it on CUDA (no host sync inside), wall time on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, result
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result
