"""Model classes by HF model_type."""

from __future__ import annotations

from flashdecode.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from flashdecode.engine.loader import load_checkpoint
from flashdecode.engine.models.llama import LlamaForCausalLM
from flashdecode.engine.models.gemma3 import Gemma3ForCausalLM
from flashdecode.engine.models.qwen2 import Qwen2ForCausalLM
from flashdecode.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
                 "qwen3": Qwen3ForCausalLM, "gemma3_text": Gemma3ForCausalLM}


def model_class(config: ModelConfig):
    if config.model_type not in MODEL_CLASSES:
        raise ValueError(f"unsupported model_type {config.model_type!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    return MODEL_CLASSES[config.model_type]


def build_model(config: ModelConfig, model_dir, dtype, device, *, max_model_len: int, parallel, seed: int,
                use_tqdm: bool):
    """An engine model of ``config`` on ``device``: the checkpoint's weights from ``model_dir``, or random ones drawn
    from ``seed`` when it is None (benchmarks). Its rotary table covers ``max_model_len`` positions."""
    model = model_class(config)(config, dtype, device, max_positions=max_model_len, parallel=parallel)
    if model_dir is None:
        model.init_random_(seed)
    else:
        load_checkpoint(model, model_dir, use_tqdm=use_tqdm)
    return model


def check_shared_model(model, max_model_len: int) -> None:
    """ValueError when an already built model (shared between engines) cannot hold ``max_model_len`` positions."""
    table = getattr(model.rotary, "cos_table", None)
    if table is not None and table.shape[0] < max_model_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's rotary table ({table.shape[0]} "
                         f"positions)")
