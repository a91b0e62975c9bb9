"""Pools of decode workspace (split partials, merge tickets, an lse nobody asked for): one per device for
flash_decode calls under CUDA-graph capture, which must not allocate (eager calls size it, reserve; captured calls
take views of it, take), and one per (device, stream) for eager calls, which take views of it instead of allocating
per call (the launches of one stream run in order, so one call's workspace is free when the next call's kernels
start; a stream of its own never shares it with another stream's kernels). Calls inside
util.call_scoped_buffers (an op that torch.compile runs) touch neither: each gets its own (``call_workspace``)."""

from __future__ import annotations

import math

import torch

_POOLS: dict = {}
# the persistent decode kernel's work queue, the last tickets of a draw: the next item, and the programs that found
# none (kernels/decode.py DYNAMIC; ops/decode_launch.py)
QUEUE_SLOTS = 2


class _Workspace:
    """Flat fp32 partial-output / partial-lse buffers and int32 tickets (zeros at rest: every kernel that draws
    tickets leaves them zero), grown to the largest request seen, never shrunk."""

    def __init__(self, device: torch.device):
        self.device = device
        self.o = torch.empty(0, dtype=torch.float32, device=device)
        self.lse = torch.empty(0, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(0, dtype=torch.int32, device=device)
        self.lse_out = torch.empty(0, dtype=torch.float32, device=device)
        self._views: dict = {}  # take_eager's views per request
        self._lengths: dict = {}  # lengths_view's int32 buffers per (slot, batch)

    def reserve(self, partial_shape, n_tickets: int) -> None:
        """Grow the buffers for partials of ``partial_shape`` (batch, seqlen_q, nheads, splits, headdim) (None:
        no split) and ``n_tickets`` tickets."""
        if partial_shape is not None:
            o_elems, lse_elems = math.prod(partial_shape), math.prod(partial_shape[:-1])
            if o_elems > self.o.numel():
                self.o = torch.empty(o_elems, dtype=torch.float32, device=self.device)
            if lse_elems > self.lse.numel():
                self.lse = torch.empty(lse_elems, dtype=torch.float32, device=self.device)
        if n_tickets > self.tickets.numel():
            self.tickets = torch.zeros(n_tickets, dtype=torch.int32, device=self.device)

    def take(self, partial_shape, n_tickets: int):
        """(partial_o, partial_lse, tickets) views for one call (None where not needed), growing first if an eager
        call has not sized the pool for it."""
        self.reserve(partial_shape, n_tickets)
        partial_o = partial_lse = tickets = None
        if partial_shape is not None:
            partial_o = self.o[: math.prod(partial_shape)].view(partial_shape)
            partial_lse = self.lse[: math.prod(partial_shape[:-1])].view(partial_shape[:-1])
        if n_tickets:
            tickets = self.tickets[:n_tickets]
        return partial_o, partial_lse, tickets

    def take_eager(self, partial_shape, n_tickets: int, lse_shape) -> tuple:
        """take()'s views, where ``lse_shape`` is not None a float32 view of that shape for an lse the caller did
        not ask for (written, never read), else None, and the last ``queue_slots`` tickets (the persistent kernel's
        work queue; None without tickets); the views of each request are kept until a buffer grows (an eager call
        of a stream's pool then slices nothing)."""
        key = (partial_shape, n_tickets, lse_shape)
        found = self._views.get(key)
        if found is None:
            buffers = (self.o, self.lse, self.tickets)
            views = self.take(partial_shape, n_tickets)
            lse = None
            if lse_shape is not None:
                n = math.prod(lse_shape)
                if n > self.lse_out.numel():
                    self.lse_out = torch.empty(n, dtype=torch.float32, device=self.device)
                    self._views.clear()
                lse = self.lse_out[:n].view(lse_shape)
            grown = any(a is not b for a, b in zip(buffers, (self.o, self.lse, self.tickets)))
            if grown:  # the views kept so far point at the old buffers
                self._views.clear()
            tickets = views[2]
            queue = None if tickets is None else tickets[n_tickets - QUEUE_SLOTS:]
            found = self._views[key] = views + (lse, queue)
        return found


    def lengths_view(self, slot: str, batch: int) -> torch.Tensor:
        """An int32 (batch,) buffer for lengths an eager wrapper derives per call and writes in place (e.g.
        flash_attn_with_kvcache's cache_seqlens + seqlen_new), one per ``slot``: the kernels of the stream's previous
        call have read it before the next call's write runs (stream order), so no call allocates one."""
        key = (slot, batch)
        found = self._lengths.get(key)
        if found is None:
            if len(self._lengths) >= 64:  # a handful of batch sizes in practice; bounded all the same
                self._lengths.clear()
            found = self._lengths[key] = torch.zeros(batch, dtype=torch.int32, device=self.device)
        return found


def call_workspace(device: torch.device, partial_shape, n_tickets: int) -> tuple:
    """(partial_o, partial_lse, tickets) of one call that keeps nothing (util.call_scoped_buffers): new tensors,
    freed when the call's last reference goes (None where not needed; tickets zeros)."""
    partial_o = partial_lse = tickets = None
    if partial_shape is not None:
        partial_o = torch.empty(partial_shape, dtype=torch.float32, device=device)
        partial_lse = torch.empty(partial_shape[:-1], dtype=torch.float32, device=device)
    if n_tickets:
        tickets = torch.zeros(n_tickets, dtype=torch.int32, device=device)
    return partial_o, partial_lse, tickets


def stream_workspace(device: torch.device, stream) -> _Workspace:
    """The pool of eager calls on ``stream`` (a raw stream handle; any hashable on CPU) of ``device``."""
    key = (device, stream)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = _Workspace(device)
    return pool


def workspace(device: torch.device) -> _Workspace:
    """The pool of ``device`` (one per device, made on first use)."""
    pool = _POOLS.get(device)
    if pool is None:
        pool = _POOLS[device] = _Workspace(device)
    return pool
