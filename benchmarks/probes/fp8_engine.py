"""Engine accuracy of 8-bit KV pages on the GPU: greedy tokens and decode logits, fp8 / int8 pages vs bf16 pages.

One model (random weights of a named shape, or a checkpoint) shared by engines that differ only in
kv_cache_dtype; each decodes the same prompts greedily for --tokens tokens. Reported per dtype: the greedy tokens
that agree with the bf16-page run (per sequence, until the first difference), the max |logit difference| over the
steps whose history still agrees (absolute, and relative to the largest bf16 logit), and the bf16 run's top-2 logit
gap where a sequence first parts (a near-tie explains it). Decode speed of the whole engine is ``flashdecode bench
e2e --kv-cache-dtype auto,fp8``.

    PYTHONPATH=. python3 -m benchmarks.probes.fp8_engine [--random-weights llama3-8b --layers 4] [--tokens 256]
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
    from flashdecode.engine.config import named_config
    from flashdecode.engine.models import model_class
    from flashdecode.timing import env_info

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-weights", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=4, help="layers of the random-weights shape")
    parser.add_argument("--prompts", default="512,2048,8192", help="prompt lengths (random token ids)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dtypes", default="fp8,int8")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fp8_engine needs a CUDA GPU")
        return 2
    env = env_info()
    cfg = named_config(args.random_weights, args.layers)
    lengths = [int(x) for x in args.prompts.split(",") if x]
    max_len = max(lengths) + args.tokens + 8
    model = model_class(cfg)(cfg, torch.bfloat16, torch.device("cuda"), max_positions=max_len)
    model.init_random_(0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    runs = {}
    for kv in ["auto"] + [k for k in args.dtypes.split(",") if k]:
        llm = LLM(model, attn_backend="flashdecode", max_model_len=max_len, max_num_seqs=len(prompts),
                  kv_cache_dtype=kv)
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
        print(f"{kv}: tokens agreeing with bf16 pages {row['tokens_agreed']} of {args.tokens}; max |logit diff| "
              f"{row['max_abs_logit_diff']:.4f} ({100 * (row['rel_logit_diff'] or 0):.2f}% of the largest logit); "
              f"bf16 top-2 gap where parted {['%.4f' % x for x in row['bf16_top2_gap_where_parted']]}")
    path = write_json(results_dir(args.out) / f"{result_stem('fp8_engine', env)}.json", "fp8_engine", env, rows,
                      {"model": f"{args.random_weights} x {args.layers} layers, random weights, bf16"})
    print(f"on {env['device']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
