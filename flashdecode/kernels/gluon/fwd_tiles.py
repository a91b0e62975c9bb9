"""The Gluon forward's tile space: which tiles a CTA takes, in which order, and which rows and key blocks a tile
covers (fixed-length or ragged batches, or a ragged batch over a paged KV cache), and where a key block's rows lie
(KVPages: the page table of a paged cache; ScoreOptions: a sliding window, softcap).

A tile is ``BLOCK_M = NUM_CONSUMERS * 64`` query rows of one (batch, head). Tiles are numbered head-major (all query
blocks of one (batch, head) are consecutive, so CTAs that run at the same time share that head's K/V in L2); causal
heads visit their query blocks heaviest (last rows) first, so the light tiles fill the tail of a persistent
schedule."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flashdecode.kernels.gluon.layouts import OPTIONAL, RUNTIME, aggregate, optional, runtime

# How CTAs with two Q buffer sets walk the tiles (TILE_ORDER; ops/gluon_attention.py TILE_ORDERS names them). 1 was
# a boustrophedon order of persistent tiles, removed (docs/decisions.md).
TILE_ORDER_ROUND_ROBIN = gl.constexpr(0)  # tiles program_id, program_id + num_programs, ...
TILE_ORDER_PAIRS = gl.constexpr(2)  # a head's k-th tile with its k-th from the end (_pair_tiles)
TILE_ORDER_LPT = gl.constexpr(3)  # each CTA's list of tiles, made on the host (_lpt_row)


@aggregate
class Tile:
    """Where one tile's work lies (TileSpace.coords): its (batch, head), first row m_start within the sequence,
    the visited keys [n_lo, n_end): [n_lo, n_full_end) need no mask for any of its rows and [n_full_end, n_end)
    are the masked blocks (diagonal and/or the ragged end; all multiples of BLOCK_N; n_lo is 0 but under a sliding
    window, whose blocks are all masked), q_base / kv_base the sequence's first rows in q / k (a paged cache: the
    offset of its block-table row), len_q / len_k its lengths; live 0 for a tile past its (ragged) sequence's rows
    (no loads, no store, no key block), else 1. Its block i holds keys n_lo + i * BLOCK_N on."""
    batch: RUNTIME
    head: RUNTIME
    m_start: RUNTIME
    n_full_end: RUNTIME
    n_end: RUNTIME
    q_base: RUNTIME
    kv_base: RUNTIME
    len_q: RUNTIME
    len_k: RUNTIME
    live: RUNTIME
    n_lo: RUNTIME

    @gluon.constexpr_function
    def __init__(self, batch, head, m_start, n_full_end, n_end, q_base, kv_base, len_q, len_k, live, n_lo=0):
        self.batch = runtime(batch)
        self.head = runtime(head)
        self.m_start = runtime(m_start)
        self.n_full_end = runtime(n_full_end)
        self.n_end = runtime(n_end)
        self.q_base = runtime(q_base)
        self.kv_base = runtime(kv_base)
        self.len_q = runtime(len_q)
        self.len_k = runtime(len_k)
        self.live = runtime(live)
        self.n_lo = runtime(n_lo)

    @gluon.jit
    def num_blocks(self, BLOCK_N: gl.constexpr):
        """The key blocks the tile visits."""
        return (self.n_end - self.n_lo) // BLOCK_N


@aggregate
class KVPages:
    """A paged KV cache as the producer reads it (attn_fwd_ws_paged_kernel): K and V are each viewed as
    (num_pages * PAGE_SIZE) rows of nheads_kv * HEAD_DIM, page p's keys at rows p * PAGE_SIZE on; block_table_ptr
    int32 (batch, max_pages) with row stride bt_stride lists each sequence's pages in key order, seqused_ptr int32
    (batch,) its key count (clamped into [0, max_pages * PAGE_SIZE]: no key past its table row). PAGE_SIZE is a
    multiple of BLOCK_N, so a key block never straddles two pages."""
    block_table_ptr: gl.tensor
    seqused_ptr: gl.tensor
    bt_stride: RUNTIME
    max_pages: RUNTIME
    num_pages: RUNTIME
    PAGE_SIZE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, block_table_ptr, seqused_ptr, bt_stride, max_pages, num_pages, PAGE_SIZE):
        self.block_table_ptr = block_table_ptr
        self.seqused_ptr = seqused_ptr
        self.bt_stride = runtime(bt_stride)
        self.max_pages = runtime(max_pages)
        self.num_pages = runtime(num_pages)
        self.PAGE_SIZE = gl.constexpr(PAGE_SIZE)

    @gluon.jit
    def keys(self, batch):
        """Sequence ``batch``'s key count, clamped into its table row."""
        return gl.minimum(gl.maximum(gl.load(self.seqused_ptr + batch), 0), self.max_pages * self.PAGE_SIZE)

    @gluon.jit
    def row(self, table_row, key):
        """The cache row (in the (num_pages * PAGE_SIZE)-row view) of the key block starting at ``key`` of the
        sequence whose block-table row starts at offset ``table_row``: its page's first row plus the key's place in
        the page. A page id outside the cache gives row num_pages * PAGE_SIZE, past the view, where TMA reads zeros:
        a bad id never becomes an address (checked metadata has none; the host rejects them)."""
        page = gl.load(self.block_table_ptr + table_row + key // self.PAGE_SIZE)
        page_ok = (page >= 0) & (page < self.num_pages)
        return gl.where(page_ok, page * self.PAGE_SIZE + key % self.PAGE_SIZE, self.num_pages * self.PAGE_SIZE)


@aggregate
class ScoreOptions:
    """A launch's score options beyond the causal mask (None where off; attn_fwd_ws_paged_kernel): a sliding window
    window_left / window_right (row i sees keys j with -window_left <= j - (i + len_k - len_q) <= window_right;
    the host passes an unbounded side as a bound no |j - diagonal| reaches) and softcap_log2 = softcap * log2(e)
    (scores become softcap * tanh(score * scale / softcap); the launch's qk_scale_log2 is then scale / softcap)."""
    window_left: RUNTIME
    window_right: RUNTIME
    softcap_log2: RUNTIME

    @gluon.constexpr_function
    def __init__(self, window_left, window_right, softcap_log2, WINDOW, SOFTCAP):
        self.window_left = runtime(window_left if WINDOW else None)
        self.window_right = runtime(window_right if WINDOW else None)
        self.softcap_log2 = runtime(softcap_log2 if SOFTCAP else None)


@aggregate
class TileSpace:
    """The launch's tiles (runtime values): num_tiles of them; seqlen_q / seqlen_k the fixed lengths, or for a
    ragged batch the longest sequence's query count (it numbers the tiles) and total_q (lse's head stride);
    cu_q_ptr / cu_k_ptr int32 (batch + 1,) cumulative lengths of a ragged batch (None: fixed-length; cu_k_ptr None
    too over a paged cache); sched_ptr the host's per-CTA tile lists (TILE_ORDER_LPT; else None); pages the paged
    cache's KVPages (else None); opts the ScoreOptions (else None: causal or no mask, no softcap); v_rows_ptr the V
    tensor behind v_desc (FwdConfig.V_BOUND; else None)."""
    num_tiles: RUNTIME
    sched_ptr: RUNTIME
    seqlen_q: RUNTIME
    seqlen_k: RUNTIME
    cu_q_ptr: RUNTIME
    cu_k_ptr: RUNTIME
    pages: OPTIONAL
    opts: OPTIONAL
    v_rows_ptr: RUNTIME

    @gluon.constexpr_function
    def __init__(self, num_tiles, sched_ptr, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, pages=None, opts=None,
                 v_rows_ptr=None):
        self.num_tiles = runtime(num_tiles)
        self.sched_ptr = runtime(sched_ptr)
        self.seqlen_q = runtime(seqlen_q)
        self.seqlen_k = runtime(seqlen_k)
        self.cu_q_ptr = runtime(cu_q_ptr)
        self.cu_k_ptr = runtime(cu_k_ptr)
        self.pages = optional(pages)
        self.opts = optional(opts)
        self.v_rows_ptr = runtime(v_rows_ptr)

    @gluon.jit
    def coords(self, tile, cfg):
        """Tile ``tile``'s rows and key blocks (a Tile). Fixed-length batches: sequence ``batch`` holds rows
        [batch * seqlen_q, ...) of q and [batch * seqlen_k, ...) of k / v. Ragged batches: its rows start at
        cu_q_ptr[batch] / cu_k_ptr[batch] (read here on the device); over a paged cache its keys are
        pages.keys(batch) and kv_base is its block-table row's offset."""
        BLOCK_M: gl.constexpr = cfg.BLOCK_M
        BLOCK_N: gl.constexpr = cfg.BLOCK_N
        num_m = gl.cdiv(self.seqlen_q, BLOCK_M)
        bh = tile // num_m
        pid_m = tile % num_m
        if cfg.CAUSAL:
            pid_m = num_m - 1 - pid_m
        batch = bh // cfg.NUM_HEADS
        head = bh % cfg.NUM_HEADS
        m_start = pid_m * BLOCK_M
        if self.cu_q_ptr is None:
            q_base = batch * self.seqlen_q
            kv_base = batch * self.seqlen_k
            len_q = self.seqlen_q
            len_k = self.seqlen_k
        else:
            q_base = gl.load(self.cu_q_ptr + batch)
            len_q = gl.load(self.cu_q_ptr + batch + 1) - q_base
            if self.pages is None:
                kv_base = gl.load(self.cu_k_ptr + batch)
                len_k = gl.load(self.cu_k_ptr + batch + 1) - kv_base
            else:
                kv_base = batch * self.pages.bt_stride
                len_k = self.pages.keys(batch)
        n_lo = 0
        n_end = len_k
        full_keys = len_k
        if cfg.CAUSAL:
            shift = len_k - len_q
            n_end = gl.minimum(len_k, gl.maximum(m_start + BLOCK_M + shift, 0))
            full_keys = gl.minimum(len_k, gl.maximum(m_start + shift + 1, 0))
        if self.opts is not None:
            if self.opts.window_left is not None:
                # the keys any of the tile's rows sees, every block masked (n_full_end = n_lo)
                shift = len_k - len_q
                first = gl.maximum(m_start + shift - self.opts.window_left, 0)
                last = gl.minimum(m_start + BLOCK_M - 1 + shift + self.opts.window_right, len_k - 1)
                n_lo = (first // BLOCK_N) * BLOCK_N
                n_end = gl.maximum(last + 1, n_lo)
                full_keys = n_lo
        n_end = gl.cdiv(n_end, BLOCK_N) * BLOCK_N
        n_full_end = (full_keys // BLOCK_N) * BLOCK_N
        if self.cu_q_ptr is None:
            live = 1  # every tile of a fixed-length batch has rows (the producer's 24 registers hold no more)
        else:
            live = (m_start < len_q).to(gl.int32)
            n_end = n_end * live
            n_full_end = n_full_end * live
            if self.opts is not None:
                if self.opts.window_left is not None:
                    n_lo = n_lo * live
        return Tile(batch, head, m_start, n_full_end, n_end, q_base, kv_base, len_q, len_k, live, n_lo)

    @gluon.jit
    def units(self, cfg):
        """A two-Q-buffer CTA's work units as its loop's (start, stop, step); a unit is two tiles (unit_tiles):
        TILE_ORDER_PAIRS: ceil(query blocks / 2) units per (batch, head), round robin over the CTAs;
        TILE_ORDER_LPT: this CTA's list from the host, two entries a unit; else one unit per round of num_programs
        tiles."""
        if cfg.TILE_ORDER == TILE_ORDER_PAIRS:
            num_m = gl.cdiv(self.seqlen_q, cfg.BLOCK_M)
            start = gl.program_id(0)
            stop = (self.num_tiles // num_m) * ((num_m + 1) // 2)
            step = gl.num_programs(0)
        elif cfg.TILE_ORDER == TILE_ORDER_LPT:
            start = 0
            stop = (gl.load(_lpt_row(self.sched_ptr)) + 1) // 2
            step = 1
        else:
            start = gl.program_id(0)
            stop = self.num_tiles
            step = 2 * gl.num_programs(0)
        return start, stop, step

    @gluon.jit
    def unit_tiles(self, unit, cfg):
        """The two tiles of work unit ``unit`` (units): (first, second), second = num_tiles where there is none.
        Round robin: the next round's tile at the same place."""
        if cfg.TILE_ORDER == TILE_ORDER_PAIRS:
            first, second = _pair_tiles(unit, self.seqlen_q, cfg.BLOCK_M)
            if second == first:
                second = self.num_tiles
        elif cfg.TILE_ORDER == TILE_ORDER_LPT:  # rows are padded with num_tiles to an even count of entries
            row = _lpt_row(self.sched_ptr)
            first = gl.load(row + 1 + 2 * unit)
            second = gl.load(row + 2 + 2 * unit)
        else:
            first = unit
            second = unit + gl.num_programs(0)
        return first, second


@gluon.jit
def _lpt_row(sched_ptr):
    """This CTA's row of the host's schedule (ops/gluon_attention.py lpt_schedule): int32 sched[0] = the row
    stride S; row p at sched[1 + p S] = [count, tile, tile, ..., num_tiles padding]."""
    return sched_ptr + 1 + gl.program_id(0) * gl.load(sched_ptr)


@gluon.jit
def _pair_tiles(pair, seqlen_q, BLOCK_M: gl.constexpr):
    """TILE_ORDER_PAIRS: unit ``pair`` is the k-th tile and the k-th from the end of one (batch, head)'s query
    blocks (k = pair % ceil(blocks / 2)), in TileSpace.coords' numbering. Causal tiles come heaviest first within a
    head, so the two carry k + 1 and blocks - k key blocks' worth of rows: every unit about the same work, and a
    grid of units needs no scheduler to balance (the second tile's Q and first K/V blocks load under the first
    tile's last blocks). Returns (first, second); second == first for the middle block of an odd count."""
    num_m = gl.cdiv(seqlen_q, BLOCK_M)
    half = (num_m + 1) // 2
    base = (pair // half) * num_m
    k = pair % half
    return base + k, base + num_m - 1 - k
