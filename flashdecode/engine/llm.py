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
import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flashdecode.distributed.groups import ParallelConfig, ParallelState
from flashdecode.engine.attention import make_backend
from flashdecode.engine.config import ModelConfig, load_config
from flashdecode.engine.kv_cache import bytes_per_page, make_block_manager
from flashdecode.engine.kv_quant import QUANT_BACKENDS, resolve_kv_cache_dtype, scale_bytes_per_page
from flashdecode.engine.layers import pdl as pdl_setting
from flashdecode.engine.loader import load_checkpoint, resolve_model_dir
from flashdecode.engine.models import model_class
from flashdecode.engine.runner import ModelRunner, PendingTokens
from flashdecode.engine.sampling import SamplingParams, draw_tokens, prompt_logprobs, sample
from flashdecode.engine.scheduler import RequestError, Scheduler, Sequence
from flashdecode.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from flashdecode.ops.checks import kernels_run_on

logger = logging.getLogger(__name__)

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
class CompletionOutput:
    """One completion of a request (vLLM's fields). ``token_ids`` are the generated ids (a stop token, EOS or a
    stop_token_id, included when it ended there); ``text`` their detokenised text, cut before a stop string;
    ``logprobs`` one dict token id -> log-probability per generated token when asked for; ``stop_reason`` the stop
    string or stop token id that ended it (None for EOS / length)."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclasses.dataclass
class RequestOutput:
    """One prompt's result: its n completions in ``outputs`` (``token_ids`` / ``text`` / ``finish_reason`` read
    the first one)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_preemptions: int = 0
    finished: bool = True

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclasses.dataclass
class _InFlightDecode:
    """A decode step launched under async scheduling whose tokens the host has not read: its rows' sequences
    (in row order) and the copy of its greedy tokens to the host."""
    seqs: list[Sequence]
    tokens: PendingTokens


