"""Llama family (Llama 2/3/3.1/3.2, CodeLlama, Mistral) for the engine.

Module and parameter names follow HF (model.layers.N.self_attn.o_proj.weight, ...) except the two fused
projections: q/k/v_proj live in ``self_attn.qkv_proj`` and gate/up_proj in ``mlp.gate_up_proj``; ``PACKED_MODULES``
says which HF tensor goes to which shard, and the loader reads it.

Activations are flat over tokens: input_ids (tokens,), a prefill packs many prompts, a decode step has one token
per sequence. Attention is delegated to an attention backend (flashdecode.engine.attention) with the per-step
metadata and each layer's paged K/V cache.

Tensor parallelism (``parallel``, a flashdecode.distributed.ParallelState): each rank builds the layers with its
heads and MLP columns only (column-parallel qkv / gate_up keeping their rows of the HF tensors, row-parallel o_proj
/ down_proj ending in the group's all-reduce); norms, embeddings and the LM head are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashdecode.engine.attention import AttentionBackend, AttentionMetadata
from flashdecode.engine.config import ModelConfig
from flashdecode.engine.kv_quant import QuantPages
from flashdecode.engine.layers import flat_gemm, fused, gemv
from flashdecode.distributed.groups import ParallelState
from flashdecode.engine.layers.linear import Linear, MergedLinear, RowParallelLinear
from flashdecode.engine.layers.norm import RMSNorm
from flashdecode.engine.layers.rotary import RotaryEmbedding

# HF module name -> (our fused module name, shard)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _output_projection(in_features: int, out_features: int, bias: bool, dtype, device, take_cols: tuple[int, int],
                       parallel: ParallelState):
    """o_proj / down_proj: a plain Linear on one rank, row-parallel (+ all-reduce) under tensor parallelism."""
    if parallel.tp_size == 1:
        return Linear(in_features, out_features, bias, dtype, device)
    return RowParallelLinear(in_features, out_features, bias, dtype, device, take_cols=take_cols, parallel=parallel)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device, parallel: ParallelState):
        super().__init__()
        d = self.head_dim = cfg.head_dim
        q0, q1 = parallel.shard(cfg.num_attention_heads)
        k0, k1 = parallel.kv_head_shard(cfg.num_key_value_heads)
        self.nheads, self.nheads_kv = q1 - q0, k1 - k0  # this rank's heads
        q_size, kv_size = self.nheads * d, self.nheads_kv * d
        take = {"q": (q0 * d, q1 * d), "k": (k0 * d, k1 * d), "v": (k0 * d, k1 * d)} if parallel.tp_size > 1 else None
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, cfg.qkv_bias, dtype,
                                     device, take_rows=take)
        self.o_proj = _output_projection(cfg.q_size, cfg.hidden_size, cfg.o_bias, dtype, device, (q0 * d, q1 * d),
                                         parallel)
        self.splits = (q_size, kv_size, kv_size)
        self.fused_rope = fused.rope_supported(cfg.head_dim)

    # this module's Triton kernels (rope + KV write, the one-token o_proj GEMV) launched as programmatic dependents
    # (flashdecode.engine.layers.pdl.install sets it, like on the modules below)
    use_pdl = False

    def forward(self, x, positions, rotary, meta: AttentionMetadata, kv_cache, backend: AttentionBackend,
                use_fused: bool = False):
        """x (tokens, hidden) -> (tokens, hidden); writes this step's K/V into kv_cache = (k_pages, v_pages)."""
        return self.attend(self.qkv_proj(x), positions, rotary, meta, kv_cache, backend, use_fused)

    def attend(self, qkv, positions, rotary, meta: AttentionMetadata, kv_cache, backend: AttentionBackend,
               use_fused: bool = False, use_gemv: bool = False):
        """qkv (tokens, q_size + 2 kv_size) = the qkv projection -> attention + o_proj, (tokens, hidden)."""
        tokens = qkv.shape[0]
        q, k, v = self._rotate_and_store(qkv, positions, rotary, meta, kv_cache, backend, use_fused)
        k_cache, v_cache = kv_cache
        if meta.reads_pages:  # a chunk after K/V already in the pages: its own K/V are written there too
            o = backend.prefill_paged(q, k_cache, v_cache, meta)
        elif meta.is_prefill:
            o = backend.prefill(q, k, v, meta)
        else:
            o = backend.decode(q, k_cache, v_cache, meta)
        o = o.reshape(tokens, self.nheads * self.head_dim)
        if use_gemv:
            return self.o_proj.finish(gemv.gemv(o, self.o_proj.weight, self.o_proj.local_bias, pdl=self.use_pdl))
        return self.o_proj(o)

    def forward_last_rows(self, x, positions, rotary, meta: AttentionMetadata, kv_cache, backend: AttentionBackend,
                          use_fused: bool, last_rows: torch.Tensor) -> torch.Tensor:
        """Prefill where only the rows ``last_rows`` (int64 (n,), one per sequence: its last token) are wanted
        downstream: K/V of every token are still rotated and written to the cache, but only those rows attend
        (to all keys of their sequence) and go through o_proj. x (tokens, hidden) -> (n, hidden)."""
        q, k, v = self._rotate_and_store(self.qkv_proj(x), positions, rotary, meta, kv_cache, backend, use_fused)
        if meta.reads_pages:
            o = backend.prefill_paged(q[last_rows], *kv_cache, meta, last_only=True)
        else:
            o = backend.prefill_last(q[last_rows], k, v, meta)
        return self.o_proj(o.reshape(last_rows.shape[0], self.nheads * self.head_dim))

    def _rotate_and_store(self, qkv, positions, rotary, meta: AttentionMetadata, kv_cache, backend, use_fused):
        """qkv (tokens, q_size + 2 kv_size) -> rotated q (tokens, nheads, d), k and v (tokens, nheads_kv, d); k/v
        also written to this layer's pages."""
        tokens = qkv.shape[0]
        k_cache, v_cache = kv_cache
        # one kernel: rotate q/k, write k/v to pages (8-bit pages quantised in it too where QUANT_ROPE_STORE is on;
        # otherwise rotary, then write_kv's quantising append_kv)
        quant = isinstance(k_cache, QuantPages)
        if use_fused and self.fused_rope and rotary.has_table and (not quant or fused.QUANT_ROPE_STORE):
            if quant:
                k_pages, v_pages, scales = k_cache.data, v_cache.data, dict(k_scale=k_cache.scale,
                                                                            v_scale=v_cache.scale)
            else:
                k_pages, v_pages, scales = k_cache, v_cache, {}
            q, k, v = fused.rope_and_store(qkv, positions, rotary.cos_table, rotary.sin_table, meta.slot_mapping,
                                           k_pages, v_pages, self.nheads, self.nheads_kv, self.head_dim,
                                           pdl=self.use_pdl, **scales)
        else:
            q, k, v = qkv.split(self.splits, dim=-1)
            q = q.view(tokens, self.nheads, self.head_dim)
            k = k.view(tokens, self.nheads_kv, self.head_dim)
            v = v.view(tokens, self.nheads_kv, self.head_dim)
            q, k = rotary(q, k, positions, meta.rope_lens)
            backend.write_kv(k_cache, v_cache, k, v, meta)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device, parallel: ParallelState):
        super().__init__()
        i0, i1 = parallel.shard(cfg.intermediate_size)
        i = self.intermediate_size = i1 - i0  # this rank's columns
        take = {"gate": (i0, i1), "up": (i0, i1)} if parallel.tp_size > 1 else None
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": i, "up": i}, False, dtype, device, take_rows=take)
        self.down_proj = _output_projection(cfg.intermediate_size, cfg.hidden_size, False, dtype, device, (i0, i1),
                                            parallel)

    use_pdl = False  # silu*mul launched as a programmatic dependent

    def forward(self, x, use_fused: bool = False):
        if use_fused:  # one launch where the flat-GEMM table chose its silu*mul epilogue, else GEMM + silu_and_mul
            act = self.gate_up_proj.forward_silu_mul(x)
            if act is None:
                act = fused.silu_and_mul(self.gate_up_proj(x), pdl=self.use_pdl)
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    attention_cls = Attention  # Qwen3 adds q/k norms to it

    def __init__(self, cfg: ModelConfig, dtype, device, parallel: ParallelState):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = self.attention_cls(cfg, dtype, device, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device, parallel)

    use_pdl = False  # forward_one_token's GEMVs launched as programmatic dependents

    def forward(self, x, residual, positions, rotary, meta, kv_cache, backend, use_fused: bool):
        """Residual-stream form of HF's block: returns (mlp output, residual) with residual + output = HF's layer
        output; the adds happen inside the next norms (fused with them on CUDA). residual None = first layer."""
        if residual is None:
            residual, h = x, self.input_layernorm(x, use_fused=use_fused)
        else:
            h, residual = self.input_layernorm(x, residual, use_fused=use_fused)
        h = self.self_attn(h, positions, rotary, meta, kv_cache, backend, use_fused)
        h, residual = self.post_attention_layernorm(h, residual, use_fused=use_fused)
        return self.mlp(h, use_fused), residual

    def forward_last_rows(self, x, residual, positions, rotary, meta, kv_cache, backend, use_fused: bool,
                          last_rows: torch.Tensor):
        """forward() of the model's last layer in a prefill that only needs the rows ``last_rows``: the input norm
        and the K/V write cover every token, attention output, MLP and the residual stream only those rows.
        Returns (mlp output, residual), both (len(last_rows), hidden)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x, use_fused=use_fused)
        else:
            h, residual = self.input_layernorm(x, residual, use_fused=use_fused)
        h = self.self_attn.forward_last_rows(h, positions, rotary, meta, kv_cache, backend, use_fused, last_rows)
        h, residual = self.post_attention_layernorm(h, residual[last_rows], use_fused=use_fused)
        return self.mlp(h, use_fused), residual

    def forward_one_token(self, x, residual, positions, rotary, meta, kv_cache, backend):
        """forward() for a single token with every projection a Triton GEMV and the norms / silu*mul fused into
        the GEMV input loads (6-7 launches per layer instead of 9-10). x, residual (1, hidden)."""
        attn, mlp, pdl = self.self_attn, self.mlp, self.use_pdl
        if residual is None:
            residual = x
            qkv = gemv.gemv(x, attn.qkv_proj.weight, attn.qkv_proj.bias, prologue=gemv.RMSNORM,
                            norm_weight=self.input_layernorm.weight, eps=self.input_layernorm.eps, pdl=pdl)
        else:
            qkv, residual = gemv.gemv(x, attn.qkv_proj.weight, attn.qkv_proj.bias, prologue=gemv.ADD_NORM,
                                      residual=residual, norm_weight=self.input_layernorm.weight,
                                      eps=self.input_layernorm.eps, pdl=pdl)
        h = attn.attend(qkv, positions, rotary, meta, kv_cache, backend, use_fused=True, use_gemv=True)
        gate_up, residual = gemv.gemv(h, mlp.gate_up_proj.weight, prologue=gemv.ADD_NORM, residual=residual,
                                      norm_weight=self.post_attention_layernorm.weight,
                                      eps=self.post_attention_layernorm.eps, pdl=pdl)
        return mlp.down_proj.finish(gemv.gemv(gate_up, mlp.down_proj.weight, prologue=gemv.SILU_MUL, pdl=pdl)), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device, parallel: ParallelState, layer_cls=DecoderLayer,
                 norm_cls=RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                                             device=device))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(layer_cls(cfg, dtype, device, parallel) for _ in range(cfg.num_hidden_layers))
        self.norm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """The whole model. ``max_positions`` sizes the rotary table (positions beyond it are rejected upstream);
    ``parallel`` (default: one rank) says which heads / MLP columns this rank holds."""

    PACKED_MODULES = PACKED_MODULES
    layer_cls, norm_cls = DecoderLayer, RMSNorm  # the block and the final norm (other families swap them)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, max_positions: int,
                 parallel: ParallelState | None = None):
        super().__init__()
        self.config = cfg
        self.parallel = parallel or ParallelState.single()
        self.parallel.config.check_model(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                                         cfg.sliding_window)
        self.model = LlamaModel(cfg, dtype, device, self.parallel, self.layer_cls, self.norm_cls)
        # fused Triton elementwise kernels (norm+residual, rope+KV write, silu*mul): on CUDA by default
        self.use_fused = torch.device(device).type == "cuda"
        # single-token steps (batch-1 decode) through the Triton GEMV with fused norm/silu prologues
        self.use_gemv = torch.device(device).type == "cuda"
        # a flat_gemm.ChoiceTable (flat_gemm.install): the lm_head's small decode batches through the flat GEMM
        # where it wins (the decoder layers' linears consult the table themselves)
        self.flat_table = None
        # the Triton kernels of a decode step (fused elementwise, GEMV, flat GEMM) as programmatic dependent
        # launches: off unless the engine turns it on (LLM(pdl=...), flashdecode.engine.layers.pdl)
        self.use_pdl = False
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings, max_positions, device)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)

    @property
    def cache_kv_heads(self) -> int:
        """KV heads this rank's cache stores (all of them without tensor parallelism)."""
        return self.model.layers[0].self_attn.nheads_kv if len(self.model.layers) else self.config.num_key_value_heads

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list, backend: AttentionBackend, last_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions int64 (tokens,) -> final hidden states (tokens, hidden) in the model dtype.

        last_rows (prefill only): int64 (n,) rows whose hidden states are wanted, one per sequence (its last
        token, whose logits sample the next one); the result is then (n, hidden) and the last layer skips the other
        rows after its K/V write (at 64k tokens that is 1/32 of the attention and of the MLP / o_proj GEMMs).
        """
        x, residual = self.model.embed_tokens(input_ids), None
        one_token = self.use_gemv and input_ids.shape[0] == 1 and self.use_fused
        last_layer = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if one_token:
                x, residual = layer.forward_one_token(x, residual, positions, self.rotary, meta, kv_cache, backend)
            elif last_rows is not None and i == last_layer:
                x, residual = layer.forward_last_rows(x, residual, positions, self.rotary, meta, kv_cache, backend,
                                                      self.use_fused, last_rows)
            else:
                x, residual = layer(x, residual, positions, self.rotary, meta, kv_cache, backend, self.use_fused)
        if one_token and last_rows is not None:
            x, residual = x[last_rows], residual[last_rows]
        return self.model.norm(x, residual, use_fused=self.use_fused)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (rows, hidden) -> float32 logits (rows, vocab)."""
        if self.use_gemv and hidden.shape[0] == 1 and hidden.is_contiguous():
            return gemv.gemv(hidden, self.lm_head_weight, pdl=self.use_pdl).float()
        config = None if self.flat_table is None else self.flat_table.choose(hidden.shape[0],
                                                                              *self.lm_head_weight.shape)
        if config is not None and hidden.stride(-1) == 1:
            return flat_gemm.flat_gemm(hidden, self.lm_head_weight, config=config, pdl=self.use_pdl).float()
        return F.linear(hidden, self.lm_head_weight).float()

    @torch.no_grad()
    def init_random_(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (benchmarks; no checkpoint can be downloaded here): N(0, std), norms 1, biases small."""
        gen = torch.Generator(device=self.model.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
