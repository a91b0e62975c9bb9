"""A stand-in for the flashinfer package on the CPU: its three wrappers with FlashInfer's documented plan / run
semantics, computed by flashdecode.reference, so the engine's FlashInfer backend runs end to end without CUDA.

Each plan checks what the real one needs (int32 offsets; indptr and last_page_len on the host, since FlashInfer
reads them there; the page indices no longer than a CUDA-graph buffer) and is recorded in ``calls`` with the
wrapper it planned (a wrapper planned twice in one forward would race FlashInfer's asynchronous plan copy). In
CUDA-graph mode the plan copies its inputs into the wrapper's fixed buffers and run reads only those (as a
replayed graph does). Paged KV: row b's pages are indices[indptr[b]:indptr[b + 1]], its keys the first
(pages - 1) * page_size + last_page_len[b] slots of them; causal masks align bottom-right; window_left >= 0 keeps
keys pos - window_left .. pos."""

from __future__ import annotations

import types

import torch

from flashdecode import reference


def _check_int32(**tensors) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")


def _check_host(**tensors) -> None:
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise AssertionError(f"{name} must be a host tensor (the plan reads it on the host), got {t.device}")


def _attend(q, k, v, qo_indptr, kv_indptr, causal: bool, window_left: int):
    out, _ = reference.attention_varlen_ref(q, k, v, qo_indptr.to(torch.int32), kv_indptr.to(torch.int32),
                                            causal=causal, window_size=(window_left, 0 if causal else -1))
    return out.to(q.dtype)


def _gather_paged(k_cache, v_cache, indptr, indices, last_page_len):
    """Each row's keys out of the pages, packed: k, v (total, hk, d) and their int32 indptr (batch + 1,)."""
    page_size = k_cache.shape[1]
    ks, vs, lens = [], [], []
    for b in range(len(last_page_len)):
        pages = indices[int(indptr[b]):int(indptr[b + 1])].long()
        n = (len(pages) - 1) * page_size + int(last_page_len[b]) if len(pages) else 0
        ks.append(k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n])
        vs.append(v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n])
        lens.append(n)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return torch.cat(ks), torch.cat(vs), cu


class _Wrapper:
    def __init__(self, calls: list, kind: str, workspace, layout: str, **kwargs):
        if layout != "NHD":
            raise ValueError(f"the engine's pages are NHD, got {layout}")
        self.calls, self.kind, self.kwargs = calls, kind, kwargs
        self.plan_args = None
        calls.append(("init", kind, kwargs))


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    def __init__(self, workspace, layout="NHD", **kwargs):
        super().__init__(self.calls_list, "ragged", workspace, layout, **kwargs)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, causal=False, window_left=-1,
             q_data_type=None, kv_data_type=None):
        _check_int32(qo_indptr=qo_indptr, kv_indptr=kv_indptr)
        _check_host(qo_indptr=qo_indptr, kv_indptr=kv_indptr)
        self.plan_args = dict(qo_indptr=qo_indptr.clone(), kv_indptr=kv_indptr.clone(), num_qo_heads=num_qo_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim_qk, causal=causal,
                              window_left=window_left, q_data_type=q_data_type, kv_data_type=kv_data_type)
        self.plan_args["wrapper"] = self
        self.calls.append(("plan", "ragged", self.plan_args))

    def run(self, q, k, v):
        a = self.plan_args
        assert q.shape[0] == int(a["qo_indptr"][-1]) and k.shape[0] == int(a["kv_indptr"][-1])
        assert (q.shape[1], k.shape[1], q.shape[2]) == (a["num_qo_heads"], a["num_kv_heads"], a["head_dim"])
        self.calls.append(("run", "ragged", None))
        return _attend(q, k, v, a["qo_indptr"], a["kv_indptr"], a["causal"], a["window_left"])


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, workspace, layout="NHD", **kwargs):
        super().__init__(self.calls_list, "paged", workspace, layout, **kwargs)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, causal=False, window_left=-1, q_data_type=None,
             kv_data_type=None):
        _check_int32(qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr, paged_kv_indices=paged_kv_indices,
                     paged_kv_last_page_len=paged_kv_last_page_len)
        _check_host(qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr,
                    paged_kv_last_page_len=paged_kv_last_page_len)
        self.plan_args = dict(qo_indptr=qo_indptr.clone(), indptr=paged_kv_indptr.clone(),
                              indices=paged_kv_indices.clone(), last_page_len=paged_kv_last_page_len.clone(),
                              num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim_qk,
                              page_size=page_size, causal=causal, window_left=window_left, q_data_type=q_data_type,
                              kv_data_type=kv_data_type)
        self.plan_args["wrapper"] = self
        self.calls.append(("plan", "paged", self.plan_args))

    def run(self, q, paged_kv_cache):
        a = self.plan_args
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1] == a["page_size"] and k_cache.stride() == v_cache.stride()
        k, v, cu_k = _gather_paged(k_cache, v_cache, a["indptr"], a["indices"], a["last_page_len"])
        self.calls.append(("run", "paged", None))
        return _attend(q, k, v, a["qo_indptr"], cu_k, a["causal"], a["window_left"])


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, workspace, layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        super().__init__(self.calls_list, "decode", workspace, layout, use_cuda_graph=use_cuda_graph,
                         use_tensor_cores=use_tensor_cores)
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.use_cuda_graph = use_cuda_graph

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             window_left=-1, q_data_type=None, kv_data_type=None):
        _check_int32(indptr=indptr, indices=indices, last_page_len=last_page_len)
        _check_host(indptr=indptr, last_page_len=last_page_len)
        if self.use_cuda_graph:
            indptr_buf, indices_buf, last_buf = self.buffers
            if len(last_page_len) != len(last_buf):
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            indptr_buf.copy_(indptr)
            last_buf.copy_(last_page_len)
            indices_buf[:len(indices)].copy_(indices)
        self.plan_args = dict(indptr=indptr.clone(), indices=indices.clone(), last_page_len=last_page_len.clone(),
                              num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              page_size=page_size, window_left=window_left, q_data_type=q_data_type,
                              kv_data_type=kv_data_type)
        self.plan_args["wrapper"] = self
        self.calls.append(("plan", "decode", self.plan_args))

    def run(self, q, paged_kv_cache):
        a = self.plan_args
        k_cache, v_cache = paged_kv_cache
        indptr, indices, last = self.buffers if self.use_cuda_graph else (a["indptr"], a["indices"],
                                                                          a["last_page_len"])
        assert q.shape[0] == len(last) and k_cache.stride() == v_cache.stride()
        k, v, cu_k = _gather_paged(k_cache, v_cache, indptr, indices, last)
        self.calls.append(("run", "decode", None))
        one_each = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        return _attend(q, k, v, one_each, cu_k, True, a["window_left"])


def fake_module() -> types.ModuleType:
    """A fresh fake ``flashinfer`` module; ``module.calls`` lists every wrapper's (event, kind, args)."""
    mod = types.ModuleType("flashinfer")
    mod.calls = []
    for cls in (BatchPrefillWithRaggedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                BatchDecodeWithPagedKVCacheWrapper):
        setattr(mod, cls.__name__, type(cls.__name__, (cls,), {"calls_list": mod.calls}))
    return mod
