"""The transformers peer of ``bench e2e --hf``: transformers' own *ForCausalLM whose parameters are views of our
model's tensors (same random weights, no second copy in memory), timed as users run it: batch-1 greedy decode
(``model(next_token, cache)`` in a Python loop, CUDA-event timed) over a DynamicCache pre-filled with random K/V, and
an hf-sdpa forward over one prompt (last-position logits)."""

from __future__ import annotations

import statistics

import torch

from flashdecode.bench.gpu import release, sync, timed

HF_IMPLEMENTATIONS = ("sdpa", "eager")
HF_KV_NOTE = "hf decode: DynamicCache pre-filled with random K/V (no prefill), eager PyTorch loop, batch 1"


def hf_unavailable_reason() -> str | None:
    """Why the transformers peer cannot run here (None when it can)."""
    try:
        import transformers  # noqa: F401
    except Exception as e:  # ImportError, or a broken install: the peer is optional, say why it is skipped
        return f"transformers not importable ({type(e).__name__}: {str(e)[:80]})"
    return None


def hf_config(cfg, attn_implementation: str):
    """Our ModelConfig -> the transformers config of the same architecture and shape (4.x rope spelling, which 5.x
    converts to ``rope_parameters``)."""
    import transformers

    if attn_implementation not in HF_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {HF_IMPLEMENTATIONS}, got {attn_implementation!r}")
    rope = cfg.rope
    scaling = None
    if rope.rope_type != "default":
        scaling = {"rope_type": rope.rope_type, "factor": rope.factor}
        if rope.rope_type == "llama3":
            scaling.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
        if rope.original_max_position_embeddings is not None:
            scaling["original_max_position_embeddings"] = rope.original_max_position_embeddings
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                  num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                  max_position_embeddings=cfg.max_position_embeddings, rope_theta=rope.theta, rope_scaling=scaling,
                  tie_word_embeddings=cfg.tie_word_embeddings, eos_token_id=None, bos_token_id=None,
                  attn_implementation=attn_implementation)
    if cfg.model_type == "qwen2":
        return transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    if cfg.model_type == "mistral":
        return (transformers.MistralConfig(sliding_window=cfg.sliding_window, **common),
                transformers.MistralForCausalLM)
    return (transformers.LlamaConfig(attention_bias=cfg.qkv_bias or cfg.o_bias, **common),
            transformers.LlamaForCausalLM)


def _our_tensor(model, hf_name: str) -> torch.Tensor:
    """The tensor of our model that holds HF parameter ``hf_name``: a row slice (a view) of a fused projection,
    the same tensor otherwise."""
    if hf_name == "lm_head.weight":
        return model.lm_head_weight
    module_path, _, param = hf_name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    if leaf in model.PACKED_MODULES:
        fused_name, shard = model.PACKED_MODULES[leaf]
        fused_module = model.get_submodule(f"{parent}.{fused_name}")
        start, end = fused_module.shard_rows[shard]
        return getattr(fused_module, param)[start:end]
    return getattr(model.get_submodule(module_path), param)


def build_hf_peer(model, attn_implementation: str):
    """transformers' *ForCausalLM of ``model``'s shape whose parameters ARE ``model``'s tensors (views into the
    fused qkv / gate_up weights): the same weights, no second copy in memory. eval mode, no grad.

    Only the rotary inv_freq buffers are new (recomputed by transformers from the config on ``model``'s device).
    """
    from torch import nn

    cfg, cls = hf_config(model.config, attn_implementation)
    weight = model.lm_head_weight
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        cfg.dtype = weight.dtype
    else:
        cfg.torch_dtype = weight.dtype
    with torch.device("meta"):
        hf = cls(cfg)
    for name, _ in list(hf.named_parameters(remove_duplicate=False)):
        module_path, _, param = name.rpartition(".")
        ours = _our_tensor(model, name)
        target = hf.get_submodule(module_path)
        if tuple(getattr(target, param).shape) != tuple(ours.shape):
            raise ValueError(f"HF peer {name}: shape {tuple(getattr(target, param).shape)} vs ours {tuple(ours.shape)}")
        target._parameters[param] = nn.Parameter(ours, requires_grad=False)
    for module_name, module in list(hf.named_modules()):
        if module_name.endswith("rotary_emb"):  # built on meta: rebuild it (transformers computes it on the CPU)
            parent, _, leaf = module_name.rpartition(".")
            rebuilt = type(module)(config=cfg).to(weight.device)
            setattr(hf.get_submodule(parent) if parent else hf, leaf, rebuilt)
    leftover = [n for n, b in hf.named_buffers() if b.is_meta] + [n for n, p in hf.named_parameters() if p.is_meta]
    if leftover:
        raise ValueError(f"HF peer: tensors left on the meta device: {leftover[:6]}")
    return hf.eval()


