"""HF ``config.json`` -> ``ModelConfig``: the few fields the engine needs, validated, with clear errors.

Both spellings of the rotary settings are read: transformers 4.x writes ``rope_theta`` + ``rope_scaling`` at the
top level, 5.x writes one ``rope_parameters`` dict (``rope_type``, ``rope_theta`` and the scaling keys).
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
}
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
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embedding and lm_head counted once each unless tied)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
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


def parse_rope(raw: dict) -> RopeConfig:
    """Rotary settings from a raw config dict, 4.x (rope_theta + rope_scaling) or 5.x (rope_parameters) style."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form; our models only have full attention layers
    if params is None:
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
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = "; ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise ValueError(f"unsupported model_type {model_type!r} (architectures {raw.get('architectures')}); "
                         f"supported: {supported}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; supported: 'silu'")
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
    sliding = None
    if model_type == "mistral":
        sliding = raw.get("sliding_window")
    elif model_type == "qwen2" and raw.get("use_sliding_window", False):
        raise ValueError("unsupported for qwen2: use_sliding_window=true; supported: use_sliding_window=false")
    eos = _as_id_tuple(raw.get("eos_token_id"))
    if generation_config:
        eos = tuple(dict.fromkeys(eos + _as_id_tuple(generation_config.get("eos_token_id"))))
    attention_bias = bool(raw.get("attention_bias", False))
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    return ModelConfig(
        model_type=model_type,
        vocab_size=_field(raw, "vocab_size", int, source),
        hidden_size=hidden,
        intermediate_size=_field(raw, "intermediate_size", int, source),
        num_hidden_layers=_field(raw, "num_hidden_layers", int, source),
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
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id"),
        torch_dtype=dtype if isinstance(dtype, str) else None,
    )


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
