"""flashdecode.engine: a small LLM inference engine (Llama / Qwen2, paged KV, continuous batching, CUDA graphs)."""

from flashdecode.engine.config import ModelConfig, load_config, named_config
from flashdecode.engine.engine_config import EngineConfig
from flashdecode.engine.llm import LLM, RequestOutput
from flashdecode.engine.sampling import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "ModelConfig", "load_config", "named_config"]
