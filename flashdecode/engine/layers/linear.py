"""Linear layers whose weights may be several HF tensors concatenated along the output dim (fused at load time).

``MergedLinear(in, [q, k, v])`` holds q_proj/k_proj/v_proj as one (q+k+v, in) weight so a decode step reads it with
one GEMV; its ``load_shard(name, tensor)`` copies one HF tensor into its rows. The shard names are declared by the
model (data, not code), so the loader stays generic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Module):
    """y = x W^T (+ b), W (sum(out_sizes), in_features) made of named row blocks ("shards")."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool, dtype: torch.dtype, device):
        super().__init__()
        self.shard_rows = {}
        start = 0
        for name, rows in shards.items():
            self.shard_rows[name] = (start, start + rows)
            start += rows
        self.weight = nn.Parameter(torch.empty(start, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(start, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        """Copy HF tensor ``tensor`` (rows, in) or (rows,) into shard ``shard`` of ``param`` ('weight'|'bias')."""
        start, end = self.shard_rows[shard]
        target = getattr(self, param)
        if target is None:
            raise ValueError(f"checkpoint has a {param} for shard {shard!r} but the config says there is none")
        if tuple(tensor.shape) != (end - start,) + tuple(target.shape[1:]):
            raise ValueError(f"shard {shard!r} {param}: expected shape {(end - start,) + tuple(target.shape[1:])}, "
                             f"got {tuple(tensor.shape)}")
        target.data[start:end].copy_(tensor)

    # a flat_gemm.ChoiceTable (installed by the engine when asked): decode batches of 2..64 rows whose shape it
    # measured faster than cuBLAS go through the flat GEMM
    choice_table = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (tokens, in_features) -> (tokens, sum(out_sizes))."""
        if self.choice_table is not None and x.dim() == 2 and x.stride(-1) == 1:
            config = self.choice_table.choose(x.shape[0], *self.weight.shape)
            if config is not None:
                from flashdecode.engine.layers.flat_gemm import flat_gemm

                return flat_gemm(x, self.weight, self.bias, config=config)
        return F.linear(x, self.weight, self.bias)


class Linear(MergedLinear):
    """A plain linear layer (one shard)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device):
        super().__init__(in_features, {"": out_features}, bias, dtype, device)
