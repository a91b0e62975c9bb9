"""The user-facing API, in vLLM's shape:

    from flashdecode.engine import LLM, SamplingParams
    llm = LLM("path/to/hf_checkpoint", dtype="bfloat16", attn_backend="flashdecode")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_new_tokens=32))
    outs[0].token_ids, outs[0].text

``model`` may also be a ModelConfig (e.g. ``named_config("llama3-8b")``): the model then gets random weights on the
device (benchmarks; no checkpoint can be downloaded here).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from flashdecode.distributed.groups import ParallelConfig, ParallelState
from flashdecode.engine.attention import make_backend
from flashdecode.engine.config import ModelConfig, load_config
from flashdecode.engine.kv_cache import bytes_per_page, make_block_manager
from flashdecode.engine.loader import load_checkpoint
from flashdecode.engine.models import model_class
from flashdecode.engine.runner import ModelRunner
from flashdecode.engine.sampling import SamplingParams, sample
from flashdecode.engine.scheduler import Scheduler, Sequence

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (or the torch dtype), got {dtype!r}")


def default_page_size(device: torch.device) -> int:
    return 128 if torch.device(device).type == "cuda" else 16


@dataclasses.dataclass
class RequestOutput:
    """One request's result: ``token_ids`` are the generated ids (EOS included when it stopped there)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_preemptions: int = 0


