"""The engine's parallel layout: ``tensor_parallel_size`` x ``context_parallel_size`` ranks.

    rank = cp_rank * tp_size + tp_rank

A tensor-parallel group (same cp_rank) shares one model replica's work Megatron-style: each rank holds
nheads / tp query heads, its KV heads (sharded, or one replicated head when tp > nheads_kv) and
intermediate / tp MLP columns; one all-reduce after o_proj and one after down_proj. A context-parallel group (same
tp_rank) holds the same heads and splits every sequence's KV pages round robin; decode attention merges the
group's partial states (flashdecode.distributed.context_parallel_decode's exchange).

Every rank runs the same engine program (SPMD: same scheduler decisions, same sampled tokens - rank 0's are
broadcast), so no rank is a "driver" and no request has to be shipped between processes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from flashdecode.ops import checks

__all__ = ["ParallelConfig", "ParallelState"]


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the two kinds of parallelism (1 = off)."""

    tensor_parallel_size: int = 1
    context_parallel_size: int = 1

    def __post_init__(self):
        checks.check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        checks.check_int("context_parallel_size", self.context_parallel_size, minimum=1)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.context_parallel_size

    def check_model(self, nheads: int, nheads_kv: int, intermediate_size: int, sliding_window) -> None:
        """ValueError (naming the size) if the model's heads / MLP cannot be split ``tensor_parallel_size`` ways,
        or if context parallelism meets a sliding window (a window is measured in positions, which a rank's shard
        of interleaved pages does not have)."""
        tp = self.tensor_parallel_size
        if nheads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {nheads} attention heads")
        if nheads_kv % tp and tp % nheads_kv:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {nheads_kv} KV heads or be a "
                             f"multiple of them (then each KV head is replicated)")
        if intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the MLP's intermediate size {intermediate_size}")
        if self.context_parallel_size > 1 and sliding_window:
            raise ValueError("context_parallel_size > 1 does not support sliding-window models")


@dataclasses.dataclass
class ParallelState:
    """This rank's place in the layout and its process groups (None when that kind of parallelism is off).

    ``device`` is where collectives run (the rank's GPU for NCCL, the CPU for gloo)."""

    config: ParallelConfig
    tp_rank: int = 0
    cp_rank: int = 0
    tp_group: object = None
    cp_group: object = None
    device: torch.device = torch.device("cpu")

    @property
    def tp_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def cp_size(self) -> int:
        return self.config.context_parallel_size

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def rank(self) -> int:
        """This rank in the default process group (0 without parallelism)."""
        return self.cp_rank * self.tp_size + self.tp_rank

    @classmethod
    def single(cls) -> "ParallelState":
        return cls(ParallelConfig())

    @classmethod
    def create(cls, config: ParallelConfig, device) -> "ParallelState":
        """Build the groups on the default process group (every rank must call this, in the same order)."""
        if config.world_size == 1:
            return cls(config, device=torch.device(device))
        from flashdecode.distributed.launch import init_distributed

        init_distributed(config.world_size)
        rank, tp, cp = dist.get_rank(), config.tensor_parallel_size, config.context_parallel_size
        state = cls(config, tp_rank=rank % tp, cp_rank=rank // tp, device=torch.device(device))
        # new_group is collective over the whole world: every rank creates every group
        for c in range(cp):
            group = dist.new_group([c * tp + t for t in range(tp)]) if tp > 1 else None
            if c == state.cp_rank:
                state.tp_group = group
        for t in range(tp):
            group = dist.new_group([c * tp + t for c in range(cp)]) if cp > 1 else None
            if t == state.tp_rank:
                state.cp_group = group
        return state

    # ------------------------------------------------------------------------------------ head / column shards
    def shard(self, total: int) -> tuple[int, int]:
        """[start, end) of this tp rank's equal slice of ``total`` (heads, MLP columns)."""
        size = total // self.tp_size
        return self.tp_rank * size, (self.tp_rank + 1) * size

    def kv_head_shard(self, nheads_kv: int) -> tuple[int, int]:
        """[start, end) of the KV heads this tp rank stores: its slice, or the one head it replicates when
        tp > nheads_kv (rank t serves query heads whose KV head is t // (tp / nheads_kv))."""
        if self.tp_size <= nheads_kv:
            return self.shard(nheads_kv)
        head = self.tp_rank // (self.tp_size // nheads_kv)
        return head, head + 1

    # ------------------------------------------------------------------------------------ collectives
    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the tensor-parallel group, in place (no-op without tensor parallelism)."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def agree_tokens(self, tokens: list[int]) -> list[int]:
        """Every rank continues with rank 0's sampled tokens (ranks sampling with unseeded generators would
        otherwise drift apart)."""
        if self.world_size == 1 or not tokens:
            return tokens
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        dist.broadcast(t, 0)
        return t.tolist()

    def broadcast_object(self, obj=None):
        """Rank 0's picklable ``obj`` on every rank (the others pass None)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def min_over_world(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. KV pages that fit: the ranks' schedulers must agree)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())
