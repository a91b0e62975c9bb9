"""RMSNorm as HF Llama/Qwen2 compute it: normalise in float32, cast back, then scale by the weight; optionally
fused with the residual add that precedes it (the residual stream is carried beside the hidden states).
GemmaRMSNorm: Gemma's form, float32 throughout with a (1 + weight) factor, cast once at the end."""

from __future__ import annotations

import torch
from torch import nn

from flashdecode.engine.layers import fused


class RMSNorm(nn.Module):
    # HF Llama / Qwen: the normalised x is cast to the activation dtype before the weight multiplies it
    ROUND_NORMED = True

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    # launch the fused kernel as a programmatic dependent (flashdecode.engine.layers.pdl.install sets it)
    use_pdl = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, use_fused: bool = False,
                scale: float = 1.0):
        """x (tokens, hidden) (or (..., hidden) unfused). Without residual: returns norm(x). With it: s = residual
        + x, returns (norm(s), s); the fused kernel writes s into ``residual`` in place. ``scale`` multiplies the
        result (unfused, no residual: a q norm folding in a softmax scale)."""
        if use_fused:
            out = fused.add_rms_norm(x, self.weight, self.eps, residual, round_normed=self.ROUND_NORMED,
                                     pdl=self.use_pdl)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = residual + x
            return self._norm(x), x
        return self._norm(x, scale)

    def _norm(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if not self.ROUND_NORMED:  # Gemma: float32 weight (1 + w), one cast at the end
            return (xf * self.weight * scale).to(x.dtype)
        out = self.weight * xf.to(x.dtype)
        return out if scale == 1.0 else out * scale


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: out = (x_f32 * rsqrt(mean(x_f32^2) + eps) * (1 + w_f32)).to(x.dtype). The parameter
    holds 1 + w in float32 (the checkpoint's w is loaded through load_param), so both paths just multiply by it."""

    ROUND_NORMED = False

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device):
        super().__init__(hidden_size, eps, torch.float32, device)

    @torch.no_grad()
    def load_param(self, param: str, tensor: torch.Tensor) -> None:
        """The checkpoint's ``weight`` (hidden,) w -> 1 + w in float32 (what HF computes on every call)."""
        if param != "weight" or tuple(tensor.shape) != tuple(self.weight.shape):
            raise ValueError(f"GemmaRMSNorm {param}: expected weight of shape {tuple(self.weight.shape)}, got "
                             f"{param} of shape {tuple(tensor.shape)}")
        self.weight.copy_(tensor.float() + 1.0)