def _load_tokenizer(model_dir: Path | None):
    if model_dir is None or not (model_dir / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


class LLM:
    """An engine instance: model weights, page pool, scheduler and runner.

    Args:
        model: HF checkpoint directory (config.json + safetensors), a ModelConfig (random weights), or an already
            built engine model (e.g. another LLM's ``.model``: engines then share the weights).
        dtype: "bfloat16"/"float16"/"float32" (default bf16 on CUDA, fp32 on CPU).
        device: "cuda" / "cpu" (default cuda when available).
        attn_backend: flashdecode | flashdecode-nosplit | sdpa | eager | torch (default flashdecode on CUDA,
            torch on the CPU).
        page_size: tokens per KV page; default 128 on CUDA (a multiple of flash_decode's 128-key block, so its
            stage 1 reads pages through TMA like a contiguous cache: page 16 measured +8..+50% decode time on the
            H100, bench decode), 16 elsewhere.
        kv_cache_memory: KV pool size, int bytes or a float in (0, 1] = fraction of the free GPU memory after the
            weights are loaded; default: what max_num_seqs sequences of max_model_len tokens need, capped at 90%
            of free memory (CUDA) or 1 GiB (CPU).
        max_num_seqs: most sequences decoded together (CUDA graphs are captured for 1, 2, 4, ... up to it).
        max_model_len: longest sequence (prompt + output); default min(max_position_embeddings, 8192).
        max_num_batched_tokens: prompt tokens per prefill step (a longer single prompt still runs alone).
        enforce_eager: no CUDA graphs.
        seed: seed of the random weights when ``model`` is a ModelConfig.
        tensor_parallel_size, context_parallel_size: ranks that share the model's heads / MLP columns, and ranks
            that share every sequence's KV pages (docs/distributed.md). Above 1, every rank runs this same program
            (torchrun, or flashdecode.distributed.launch.spawn) and gets the same outputs.
    """

    def __init__(self, model, *, dtype=None, device=None, attn_backend: str | None = None, page_size: int | None = None,
                 kv_cache_memory: int | float | None = None, max_num_seqs: int = 32,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 enforce_eager: bool = False, seed: int = 0, tensor_parallel_size: int = 1,
                 context_parallel_size: int = 1):
        prebuilt = model if isinstance(model, torch.nn.Module) and isinstance(getattr(model, "config", None),
                                                                             ModelConfig) else None
        if prebuilt is not None:  # share one set of weights between engines (benchmarks)
            weight = prebuilt.lm_head_weight
            device, dtype = weight.device, weight.dtype
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        self.parallel = ParallelState.create(ParallelConfig(tensor_parallel_size, context_parallel_size), self.device)
        if prebuilt is not None:
            self.config, self.model_dir = prebuilt.config, None
        elif isinstance(model, ModelConfig):
            self.config, self.model_dir = model, None
        elif isinstance(model, (str, Path)):
            self.model_dir = Path(model)
            self.config = load_config(self.model_dir)
        else:
            raise TypeError(f"model must be a checkpoint directory, a ModelConfig or an engine model, "
                            f"got {type(model).__name__}")
        if page_size is None:
            page_size = default_page_size(self.device)
        for name, value in (("page_size", page_size), ("max_num_seqs", max_num_seqs)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        cfg = self.config
        self.max_model_len = int(max_model_len or min(cfg.max_position_embeddings, 8192))
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.backend = make_backend(attn_backend, self.device, (cfg.sliding_window - 1) if cfg.sliding_window else -1)

        if prebuilt is not None:
            self.model = prebuilt
            table = getattr(prebuilt.rotary, "cos_table", None)
            if table is not None and table.shape[0] < self.max_model_len:
                raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's rotary table "
                                 f"({table.shape[0]} positions)")
        else:
            self.model = model_class(cfg)(cfg, self.dtype, self.device, max_positions=self.max_model_len,
                                          parallel=self.parallel)
            if self.model_dir is None:
                self.model.init_random_(seed)
            else:
                load_checkpoint(self.model, self.model_dir)
        self.tokenizer = _load_tokenizer(self.model_dir)

        page_bytes = bytes_per_page(cfg.num_hidden_layers, page_size, self.model.cache_kv_heads, cfg.head_dim,
                                    self.dtype)
        self.scheduler_tokens = max_num_batched_tokens or max(self.max_model_len, 2048)
        num_pages = self.parallel.min_over_world(self._num_pages(kv_cache_memory, page_bytes, page_size,
                                                                  max_num_seqs))
        self.block_manager = make_block_manager(num_pages, page_size, self.parallel.cp_size, self.parallel.cp_rank)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, self.scheduler_tokens, self.max_model_len)
        use_graphs = self.device.type == "cuda" and not enforce_eager and self.backend.supports_cuda_graphs
        self.runner = ModelRunner(self.model, self.backend, num_pages=num_pages, page_size=page_size,
                                  max_model_len=self.max_model_len, max_num_seqs=max_num_seqs, device=self.device,
                                  dtype=self.dtype, use_cuda_graphs=use_graphs, parallel=self.parallel)

    def _num_pages(self, kv_cache_memory, page_bytes: int, page_size: int, max_num_seqs: int) -> int:
        wanted = max_num_seqs * -(-self.max_model_len // page_size) * page_bytes
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            cap = int(0.9 * free) - self._activation_reserve()
        else:
            free, cap = None, 2**30
        if kv_cache_memory is None:
            budget = min(wanted, cap)
        elif isinstance(kv_cache_memory, float):
            if not 0.0 < kv_cache_memory <= 1.0:
                raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {kv_cache_memory}")
            if free is None:
                raise ValueError("kv_cache_memory as a fraction of free GPU memory needs a CUDA device; give bytes")
            budget = int(kv_cache_memory * free)
        elif isinstance(kv_cache_memory, int) and kv_cache_memory > 0:
            budget = kv_cache_memory
        else:
            raise ValueError(f"kv_cache_memory must be int bytes > 0 or a float fraction, got {kv_cache_memory!r}")
        pages = budget // page_bytes
        if pages < 1 and kv_cache_memory is None:
            raise MemoryError(f"no GPU memory left for the KV cache: {free} bytes free on {self.device}, of which "
                              f"~{self._activation_reserve()} are kept for activations; pass kv_cache_memory=<bytes> "
                              f"or free GPU memory")
        if pages < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no page of {page_bytes} bytes")
        return int(pages)

    def _activation_reserve(self) -> int:
        """Rough bytes a full prefill batch needs beside the pool (gate/up, qkv, hidden states), + 1 GiB slack."""
        cfg = self.config
        tokens = self.scheduler_tokens
        width = 3 * cfg.intermediate_size + 6 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size
        return tokens * width * torch.empty((), dtype=self.dtype).element_size() + 2**30

    # ---------------------------------------------------------------------------------------------- prompts
    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer.json in the model directory; pass token ids")
            return self.tokenizer.encode(prompt).ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size}), got {bad[:4]}")
            return list(prompt)
        raise TypeError(f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}")

    def _decode_text(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---------------------------------------------------------------------------------------------- API
    def add_request(self, prompt, params: SamplingParams) -> Sequence:
        seq = Sequence(self._encode(prompt), params, self.config.eos_token_ids, self.device)
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        """One engine step (a prefill batch or a decode step). Returns the sequences that finished."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        tables = [self.block_manager.table(s.seq_id) for s in seqs]
        if is_prefill:
            logits, greedy = self.runner.prefill(seqs, tables), None
        else:
            logits, greedy = self.runner.decode(seqs, tables)
        tokens = self.parallel.agree_tokens(sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                                                   greedy))
        return self.scheduler.postprocess(seqs, tokens)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (str or list of token ids); results in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc="generate")
        while self.scheduler.has_work():
            done = self.step()
            if bar is not None:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return [RequestOutput(s.token_ids[:s.num_prompt_tokens], s.output_token_ids, self._decode_text(s.output_token_ids),
                              s.finish_reason, s.num_preemptions) for s in seqs]

    def prompt_logits(self, token_ids) -> torch.Tensor:
        """float32 logits (len, vocab) of every position of one prompt (str or token ids), on the host."""
        ids = self._encode(token_ids)
        if not 1 <= len(ids) <= self.max_model_len:
            raise ValueError(f"prompt must have 1..max_model_len={self.max_model_len} tokens, got {len(ids)}")
        return self.runner.prompt_logits(ids).cpu()
