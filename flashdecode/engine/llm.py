"""The user-facing API, in vLLM's shape:

    from flashdecode.engine import LLM, SamplingParams
    llm = LLM("path/to/hf_checkpoint", dtype="bfloat16", attn_backend="flashdecode")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_new_tokens=32))
    outs[0].token_ids, outs[0].text

``model`` may also be a ModelConfig (e.g. ``named_config("llama3-8b")``): the model then gets random weights on the
device (benchmarks; no checkpoint can be downloaded here). The options may also come as one
``LLM(config=EngineConfig(...))`` (engine_config.py). ``LLM`` is a facade: the options are checked and resolved in
engine_config.py, the model is built in models/ and loaded by loader.py, the page pool is sized in kv_cache.py, the
steps run in engine_core.py (scheduler.py, runner.py, sampling.py) and the results are made in outputs.py.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm.auto import tqdm

from flashdecode.distributed.groups import ParallelConfig, ParallelState
from flashdecode.engine import engine_config as ec
from flashdecode.engine.backends import make_backend
from flashdecode.engine.config import ModelConfig, load_config
from flashdecode.engine.engine_config import EngineConfig, built_model, config_from_kwargs
from flashdecode.engine.engine_core import EngineCore
from flashdecode.engine.kv_cache import activation_reserve, engine_page_bytes, make_block_manager, pool_pages
from flashdecode.engine.kv_quant import QUANT_BACKENDS, resolve_kv_cache_dtype
from flashdecode.engine.layers import flat_gemm as fg
from flashdecode.engine.layers import pdl as pdl_setting
from flashdecode.engine.loader import resolve_model_dir
from flashdecode.engine.models import build_model, check_shared_model
from flashdecode.engine.outputs import CompletionOutput, RequestOutput, request_output, update_text
from flashdecode.engine.runner import ModelRunner
from flashdecode.engine.sampling import SamplingParams, prompt_logprobs
from flashdecode.engine.scheduler import RequestError, Scheduler, Sequence
from flashdecode.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from flashdecode.ops.checks import kernels_run_on

logger = logging.getLogger(__name__)

__all__ = ["LLM", "EngineConfig", "RequestOutput", "CompletionOutput"]


class LLM:
    """An engine instance: model weights, page pool, scheduler and runner.

    ``LLM(model, **options)`` or ``LLM(config=EngineConfig(model, **options))``: the options and what each does are
    EngineConfig's (engine_config.py); ``engine_config`` holds the one this engine runs with.
    """

    def __init__(self, model=None, *, config: EngineConfig | None = None, **options):
        t_start = time.perf_counter()
        cfg = config_from_kwargs(model, config, options)
        prebuilt = built_model(cfg.model)
        if prebuilt is not None:  # share one set of weights between engines (benchmarks)
            weight = prebuilt.lm_head_weight
            cfg = cfg.replace(device=weight.device, dtype=weight.dtype)
        self.engine_config = cfg
        self.device = ec.resolve_device(cfg.device)
        self.dtype = ec.resolve_dtype(cfg.dtype, self.device)
        self.pdl = pdl_setting.resolve_pdl(cfg.pdl, self.device)
        self.parallel = ParallelState.create(ParallelConfig(cfg.tensor_parallel_size, cfg.context_parallel_size),
                                             self.device)
        self.config, self.model_dir = self._model_config(cfg.model, prebuilt)
        self.max_model_len = ec.resolve_max_model_len(cfg.max_model_len, self.config)
        self.backend = self._attention_backend(cfg)
        self.model = self._model(cfg, prebuilt)
        self.tokenizer = load_tokenizer(self.model_dir)
        # EOS: config.json / generation_config.json and the tokenizer's (vLLM reads both)
        self.eos_token_ids = tuple(dict.fromkeys(self.config.eos_token_ids + (
            self.tokenizer.eos_token_ids if self.tokenizer is not None else ())))
        self.kv_cache_dtype = self._kv_cache_dtype(cfg)
        self.enable_prefix_caching = ec.resolve_prefix_caching(cfg.enable_prefix_caching, self.parallel.cp_size,
                                                               self.config, self.kv_cache_dtype is not None)
        self.enable_chunked_prefill = cfg.enable_chunked_prefill
        self.chunked_prefill_single_forward = cfg.chunked_prefill_single_forward
        self.scheduler_tokens = ec.resolve_max_num_batched_tokens(cfg, self.max_model_len)
        page_size = cfg.page_size or ec.default_page_size(self.device)
        num_pages = self.parallel.min_over_world(self._num_pages(cfg, page_size))
        self.block_manager = make_block_manager(num_pages, page_size, self.parallel.cp_size, self.parallel.cp_rank,
                                                self.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, self.scheduler_tokens, self.max_model_len,
                                   chunked_prefill=self.enable_chunked_prefill)
        use_graphs = self.device.type == "cuda" and not cfg.enforce_eager and self.backend.supports_cuda_graphs
        self.runner = ModelRunner(self.model, self.backend, num_pages=num_pages, page_size=page_size,
                                  max_model_len=self.max_model_len, max_num_seqs=cfg.max_num_seqs, device=self.device,
                                  dtype=self.dtype, use_cuda_graphs=use_graphs, parallel=self.parallel,
                                  kv_cache_dtype=self.kv_cache_dtype)
        if ec.resolve_prefill_warmup(cfg.prefill_warmup, self.device, self.backend.name):
            self.runner.warm_up_prefill(ec.prefill_warmup_lengths(self.scheduler_tokens, self.max_model_len))
        self.core = EngineCore(self.scheduler, self.block_manager, self.runner, self.parallel, self.max_model_len,
                               async_scheduling=ec.resolve_async_scheduling(cfg.async_scheduling, self.device,
                                                                            self.parallel.world_size),
                               single_forward=cfg.chunked_prefill_single_forward)
        logger.info("engine ready in %.1f s: %s, %d layers, %s on %s, attention %s, %d KV pages of %d tokens, "
                    "CUDA graphs %s, PDL %s", time.perf_counter() - t_start, self.config.model_type,
                    self.config.num_hidden_layers, str(self.dtype).replace("torch.", ""), self.device,
                    self.backend.name, num_pages, page_size, "on" if self.runner.graphs else "off",
                    "on" if self.pdl else "off")

    # ---------------------------------------------------------------------------------------------- start-up
    @staticmethod
    def _model_config(model, prebuilt) -> tuple[ModelConfig, object]:
        """(the model's ModelConfig, its checkpoint directory or None for random / shared weights)."""
        if prebuilt is not None:
            return prebuilt.config, None
        if isinstance(model, ModelConfig):
            return model, None
        model_dir = resolve_model_dir(model)
        return load_config(model_dir), model_dir

    def _attention_backend(self, cfg: EngineConfig):
        """The attention backend by name (None: the device's default), with its batch_invariant plans when asked
        (the flashdecode backends only: ValueError otherwise)."""
        backend = make_backend(cfg.attn_backend, self.device, self.config.base_window_left)
        backend.check_engine(self.device, self.dtype, self.config)
        if backend.name.startswith("flashdecode") and not kernels_run_on(self.device):
            raise ValueError(f"attn_backend={backend.name!r} runs Triton kernels, which need a CUDA device "
                             f"(or TRITON_INTERPRET=1); on {self.device} leave attn_backend unset (torch) or use "
                             f"sdpa / eager")
        if cfg.batch_invariant:
            if not hasattr(backend, "batch_invariant"):
                raise ValueError(f"batch_invariant=True needs attn_backend 'flashdecode' or 'flashdecode-nosplit', "
                                 f"got {backend.name!r}")
            backend.batch_invariant = True
        if hasattr(backend, "prefill_autotune"):
            backend.prefill_autotune = cfg.prefill_autotune
        return backend

    def _model(self, cfg: EngineConfig, prebuilt) -> torch.nn.Module:
        """The engine model (built and loaded, or the shared one) with this engine's flat GEMM and PDL choices
        installed (before the runner captures its graphs)."""
        if prebuilt is not None:
            check_shared_model(prebuilt, self.max_model_len)
            model = prebuilt
        else:
            model = build_model(self.config, self.model_dir, self.dtype, self.device, max_model_len=self.max_model_len,
                                parallel=self.parallel, seed=cfg.seed, use_tqdm=cfg.use_tqdm)
        fg.install_for_engine(model, cfg.flat_gemm, cfg.max_num_seqs, self.dtype, self.device)
        pdl_setting.install(model, self.pdl)
        return model

    def _kv_cache_dtype(self, cfg: EngineConfig) -> torch.dtype | None:
        """The 8-bit page dtype (None: pages in the model's dtype); ValueError where the backend cannot read it."""
        kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype)
        if kv_dtype is not None and self.backend.name not in QUANT_BACKENDS:
            raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r} needs attn_backend in {QUANT_BACKENDS}, got "
                             f"{self.backend.name!r}")
        if kv_dtype is not None and self.parallel.cp_size > 1:
            raise ValueError("kv_cache_dtype other than 'auto' does not support context parallelism yet")
        return kv_dtype

    def _num_pages(self, cfg: EngineConfig, page_size: int) -> int:
        """Pages of this rank's pool (kv_cache.pool_pages): by default what max_num_seqs sequences of max_model_len
        need."""
        page_bytes = engine_page_bytes(self.config, page_size, self.model.cache_kv_heads, self.dtype,
                                       self.kv_cache_dtype)
        wanted = cfg.max_num_seqs * -(-self.max_model_len // page_size)
        on_gpu = self.device.type == "cuda"
        reserve = activation_reserve(self.config, self.scheduler_tokens, self.dtype) if on_gpu else 0
        return pool_pages(cfg.kv_cache_memory, page_bytes, wanted, self.device, reserve)

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @property
    def stats(self):
        """The engine's counters (scheduler.EngineStats: prefix_cache_queries / prefix_cache_hits in prompt
        tokens, ...), monotonic."""
        return self.scheduler.stats

    def reset_prefix_cache(self) -> int:
        """Forget every cached page no sequence uses (benchmarks: a cold cache). Returns how many pages."""
        return self.block_manager.reset_prefix_cache()

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

    # ---------------------------------------------------------------------------------------------- requests
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
        """One engine step. Returns (the sequences that got a token, those of them that finished); with async
        scheduling the step whose tokens this returns may have been launched by the call before (EngineCore)."""
        return self.core.step_sequences()

    def update_text(self, seq: Sequence) -> str:
        """Bring ``seq.text`` up to its tokens; returns the new text (outputs.update_text)."""
        return update_text(seq)

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
        return [request_output(p, seqs) for p, seqs in requests]

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
