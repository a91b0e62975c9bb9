"""Engine accuracy of 8-bit KV pages on the GPU: greedy tokens and decode logits, fp8 / int8 pages vs bf16 pages.

One model (random weights of a named shape, or a checkpoint) shared by engines that differ only in
kv_cache_dtype; each decodes the same prompts greedily for --tokens tokens. Reported per dtype: the greedy tokens
that agree with the bf16-page run (per sequence, until the first difference), the max |logit difference| over the
steps whose history still agrees (absolute, and relative to the largest bf16 logit), and the bf16 run's top-2 logit
gap where a sequence first parts (a near-tie explains it). Decode speed of the whole engine is ``flashdecode bench
e2e --kv-cache-dtype auto,fp8``.

    PYTHONPATH=. python3 -m benchmarks.probes.fp8_engine [--random-weights llama3-8b --layers 4] [--tokens 256]
    PYTHONPATH=. python3 -m benchmarks.probes.fp8_engine --model CKPT --device cpu --backend torch

On the CPU (float32 engines; --backend torch dequantises the same 8-bit pages, --backend flashdecode runs the
Triton kernels in the interpreter, slowly) it takes a checkpoint folder, e.g. the tiny ones the tests build:
``python -c "import sys; sys.path.insert(0, 'tests'); from engine_helpers import save_tiny; save_tiny('/tmp/tiny',
'llama')"``.
"""

from __future__ import annotations

import argparse
import os

import torch


def _greedy_with_logits(llm, prompts, tokens):
    """(token ids per prompt, decode logits per step: float32 (batch, vocab) on the host)."""
    from flashdecode.engine import SamplingParams

    steps = []
    decode = llm.runner.decode

    def recording(*args, **kw):
        logits, greedy = decode(*args, **kw)
        steps.append(logits.float().cpu())
        return logits, greedy

    llm.runner.decode = recording
    try:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    finally:
        llm.runner.decode = decode
    return [o.token_ids for o in outs], steps


def compare(want, want_logits, got, got_logits) -> dict:
    """Agreement and logit differences of one run (got) against the bf16-page run (want)."""
    agreed, max_diff, part_gaps = [], 0.0, []
    scale = max(x.abs().max().item() for x in want_logits) if want_logits else 0.0
    for r, (g, w) in enumerate(zip(got, want)):
        n = 1 if g[:1] == w[:1] else 0
        for step in range(min(len(g), len(w)) - 1):
            if n <= step:
                break
            max_diff = max(max_diff, (got_logits[step][r] - want_logits[step][r]).abs().max().item())
            if g[step + 1] != w[step + 1]:
                top2 = want_logits[step][r].topk(2).values
                part_gaps.append((top2[0] - top2[1]).item())
                break
            n += 1
        agreed.append(n)
    return dict(tokens_agreed=agreed, max_abs_logit_diff=max_diff, max_bf16_logit=scale,
                rel_logit_diff=max_diff / scale if scale else None, bf16_top2_gap_where_parted=part_gaps)


def main() -> int:
    from flashdecode.bench.report import result_stem, results_dir, write_json
    from flashdecode.engine import LLM
    from flashdecode.engine.config import load_config, named_config
    from flashdecode.engine.models import model_class
    from flashdecode.timing import env_info

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-weights", default="llama3-8b")
    parser.add_argument("--model", default=None, help="a checkpoint folder instead of random weights")
    parser.add_argument("--device", default="cuda", help="cuda (bf16 engines) or cpu (float32 engines)")
    parser.add_argument("--backend", default="flashdecode", help="the engines' attn_backend")
    parser.add_argument("--layers", type=int, default=4, help="layers of the random-weights shape")
    parser.add_argument("--prompts", default="512,2048,8192", help="prompt lengths (random token ids)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dtypes", default="fp8,int8")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("fp8_engine: no CUDA GPU here (--device cpu runs the float32 engines)")
        return 2
    env = env_info()
    lengths = [int(x) for x in args.prompts.split(",") if x]
    max_len = max(lengths) + args.tokens + 8
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model:
        model = args.model
        vocab = load_config(args.model).vocab_size
        what = f"{args.model}, {dtype}"
    else:
        cfg = named_config(args.random_weights, args.layers)
        model = model_class(cfg)(cfg, dtype, device, max_positions=max_len)
        model.init_random_(0)
        vocab = cfg.vocab_size
        what = f"{args.random_weights} x {args.layers} layers, random weights, {dtype}"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    runs = {}
    for kv in ["auto"] + [k for k in args.dtypes.split(",") if k]:
        llm = LLM(model, device=device, dtype=dtype, attn_backend=args.backend, max_model_len=max_len,
                  max_num_seqs=len(prompts), kv_cache_dtype=kv,
                  async_scheduling=False)  # the recording wrapper reads each step's logits
        runs[kv] = _greedy_with_logits(llm, prompts, args.tokens)
        del llm
        torch.cuda.empty_cache()
    rows = []
    for kv in runs:
        if kv == "auto":
            continue
        row = dict(kv_cache_dtype=kv, prompts=lengths, tokens=args.tokens,
                   **compare(runs["auto"][0], runs["auto"][1], runs[kv][0], runs[kv][1]))
        rows.append(row)
        print(f"{kv}: tokens agreeing with {dtype} pages {row['tokens_agreed']} of {args.tokens}; max |logit diff| "
              f"{row['max_abs_logit_diff']:.4f} ({100 * (row['rel_logit_diff'] or 0):.2f}% of the largest logit); "
              f"{dtype} top-2 gap where parted {['%.4f' % x for x in row['bf16_top2_gap_where_parted']]}")
    path = write_json(results_dir(args.out) / f"{result_stem('fp8_engine', env)}.json", "fp8_engine", env, rows,
                      {"model": what, "backend": args.backend})
    print(f"on {env['device']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
