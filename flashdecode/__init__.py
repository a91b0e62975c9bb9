"""flashdecode: exact, IO-aware attention (FlashAttention, Flash-Decoding) in Triton, and a small inference engine.

Public API (see README.md): the reference spec lives in ``flashdecode.reference``.
"""

from flashdecode import reference  # noqa: F401
from flashdecode.config import AttentionConfig, DecodeConfig, DecodePath  # noqa: F401
from flashdecode.ops.decode import DecodePlan, append_kv, flash_decode  # noqa: F401
from flashdecode.ops.merge import merge_states, merge_states_many  # noqa: F401
from flashdecode.ops.attention import flash_attn, flash_attn_varlen  # noqa: F401
from flashdecode.ops.quant import dequantize_fp8, hadamard_rotate, quantize_fp8  # noqa: F401
from flashdecode.ops.sinks import apply_sinks  # noqa: F401

__version__ = "0.1.0"


def warmup(*args, **kwargs):
    """Compile the kernel variants a model shape needs before the first request (flashdecode/warm.py)."""
    from flashdecode.warm import warmup as _warmup

    return _warmup(*args, **kwargs)


__all__ = ["reference", "flash_decode", "DecodePlan", "DecodeConfig", "DecodePath", "append_kv", "merge_states",
           "merge_states_many", "flash_attn", "flash_attn_varlen", "AttentionConfig", "apply_sinks", "quantize_fp8",
           "dequantize_fp8", "hadamard_rotate", "warmup", "__version__"]
