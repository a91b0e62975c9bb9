"""Where a split's finished state goes in the kernels of kernels.decode that merge in-kernel: the final output of a
sequence with one split, or the split's partial and a ticket, the split that draws the last ticket merging them
all (no merge kernel follows). group_rows maps a row block to its (new token, query head) rows."""

import triton
import triton.language as tl

from flashdecode.kernels.softmax_state import LN2, fold_live_states, normalize_state


@triton.jit
def group_rows(m_block, hk, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
                SEQLEN_Q: tl.constexpr):
    """The first ROWS query rows of row block ``m_block`` of kv head ``hk``: (t, head, ok), each (ROWS,).
    Row r = t * GROUP + g serves query head hk * GROUP + g of new token t; ok marks rows that exist."""
    rows = m_block * BLOCK_M + tl.arange(0, ROWS)
    return rows // GROUP, hk * GROUP + rows % GROUP, rows < GROUP * SEQLEN_Q


@triton.jit
def _store_final(O_FINAL, LSE_FINAL, o, lse2, b, t, head, row_ok, offs_d, d_ok,
                 stride_fb, stride_ft, stride_fh, stride_fd, stride_flb, stride_flt, stride_flh):
    """Write a finished state of the rows (t, head, row_ok: (ROWS,)) of sequence b: o (ROWS, BLOCK_D) fp32 into
    O_FINAL in its dtype, lse2 (ROWS,) log2 into LSE_FINAL as natural log."""
    o_final = O_FINAL + b.to(tl.int64) * stride_fb + t * stride_ft + head * stride_fh
    tl.store(o_final[:, None] + offs_d[None, :] * stride_fd, o.to(O_FINAL.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE_FINAL + b.to(tl.int64) * stride_flb + t * stride_flt + head * stride_flh, lse2 * LN2, mask=row_ok)


@triton.jit
def _merge_if_last_ticket(O, LSE, O_FINAL, LSE_FINAL, ticket_ptr, count, b, hk, m_block,
                          stride_ob, stride_ot, stride_oh, stride_os, stride_od,
                          stride_lb, stride_lt, stride_lh, stride_ls,
                          stride_fb, stride_ft, stride_fh, stride_fd,
                          stride_flb, stride_flt, stride_flh,
                          GROUP: tl.constexpr, SEQLEN_Q: tl.constexpr, HEADDIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          MERGE_M: tl.constexpr, MERGE_SPLITS: tl.constexpr, MERGE_BLOCK_S: tl.constexpr):
    """The in-kernel merge's epilogue (the persistent kernel; decode_split_kernel with MERGE, via finish_split), run
    by every split of a sequence after it stored its partial (o, lse2) rows: the split that draws the last ticket
    merges (no merge kernel follows).

    ticket_ptr: this (batch, kv head, row block)'s int32 counter, 0 on entry of the launch; ``count``: the splits
    that draw a ticket and whose states are merged (slots 0 .. count - 1, count <= NUM_SPLITS). The merging program
    works on the MERGE_M (the real rows, padded to a power of two, <= BLOCK_M) rows only, not on the MMA padding,
    and folds the splits' states with softmax_state.fold_live_states (MERGE_SPLITS = NUM_SPLITS padded to a power
    of two, MERGE_BLOCK_S splits a step; an unrolled loop over 1-split steps ran 64 round trips in a row: 28.9 us
    for 4k keys in 64 splits on the H100).
    """
    # All threads' partial stores must precede the release: the barrier orders them before the one thread that
    # performs the atomic, whose acq_rel (release, cumulative) then publishes them at GPU scope.
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == count - 1:  # every other split has published its partial: merge them (acquire side)
        t, head, row_ok = group_rows(m_block, hk, MERGE_M, BLOCK_M, GROUP, SEQLEN_Q)
        lse_rows = LSE + b.to(tl.int64) * stride_lb + t * stride_lt + head * stride_lh
        o_rows = O + b.to(tl.int64) * stride_ob + t * stride_ot + head * stride_oh
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEADDIM
        # .cg: read other programs' partials from L2, never from a (non-coherent) L1 line
        acc, shift, total = fold_live_states(o_rows, lse_rows, offs_d, d_ok, row_ok, count, stride_os, stride_od,
                                             stride_ls, MERGE_M, MERGE_BLOCK_S, BLOCK_D, MERGE_SPLITS, True, ".cg",
                                             False)
        o, lse2 = normalize_state(acc, shift, total)
        _store_final(O_FINAL, LSE_FINAL, o, lse2, b, t, head, row_ok, offs_d, d_ok,
                     stride_fb, stride_ft, stride_fh, stride_fd, stride_flb, stride_flt, stride_flh)
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")  # all tickets drawn: ready for the next launch


@triton.jit
def finish_split(O, LSE, O_FINAL, LSE_FINAL, ticket_ptr, o, lse2, b, hk, m_block, split, t, head, row_ok, offs_d,
                  d_ok, num_splits, stride_o, stride_l, stride_final, GROUP: tl.constexpr, SEQLEN_Q: tl.constexpr,
                  HEADDIM: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, MERGE: tl.constexpr):
    """The end of a work item of a launch that merges in-kernel (the persistent kernel; decode_split_kernel with
    MERGE): a sequence with one split writes its state (o (BLOCK_M, BLOCK_D) fp32, lse2 log2) as its result to
    O_FINAL / LSE_FINAL; split ``split`` of a longer one stores its partial in O / LSE and draws a ticket at
    ticket_ptr (its (sequence, kv head, row block)'s counter), the last split merging them all."""
    stride_f, stride_fl = stride_final
    stride_fb, stride_ft, stride_fh, stride_fd = stride_f
    stride_flb, stride_flt, stride_flh = stride_fl
    stride_ob, stride_ot, stride_oh, stride_os, stride_od = stride_o
    stride_lb, stride_lt, stride_lh, stride_ls = stride_l
    if num_splits == 1:
        _store_final(O_FINAL, LSE_FINAL, o, lse2, b, t, head, row_ok, offs_d, d_ok,
                     stride_fb, stride_ft, stride_fh, stride_fd, stride_flb, stride_flt, stride_flh)
    else:
        o_rows = O + b.to(tl.int64) * stride_ob + t * stride_ot + head * stride_oh + split * stride_os
        tl.store(o_rows[:, None] + offs_d[None, :] * stride_od, o, mask=row_ok[:, None] & d_ok[None, :])
        lse_rows = LSE + b.to(tl.int64) * stride_lb + t * stride_lt + head * stride_lh
        tl.store(lse_rows + split * stride_ls, lse2, mask=row_ok)
        _merge_if_last_ticket(O, LSE, O_FINAL, LSE_FINAL, ticket_ptr, num_splits, b, hk, m_block,
                              stride_ob, stride_ot, stride_oh, stride_os, stride_od,
                              stride_lb, stride_lt, stride_lh, stride_ls,
                              stride_fb, stride_ft, stride_fh, stride_fd, stride_flb, stride_flt, stride_flh,
                              GROUP, SEQLEN_Q, HEADDIM, TILE.block_m, TILE.block_d, SPLITS.num_splits,
                              MERGE.rows, SPLITS.merge_splits, MERGE.block_s)