def hf_prefilled_cache(hf, context: int, seed: int = 0):
    """A DynamicCache holding ``context`` positions of random K/V per layer, (1, kv_heads, context, head_dim) in the
    model dtype (decode speed does not depend on the cache content; a real 128k prefill would cost minutes)."""
    from transformers import DynamicCache

    cfg = hf.config
    weight = hf.get_output_embeddings().weight
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    cache = DynamicCache()
    shape = (1, cfg.num_key_value_heads, context, head_dim)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(shape, generator=gen, device=weight.device, dtype=weight.dtype)
        v = torch.randn(shape, generator=gen, device=weight.device, dtype=weight.dtype)
        cache.update(k, v, layer)
        del k, v
    return cache


def hf_cache_kwarg(model) -> str:
    """The keyword under which this transformers version's forward takes the KV cache: "cache" (newer releases,
    which deprecate the old name) or "past_key_values"."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_greedy_steps(hf, cache, token: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy decode steps as users run them: model(next_token, cache) in a Python loop.
    token int64 (1, 1) on the model's device -> the last generated token (1, 1); no host sync in the loop."""
    kw = {hf_cache_kwarg(hf): cache}
    for _ in range(steps):
        logits = hf(input_ids=token, use_cache=True, **kw).logits
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
    return token


def hf_decode_tokens_per_s(hf, context: int, steps: int, repeats: int) -> float:
    """Batch-1 tokens/s of transformers' greedy decode with ``context`` cached positions (median of ``repeats``)."""
    device = hf.get_output_embeddings().weight.device
    cache = hf_prefilled_cache(hf, context, seed=context)
    try:
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        token = hf_greedy_steps(hf, cache, token, 3)  # warm-up
        sync(device)
        rates = []
        for _ in range(repeats):
            secs, token = timed(device, lambda: hf_greedy_steps(hf, cache, token, steps))
            rates.append(steps / secs)
        return statistics.median(rates)
    finally:
        del cache
        release()


def _logits_to_keep_kwarg(hf) -> dict:
    import inspect

    params = inspect.signature(hf.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):  # transformers >= 4.50 / 4.45-4.49
        if name in params:
            return {name: 1}
    return {}


def hf_prefill_seconds(hf, length: int, seed: int = 0) -> float:
    """Seconds of transformers' forward over one ``length``-token prompt (no KV cache kept, logits of the last
    position only where the API allows); best of 2 after a 1024-token warm-up."""
    device = hf.get_output_embeddings().weight.device
    gen = torch.Generator().manual_seed(length + seed)
    ids = torch.randint(0, hf.config.vocab_size, (1, length), generator=gen).to(device)
    extra = _logits_to_keep_kwarg(hf)
    with torch.inference_mode():
        hf(input_ids=ids[:, :1024], use_cache=False, **extra)
        sync(device)
        times = [timed(device, lambda: hf(input_ids=ids, use_cache=False, **extra))[0] for _ in range(2)]
    release()
    return min(times)


def hf_peer_rows(model, impls: list[str], contexts: list[int], steps: int, repeats: int, prefill: int) -> list:
    """Decode rows (backend ``hf-<impl>``, batch 1) per context and a ``hf-sdpa`` prefill row, measured on a
    transformers model sharing ``model``'s weights. An OOM point becomes a row with its error."""
    from tqdm import tqdm

    rows = []
    for impl in impls:
        hf = build_hf_peer(model, impl)
        for ctx in tqdm(contexts, desc=f"hf-{impl} decode"):
            try:
                rate, err = hf_decode_tokens_per_s(hf, ctx, steps, repeats), None
            except torch.cuda.OutOfMemoryError as e:
                rate, err = None, f"OOM: {str(e)[:80]}"
                release()
            rows.append(dict(kind="decode", backend=f"hf-{impl}", context=ctx, batch=1, tokens_per_s=rate,
                             roofline_tokens_per_s=None, pct_roofline=None, error=err, kv=HF_KV_NOTE))
        if prefill and impl == "sdpa":  # eager materialises (heads, n, n) scores: 256 GB at 64k, not run
            try:
                secs = hf_prefill_seconds(hf, prefill)
                rows.append(dict(kind="prefill", backend="hf-sdpa", context=prefill, batch=1, seconds=secs,
                                 tokens_per_s=prefill / secs))
                print(f"prefill {prefill} tokens, hf-sdpa: {secs:.2f} s")
            except torch.cuda.OutOfMemoryError as e:
                print(f"prefill {prefill} tokens, hf-sdpa: OOM ({str(e)[:80]})")
                release()
        del hf
        release()
    return rows


# the architectures whose transformers peer hf_config / build_hf_peer make (sharing our tensors)
HF_PEER_TYPES = ("llama", "qwen2", "mistral")
