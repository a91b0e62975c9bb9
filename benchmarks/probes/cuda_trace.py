"""Per-kernel device time of a callable from a CUDA profiler trace (shared by the decode probes)."""

from __future__ import annotations

import torch


def kernel_times_us(fn, calls: int) -> dict:
    """Device time per call of each kernel name fn() launches (CUDA trace), over `calls` calls after a warm-up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}
