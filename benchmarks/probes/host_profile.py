"""Where an eager call's host microseconds go: bench.host's calls (decode table and the flash_attn prefill pair) timed
in a plain loop of 200 (bench.host.time_calls: host and wall time per call), then profiled with cProfile over 200
more (the 28 costliest functions by own time and by cumulative time). Profiler numbers run about 2x the plain
loop's: read them as shares, the loop as the figure.
    PYTHONPATH=. python benchmarks/probes/host_profile.py ["flash_decode" "flash_attn fwd+bwd" ...]
FLASHDECODE_DESCRIPTOR_LAUNCHER=1 profiles with the descriptor launcher's gate open. Prints to stdout."""
import cProfile
import io
import pstats
import sys

import torch

from flashdecode.bench import host
from flashdecode.ops import direct_launch

CALLS = 200
DEFAULT = ["flash_decode", "flash_attn_with_kvcache", "flash_attn fwd", "flash_attn fwd+bwd"]


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
        host_us, wall_us = host.time_calls(calls[name], CALLS)
        print(f"==== {name}: host {host_us:.1f} us, wall {wall_us:.1f} us per call (plain loop)")
        print(profile_text(calls[name]))


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
