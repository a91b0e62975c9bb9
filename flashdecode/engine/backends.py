"""The engine's attention backends by name: the one place that maps `EngineConfig.attn_backend` to a class.

Kept apart from engine/attention.py so that a backend living in its own module (engine/flashinfer_backend.py, which
subclasses `AttentionBackend`) is imported from here, not from the module that defines its base class.
"""

from __future__ import annotations

import torch

from flashdecode.engine.attention import (BACKENDS, AttentionBackend, EagerBackend, FlashDecodeBackend,
                                          FlashDecodeNoSplitBackend, SdpaBackend, TorchBackend)

_CLASSES = {c.name: c for c in (FlashDecodeBackend, FlashDecodeNoSplitBackend, SdpaBackend, EagerBackend,
                                TorchBackend)}


def default_backend(device: torch.device) -> str:
    return "flashdecode" if torch.device(device).type == "cuda" else "torch"


def make_backend(name: str | None, device, window_left: int = -1) -> AttentionBackend:
    """Backend by name (None = the device's default). ValueError lists the names."""
    name = name or default_backend(device)
    if name == "flashinfer":  # imported only when asked for: it imports the flashinfer package
        from flashdecode.engine.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(window_left)
    if name not in _CLASSES:
        raise ValueError(f"attn_backend must be one of {list(BACKENDS)}, got {name!r}")
    return _CLASSES[name](window_left)
