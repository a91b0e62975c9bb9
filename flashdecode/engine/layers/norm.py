"""RMSNorm as HF Llama/Qwen2 compute it: normalise in float32, cast back, then scale by the weight; optionally
fused with the residual add that precedes it (the residual stream is carried beside the hidden states)."""

from __future__ import annotations

import torch
from torch import nn

from flashdecode.engine.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    # launch the fused kernel as a programmatic dependent (flashdecode.engine.layers.pdl.install sets it)
    use_pdl = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, use_fused: bool = False):
        """x (tokens, hidden). Without residual: returns norm(x). With it: s = residual + x, returns (norm(s), s);
        the fused kernel writes s into ``residual`` in place."""
        if use_fused:
            out = fused.add_rms_norm(x, self.weight, self.eps, residual, pdl=self.use_pdl)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = residual + x
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
