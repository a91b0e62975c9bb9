"""Beyond one GPU, over torch.distributed (NCCL on GPUs, gloo on CPUs): context-parallel decode (a sequence's KV
cache sharded across ranks, merged exactly by log-sum-exp) and the process groups of the engine's tensor- and
context-parallel modes. See docs/distributed.md."""

from flashdecode.distributed.cp_decode import ContextParallelDecodePlan, context_parallel_decode  # noqa: F401
from flashdecode.distributed.exchange import StateExchange  # noqa: F401

__all__ = ["context_parallel_decode", "ContextParallelDecodePlan", "StateExchange"]
