"""Gluon names that moved between the Triton releases the package supports (3.6, what the GPU machine runs, to 3.9,
what the newest torch pins): each is bound once here to whichever name this Triton has, with the same arguments."""

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# The TMA load (descriptor, coordinates, barrier, destination[, pred]): 3.9 renamed it tma.async_load and keeps
# tma.async_copy_global_to_shared as a stub that raises; 3.6 has only the old name.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

# A barrier of the CTA's threads: 3.9 replaced gl.thread_barrier() by gl.barrier() (cluster=False: the same barrier).
thread_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
