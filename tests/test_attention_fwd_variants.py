"""The prefill launch configuration: heuristics.resolve_attention_config (pure, on the CPU) for the problems whose
decisions differ (Hopper or not, descriptor layout, long sequences, head dim 256, fp32, the interpreter, autotune
off), the config= override (validation, forcing a path, kept through torch.compile's custom ops), and forward launch
variants against the float64 reference: long sequences on the descriptor path take a fixed, untimed tile.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import heuristics as hx
from flashdecode.config import AttentionConfig, AttentionProblem
from flashdecode.ops import attention as attn_ops
from helpers import HAS_CUDA, KERNEL_DTYPES
from test_attention import _inputs, check_dense, fixed_config, record_launches

H100 = dict(capability_major=9, smem_limit=227 * 1024, interpret=False, autotune=True)


def _problem(head_dim_pad=128, elem_bytes=2, max_seqlen_k=1024, deterministic=True, tma_layout=True, **device):
    return AttentionProblem(head_dim_pad=head_dim_pad, elem_bytes=elem_bytes, max_seqlen_k=max_seqlen_k,
                            deterministic=deterministic, tma_layout=tma_layout, **{**H100, **device})


def test_hopper_defaults():
    config = hx.resolve_attention_config(_problem())
    assert config.fwd_tma and config.fwd_autotune and config.bwd_autotune
    assert config.fwd_tiles == hx.PREFILL_FWD_CANDIDATES  # all fit 227 KiB at hd128 bf16
    assert not config.bwd_tma and not config.bwd_fused  # short: pointer backward, two launches
    assert config.bwd_dkdv_tiles[0] == hx.PREFILL_BWD_KV_CANDIDATES[0]
    assert config.bwd_dq_tiles[0] == hx.PREFILL_BWD_Q_CANDIDATES[0]
    assert config.bwd_atomic_tiles[0] == hx.PREFILL_BWD_ATOMIC_CANDIDATES[0]


def test_resolved_config_names_the_backend():
    """sm_90 resolves the Gluon family (so config=resolve_config(...) runs what the default call runs), other GPUs
    and the interpreter the Triton kernels; a hand-built config pins Triton."""
    assert hx.resolve_attention_config(_problem()).backend == "gluon"
    assert hx.resolve_attention_config(_problem(capability_major=8)).backend == "triton"
    assert hx.resolve_attention_config(_problem(capability_major=0, interpret=True)).backend == "triton"
    assert dataclasses.replace(hx.resolve_attention_config(_problem()), backend="triton").check().backend == "triton"


def test_long_sequences_take_the_fixed_tile_and_descriptor_backward():
    config = hx.resolve_attention_config(_problem(max_seqlen_k=hx.PREFILL_FWD_LONG_MIN_KEYS))
    assert config.fwd_tiles[0] == (128, 128, 8, 3) and not config.fwd_autotune
    assert config.bwd_tma and config.bwd_autotune
    shorter = hx.resolve_attention_config(_problem(max_seqlen_k=hx.PREFILL_FWD_LONG_MIN_KEYS - 1))
    assert shorter.fwd_autotune and shorter.bwd_tma  # from PREFILL_BWD_TMA_MIN_KEYS
    assert not hx.resolve_attention_config(_problem(max_seqlen_k=hx.PREFILL_BWD_TMA_MIN_KEYS - 1)).bwd_tma
    # the descriptor backward is a deterministic-mode default only
    assert not hx.resolve_attention_config(_problem(max_seqlen_k=16384, deterministic=False)).bwd_tma


@pytest.mark.parametrize("changes", [dict(head_dim_pad=64), dict(head_dim_pad=256), dict(elem_bytes=4),
                                     dict(tma_layout=False), dict(capability_major=8)], ids=str)
def test_fixed_tile_only_where_measured(changes):
    """16-bit hd128 on the descriptor path only; elsewhere long sequences are autotuned."""
    config = hx.resolve_attention_config(_problem(max_seqlen_k=65536, **changes))
    assert config.fwd_autotune


def test_pre_hopper_and_bad_layouts_use_pointers():
    for changes in (dict(capability_major=8), dict(tma_layout=False)):
        config = hx.resolve_attention_config(_problem(max_seqlen_k=16384, **changes))
        assert not config.fwd_tma and not config.bwd_tma


def test_head_dim_256_tiles_and_fused_backward():
    config = hx.resolve_attention_config(_problem(head_dim_pad=256, max_seqlen_k=hx.PREFILL_BWD_FUSED_MIN_KEYS))
    assert config.bwd_fused
    assert config.fwd_tiles[0] == hx.PREFILL_LARGE_HEAD_DIM_CANDIDATES["fwd"][0]
    assert config.bwd_fused_tiles[0] == hx.PREFILL_LARGE_HEAD_DIM_CANDIDATES["bwd_fused"][0]
    assert not hx.resolve_attention_config(_problem(head_dim_pad=256, max_seqlen_k=4096)).bwd_fused
    assert not hx.resolve_attention_config(_problem(head_dim_pad=128, max_seqlen_k=16384)).bwd_fused


def test_fp32_tiles_are_pruned_to_shared_memory():
    config = hx.resolve_attention_config(_problem(head_dim_pad=256, elem_bytes=4, smem_limit=99 * 1024))
    for tile in config.fwd_tiles:
        assert hx.prefill_shared_bytes(tile[0], tile[1], 256, tile[3], 4) <= 99 * 1024 or len(config.fwd_tiles) == 1


def test_interpreter_and_autotune_switch():
    config = hx.resolve_attention_config(_problem(interpret=True, capability_major=0))
    assert config.fwd_tiles == ((32, 32, 4, 1),) and not config.fwd_autotune and not config.fwd_tma
    assert config.bwd_fused_tiles == ((32, 32, 32, 32, False, 4, 1),)
    off = hx.resolve_attention_config(_problem(autotune=False))
    assert not off.fwd_autotune and not off.bwd_autotune


@pytest.mark.parametrize("n", [1, 4096, 8191, 8192, 12000, 16383, 16384, 65536])
def test_length_class_decides_like_the_length(n):
    """Launch caches key on prefill_length_class: every length of a class resolves to the same configuration."""
    same_class = [m for m in (1, 4096, 8191, 8192, 12000, 16383, 16384, 65536)
                  if hx.prefill_length_class(m) == hx.prefill_length_class(n)]
    for head_dim_pad in (128, 256):
        configs = {hx.resolve_attention_config(_problem(head_dim_pad=head_dim_pad, max_seqlen_k=m)) for m in same_class}
        assert len(configs) == 1


def test_config_override_is_validated():
    q, k, v = _inputs(torch.Generator().manual_seed(0), torch.float16, (1, 8, 2, 64), (1, 8, 2, 64))
    with pytest.raises(TypeError, match="config must be a flashdecode.AttentionConfig"):
        flashdecode.flash_attn(q, k, v, config={"fwd_tma": True})
    good = attn_ops.resolve_config(q, k, v)
    with pytest.raises(ValueError, match="config.fwd_tiles"):
        flashdecode.flash_attn(q, k, v, config=dataclasses.replace(good, fwd_tiles=()))
    with pytest.raises(ValueError, match="config.bwd_fused_tiles"):
        flashdecode.flash_attn(q, k, v, config=dataclasses.replace(good, bwd_fused_tiles=((64, 64, 4, 2),)))
    with pytest.raises(TypeError, match="config.bwd_tma"):
        flashdecode.flash_attn(q, k, v, config=dataclasses.replace(good, bwd_tma="yes"))
    with pytest.raises(ValueError, match="config.backend"):
        flashdecode.flash_attn(q, k, v, config=dataclasses.replace(good, backend="cuda"))
    cu = torch.tensor([0, 8], dtype=torch.int32, device=q.device)
    with pytest.raises(TypeError, match="config must be"):
        flashdecode.flash_attn_varlen(q[0], k[0], v[0], cu, cu, 8, 8, config=1)
    assert flashdecode.AttentionConfig is AttentionConfig


def test_config_reaches_the_kernels_through_the_custom_op(gen, monkeypatch):
    """A given config travels through torch.compile's custom ops as an index: the compiled call launches the
    one-launch backward it asks for (the resolved config would take two launches here). fullgraph=True: the config
    must reach the interning without a graph break on every supported torch (a dataclass instance cannot be an
    assume_constant_result argument in torch 2.11's Dynamo; ops/attention.py passes its field values)."""
    launched = record_launches(monkeypatch)
    q, k, v = (x.requires_grad_() for x in _inputs(gen, KERNEL_DTYPES[0], (1, 33, 2, 64), (1, 33, 2, 64)))
    config = fixed_config(q, k, v, bwd_fused=True)

    def step(a, b, c):
        return flashdecode.flash_attn(a, b, c, causal=True, config=config).float().sum()

    torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v).backward()
    assert launched == ["fwd", "bwd_fused"]


