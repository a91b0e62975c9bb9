"""Engine decode on 8-bit pages with the quantising rope store off and on (``fused.QUANT_ROPE_STORE``), same model.

The engine's 8-bit pages are written either by the fused rope kernel (one launch per layer: rope_and_store with
k_scale / v_scale) or by PyTorch's rotary and kv_quant.write_quantized (about 18 small launches per layer). This
times the decode loop of ``flashdecode bench e2e`` (random Llama-3-8B weights, pages filled with random codes, CUDA
graphs) for bf16 pages, then fp8 pages with the store off and on, alternating for --rounds rounds, and prints
tokens/s and % of each cache's roofline (weights + KV bytes over the copy bandwidth measured in the run). It also
checks the two fp8 engines' greedy tokens on one prompt are equal (the codes are bitwise the same by
tests/test_engine_fused.py). Writes engine_quant_store_<device>_<time>.json to $OUT.

    PYTHONPATH=. python3 -m benchmarks.probes.engine_quant_store [--contexts 65536,131072] [--batch 1,16]
"""

from __future__ import annotations

import argparse
import os

import torch


def _greedy(model, quant_store: bool) -> list[int]:
    from flashdecode.engine import LLM, SamplingParams
    from flashdecode.engine.layers import fused

    fused.QUANT_ROPE_STORE = quant_store  # read while the engine captures its graphs
    llm = LLM(model, attn_backend="flashdecode", max_model_len=1024, max_num_seqs=1, kv_cache_dtype="fp8",
              use_tqdm=False)
    ids = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    out = llm.generate([ids], SamplingParams(max_new_tokens=32, ignore_eos=True))[0].token_ids
    del llm
    return out


def main() -> int:
    from flashdecode.bench import e2e
    from flashdecode.bench.report import result_stem, results_dir, write_json
    from flashdecode.engine.config import named_config
    from flashdecode.engine.layers import fused
    from flashdecode.engine.models import model_class
    from flashdecode.timing import copy_bandwidth_bytes_per_s, env_info

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="65536,131072")
    parser.add_argument("--batch", default="1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("engine_quant_store needs a CUDA GPU")
        return 2
    env = env_info()
    contexts = [int(x) for x in args.contexts.split(",") if x]
    batches = [int(x) for x in args.batch.split(",") if x]
    cfg = named_config("llama3-8b")
    model = model_class(cfg)(cfg, torch.bfloat16, torch.device("cuda"), max_positions=max(contexts) + 4096)
    model.init_random_(0)
    bandwidth = copy_bandwidth_bytes_per_s()
    same = _greedy(model, False) == _greedy(model, True)
    print(f"{env['device']}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; greedy tokens equal off / on: {same}")
    rows = []
    for batch in batches:
        for ctx in contexts:
            for r in range(args.rounds):
                for label, kv, store in (("bf16", "auto", False), ("fp8", "fp8", False), ("fp8+store", "fp8", True)):
                    fused.QUANT_ROPE_STORE = store
                    rate = e2e.decode_tokens_per_s(model, "flashdecode", ctx, batch, args.steps, 2, 128,
                                                   kv_cache_dtype=kv)
                    roof = e2e.roofline_tokens_per_s(cfg, ctx, batch, bandwidth, kv)
                    rows.append(dict(batch=batch, context=ctx, round=r, pages=label, tokens_per_s=rate,
                                     pct_roofline=100 * rate / roof))
                    print(f"b{batch} {ctx:>6} round {r} {label:>9}: {rate:8.1f} tok/s = {100 * rate / roof:5.1f}% "
                          f"of its roofline", flush=True)
    fused.QUANT_ROPE_STORE = False
    path = write_json(results_dir(args.out) / f"{result_stem('engine_quant_store', env)}.json", "engine_quant_store",
                      env, rows, {"greedy_equal": same, "copy_bandwidth_bytes_per_s": bandwidth})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
