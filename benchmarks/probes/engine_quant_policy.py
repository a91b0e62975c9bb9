"""Engine decode on 8-bit pages under the 8-bit batch policy and without it, same process.

The policy (heuristics.DECODE_QUANT_DEVICE_SPLIT_GRID and DECODE_QUANT_WARP_SPLIT_MIN_KEYS): batches of an 8-bit
cache that the persistent kernel would serve take the device-split grid, with the keys of each block split across
the warps (DecodeConfig.quant_warp_split) where the device's splits hold enough keys. This runs ``flashdecode bench
e2e`` with the arguments given (add --kv-cache-dtype fp8 and a --page-size), writing its record under $OUT/on,
then again with both rules turned off (the persistent kernel and the shared loop, the policy before them) under
$OUT/off: tokens/s and % of the roofline of the same engine, model and pages, one after the other. A plan
resolves its launch per run shape when a new engine builds it, so the second run uses the changed constants.

    PYTHONPATH=. python3 -m benchmarks.probes.engine_quant_policy --random-weights llama3-8b --contexts 8192 \\
        --batch 16,64 --backends flashdecode --kv-cache-dtype fp8 --page-size 16 --hf none --prefill 0
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from flashdecode import heuristics
    from flashdecode.cli import main as cli

    out = os.environ.get("OUT", ".")
    cli(["bench", "e2e", *argv, "--out", os.path.join(out, "on")])
    heuristics.DECODE_QUANT_DEVICE_SPLIT_GRID = False
    heuristics.DECODE_QUANT_WARP_SPLIT_MIN_KEYS = 1 << 62
    cli(["bench", "e2e", *argv, "--out", os.path.join(out, "off")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