@pytest.mark.parametrize("seqlen", [100, 300], ids=str)
def test_descriptor_forward_with_the_long_sequence_tile(gen, monkeypatch, seqlen):
    """The fixed long-sequence tile (BLOCK_M = BLOCK_N = 128) on the descriptor path, ragged and exact."""
    launched = record_launches(monkeypatch)
    check_dense(gen, KERNEL_DTYPES[0], 1, seqlen, seqlen, 2, 1, 128, causal=True,
                config_changes=dict(fwd_tma=True, fwd_tiles=(hx.PREFILL_FWD_LONG_CANDIDATES[0],)))
    assert launched == ["fwd"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_gpu_long_sequences_resolve_the_fixed_tile():
    q = torch.randn(1, 16384, 4, 128, device="cuda", dtype=torch.bfloat16)
    config = attn_ops.resolve_config(q, q, q)
    if torch.cuda.get_device_capability()[0] >= 9:
        assert config.fwd_tma and not config.fwd_autotune and config.fwd_tiles[0] == (128, 128, 8, 3)


def test_autotune_switch_is_read_when_resolving(monkeypatch):
    """FLASHDECODE_AUTOTUNE is the one environment variable, read per call (not at import)."""
    q = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
    monkeypatch.setenv(attn_ops.AUTOTUNE_ENV, "0")
    assert not attn_ops.attention_problem(q, q, q, 8).autotune
    monkeypatch.delenv(attn_ops.AUTOTUNE_ENV)
    assert attn_ops.attention_problem(q, q, q, 8).autotune
    with pytest.raises(ValueError, match="max_seqlen_k"):
        attn_ops.resolve_config(q[0], q[0], q[0])


def test_ragged_gluon_launch_rule():
    """resolve_gluon_varlen_config: the dense rule at the mean key count, except one CTA per tile where the dense
    rule takes host tile lists (they need the lengths on the host) and for causal hd128 batches averaging more
    than RAGGED_PAIRS_MAX_KEYS keys (ragged heads do not pair into equal units); hd64 keeps the dense rule."""
    from flashdecode.ops import gluon_attention as ga

    for causal in (False, True):
        for mean_keys in (256, 1024, 2048, 4096, 8192, 16384):
            cfg = ga.resolve_gluon_varlen_config(128, causal, mean_keys)
            assert cfg.tile_order != "lpt"
            if causal and mean_keys > ga.RAGGED_PAIRS_MAX_KEYS:
                assert not cfg.persistent and not cfg.overlap
            assert cfg == ga.resolve_gluon_varlen_config(128, causal, mean_keys)  # pure
    assert ga.resolve_gluon_varlen_config(128, True, 256).tile_order == "pairs"
    assert ga.resolve_gluon_varlen_config(128, False, 4096).overlap  # the non-causal lpt range: one CTA per tile
    assert ga.resolve_gluon_varlen_config(64, True, 2048) == ga.resolve_gluon_config(64, True, 2048)
