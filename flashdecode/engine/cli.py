"""`flashdecode generate`: run the engine on one prompt and print the output with prefill / decode timings.

    flashdecode generate --model DIR --prompt "Hello" --max-tokens 32
    flashdecode generate --model DIR --chat --prompt "Tell me a joke"
    flashdecode generate --random-weights llama3-8b --layers 4 --prompt-len 512 --max-tokens 64
    flashdecode generate --model DIR --prompt "Hello" --tp 2 --cp 2     # 4 local ranks (or under torchrun)

The engine options (add_engine_arguments -> engine_config -> one EngineConfig, build_llm) are shared with
`flashdecode serve` and `flashdecode bench serve`.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading
import time

import torch

from flashdecode.engine.attention import BACKENDS
from flashdecode.engine.config import NAMED_CONFIGS

logger = logging.getLogger(__name__)

_TOKEN_IDS = re.compile(r"^[\d,\s]+$")
ON_OFF = {"auto": "auto", "on": True, "off": False}  # the engine options' auto | on | off choices, as LLM takes them


def add_engine_arguments(parser: argparse.ArgumentParser, default_max_num_seqs: int, required: bool = True) -> None:
    src = parser.add_mutually_exclusive_group(required=required)
    src.add_argument("--model", help="HF checkpoint directory (config.json + safetensors [+ tokenizer files]) or hub "
                                     "id (e.g. Qwen/Qwen3-8B, from the local HF cache)")
    src.add_argument("--random-weights", metavar="CONFIG_NAME", choices=sorted(NAMED_CONFIGS),
                     help="a named shape with random weights (no tokenizer: token-id prompts only)")
    parser.add_argument("--layers", type=int, default=None, help="with --random-weights: keep only N layers")
    parser.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: bf16 on CUDA, fp32 "
                                                      "on the CPU)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is a GPU)")
    parser.add_argument("--attn-backend", default=None, choices=BACKENDS,
                        help="default: flashdecode on CUDA, torch (the reference) on the CPU")
    parser.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default 128 on CUDA, 16 "
                                                                    "elsewhere)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence (default min(max_position_embeddings, 8192))")
    parser.add_argument("--max-num-seqs", type=int, default=default_max_num_seqs,
                        help="most sequences decoded together")
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="KV pool: bytes (> 1) or a fraction of free GPU memory (<= 1); default: what "
                             "max-num-seqs sequences of max-model-len need")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "int8"),
                        help="KV pages: the model's dtype (auto), or 8 bits with per-token-head scales")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--flat-gemm", choices=("auto", "on", "off"), default="auto",
                        help="the flat GEMM for small decode batches where it beats cuBLAS: auto = from the "
                             "table measured once per GPU model (cached), on = measure now, off = cuBLAS")
    parser.add_argument("--pdl", choices=("auto", "on", "off"), default="auto",
                        help="programmatic dependent launch of the decode step's Triton kernels (sm_90+): auto = "
                             "the engine's default for the GPU, on, off")
    parser.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                        help="launch each decode step before the host reads the one in flight (vLLM's async "
                             "scheduling): auto = on for a single-GPU engine on CUDA, on, off")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the KV pages of cached prompt prefixes (vLLM's automatic prefix caching); "
                             "default: on except for 8-bit pages, context parallelism and dynamic rope")
    parser.add_argument("--enable-chunked-prefill", action="store_true",
                        help="run long prompts in chunks beside the running decodes (budget: "
                             "--max-num-batched-tokens)")
    parser.add_argument("--chunked-prefill-single-forward", action="store_true",
                        help="with chunked prefill: the decodes and the chunks of a step in one eager forward (the "
                             "weights read once) instead of the decode CUDA graph + a chunk forward")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step: a prefill batch's prompt tokens, or with chunked prefill the decodes "
                             "plus the prompt chunks (default 2048 then)")
    parser.add_argument("--prefill-autotune", action="store_true",
                        help="let the Triton prefill kernels time their tiles on the first call of each length "
                             "bucket (about a second inside that request); default: the resolved tile, never timed")
    parser.add_argument("--prefill-warmup", choices=("auto", "on", "off"), default="auto",
                        help="compile the prefill kernels at start-up (auto: flashdecode backends on CUDA)")
    parser.add_argument("--weights-seed", type=int, default=0, help="seed of --random-weights")


def engine_config(args, max_model_len: int | None = None):
    """The EngineConfig the engine options describe (``max_model_len``: the default when --max-model-len is not
    given). ValueError naming the flag for a bad value."""
    from flashdecode.engine.config import named_config
    from flashdecode.engine.engine_config import EngineConfig

    for name in ("layers", "page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    model = named_config(args.random_weights, args.layers) if args.random_weights else args.model
    memory = args.kv_cache_memory
    if memory is not None:
        memory = int(memory) if memory > 1 else float(memory)
    return EngineConfig(model, dtype=args.dtype, device=args.device, attn_backend=args.attn_backend,
                        page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len or max_model_len, kv_cache_memory=memory,
                        enforce_eager=args.enforce_eager, seed=args.weights_seed, flat_gemm=ON_OFF[args.flat_gemm],
                        tensor_parallel_size=getattr(args, "tp", 1), context_parallel_size=getattr(args, "cp", 1),
                        kv_cache_dtype=args.kv_cache_dtype, pdl=ON_OFF[args.pdl],
                        prefill_autotune=args.prefill_autotune, prefill_warmup=ON_OFF[args.prefill_warmup],
                        async_scheduling=ON_OFF[args.async_scheduling],
                        enable_prefix_caching=args.enable_prefix_caching,
                        enable_chunked_prefill=args.enable_chunked_prefill,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        chunked_prefill_single_forward=args.chunked_prefill_single_forward)


def build_llm(args, max_model_len: int | None = None):
    """The LLM the engine options describe (engine_config)."""
    from flashdecode.engine import LLM

    return LLM(config=engine_config(args, max_model_len))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, default_max_num_seqs=1)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the model's tokenizer), or comma-separated token ids")
    prompt.add_argument("--prompt-len", type=int, help="a random prompt of N token ids")
    parser.add_argument("--chat", action="store_true", help="send --prompt as a user message through the chat "
                                                            "template")
    parser.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=32,
                        help="most new tokens")
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (and of --prompt-len's prompt)")
    parser.add_argument("--ignore-eos", action="store_true")
    add_parallel_arguments(parser)


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (heads / MLP columns sharded)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks (KV pages of each sequence spread)")


def join_ranks(command, args) -> int | None:
    """With --tp x --cp > 1 ranks: spawn them, each running ``command(args)``, and return rank 0's exit code; as
    one of the ranks (spawned, or under torchrun) return None: the caller goes on with the command. A single rank:
    None."""
    if args.tp * args.cp <= 1:
        return None
    engine_config(args)  # the options checked once here, before any rank starts (ValueError naming the flag)
    from flashdecode.distributed.launch import main_on_ranks

    if threading.current_thread() is threading.main_thread():
        # a plain `kill` of the launcher ends the ranks too (spawn's cleanup runs on SystemExit, not on SIGTERM)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    backend = "gloo" if args.device == "cpu" else None  # CPU ranks on a GPU machine too (NCCL needs GPUs)
    return main_on_ranks(command, args, args.tp * args.cp, backend=backend)


def parse_prompt(text: str, has_tokenizer: bool) -> str | list[int]:
    """--prompt as token ids ("1,2,3") or text. ValueError with what is wrong."""
    if _TOKEN_IDS.match(text):
        items = [t.strip() for t in text.split(",")]
        if any(not t for t in items):
            raise ValueError(f"--prompt {text!r}: an empty token id in the comma-separated list (item "
                             f"{items.index('') + 1}); give ids like 1,2,3")
        if all(t.isdigit() for t in items):
            return [int(t) for t in items]
    if not has_tokenizer:
        raise ValueError(f"--prompt {text!r}: this model has no tokenizer, so the prompt must be comma-separated "
                         f"token ids like 1,2,3")
    return text


def _prompt(args, llm) -> str | list[int]:
    if args.prompt_len is not None:
        if args.prompt_len < 1:
            raise ValueError(f"--prompt-len must be >= 1, got {args.prompt_len}")
        gen = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, llm.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
    if args.chat:
        return llm.render_chat([{"role": "user", "content": args.prompt}])
    return parse_prompt(args.prompt, llm.tokenizer is not None)


def run(args) -> int:
    from flashdecode.engine import SamplingParams

    code = join_ranks(run, args)
    if code is not None:
        return code
    if args.chat and args.prompt is None:
        raise ValueError("--chat needs --prompt")
    if args.prompt is not None and not args.chat:
        parse_prompt(args.prompt, has_tokenizer=True)  # a malformed id list fails before the weights load
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, stop=args.stop, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    max_len = args.prompt_len + args.max_tokens + 1 if args.prompt_len is not None else None
    llm = build_llm(args, max_model_len=max_len)
    seq, = llm.add_request(_prompt(args, llm), params)
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
        llm.update_text(seq)
        print("text:", seq.text)
    decode_rate = (len(out) - 1) / t_decode if len(out) > 1 and t_decode > 0 else float("nan")
    print(f"prefill {t_prefill * 1e3:.1f} ms ({seq.num_prompt_tokens / t_prefill:.0f} tok/s), "
          f"decode {decode_rate:.1f} tok/s")
    return 0
