"""Linear layers whose weights may be several HF tensors concatenated along the output dim (fused at load time).

``MergedLinear(in, [q, k, v])`` holds q_proj/k_proj/v_proj as one (q+k+v, in) weight so a decode step reads it with
one GEMV; its ``load_shard(name, tensor)`` copies one HF tensor into its rows. The shard names are declared by the
model (data, not code), so the loader stays generic.

Tensor parallelism (Megatron-style) reuses the same classes: a column-parallel layer keeps, of each HF tensor, the
rows ``take_rows[shard]`` (its heads / MLP columns); ``RowParallelLinear`` keeps the input columns ``take_cols``
and sums the ranks' partial products with one all-reduce (its bias is added once, after the sum). Each rank reads
the full HF tensor and copies its slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Module):
    """y = x W^T (+ b), W (sum(out_sizes), in_features) made of named row blocks ("shards")."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool, dtype: torch.dtype, device, *,
                 take_rows: dict[str, tuple[int, int]] | None = None):
        """take_rows: shard name -> [start, end) rows of the HF tensor this rank keeps (tensor parallelism;
        end - start must equal the shard's size). None: the whole tensor."""
        super().__init__()
        self.take_rows = take_rows or {}
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
        if shard in self.take_rows:
            lo, hi = self.take_rows[shard]
            tensor = tensor[lo:hi]
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
    # the flat GEMM launched as a programmatic dependent (flashdecode.engine.layers.pdl.install sets it)
    use_pdl = False

    def _table_applies(self, x: torch.Tensor) -> bool:
        """Whether x may take a flat-GEMM launch the choice table picks (a table, 2-D rows of unit stride)."""
        return self.choice_table is not None and x.dim() == 2 and x.stride(-1) == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (tokens, in_features) -> (tokens, sum(out_sizes))."""
        if self._table_applies(x):
            config = self.choice_table.choose(x.shape[0], *self.weight.shape)
            if config is not None:
                from flashdecode.engine.layers.flat_gemm import flat_gemm

                return flat_gemm(x, self.weight, self.bias, config=config, pdl=self.use_pdl)
        return F.linear(x, self.weight, self.bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up (tokens, out / 2) of a [gate | up] layer in one flat-GEMM launch (its silu*mul
        epilogue) where the choice table measured that faster than this layer's GEMM followed by silu_and_mul;
        else None (the caller runs those two)."""
        if not self._table_applies(x):
            return None
        config = self.choice_table.choose_silu_mul(x.shape[0], *self.weight.shape)
        if config is None:
            return None
        from flashdecode.engine.layers.flat_gemm import EPILOGUE_SILU_MUL, flat_gemm

        return flat_gemm(x, self.weight, self.bias, config=config, pdl=self.use_pdl, epilogue=EPILOGUE_SILU_MUL)

    # the split a fused kernel (GEMV) computing x W^T + local_bias needs, then finish(): see RowParallelLinear
    @property
    def local_bias(self):
        return self.bias

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y


class Linear(MergedLinear):
    """A plain linear layer (one shard)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device):
        super().__init__(in_features, {"": out_features}, bias, dtype, device)


class RowParallelLinear(Linear):
    """y = all_reduce(x_r W_r^T) + b over the tensor-parallel group: W_r = the HF weight's input columns
    ``take_cols`` (this rank's heads / MLP columns), x_r the matching slice of the activations, which the
    column-parallel layer before it produced locally."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device, *,
                 take_cols: tuple[int, int], parallel):
        super().__init__(take_cols[1] - take_cols[0], out_features, bias, dtype, device)
        self.take_cols, self.parallel, self.full_in_features = take_cols, parallel, in_features

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        if param == "weight":
            if tensor.dim() != 2 or tensor.shape[1] != self.full_in_features:
                raise ValueError(f"{param}: expected {self.full_in_features} input columns, got {tuple(tensor.shape)}")
            tensor = tensor[:, self.take_cols[0]:self.take_cols[1]]
        super().load_shard(shard, param, tensor)

    @property
    def local_bias(self):
        return None

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The partial product of this rank -> the layer's output (sum over the group, then the bias)."""
        y = self.parallel.all_reduce_tp(y)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(F.linear(x, self.weight))
