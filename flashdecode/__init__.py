"""flashdecode: exact, IO-aware attention (FlashAttention, Flash-Decoding) in Triton, and a small inference engine.

Public API (see README.md): the reference spec lives in ``flashdecode.reference``.
"""

from flashdecode import reference  # noqa: F401
from flashdecode.config import DecodeConfig, DecodePath  # noqa: F401
from flashdecode.ops.decode import DecodePlan, append_kv, flash_decode  # noqa: F401
from flashdecode.ops.merge import merge_states, merge_states_many  # noqa: F401
from flashdecode.ops.attention import flash_attn, flash_attn_varlen  # noqa: F401
from flashdecode.config import AttentionConfig  # noqa: F401

__version__ = "0.1.0"

__all__ = ["reference", "DecodeConfig", "DecodePath", "flash_decode", "DecodePlan", "append_kv", "merge_states",
           "merge_states_many", "flash_attn", "flash_attn_varlen", "AttentionConfig", "__version__"]
