"""Where an eager call's host microseconds go: bench.host's calls (decode table and the flash_attn prefill pair) timed
in a plain loop of 200 (bench.host.time_calls: host and wall time per call), then profiled with cProfile over 200
more (the 28 costliest functions by own time and by cumulative time). Profiler numbers run about 2x the plain
loop's: read them as shares, the loop as the figure.
    PYTHONPATH=. python benchmarks/probes/host_profile.py ["flash_decode" "flash_attn fwd+bwd" ...]
FLASHDECODE_DESCRIPTOR_LAUNCHER=1 profiles with the descriptor launcher's gate open. Prints to stdout.

    PYTHONPATH=. python benchmarks/probes/host_profile.py --descriptor-ab [ROUNDS] [--cpu]
times the decode calls with the descriptor launcher's gate off and on in ONE process, interleaved (off, on, off,
on, ...; every launch record and kept decision cleared at each switch, then re-warmed), and prints each call's
median host us per call of each setting: two processes' samples disagreed by more than the effect
(docs/decisions.md). --cpu: the same on the CPU proxy (bench.host --cpu's stubbed launches), to try the probe."""
import cProfile
import io
import pstats
import statistics
import sys

import torch

from flashdecode.bench import host
from flashdecode.ops import decode_host, direct_launch, launch_cache

CALLS = 200
DEFAULT = ["flash_decode", "flash_attn_with_kvcache", "flash_attn fwd", "flash_attn fwd+bwd"]
AB_CALLS = ["flash_decode", "DecodePlan.run", "flash_attn_with_kvcache", "flash_attn_with_kvcache +append"]


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


def descriptor_ab(rounds: int, cpu: bool) -> dict:
    """{(call, gate): [host us per call, one per round]} of AB_CALLS with the gate off and on, interleaved."""
    if cpu:
        host.stub_launches()
        device = torch.device("cpu")
    else:
        device = torch.device("cuda")
    calls = host._decode_calls(device, reference=False)
    samples = {}
    for _ in range(rounds):
        for gate in (False, True):
            direct_launch.DESCRIPTOR_LAUNCHER = gate
            launch_cache.clear()  # the next calls record their launches anew, through this gate's launcher
            decode_host.clear()
            for name in AB_CALLS:
                if cpu:
                    us = host.cpu_us_per_call({name: calls[name]}, CALLS, rounds=1)[name]
                else:
                    us = host.time_calls(calls[name], CALLS)[0]
                samples.setdefault((name, gate), []).append(us)
    print(f"descriptor launcher A/B, one process, {rounds} interleaved rounds of {CALLS} calls "
          f"({'CPU proxy' if cpu else torch.cuda.get_device_name()}); median host us per call")
    print("| call | off | on | on / off |")
    print("|---|---|---|---|")
    for name in AB_CALLS:
        off, on = (statistics.median(samples[(name, g)]) for g in (False, True))
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f} |")
    return samples


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--descriptor-ab":
        rest = [a for a in args[1:] if a != "--cpu"]
        descriptor_ab(int(rest[0]) if rest else 5, "--cpu" in args)
    else:
        main(args or DEFAULT)
