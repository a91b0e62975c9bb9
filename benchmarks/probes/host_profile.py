"""Where an eager call's host microseconds go: bench.host's calls (decode table and the flash_attn prefill pair) timed
in a plain loop of 200, then profiled with cProfile over 200 more (the 28 costliest functions by own time and by
cumulative time). Profiler numbers run about 2x the plain loop's: read them as shares, the loop as the figure.
    PYTHONPATH=. python benchmarks/probes/host_profile.py ["flash_decode" "flash_attn fwd+bwd" ...]
FLASHDECODE_DESCRIPTOR_LAUNCHER=1 profiles with the descriptor launcher's gate open. Prints to stdout."""
import cProfile
import io
import pstats
import sys
import time

import torch

from flashdecode.bench import host
from flashdecode.ops import direct_launch

CALLS = 200
DEFAULT = ["flash_decode", "flash_attn_with_kvcache", "flash_attn fwd", "flash_attn fwd+bwd"]


def loop_us(fn) -> float:
    """Host us per call of CALLS asynchronous calls (after 20 warm-up calls and a sync)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    us = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    return us


def profile_text(fn) -> str:
    """cProfile's two top-28 tables of CALLS calls of fn."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CALLS):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(28)
    stats.sort_stats("cumulative").print_stats(28)
    return text.getvalue()


def main(names) -> None:
    device = torch.device("cuda")
    calls = host._decode_calls(device, reference=False)
    calls.update(host._prefill_calls(device))
    print("descriptor launcher:", direct_launch.DESCRIPTOR_LAUNCHER)
    for name in names:
        us = loop_us(calls[name])
        print(f"==== {name}: {us:.1f} us per call (plain loop)")
        print(profile_text(calls[name]))


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
