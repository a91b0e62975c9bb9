"""Model (CPU, pure Python): how the launch order of the deterministic causal Gluon backward shapes its tail.

The causal backward runs one CTA per (key block, kv head, batch); key block j of a head visits query blocks 2j ..
NM - 1 (128-key blocks, 64-row query blocks, seqlen_q = seqlen_k), one unit of time each. The deterministic mode
makes the key blocks of a head add their dQ of a query block in a fixed order, each addition taking `a` units
after the one before it lands (the writer warp's L2 round trip); the consumers run at most one step ahead of
their writer. CTAs start on the first free SM in launch order (as the hardware launches a grid's CTAs).

Orders compared (kernels/gluon/attn_bwd.py, _key_block / _turn):
- non-deterministic: a head's blocks heaviest first, no waits;
- deterministic (the default): a head's blocks lightest first, each walking its query blocks upward, the later
  key block adding first - the grid ends on its last head's heaviest blocks;
- tail_heavy_first: the same except the grid's last head, whose blocks launch heaviest first, walk their query
  blocks downward and add in ascending key-block order.

Prints each order's makespan over the ideal (total work / SMs + one CTA's overhead share) for a few head counts.
--non-causal: every key block visits every query block, in ascending order, added in ascending key-block order
(the kernel's non-causal deterministic mode): what the chain of the first wave's additions costs.

    python benchmarks/probes/bwd_schedule_model.py [--heads 16,8,4] [--sms 132] [--key-blocks 128] [--non-causal]
"""

from __future__ import annotations

import argparse
import heapq


def makespan(order, walk_down_units, det, nb, nm, sms, a, eps=0.1, overhead=4.0, causal=True):
    """Finish time of the last CTA. order: [(unit, key block j)] in launch order; walk_down_units: the units
    whose blocks walk down and add in ascending order (the others walk up, descending); det: ordered additions;
    causal=False: every block walks every query block up, adding in ascending order."""
    free = [(0.0, sm) for sm in range(sms)]
    heapq.heapify(free)
    landed = {}  # (unit, query block, key block) -> when its addition landed
    end_all = 0.0
    for unit, j in order:
        start, sm = heapq.heappop(free)
        t = start + overhead / 2
        prev_start = prev_end = compute = t
        down = unit in walk_down_units
        first = 2 * j if causal else 0
        for m in (range(nm - 1, first - 1, -1) if down else range(first, nm)):
            compute = max(compute + 1, prev_start + eps)  # one staging buffer: wait until the writer took the last
            add = max(compute, prev_end)
            if det and (down or not causal) and j > 0:
                add = max(add, landed[(unit, m, j - 1)])
            if det and causal and not down and j + 1 < nb and 2 * (j + 1) <= m:
                add = max(add, landed[(unit, m, j + 1)])
            landed[(unit, m, j)] = add + a
            prev_start, prev_end = add, add + a
        end = prev_end + overhead / 2
        end_all = max(end_all, end)
        heapq.heappush(free, (end, sm))
    return end_all


def compare(units: int, nb: int, sms: int, a: float) -> dict:
    nm = 2 * nb
    ideal = sum(nm - 2 * j + 4.0 for j in range(nb)) * units / sms
    heavy = [(u, j) for u in range(units) for j in range(nb)]
    light = [(u, j) for u in range(units) for j in reversed(range(nb))]
    tail = [(u, j) for u in range(units) for j in (range(nb) if u == units - 1 else reversed(range(nb)))]
    return {"non-deterministic": makespan(heavy, set(), False, nb, nm, sms, a) / ideal,
            "deterministic": makespan(light, set(), True, nb, nm, sms, a) / ideal,
            "tail_heavy_first": makespan(tail, {units - 1}, True, nb, nm, sms, a) / ideal}


def compare_non_causal(units: int, nb: int, sms: int, a: float) -> dict:
    nm = 2 * nb
    ideal = (nm + 4.0) * nb * units / sms
    order = [(u, j) for u in range(units) for j in range(nb)]
    return {"non-deterministic": makespan(order, set(), False, nb, nm, sms, a, causal=False) / ideal,
            "deterministic": makespan(order, set(), True, nb, nm, sms, a, causal=False) / ideal}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16,8,4", help="(batch, kv head) units of the grid")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--key-blocks", type=int, default=128, help="128-key blocks a head (128: 16k tokens)")
    ap.add_argument("--add", default="0.25,0.5,1.0", help="an addition's round trip, in steps")
    ap.add_argument("--non-causal", action="store_true")
    args = ap.parse_args()
    print("makespan / ideal" + (" (non-causal)" if args.non_causal else " (causal)"))
    for units in map(int, args.heads.split(",")):
        for a in map(float, args.add.split(",")):
            row = (compare_non_causal if args.non_causal else compare)(units, args.key_blocks, args.sms, a)
            print(f"{units:>3} heads, a={a:<4} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
