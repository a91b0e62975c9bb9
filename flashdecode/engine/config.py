"""HF ``config.json`` -> ``ModelConfig``: the few fields the engine needs, validated, with clear errors.

Both spellings of the rotary settings are read: transformers 4.x writes ``rope_theta`` + ``rope_scaling`` at the
top level, 5.x writes one ``rope_parameters`` dict (``rope_type``, ``rope_theta`` and the scaling keys), per layer
type (``full_attention`` / ``sliding_attention``) for models that have both (Gemma 3).
Keys a checkpoint leaves out take transformers' defaults of that architecture (Gemma 3's published configs give
only a few; the rest are its config class's defaults: ``ARCHITECTURE_DEFAULTS``).
``eos_token_id`` comes from config.json and generation_config.json (their union; an int or a list in either).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    # model_type -> what it means for the engine
    "llama": "Llama 2 / 3 / 3.1 / 3.2, CodeLlama",
    "mistral": "Mistral (sliding window supported)",
    "qwen2": "Qwen2 / Qwen2.5 (qkv bias, tied embeddings)",
    "qwen3": "Qwen3 dense (q/k RMSNorm per head)",
    "gemma3_text": "Gemma 3 text (Gemma3ForCausalLM; interleaved sliding-window / global layers)",
    "gemma3": "Gemma 3 image+text (Gemma3ForConditionalGeneration): its language model, text prompts only",
}
# HF config-class defaults a checkpoint's config.json may rely on (transformers' Qwen3Config / Gemma3TextConfig)
ARCHITECTURE_DEFAULTS = {
    "qwen3": dict(head_dim=128),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                        max_position_embeddings=131072, tie_word_embeddings=True, query_pre_attn_scalar=256,
                        sliding_window=4096, sliding_window_pattern=6, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, hidden_activation="gelu_pytorch_tanh", eos_token_id=1,
                        bos_token_id=2),
}
# the MLP activation each architecture's config may name (Gemma: hidden_activation; the others: hidden_act)
_ACTIVATIONS = {"gemma3_text": "gelu_pytorch_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")
UNQUANTIZED_ONLY = ("unquantized float32 / float16 / bfloat16 safetensors weights (the KV cache alone may be 8-bit: "
                    "kv_cache_dtype='fp8' or 'int8')")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic")


@dataclasses.dataclass
class RopeConfig:
    """Rotary embedding settings. ``rope_type`` is one of SUPPORTED_ROPE_TYPES; ``factor`` etc. as in HF."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclasses.dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # tokens a query sees, itself included (HF semantics); None = full
    # per-layer "full_attention" / "sliding_attention" (Gemma 3: sliding_window applies to the sliding layers only);
    # None: every layer alike (Mistral's window on all of them)
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotary (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # MLP activation: silu (gate) * up, or gelu_pytorch_tanh (gate) * up (Gemma)
    local_rope: RopeConfig | None = None  # rotary of the sliding layers where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # softmax scale = its ** -0.5 (Gemma 3); None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_window_left(self, layer: int) -> int:
        """Keys before the query that layer ``layer`` attends (flashdecode's window_left); -1 = all of them."""
        if self.sliding_window is None:
            return -1
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return -1
        return self.sliding_window - 1

    @property
    def base_window_left(self) -> int:
        """The window of the engine's attention backend: Mistral's on every layer; -1 where layers differ (Gemma 3:
        its sliding layers take a windowed twin of the backend, AttentionBackend.with_window)."""
        return -1 if self.layer_types is not None else self.layer_window_left(0)

    def kv_tokens_read(self, context: int) -> int:
        """Cached tokens one decode step reads over all layers at ``context`` (a sliding layer reads its window)."""
        return sum(min(context, w + 1) if w >= 0 else context
                   for w in map(self.layer_window_left, range(self.num_hidden_layers)))

    def num_parameters(self) -> int:
        """Parameter count (embedding and lm_head counted once each unless tied)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.model_type == "gemma3_text":  # pre/post feed-forward norms
            per_layer += 2 * h
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.o_bias:
            per_layer += h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + emb + h


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def parse_rope(raw: dict, layer_type: str = "full_attention") -> RopeConfig:
    """Rotary settings of ``layer_type``'s layers from a raw config dict: 4.x style (rope_theta + rope_scaling;
    Gemma 3's sliding layers: rope_local_base_freq, unscaled) or 5.x (rope_parameters, flat or per layer type)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if params is None and layer_type == "sliding_attention":
        params = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    elif params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    rope = RopeConfig(rope_type=rope_type, theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))))
    if rope_type != "default":
        if "factor" not in params:
            raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'")
        rope.factor = float(params["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ValueError(f"rope scaling 'llama3' needs {key!r}")
        rope.low_freq_factor = float(params["low_freq_factor"])
        rope.high_freq_factor = float(params["high_freq_factor"])
    rope.original_max_position_embeddings = params.get("original_max_position_embeddings")
    return rope


def _field(raw: dict, key: str, kind, source: str, default=None):
    """raw[key] converted by ``kind`` (int / float); ValueError naming the file and the key when it is missing
    (and has no default) or has the wrong type."""
    value = raw.get(key)
    value = default if value is None else value
    if value is None:
        raise ValueError(f"{source}: missing required key {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ValueError(f"{source}: {key!r} must be {'an int' if kind is int else 'a number'}, got {value!r}")
    if kind is int and value < 1:
        raise ValueError(f"{source}: {key!r} must be >= 1, got {value!r}")
    return kind(value)


def config_from_dict(raw: dict, generation_config: dict | None = None, source: str = "config") -> ModelConfig:
    """Validate and convert a raw HF config dict. Raises ValueError naming ``source`` (the file) and the key, or
    listing what is supported."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object (the HF config), got a {type(raw).__name__}")
    if generation_config is not None and not isinstance(generation_config, dict):
        raise ValueError(f"generation_config.json: expected a JSON object, got a {type(generation_config).__name__}")
    _refuse_quantized(raw, source)
    model_type = raw.get("model_type")
    if model_type == "gemma3":
        raw = _gemma3_language_model(raw, source)
        model_type = "gemma3_text"
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = "; ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise ValueError(f"unsupported model_type {model_type!r} (architectures {raw.get('architectures')}); "
                         f"supported: {supported}")
    raw = {**ARCHITECTURE_DEFAULTS.get(model_type, {}), **raw}
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    if act != _ACTIVATIONS.get(model_type, "silu"):
        raise ValueError(f"unsupported hidden_act {act!r} for {model_type}; supported: "
                         f"{_ACTIVATIONS.get(model_type, 'silu')!r}")
    if raw.get("mlp_bias", False):
        raise ValueError("unsupported mlp_bias=true; supported: mlp_bias=false")
    heads = _field(raw, "num_attention_heads", int, source)
    hidden = _field(raw, "hidden_size", int, source)
    head_dim = _field(raw, "head_dim", int, source) if raw.get("head_dim") else hidden // heads
    if head_dim < 1 or (not raw.get("head_dim") and hidden % heads):
        raise ValueError(f"{source}: 'hidden_size'={hidden} is not a multiple of 'num_attention_heads'={heads} "
                         f"(give 'head_dim')")
    kv_heads = _field(raw, "num_key_value_heads", int, source, heads)
    if heads % kv_heads:
        raise ValueError(f"{source}: 'num_attention_heads'={heads} is not a multiple of 'num_key_value_heads'="
                         f"{kv_heads}")
    layers = _field(raw, "num_hidden_layers", int, source)
    sliding = None
    if model_type == "mistral":
        sliding = raw.get("sliding_window")
    elif model_type in ("qwen2", "qwen3") and raw.get("use_sliding_window", False):
        raise ValueError(f"unsupported for {model_type}: use_sliding_window=true; supported: use_sliding_window=false")
    eos = _as_id_tuple(raw.get("eos_token_id"))
    if generation_config:
        eos = tuple(dict.fromkeys(eos + _as_id_tuple(generation_config.get("eos_token_id"))))
    attention_bias = bool(raw.get("attention_bias", False))
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    config = ModelConfig(
        model_type=model_type,
        vocab_size=_field(raw, "vocab_size", int, source),
        hidden_size=hidden,
        intermediate_size=_field(raw, "intermediate_size", int, source),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_field(raw, "rms_norm_eps", float, source, 1e-6),
        max_position_embeddings=_field(raw, "max_position_embeddings", int, source, 4096),
        rope=parse_rope(raw),
        qkv_bias=(model_type == "qwen2") or attention_bias,
        o_bias=attention_bias and model_type != "qwen2",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=int(sliding) if sliding else None,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        hidden_act=act,
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id"),
        torch_dtype=dtype if isinstance(dtype, str) else None,
    )
    if model_type == "gemma3_text":
        config = _gemma3_fields(config, raw, source)
    return config


def _refuse_quantized(raw: dict, source: str) -> None:
    """ValueError for a quantized checkpoint (AWQ, GPTQ, bitsandbytes, fp8, compressed-tensors, ...: config.json
    has a quantization_config); the engine loads unquantized weights only."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ValueError(f"{source}: quantized checkpoints are not supported (quantization_config, quant_method "
                         f"{method!r}); supported: {UNQUANTIZED_ONLY}")


def _gemma3_language_model(raw: dict, source: str) -> dict:
    """The text_config of an image+text Gemma 3 config (Gemma3ForConditionalGeneration), with the top-level keys
    it inherits (EOS / BOS ids, tied embeddings, dtype) where it does not give them."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{source}: model_type 'gemma3' needs a 'text_config' object (its language model)")
    inherited = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "torch_dtype", "dtype")
                 if k in raw and k not in text}
    return {**text, **inherited, "model_type": "gemma3_text"}


def _gemma3_fields(config: ModelConfig, raw: dict, source: str) -> ModelConfig:
    """Gemma 3's own settings: the layer pattern and its window, the sliding layers' rotary, the softmax scale,
    the final logit softcap; refuses what the engine's attention cannot do (attention-logit softcapping,
    bidirectional attention)."""
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{source}: unsupported attn_logit_softcapping={raw['attn_logit_softcapping']}; "
                         f"supported: null (Gemma 3's default)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: unsupported use_bidirectional_attention=true; supported: false (causal)")
    n = config.num_hidden_layers
    layer_types = raw.get("layer_types")
    if layer_types is None:  # the older spelling: every pattern-th layer is global
        pattern = _field(raw, "sliding_window_pattern", int, source)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if (not isinstance(layer_types, list) or len(layer_types) < n
            or any(t not in LAYER_TYPES for t in layer_types)):
        raise ValueError(f"{source}: 'layer_types' must list {n} entries from {LAYER_TYPES}, got {layer_types!r}")
    softcap = raw.get("final_logit_softcapping")
    return dataclasses.replace(
        config, layer_types=tuple(layer_types[:n]), sliding_window=_field(raw, "sliding_window", int, source),
        local_rope=parse_rope(raw, "sliding_attention"),
        query_pre_attn_scalar=_field(raw, "query_pre_attn_scalar", float, source),
        final_logit_softcapping=None if softcap is None else _field(raw, "final_logit_softcapping", float, source))


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` when present) from an HF checkpoint directory."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"model_dir {str(model_dir)!r} has no config.json (expected an HF checkpoint directory)")
    raw = _read_json(path / "config.json")
    gen = None
    if (path / "generation_config.json").is_file():
        gen = _read_json(path / "generation_config.json")
    return config_from_dict(raw, gen, source=str(path / "config.json"))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


# Named shapes for --random-weights (no weights can be downloaded here). Values as in the published configs.
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
NAMED_CONFIGS = {
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                      max_position_embeddings=131072, rope_parameters=_LLAMA3_ROPE, eos_token_id=128001,
                      bos_token_id=128000),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
                        rope_parameters={**_LLAMA3_ROPE, "factor": 32.0}, eos_token_id=128001,
                        bos_token_id=128000),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         eos_token_id=151643),
    "codellama-34b": dict(model_type="llama", vocab_size=32000, hidden_size=8192, intermediate_size=22016,
                          num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5,
                          max_position_embeddings=16384,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, eos_token_id=2,
                          bos_token_id=1),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, max_position_embeddings=40960,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, eos_token_id=151645,
                     bos_token_id=151643),
    # Gemma-3-12B's language model (the text_config of google/gemma-3-12b-it), 4.x spelling as on the hub
    "gemma3-12b": dict(model_type="gemma3_text", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                       num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                       query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
                       rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                       rope_local_base_freq=10000.0, max_position_embeddings=131072, eos_token_id=1,
                       bos_token_id=2),
}


def named_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """A published model's shape by name (see NAMED_CONFIGS), optionally cut to ``num_layers`` layers."""
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown config name {name!r}; expected one of {sorted(NAMED_CONFIGS)}")
    raw = dict(NAMED_CONFIGS[name])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        raw["num_hidden_layers"] = num_layers
    return config_from_dict(raw)
