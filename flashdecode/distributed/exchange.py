"""StateExchange: one collective that moves the small (out, lse) partial attention states between the ranks of a
group, and the exact log-sum-exp merge of what arrives.

A rank's partial state is o (rows, nheads, headdim) in the attention dtype plus lse (rows, nheads) float32, where
``rows`` is batch (x seqlen_q). Both are packed into ONE byte buffer so that one collective carries them:

    segment = [ lse (rows, heads) float32 | pad to 16 B | o (rows, heads, headdim) dtype | pad to 16 B ]

laid out for the call's rows (not the maximum), so a small batch moves only its own bytes.

* ``all_gather``: every rank sends its whole segment and receives every rank's (bytes in per rank:
  (world - 1) x segment); each rank then merges all heads (the output every rank needs when the next layer is
  replicated over the group).
* ``head_scatter`` (the "reduce-scatter by head"): the heads are cut into ``world`` equal slices; slice j of every
  rank goes to rank j with one all_to_all (bytes in per rank: (world - 1) / world x segment), and rank j merges only
  its slice. The result is (rows, nheads / world, headdim): what a row-parallel output projection over the same
  group consumes (Helix's layout); its all-reduce then completes the layer.

Buffers are allocated once (by the constructor) for a maximum row count; ``exchange`` works on any rows <= that
maximum. The collective is asynchronous with respect to the host (no .item(), no allocation), so under NCCL the
whole sequence - pack copies, collective, merge kernel - can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashdecode import reference
from flashdecode.ops import checks
from flashdecode.ops.merge import launch_merge_many

MODES = ("all_gather", "head_scatter")
_ALIGN = 16  # bytes: every typed view into the byte buffers starts 16-byte aligned (vector loads, dtype views)


def _pad(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _all_gather_bytes(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """All-gather a flat byte tensor into out (world * inp.numel(),): the current name, or the older one."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge N states along dim 0 into preallocated out/lse.

    outs (N, rows, heads, headdim), lses (N, rows, heads) float32, any strides; out (rows, heads, headdim) in
    outs' dtype, lse (rows, heads) float32. Triton's merge kernel on CUDA or under the interpreter; the float64
    reference merge on a plain CPU (the engine's CPU backend runs no Triton).
    """
    if out.numel() == 0:
        return
    if outs.device.type == "cuda" or checks.interpreting():
        launch_merge_many(outs, lses, out, lse, states_dim=0, lse_log2=False)
        return
    o_ref, lse_ref = reference.merge_states_many_ref(outs.double(), lses.double())
    out.copy_(o_ref)
    lse.copy_(lse_ref)


class StateExchange:
    """Preallocated buffers and the one collective for merging partial attention states across ``group``.

    Args:
        max_rows: most rows (batch x seqlen_q) one exchange carries.
        nheads, headdim: the state's heads and head dim (head_scatter needs nheads % world == 0).
        dtype: the partial outputs' dtype (fp16/bf16/fp32); lse is always float32.
        device: where the buffers live (the collective's device: CUDA for NCCL, CPU for gloo).
        group: a torch.distributed process group (None: the default group).
        mode: "all_gather" or "head_scatter" (module docstring).
    """

    def __init__(self, max_rows: int, nheads: int, headdim: int, dtype: torch.dtype, device, *, group=None,
                 mode: str = "all_gather"):
        checks.check_int("max_rows", max_rows, minimum=1)
        checks.check_int("nheads", nheads, minimum=1)
        checks.check_int("headdim", headdim, minimum=1)
        if dtype not in checks.FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {checks.FLOAT_DTYPES}, got {dtype}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("exchanging attention states needs an initialized torch.distributed process group "
                               "(dist.init_process_group, torchrun, or flashdecode.distributed.launch.spawn)")
        self.group, self.mode = group, mode
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if mode == "head_scatter" and nheads % self.world:
            raise ValueError(f"mode='head_scatter' needs nheads ({nheads}) divisible by the group size "
                             f"({self.world})")
        self.max_rows, self.nheads, self.headdim, self.dtype = max_rows, nheads, headdim, dtype
        self.device = checks.full_device(device)
        # heads of one segment: all of them (all_gather) or one destination's slice (head_scatter)
        self.seg_heads = nheads if mode == "all_gather" else nheads // self.world
        self.elem = torch.empty((), dtype=dtype).element_size()
        chunks_out = 1 if mode == "all_gather" else self.world
        u8 = dict(dtype=torch.uint8, device=self.device)
        self.send = torch.zeros(chunks_out * self._segment(max_rows)[1], **u8)
        self.recv = torch.zeros(self.world * self._segment(max_rows)[1], **u8)
        out_heads = nheads if mode == "all_gather" else self.seg_heads
        self.out = torch.empty(max_rows * out_heads * headdim, dtype=dtype, device=self.device)
        self.lse = torch.empty(max_rows * out_heads, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------------------------------ views
    def _segment(self, rows: int) -> tuple[int, int]:
        """(bytes before o, bytes of one segment) for ``rows`` rows."""
        lse_bytes = _pad(rows * self.seg_heads * 4)
        return lse_bytes, lse_bytes + _pad(rows * self.seg_heads * self.headdim * self.elem)

    def _views(self, buf: torch.Tensor, chunks: int, rows: int):
        """(o (chunks, rows, seg_heads, headdim), lse (chunks, rows, seg_heads)) views of the first ``chunks``
        segments of a byte buffer laid out for ``rows`` rows."""
        lse_bytes, segment = self._segment(rows)
        seg = buf[:chunks * segment].view(chunks, segment)
        h, d = self.seg_heads, self.headdim
        lse = seg[:, :rows * h * 4].view(torch.float32).view(chunks, rows, h)
        o = seg[:, lse_bytes:lse_bytes + rows * h * d * self.elem].view(self.dtype).view(chunks, rows, h, d)
        return o, lse

    def send_views(self, rows: int):
        """Where a rank's local state goes before ``exchange`` (all_gather mode only: the local attention can write
        its output straight into them). o (rows, nheads, headdim), lse (rows, nheads)."""
        if self.mode != "all_gather":
            raise ValueError("send_views is for mode='all_gather'; head_scatter packs the state by head slice")
        o, lse = self._views(self.send, 1, rows)
        return o[0], lse[0]

    def _check_rows(self, rows: int) -> None:
        if not 0 <= rows <= self.max_rows:
            raise ValueError(f"the state has {rows} rows but this exchange holds at most {self.max_rows}")

    # ------------------------------------------------------------------------------------------ run
    def exchange(self, o: torch.Tensor, lse: torch.Tensor):
        """Merge this rank's state (o (rows, nheads, headdim), lse (rows, nheads) float32) with every other rank's.

        Returns views of the exchange's own buffers (overwritten by the next call): all_gather -> (out (rows,
        nheads, headdim), lse (rows, nheads)); head_scatter -> this rank's head slice, (rows, nheads / world,
        headdim) and (rows, nheads / world). Every rank of the group must call it with the same rows.
        """
        rows = o.shape[0]
        self._check_rows(rows)
        if tuple(o.shape) != (rows, self.nheads, self.headdim) or o.dtype != self.dtype:
            raise ValueError(f"o must be ({rows}, {self.nheads}, {self.headdim}) {self.dtype}, got "
                             f"{tuple(o.shape)} {o.dtype}")
        if tuple(lse.shape) != (rows, self.nheads) or lse.dtype != torch.float32:
            raise ValueError(f"lse must be ({rows}, {self.nheads}) float32, got {tuple(lse.shape)} {lse.dtype}")
        if self.mode == "all_gather":
            return self.merge_local(rows, lambda out: (o, lse))
        send_o, send_lse = self._views(self.send, self.world, rows)  # slice j of the heads goes to rank j
        w, h = self.world, self.seg_heads
        send_o.copy_(o.view(rows, w, h, self.headdim).transpose(0, 1))
        send_lse.copy_(lse.view(rows, w, h).transpose(0, 1))
        return self.collect(rows)

    def merge_local(self, rows: int, local):
        """Run this rank's attention and merge it with the group's: ``local(out)`` computes the local state,
        writing its output into ``out`` when that is a tensor (all_gather: the send buffer itself, (rows, nheads,
        headdim), so the output is not copied) or anywhere when it is None, and returns (o, lse) shaped (rows,
        nheads, headdim) / (rows, nheads). Returns what ``exchange`` returns."""
        if self.mode != "all_gather":
            o, lse = local(None)
            return self.exchange(o, lse)
        send_o, send_lse = self.send_views(rows)
        o, lse = local(send_o)
        if o.data_ptr() != send_o.data_ptr():
            send_o.copy_(o)
        send_lse.copy_(lse)
        return self.collect(rows)

    def collect(self, rows: int):
        """The collective and the merge, once the send buffer holds this rank's state (see ``send_views``)."""
        self._check_rows(rows)
        segment = self._segment(rows)[1]
        if self.mode == "all_gather":
            _all_gather_bytes(self.recv[:self.world * segment], self.send[:segment], self.group)
        else:
            dist.all_to_all_single(self.recv[:self.world * segment], self.send[:self.world * segment],
                                   group=self.group)
        outs, lses = self._views(self.recv, self.world, rows)
        h = self.nheads if self.mode == "all_gather" else self.seg_heads
        out = self.out[:rows * h * self.headdim].view(rows, h, self.headdim)
        lse = self.lse[:rows * h].view(rows, h)
        merge_partials(outs, lses, out, lse)
        return out, lse

    def bytes_received(self, rows: int) -> int:
        """Bytes that arrive at one rank per exchange of ``rows`` rows (payload only, no padding)."""
        per_state = rows * self.seg_heads * (4 + self.headdim * self.elem)
        return (self.world - 1) * per_state
