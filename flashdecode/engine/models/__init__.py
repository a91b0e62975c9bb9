"""Model classes by HF model_type."""

from __future__ import annotations

from flashdecode.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
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
