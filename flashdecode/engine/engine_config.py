"""``EngineConfig``: every option of an engine in one frozen dataclass, checked once.

``LLM(...)``'s keyword arguments, ``LLM(config=EngineConfig(...))``, ``flashdecode generate`` / ``serve`` and
``bench serve`` all end here: the options are named as vLLM's ``EngineArgs`` names them where vLLM has them
(model, dtype, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_dtype, enable_prefix_caching,
enable_chunked_prefill, tensor_parallel_size, seed, enforce_eager, async_scheduling); ours where vLLM's differ in
meaning: ``page_size`` (vLLM's block_size), ``kv_cache_memory`` (bytes, or a fraction of the free GPU memory left
after the weights: vLLM's kv_cache_memory_bytes / gpu_memory_utilization, which counts the weights too).

Bad values raise ValueError / TypeError naming the field when the config is made. What depends on the device or
the model (a default page size, dtype or length; whether prefix caching is safe) is resolved by the functions
below when the engine starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from flashdecode.engine.attention import BACKENDS
from flashdecode.engine.config import ModelConfig
from flashdecode.engine.kv_quant import resolve_kv_cache_dtype
from flashdecode.engine.layers.flat_gemm import ChoiceTable
from flashdecode.ops.checks import check_int

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
DEFAULT_MAX_MODEL_LEN = 8192  # cap of the default max_model_len (a model's max_position_embeddings may be 128k)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """An engine's options; None on an option = its default for the device / model, resolved when the engine starts.

    Args:
        model: HF checkpoint directory (config.json + safetensors), a hub id ("Qwen/Qwen3-8B": its snapshot in the
            local HF cache, else downloaded unless HF_HUB_OFFLINE=1), a ModelConfig (random weights), or an already
            built engine model (e.g. another LLM's ``.model``: engines then share the weights).
        dtype: "bfloat16"/"float16"/"float32" (default bf16 on CUDA, fp32 on CPU).
        device: "cuda" / "cpu" (default cuda when available).
        attn_backend: flashdecode | flashdecode-nosplit | flashinfer | sdpa | eager | torch (default flashdecode
            on CUDA, torch on the CPU). flashinfer: FlashInfer's paged decode / prefill (the flashinfer package;
            CUDA, fp16 / bf16, head_dim 64 / 128 / 256, 16-bit pages: engine/flashinfer_backend.py).
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
        prefill_autotune: let the Triton prefill kernels (flashdecode backends) time their candidate tiles on the
            first call of each (query, key) length bucket, as a direct flash_attn call does: about a second inside
            the request that meets a new bucket (a prefix-cache hit with a longer history, a longer chunk). False
            (default): the resolved first tile of each length class, never timed inside a request (vLLM's rule).
        prefill_warmup: compile the prefill kernels while the engine starts, not in the first requests (Triton and
            Gluon compile a variant on its first call: seconds each without Triton's disk cache): at each length of
            PREFILL_WARMUP_TOKENS (capped by the step budget and half the context) one prompt (the dense kernel),
            two (the ragged one) and a chunk after as many cached keys (the paged one), all on the pool's scratch
            page. "auto" (default): on for the flashdecode backends on CUDA; True / False as given.
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

    model: str | Path | ModelConfig | torch.nn.Module
    dtype: str | torch.dtype | None = None
    device: str | torch.device | None = None
    attn_backend: str | None = None
    page_size: int | None = None
    kv_cache_memory: int | float | None = None
    max_num_seqs: int = 32
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    seed: int = 0
    use_tqdm: bool = True
    flat_gemm: str | bool | ChoiceTable | None = "auto"  # None = False
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    batch_invariant: bool = False
    prefill_autotune: bool = False
    prefill_warmup: str | bool = "auto"
    kv_cache_dtype: str = "auto"
    pdl: str | bool = "auto"
    async_scheduling: str | bool = "auto"
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool = False
    chunked_prefill_single_forward: bool = False

    def __post_init__(self):
        _check_model(self.model)
        if self.dtype is not None:
            resolve_dtype(self.dtype, torch.device("cpu"))
        if self.device is not None and not isinstance(self.device, (str, torch.device)):
            raise TypeError(f"device must be a str or a torch.device, got {type(self.device).__name__}")
        if self.attn_backend is not None and self.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {list(BACKENDS)}, got {self.attn_backend!r}")
        for name in ("page_size", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, minimum=2)
        for name in ("max_num_seqs", "tensor_parallel_size", "context_parallel_size"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("seed", self.seed)
        _check_kv_cache_memory(self.kv_cache_memory)
        resolve_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("enforce_eager", "use_tqdm", "batch_invariant", "prefill_autotune", "enable_chunked_prefill",
                     "chunked_prefill_single_forward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool or None, got {self.enable_prefix_caching!r}")
        for name in ("pdl", "async_scheduling", "prefill_warmup"):
            _check_auto_or_bool(name, getattr(self, name))
        _check_flat_gemm(self.flat_gemm)
        if self.enable_chunked_prefill and self.context_parallel_size > 1:
            raise ValueError("enable_chunked_prefill=True does not support context parallelism (each rank holds "
                             "only its own pages)")
        if self.async_scheduling is True and self.tensor_parallel_size * self.context_parallel_size > 1:
            raise ValueError("async_scheduling=True needs a single-rank engine (parallel ranks agree on each "
                             "step's tokens first)")

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


def _check_model(model) -> None:
    if isinstance(model, (str, Path, ModelConfig)) or built_model(model) is not None:
        return
    raise TypeError(f"model must be a checkpoint directory, a ModelConfig or an engine model, "
                    f"got {type(model).__name__}")


def built_model(model) -> torch.nn.Module | None:
    """``model`` when it is an already built engine model (an nn.Module with a ModelConfig), else None."""
    if isinstance(model, torch.nn.Module) and isinstance(getattr(model, "config", None), ModelConfig):
        return model
    return None


def _check_kv_cache_memory(value) -> None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {value}")
        return
    raise ValueError(f"kv_cache_memory must be int bytes > 0 or a float fraction, got {value!r}")


def _check_auto_or_bool(name: str, value) -> None:
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"{name} must be 'auto' or a bool, got {value!r}")
    elif not isinstance(value, bool):
        raise TypeError(f"{name} must be 'auto' or a bool, got {type(value).__name__}")


def _check_flat_gemm(value) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"flat_gemm must be 'auto', a bool or a ChoiceTable, got {value!r}")
        return
    if not isinstance(value, ChoiceTable):
        raise TypeError(f"flat_gemm must be a bool or a ChoiceTable, got {type(value).__name__}")


def config_from_kwargs(model, config: EngineConfig | None, options: dict) -> EngineConfig:
    """The EngineConfig of ``LLM(model, **options)`` or ``LLM(config=...)`` (not both: TypeError)."""
    if config is None:
        if model is None:
            raise TypeError("LLM needs a model (or config=EngineConfig(...))")
        return EngineConfig(model, **options)
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    if model is not None or options:
        given = (["model"] if model is not None else []) + sorted(options)
        raise TypeError(f"pass either config= or the options, not both (got config= and {', '.join(given)}); "
                        f"use config.replace(...) to change some")
    return config


# ---------------------------------------------------------------------------------- resolved when the engine starts
def resolve_device(device) -> torch.device:
    """The engine's device: ``device``, or cuda when there is a GPU, else the CPU."""
    resolved = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but this machine has no CUDA GPU; leave device unset (the CPU is then "
                         f"used) or pass device='cpu'")
    return resolved


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """The weights' dtype: ``dtype`` (a name of DTYPES or the torch dtype), default bf16 on CUDA, fp32 elsewhere."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPES)} (or the torch dtype), got {dtype!r}")


def default_page_size(device: torch.device) -> int:
    """128 on CUDA (a multiple of flash_decode's 128-key block: its stage 1 reads pages through TMA as it reads a
    contiguous cache), 16 elsewhere."""
    return 128 if torch.device(device).type == "cuda" else 16


def resolve_max_model_len(max_model_len: int | None, model_config: ModelConfig) -> int:
    return max_model_len or min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def resolve_max_num_batched_tokens(config: EngineConfig, max_model_len: int) -> int:
    """Tokens per step: with chunked prefill the decodes plus the prompt chunks (default max(2048, max_num_seqs));
    without, a prefill batch's prompt tokens (default max(max_model_len, 2048): any prompt fits one step)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    if config.enable_chunked_prefill:
        return max(2048, config.max_num_seqs)
    return max(max_model_len, 2048)


def prefix_caching_unsafe(cp_size: int, model_config: ModelConfig) -> str | None:
    """Why prefix caching cannot run here (None: it can)."""
    if cp_size > 1:
        return "context parallelism (each rank holds only its own pages)"
    if model_config.rope.rope_type == "dynamic":
        return "dynamic rope scaling (a token's K depends on the length of the prompt it was computed in)"
    return None


def resolve_prefix_caching(enable: bool | None, cp_size: int, model_config: ModelConfig,
                           quantized_pages: bool) -> bool:
    """None (default): on where it is safe and exact - off under context parallelism and dynamic rope (it cannot run
    there: ValueError when asked for) and for 8-bit pages (a cached prefix is then read 8-bit where a fresh prefill
    attends its own unquantised K/V, so results would depend on what ran before; True turns it on)."""
    unsafe = prefix_caching_unsafe(cp_size, model_config)
    if enable and unsafe:
        raise ValueError(f"enable_prefix_caching=True does not support {unsafe}")
    if enable is None:
        return unsafe is None and not quantized_pages
    return enable


PREFILL_WARMUP_TOKENS = (256, 2048)  # prompt lengths of the start-up prefills: short and long kernel variants


def resolve_prefill_warmup(value: str | bool, device: torch.device, backend_name: str) -> bool:
    """"auto": on for a flashdecode backend on CUDA (whose kernels compile on first use); a bool as given."""
    if value == "auto":
        return device.type == "cuda" and backend_name.startswith("flashdecode")
    return value


def prefill_warmup_lengths(max_num_batched_tokens: int, max_model_len: int) -> tuple[int, ...]:
    """PREFILL_WARMUP_TOKENS within one step's budget and half the context (the paged warm-up's chunk follows as
    many keys), at least 2 tokens (the ragged warm-up's two prompts)."""
    cap = min(max_num_batched_tokens, max_model_len // 2)
    return tuple(sorted({min(n, cap) for n in PREFILL_WARMUP_TOKENS if min(n, cap) >= 2}))


def resolve_async_scheduling(value: str | bool, device: torch.device, world_size: int) -> bool:
    """"auto": on for a single-rank engine on CUDA; a bool as given (checked by EngineConfig)."""
    if value == "auto":
        return device.type == "cuda" and world_size == 1
    return value
