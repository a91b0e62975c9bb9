"""Host cost of one flash_attn call against its kernel time, on the GPU machine (short sequences are host-bound).

    PYTHONPATH=. python3 scripts/host_overhead.py

Per shape (16 x 1024 tokens, 16 heads, bf16): host microseconds per call with the GPU running behind, wall
microseconds per call, and the attention kernel's device time per call (torch.profiler); then a cProfile of 300 calls
of the last shape, sorted by own time, to show where the host time goes.
"""
import cProfile, pstats, time, torch, flashdecode
from torch.profiler import profile, ProfilerActivity
for hd, causal in [(64, True), (128, True), (128, False)]:
    q = torch.randn(16, 1024, 16, hd, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    f = lambda: flashdecode.flash_attn(q, k, v, causal=causal)
    for _ in range(30): f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(300): f()
    th = (time.perf_counter() - t) / 300 * 1e6
    torch.cuda.synchronize(); tw = (time.perf_counter() - t) / 300 * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(50): f()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if "attn" in e.key]
    dev = sum(e.device_time_total for e in ev) / 50 if ev else -1
    print(f"hd{hd} causal={causal}: host {th:.0f} us/call, wall {tw:.0f} us/call, kernel {dev:.0f} us/call", flush=True)
pr = cProfile.Profile(); pr.enable()
for _ in range(300): f()
pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