class LLM:
    """An engine instance: model weights, page pool, scheduler and runner.

    Args:
        model: HF checkpoint directory (config.json + safetensors), a hub id ("Qwen/Qwen3-8B": its snapshot in the
            local HF cache, else downloaded unless HF_HUB_OFFLINE=1), a ModelConfig (random weights), or an already
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
        max_num_batched_tokens: tokens computed per step. Without chunked prefill: prompt tokens per prefill step
            (a longer single prompt still runs alone; default max(max_model_len, 2048)). With it: the running
            decodes plus the prompt chunks of a step (default max(2048, max_num_seqs); >= max_num_seqs).
        enforce_eager: no CUDA graphs.
        seed: seed of the random weights when ``model`` is a ModelConfig.
        use_tqdm: a progress bar while the weights load.
        flat_gemm: "auto" (default) = on CUDA with max_num_seqs >= 2, the flat GEMM for the decode linears of
            small batches where it beats cuBLAS (models whose weights stream from HBM: fg.worth_measuring), from a
            per-(M, N, K) table measured once per GPU model and then read from the cache
            (flashdecode.engine.layers.flat_gemm.cached_table_for_model; a first start on a new GPU measures for
            some seconds); True = measure now (CUDA only); False = cuBLAS everywhere; or a ready ChoiceTable.
        tensor_parallel_size, context_parallel_size: ranks that share the model's heads / MLP columns, and ranks
            that share every sequence's KV pages (docs/distributed.md). Above 1, every rank runs this same program
            (torchrun, or flashdecode.distributed.launch.spawn) and gets the same outputs.
        batch_invariant: decode attention whose result for a sequence does not depend on the batch it runs in
            or the other sequences' lengths (flash_decode(batch_invariant=True); flashdecode backends only).
            The linear layers stay the library's (cuBLAS may pick other kernels per batch size), so bitwise
            equal logits across batches also need batch-invariant GEMMs; attention is what this flag fixes.
        kv_cache_dtype: "auto" (the model's dtype), "fp8" (float8_e4m3fn) or "int8": 8-bit K/V pages with a float32
            scale per token and kv head (~1.94x the tokens in the same memory at head dim 128; flashdecode
            backends, or torch on the CPU; engine/kv_quant.py).
        pdl: programmatic dependent launch of the decode step's Triton kernels (fused norm / rope / silu*mul, the
            GEMV and the flat GEMM): each may start while the kernel before it finishes, prefetching its weights
            (flashdecode.engine.layers.pdl). "auto" (default) = pdl.AUTO_ON on a GPU of compute capability >= 9.0
            (off: measured neutral end to end on the H100, docs/decisions.md), True = on (ValueError elsewhere:
            CPU, interpreter, older GPUs), False = off. Decode attention keeps its own PDL policy (DecodePlan: on
            for Hopper) either way.
        async_scheduling: "auto" (default) = on for a single-GPU engine on CUDA, True = on (any device), False =
            off. On, a decode step whose tokens the device draws alone (greedy or seeded / unseeded sampling; no
            penalties, logprobs or pending min_tokens) is launched before the host has read the tokens of the
            step in flight, so the host's bookkeeping overlaps the GPU's work (vLLM's async scheduling). Same
            tokens as off; a sequence that stops costs one discarded row, and a step that cannot run ahead (new
            requests waiting, a length limit, a full page pool, those sampling options) waits as before.
        enable_prefix_caching: vLLM's automatic prefix caching: full KV pages are kept, keyed by their tokens and
            everything before them, and a request starting with cached pages shares them and prefills only the
            rest (engine/kv_cache.py). None (default) = on, except for 8-bit pages (off: a cached prefix is read
            8-bit, a fresh one is not) and where it cannot run (context parallelism, dynamic rope: ValueError
            when True). ``stats`` counts the prompt tokens looked up and found cached.
        enable_chunked_prefill: each step runs every running decode (the CUDA-graph step) and then, in a second
            forward, up to max_num_batched_tokens minus the decodes of prompt tokens (chunks of long prompts,
            attending their earlier chunks in the pages): a long prompt no longer stalls the running streams.
            Same greedy tokens as off. Default off; not with context parallelism.
        chunked_prefill_single_forward: with chunked prefill, a step with decodes and chunks runs them as one
            eager forward (each decode row a one-token chunk attending its pages: the weights read once) instead
            of the decode CUDA graph and a second forward.
    """

    def _set_batch_invariant(self, batch_invariant) -> None:
        """batch_invariant=True: decode attention through DecodePlans made with batch_invariant=True
        (splits at fixed key offsets with fixed tiles and an in-order merge; unsplit on 'flashdecode-nosplit'),
        so a sequence's attention does not depend on its batch; only the flashdecode backends have it."""
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"batch_invariant must be a bool, got {batch_invariant!r}")
        if batch_invariant and not hasattr(self.backend, "batch_invariant"):
            raise ValueError(f"batch_invariant=True needs attn_backend 'flashdecode' or 'flashdecode-nosplit', "
                             f"got {self.backend.name!r}")
        if batch_invariant:
            self.backend.batch_invariant = True

    def __init__(self, model, *, dtype=None, device=None, attn_backend: str | None = None, page_size: int | None = None,
                 kv_cache_memory: int | float | None = None, max_num_seqs: int = 32,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 enforce_eager: bool = False, seed: int = 0, use_tqdm: bool = True, flat_gemm="auto",
                 tensor_parallel_size: int = 1, context_parallel_size: int = 1, batch_invariant: bool = False,
                 kv_cache_dtype: str = "auto", pdl="auto", async_scheduling="auto",
                 enable_prefix_caching: bool | None = None, enable_chunked_prefill: bool = False,
                 chunked_prefill_single_forward: bool = False):
        prebuilt = model if isinstance(model, torch.nn.Module) and isinstance(getattr(model, "config", None),
                                                                             ModelConfig) else None
        if prebuilt is not None:  # share one set of weights between engines (benchmarks)
            weight = prebuilt.lm_head_weight
            device, dtype = weight.device, weight.dtype
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but this machine has no CUDA GPU; leave device unset (the CPU "
                             f"is then used) or pass device='cpu'")
        t_start = time.perf_counter()
        self.dtype = resolve_dtype(dtype, self.device)
        self.pdl = pdl_setting.resolve_pdl(pdl, self.device)
        self.parallel = ParallelState.create(ParallelConfig(tensor_parallel_size, context_parallel_size), self.device)
        if prebuilt is not None:
            self.config, self.model_dir = prebuilt.config, None
        elif isinstance(model, ModelConfig):
            self.config, self.model_dir = model, None
        elif isinstance(model, (str, Path)):
            self.model_dir = resolve_model_dir(model)
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
        self.backend = make_backend(attn_backend, self.device, cfg.base_window_left)
        if self.backend.name.startswith("flashdecode") and not kernels_run_on(self.device):
            raise ValueError(f"attn_backend={self.backend.name!r} runs Triton kernels, which need a CUDA device "
                             f"(or TRITON_INTERPRET=1); on {self.device} leave attn_backend unset (torch) or use "
                             f"sdpa / eager")
        self._set_batch_invariant(batch_invariant)

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
                load_checkpoint(self.model, self.model_dir, use_tqdm=use_tqdm)
        self._install_flat_gemm(flat_gemm, max_num_seqs)
        pdl_setting.install(self.model, self.pdl)  # before the runner captures its graphs
        self.tokenizer = load_tokenizer(self.model_dir)
        # EOS: config.json / generation_config.json and the tokenizer's (vLLM reads both)
        self.eos_token_ids = tuple(dict.fromkeys(cfg.eos_token_ids + (self.tokenizer.eos_token_ids
                                                                      if self.tokenizer is not None else ())))

        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype)
        if self.kv_cache_dtype is not None and self.backend.name not in QUANT_BACKENDS:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs attn_backend in {QUANT_BACKENDS}, got "
                             f"{self.backend.name!r}")
        if self.kv_cache_dtype is not None and self.parallel.cp_size > 1:
            raise ValueError("kv_cache_dtype other than 'auto' does not support context parallelism yet")
        page_bytes = bytes_per_page(cfg.num_hidden_layers, page_size, self.model.cache_kv_heads, cfg.head_dim,
                                    self.kv_cache_dtype or self.dtype)
        if self.kv_cache_dtype is not None:
            page_bytes += scale_bytes_per_page(cfg.num_hidden_layers, page_size, self.model.cache_kv_heads)
        self.enable_prefix_caching = self._resolve_prefix_caching(enable_prefix_caching)
        self.enable_chunked_prefill = self._resolve_chunked_prefill(enable_chunked_prefill)
        if not isinstance(chunked_prefill_single_forward, bool):
            raise TypeError(f"chunked_prefill_single_forward must be a bool, got {chunked_prefill_single_forward!r}")
        self.chunked_prefill_single_forward = chunked_prefill_single_forward
        default_tokens = max(2048, max_num_seqs) if self.enable_chunked_prefill else max(self.max_model_len, 2048)
        self.scheduler_tokens = max_num_batched_tokens or default_tokens
        num_pages = self.parallel.min_over_world(self._num_pages(kv_cache_memory, page_bytes, page_size,
                                                                  max_num_seqs))
        self.block_manager = make_block_manager(num_pages, page_size, self.parallel.cp_size, self.parallel.cp_rank,
                                                self.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, self.scheduler_tokens, self.max_model_len,
                                   chunked_prefill=self.enable_chunked_prefill)
        use_graphs = self.device.type == "cuda" and not enforce_eager and self.backend.supports_cuda_graphs
        self.runner = ModelRunner(self.model, self.backend, num_pages=num_pages, page_size=page_size,
                                  max_model_len=self.max_model_len, max_num_seqs=max_num_seqs, device=self.device,
                                  dtype=self.dtype, use_cuda_graphs=use_graphs, parallel=self.parallel,
                                  kv_cache_dtype=self.kv_cache_dtype)
        self.async_scheduling = self._resolve_async_scheduling(async_scheduling)
        self._in_flight: _InFlightDecode | None = None  # the decode step launched and not yet read (async)
        logger.info("engine ready in %.1f s: %s, %d layers, %s on %s, attention %s, %d KV pages of %d tokens, "
                    "CUDA graphs %s, PDL %s", time.perf_counter() - t_start, cfg.model_type, cfg.num_hidden_layers,
                    str(self.dtype).replace("torch.", ""), self.device, self.backend.name, num_pages, page_size,
                    "on" if self.runner.graphs else "off", "on" if self.pdl else "off")

    def _prefix_caching_unsafe(self) -> str | None:
        """Why prefix caching cannot run here (None: it can)."""
        if self.parallel.cp_size > 1:
            return "context parallelism (each rank holds only its own pages)"
        if self.config.rope.rope_type == "dynamic":
            return "dynamic rope scaling (a token's K depends on the length of the prompt it was computed in)"
        return None

    def _resolve_prefix_caching(self, enable) -> bool:
        """None (default): on where it is safe and exact - off under context parallelism and dynamic rope (it
        cannot run there: ValueError when asked for) and for 8-bit pages (a cached prefix is then read 8-bit where
        a fresh prefill attends its own unquantised K/V, so results would depend on what ran before; True turns
        it on)."""
        if enable is not None and not isinstance(enable, bool):
            raise TypeError(f"enable_prefix_caching must be a bool or None, got {enable!r}")
        unsafe = self._prefix_caching_unsafe()
        if enable and unsafe:
            raise ValueError(f"enable_prefix_caching=True does not support {unsafe}")
        if enable is None:
            return unsafe is None and self.kv_cache_dtype is None
        return enable

    def _resolve_chunked_prefill(self, enable) -> bool:
        if not isinstance(enable, bool):
            raise TypeError(f"enable_chunked_prefill must be a bool, got {enable!r}")
        if enable and self.parallel.cp_size > 1:
            raise ValueError("enable_chunked_prefill=True does not support context parallelism (each rank holds "
                             "only its own pages)")
        return enable

    @property
    def stats(self):
        """The engine's counters (scheduler.EngineStats: prefix_cache_queries / prefix_cache_hits in prompt
        tokens, ...), monotonic."""
        return self.scheduler.stats

    def reset_prefix_cache(self) -> int:
        """Forget every cached page no sequence uses (benchmarks: a cold cache). Returns how many pages."""
        return self.block_manager.reset_prefix_cache()

    def _resolve_async_scheduling(self, async_scheduling) -> bool:
        if isinstance(async_scheduling, str):
            if async_scheduling != "auto":
                raise ValueError(f"async_scheduling must be 'auto' or a bool, got {async_scheduling!r}")
            return self.device.type == "cuda" and self.parallel.world_size == 1
        if not isinstance(async_scheduling, bool):
            raise TypeError(f"async_scheduling must be 'auto' or a bool, got {type(async_scheduling).__name__}")
        if async_scheduling and self.parallel.world_size > 1:
            raise ValueError("async_scheduling=True needs a single-rank engine (parallel ranks agree on each "
                             "step's tokens first)")
        return async_scheduling

    def _install_flat_gemm(self, flat_gemm, max_num_seqs: int) -> None:
        from flashdecode.engine.layers import flat_gemm as fg

        if flat_gemm is False or flat_gemm is None:
            fg.install(self.model, None)  # a shared model may hold another engine's table (bench e2e's columns)
            return
        if isinstance(flat_gemm, str):
            if flat_gemm != "auto":
                raise ValueError(f"flat_gemm must be 'auto', a bool or a ChoiceTable, got {flat_gemm!r}")
            if self.device.type != "cuda" or max_num_seqs < 2 or not fg.worth_measuring(self.model):
                return
            t0 = time.perf_counter()
            flat_gemm = fg.cached_table_for_model(self.model, self.dtype, self.device)
            logger.info("flat GEMM table ready in %.1f s (measured once per GPU model, then read from %s; "
                        "flat_gemm=False skips it)", time.perf_counter() - t0, fg.cache_dir())
        if flat_gemm is True:
            if self.device.type != "cuda":
                raise ValueError("flat_gemm=True measures kernels on the GPU; it needs a CUDA device")
            t0 = time.perf_counter()
            flat_gemm = fg.measure_for_model(self.model, max_num_seqs, self.dtype, self.device)
            wins = [r for r in flat_gemm.rows() if r["kernel"] == "flat"]
            logger.info("flat GEMM measured in %.1f s: chosen for %d of %d (M, N, K) shapes", time.perf_counter() - t0,
                        len(wins), len(flat_gemm.rows()))
        if not isinstance(flat_gemm, fg.ChoiceTable):
            raise TypeError(f"flat_gemm must be a bool or a ChoiceTable, got {type(flat_gemm).__name__}")
        fg.install(self.model, flat_gemm)

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
    def encode(self, prompt, add_special_tokens: bool = True) -> list[int]:
        """A prompt (str, or a list of int token ids) as checked token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer (tokenizer.json) in the model directory; "
                                 "pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size}), got {bad[:4]}")
            return list(prompt)
        raise TypeError(f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}")

    _encode = encode

    def _decode_text(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
        """Token ids of a conversation (list of {"role", "content"} dicts) through the checkpoint's chat template.
        The template writes any BOS itself, so the text is encoded without adding special tokens."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template in the model directory")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, chat_template)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """RequestError (a ValueError naming the field) if a request could never run: the scheduler's admission
        rules (prompt + max_tokens within max_model_len, pages within the pool), without queueing it."""
        self.scheduler.check(len(prompt_token_ids), params.max_tokens)
        bad = [t for t in params.stop_token_ids if t >= self.config.vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids must be < vocab_size={self.config.vocab_size}, got {bad[:4]}",
                               "stop_token_ids")

    # ---------------------------------------------------------------------------------------------- API
    def add_request(self, prompt, params: SamplingParams | None = None) -> list[Sequence]:
        """Queue one prompt; returns its ``params.n`` sequences (one per completion)."""
        return self._queue(*self._checked(prompt, params))

    def _checked(self, prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        """(token ids, params) of a request that can run; ValueError / TypeError otherwise. Runs nothing."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        self.check_request(ids, params)
        return ids, params

    def _queue(self, ids: list[int], params: SamplingParams) -> list[Sequence]:
        """Queue a checked request (its prompt logprobs computed first, if asked for)."""
        prompt_lp = None
        if params.prompt_logprobs is not None:
            prompt_lp = prompt_logprobs(self.runner.prompt_logits(ids), ids, params.prompt_logprobs)
        seqs = []
        for i in range(params.n):
            seq = Sequence(ids, params if params.n == 1 else params.for_choice(i), self.eos_token_ids, self.device,
                           index=i)
            seq.prompt_logprobs = prompt_lp
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            self.scheduler.add(seq)
            seqs.append(seq)
        return seqs

    def abort(self, seqs: list[Sequence]) -> None:
        """Stop these sequences now (finish reason "abort"); their pages return to the pool at once."""
        for seq in seqs:
            self.scheduler.finish(seq, "abort")

    def step(self) -> list[Sequence]:
        """One engine step (a prefill batch or a decode step). Returns the sequences that finished."""
        return self.step_sequences()[1]

    def step_sequences(self) -> tuple[list[Sequence], list[Sequence]]:
        """One engine step. Returns (the sequences that got a token, those of them that finished).

        With async scheduling the step whose tokens this returns may have been launched by the call before, and
        the step after it is launched here before its tokens are read (see _read_in_flight)."""
        if self._in_flight is not None:
            if any(not s.finished for s in self._in_flight.seqs):
                return self._read_in_flight()
            self._in_flight.tokens.wait()  # every row was aborted meanwhile: nothing to report
            self._in_flight = None
        step = self.scheduler.schedule_step()
        if not step:
            return [], []
        if not step.prefill and self._runs_ahead(step.decode, ahead=0):
            self._in_flight = self._launch_decode(step.decode, self._tables(step.decode), ahead=False)
            return self._read_in_flight()
        seqs, tokens, rows = [], [], step.prefill
        if step.decode and step.prefill and self.chunked_prefill_single_forward:
            for s in step.decode:  # one-token chunks after their pages, in the chunks' forward
                s.num_computed_tokens, s.num_scheduled_tokens = len(s) - 1, 1
            rows = step.decode + step.prefill
        elif step.decode:  # a CUDA-graph decode step, then (chunked prefill) the prompts' chunks in a second forward
            logits, greedy = self.runner.decode(step.decode, self._tables(step.decode))
            seqs, tokens = list(step.decode), self._sample(logits, step.decode, greedy)
        if rows:
            logits = self.runner.prefill(rows, self._tables(rows))
            last = [s.num_computed_tokens + s.num_scheduled_tokens == len(s) for s in rows]
            self.scheduler.advance([s for s, done in zip(rows, last) if not done])  # chunks mid-prompt
            done = [s for s, d in zip(rows, last) if d]
            if done:
                rows = [i for i, d in enumerate(last) if d]
                seqs += done
                tokens += self._sample(logits[rows] if len(rows) < len(last) else logits, done, None)
        # parallel ranks continue with rank 0's draws (its logprobs above are of its own draw)
        return seqs, self._finish_step(seqs, self.parallel.agree_tokens(tokens))

    def _tables(self, seqs: list[Sequence]) -> list[list[int]]:
        return [self.block_manager.table(s.seq_id) for s in seqs]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None) -> list[int]:
        """The next token of each row (and its logprobs, when asked for)."""
        result = sample(logits, seqs, greedy)
        for seq, lp, tok in zip(seqs, result.logprobs, result.tokens):
            if lp is not None:
                seq.logprobs.append(lp)
                seq.cumulative_logprob += lp[tok]
        return list(result.tokens)

    def _finish_step(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append the step's tokens; the sequences that finished (stop token, length, stop string)."""
        finished = self.scheduler.postprocess(seqs, tokens)
        for seq in seqs:
            if seq.params.stop and seq.detokenizer is not None and self._check_stop_strings(seq):
                finished.append(seq)
        return finished

    # ------------------------------------------------------------------------------------- async scheduling
    def _runs_ahead(self, seqs: list[Sequence], ahead: int) -> bool:
        """Whether a decode step of ``seqs`` may be launched without reading the device's tokens: ``ahead`` = 0
        for a step whose inputs the host has, 1 for the step after the one in flight (whose token is still on
        the device). Rows whose token the device draws alone (greedy, or sampled from the row's generator; no
        penalties, logprobs or pending min_tokens mask, which need the host's token lists), no request waiting to
        join nor prompt chunk pending (they would be prefilled first), and for ahead = 1 no row ending by length at
        the step in flight (its next row would need a position past its limit)."""
        if not self.async_scheduling or self.scheduler.has_pending_prefill():
            return False
        for s in seqs:
            p, generated = s.params, s.num_generated + ahead
            if p.has_penalties or p.logprobs is not None or (generated < p.min_tokens and s.min_tokens_stop_ids):
                return False
            if ahead and (generated >= p.max_tokens or len(s) + ahead >= self.max_model_len):
                return False
        return True

    def _launch_decode(self, seqs: list[Sequence], tables: list[list[int]], ahead: bool) -> "_InFlightDecode":
        """Launch a decode step and its tokens' way to the host, without waiting for either. Sampled rows draw on
        the device, before the next step's graph overwrites the logits; their tokens replace the argmax in the
        runner's token buffer, which the step after copies its input tokens from."""
        logits, greedy = self.runner.decode(seqs, tables, ahead=ahead)
        tokens = draw_tokens(logits, seqs, greedy)
        if tokens.data_ptr() != greedy.data_ptr():  # some row was sampled
            greedy.copy_(tokens)
        return _InFlightDecode(seqs, self.runner.greedy_tokens_to_host(len(seqs)))

    def _read_in_flight(self) -> tuple[list[Sequence], list[Sequence]]:
        """Launch the next decode step of the in-flight step's sequences ahead of its tokens (same rows, same
        order: each row's input token is copied on the device) where every row is still running and may run
        ahead and pages allow, then read the in-flight step's tokens and apply them. Rows of sequences that
        finished meanwhile (aborted; or, for a step launched ahead, stopped at the step before) are dropped."""
        flight, nxt = self._in_flight, None
        seqs = flight.seqs
        blocks = self.block_manager
        if all(not s.finished for s in seqs) and self._runs_ahead(seqs, ahead=1) and sum(
                blocks.pages_missing(s.seq_id, len(s) + 1) for s in seqs) <= blocks.num_free:
            tables = [blocks.ensure(s.seq_id, len(s) + 1) for s in seqs]
            nxt = self._launch_decode(seqs, tables, ahead=True)
        tokens = flight.tokens.wait()
        live = [i for i, s in enumerate(seqs) if not s.finished]
        stepped = [seqs[i] for i in live]
        finished = self._finish_step(stepped, [tokens[i] for i in live])
        self._in_flight = nxt if nxt is not None and any(not s.finished for s in seqs) else None
        if nxt is not None and self._in_flight is None:
            nxt.tokens.wait()  # every row stopped: the step ahead is discarded (its pinned slot comes free)
        return stepped, finished

    def update_text(self, seq: Sequence) -> str:
        """Bring ``seq.text`` up to its tokens (detokenisation is lazy: only sequences with stop strings need it
        every step; the server asks every step for streaming, ``generate`` once at the end). Returns the new text."""
        if seq.detokenizer is None or seq.text_final:
            return ""
        pending = seq.num_generated - seq.num_detokenized
        delta = seq.detokenizer.step(seq.token_ids[len(seq.token_ids) - pending:]) if pending else ""
        seq.num_detokenized = seq.num_generated
        if seq.finished:
            delta += seq.detokenizer.flush()
            seq.text_final = True
        seq.text += delta
        return delta

    def _completion_output(self, seq: Sequence) -> CompletionOutput:
        self.update_text(seq)
        return CompletionOutput(seq.index, seq.text if seq.detokenizer is not None else None, seq.output_token_ids,
                                seq.cumulative_logprob, seq.logprobs, seq.finish_reason, seq.stop_reason)

    def _check_stop_strings(self, seq: Sequence) -> bool:
        """Extend ``seq.text`` by its newest tokens; finish it at a stop string. True if that finished it."""
        delta = self.update_text(seq)
        stops = seq.params.stop
        if not delta or seq.num_generated < seq.params.min_tokens:
            return False
        longest = max(len(s) for s in stops)
        start = max(0, len(seq.text) - len(delta) - longest + 1)  # a match must end in the new text
        hits = [(pos, s) for s in stops if (pos := seq.text.find(s, start)) >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        seq.text = seq.text[:pos + (len(stop) if seq.params.include_stop_str_in_output else 0)]
        seq.text_final = True  # pending characters after the stop string are never added
        if seq.finished:  # it also hit a stop token or the length in this step: the stop string wins
            seq.finish_reason, seq.stop_reason = "stop", stop
            return False
        self.scheduler.finish(seq, "stop", stop)
        return True

    def _run(self, seqs: list[Sequence], use_tqdm: bool, desc: str) -> None:
        with tqdm(total=len(seqs), desc=desc, unit="seq", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while self.scheduler.has_work():
                bar.update(len(self.step()))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (str or list of token ids); results in prompt order. A progress bar shows
        finished sequences (``use_tqdm=False`` hides it). ValueError, before anything runs, if a prompt with its
        max_tokens does not fit max_model_len (never cut short silently) or the page pool."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        return self._generate(prompts, params, use_tqdm, "generate")

    def _generate(self, prompts, params: list[SamplingParams], use_tqdm: bool, desc: str) -> list[RequestOutput]:
        # every request is checked before any runs (prompt logprobs run a forward): a bad one changes nothing
        checked = [self._checked(p, sp) for p, sp in zip(prompts, params)]
        requests = []
        try:
            for p, request in zip(prompts, checked):
                requests.append((p, self._queue(*request)))
        except Exception:
            self.abort([s for _, seqs in requests for s in seqs])
            raise
        self._run([s for _, seqs in requests for s in seqs], use_tqdm, desc)
        return [RequestOutput(p if isinstance(p, str) else None, seqs[0].token_ids[:seqs[0].num_prompt_tokens],
                              [self._completion_output(s) for s in seqs], seqs[0].prompt_logprobs,
                              sum(s.num_preemptions for s in seqs)) for p, seqs in requests]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of them, through
        the checkpoint's chat template with the generation prompt appended."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(c, add_generation_prompt, chat_template) for c in conversations]
        params = sampling_params if sampling_params is not None else SamplingParams()
        return self._generate(prompts, [params] * len(prompts), use_tqdm, "chat")

    def prompt_logits(self, token_ids) -> torch.Tensor:
        """float32 logits (len, vocab) of every position of one prompt (str or token ids), on the host."""
        ids = self.encode(token_ids)
        if not 1 <= len(ids) <= self.max_model_len:
            raise ValueError(f"prompt must have 1..max_model_len={self.max_model_len} tokens, got {len(ids)}")
        return self.runner.prompt_logits(ids).cpu()
