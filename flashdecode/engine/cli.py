"""`flashdecode generate`: run the engine on one prompt and print the output with prefill / decode timings.

    flashdecode generate --model DIR --prompt "Hello" --max-new-tokens 32
    flashdecode generate --random-weights llama3-8b --layers 4 --prompt-len 512 --max-new-tokens 64
    flashdecode generate --model DIR --prompt "Hello" --tp 2 --cp 2     # 4 local ranks (or under torchrun)
"""

from __future__ import annotations

import argparse
import time

import torch

from flashdecode.engine.attention import BACKENDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF checkpoint directory (config.json + safetensors [+ tokenizer.json])")
    src.add_argument("--random-weights", metavar="CONFIG_NAME",
                     help="a named shape with random weights: llama3-8b, llama3.2-1b, qwen2.5-1.5b, codellama-34b")
    parser.add_argument("--layers", type=int, default=None, help="with --random-weights: keep only N layers")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json), or comma-separated token ids")
    prompt.add_argument("--prompt-len", type=int, help="a random prompt of N token ids")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default bf16 on CUDA, fp32 CPU)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--attn-backend", default=None, choices=BACKENDS)
    parser.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default 128 on CUDA)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (heads / MLP columns sharded)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks (KV pages of each sequence spread)")


def _prompt(args, llm) -> str | list[int]:
    if args.prompt_len is not None:
        if args.prompt_len < 1:
            raise ValueError(f"--prompt-len must be >= 1, got {args.prompt_len}")
        gen = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, llm.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
    text = args.prompt
    if llm.tokenizer is None:
        try:
            return [int(t) for t in text.split(",")]
        except ValueError:
            raise ValueError("--prompt: this model has no tokenizer.json; give comma-separated token ids") from None
    return text


def run(args) -> int:
    from flashdecode.engine import LLM, SamplingParams
    from flashdecode.engine.config import named_config

    if args.tp * args.cp > 1:  # spawn the ranks (each runs this command), or go on as one of them (torchrun)
        from flashdecode.distributed.launch import main_on_ranks

        code = main_on_ranks(run, args, args.tp * args.cp)
        if code is not None:
            return code
    model = named_config(args.random_weights, args.layers) if args.random_weights else args.model
    max_len = args.max_model_len
    if max_len is None and args.prompt_len is not None:
        max_len = args.prompt_len + args.max_new_tokens + 1
    t0 = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, device=args.device, attn_backend=args.attn_backend,
              page_size=args.page_size, max_num_seqs=1, max_model_len=max_len, enforce_eager=args.enforce_eager,
              seed=args.seed, tensor_parallel_size=args.tp, context_parallel_size=args.cp)
    print(f"loaded in {time.perf_counter() - t0:.1f} s: {llm.config.model_type}, {llm.config.num_hidden_layers} "
          f"layers, {llm.dtype}, {llm.device}, backend {llm.backend.name}, "
          f"CUDA graphs {'on' if llm.runner.graphs else 'off'}")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    seq = llm.add_request(_prompt(args, llm), params)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    llm.step()  # the prefill (and the first token)
    sync()
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    while llm.scheduler.has_work():
        llm.step()
    sync()
    t_decode = time.perf_counter() - t0
    out = seq.output_token_ids
    print(f"prompt {seq.num_prompt_tokens} tokens, generated {len(out)} ({seq.finish_reason})")
    print("token ids:", out)
    if llm.tokenizer is not None:
        print("text:", llm._decode_text(out))
    decode_rate = (len(out) - 1) / t_decode if len(out) > 1 and t_decode > 0 else float("nan")
    print(f"prefill {t_prefill * 1e3:.1f} ms ({seq.num_prompt_tokens / t_prefill:.0f} tok/s), "
          f"decode {decode_rate:.1f} tok/s")
    return 0
