"""Typed configurations: every launch decision of an op, made once.

A config is a frozen dataclass resolved by a pure function of a problem description and device facts
(flashdecode/heuristics.py); ops take ``config=`` to override it (``dataclasses.replace`` of the resolved one).
"""

from __future__ import annotations


# ----------------------------------------------------------------------------------------------------------------
# Prefill / training attention (flash_attn, flash_attn_varlen)
# ----------------------------------------------------------------------------------------------------------------

from dataclasses import dataclass  # noqa: E402  (this block stays self-contained)

# A tile of the forward, the two-launch backward or the atomic backward: (rows held, rows streamed, warps, stages)
Tile = tuple[int, int, int, int]
# A tile of the one-launch backward: (BLOCK_N, BLOCK_M, BLOCK_M2, BLOCK_N2, SPLIT_DKDV, warps, stages)
FusedTile = tuple[int, int, int, int, bool, int, int]


@dataclass(frozen=True)
class AttentionProblem:
    """What the attention launch policy (heuristics.resolve_attention_config) looks at: the problem and the
    device's facts, no tensors."""

    head_dim_pad: int  # head dim rounded up to a power of two >= 16
    elem_bytes: int  # 2 (fp16 / bf16) or 4 (fp32)
    max_seqlen_k: int
    deterministic: bool  # flash_attn(deterministic=...)
    tma_layout: bool  # q, k, v allow tensor descriptors (unit head-dim stride, 16-byte aligned rows)
    capability_major: int  # CUDA compute capability major; 0 off the GPU
    smem_limit: int  # shared memory per block in bytes
    interpret: bool  # Triton's CPU interpreter
    autotune: bool  # FLASHDECODE_AUTOTUNE (default on): time the candidates on the GPU


@dataclass(frozen=True)
class AttentionConfig:
    """Every launch decision of one flash_attn / flash_attn_varlen call, forward and backward.

    Resolved once per problem by heuristics.resolve_attention_config; ``flash_attn(..., config=)`` takes a
    ``dataclasses.replace`` of it. Descriptor flags are permissions: the launcher still uses pointers where a
    tensor's layout does not allow descriptors. Tiles are tried in order: the first one when autotuning is off,
    every one (timed once per shape bucket) when it is on. The backward takes bwd_atomic_tiles when
    deterministic=False, bwd_fused_tiles when bwd_fused, else bwd_dkdv_tiles and bwd_dq_tiles.
    """

    fwd_tma: bool  # forward through tensor descriptors (TMA)
    fwd_tiles: tuple[Tile, ...]  # (BLOCK_M, BLOCK_N, warps, stages)
    fwd_autotune: bool
    bwd_tma: bool  # backward loads through descriptors (and, deterministic=False, a bulk reduction of dQ)
    bwd_fused: bool  # deterministic backward in one launch (dK/dV of KV block j, then dQ of Q block j)
    bwd_dkdv_tiles: tuple[Tile, ...]  # (BLOCK_N, BLOCK_M, warps, stages)
    bwd_dq_tiles: tuple[Tile, ...]  # (BLOCK_M, BLOCK_N, warps, stages)
    bwd_atomic_tiles: tuple[Tile, ...]  # (BLOCK_N, BLOCK_M, warps, stages)
    bwd_fused_tiles: tuple[FusedTile, ...]
    bwd_autotune: bool

    def check(self) -> "AttentionConfig":
        """ValueError/TypeError naming ``config`` for a field of the wrong type or a malformed tile list."""
        for name in ("fwd_tma", "fwd_autotune", "bwd_tma", "bwd_fused", "bwd_autotune"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"config.{name} must be a bool, got {getattr(self, name)!r}")
        for name, length in (("fwd_tiles", 4), ("bwd_dkdv_tiles", 4), ("bwd_dq_tiles", 4),
                             ("bwd_atomic_tiles", 4), ("bwd_fused_tiles", 7)):
            tiles = getattr(self, name)
            if not isinstance(tiles, tuple) or not tiles:
                raise ValueError(f"config.{name} must be a non-empty tuple of tiles, got {tiles!r}")
            for tile in tiles:
                if not _is_tile(tile, length):
                    raise ValueError(f"config.{name} entries must be tuples of {length} positive ints"
                                     f"{' (the fifth a bool)' if length == 7 else ''}, got {tile!r}")
        return self


def _is_tile(tile, length: int) -> bool:
    """A tuple of ``length`` positive ints; a fused tile's fifth entry (SPLIT_DKDV) is a bool instead."""
    if not isinstance(tile, tuple) or len(tile) != length:
        return False
    split = length == 7
    if split and not isinstance(tile[4], bool):
        return False
    ints = [x for i, x in enumerate(tile) if not (split and i == 4)]
    return all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in ints)
