"""Decode's work schedule, on the device: which keys a split covers (split_range; the pre-wait guess of it,
stale_split_range), how many splits each sequence gets when the device chooses (device_split_counts), and the
persistent kernel's work items and queue (planned_item, item_of, queue_split_ways, items_before). Pure index
arithmetic over lengths: no K/V is read here (kernels.decode_gather fetches it, kernels.decode attends)."""

import triton
import triton.language as tl


@triton.jit
def split_range(seqlen, split, window_left, SEQLEN_Q: tl.constexpr, num_splits,
                BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, WINDOW: tl.constexpr, SPLIT_KEYS: tl.constexpr = 0):
    """[start, end) of keys this split attends to, from the live length on the device (see module doc).
    num_splits: the launch's constexpr split count, or a per-sequence count computed on the device.
    SPLIT_KEYS > 0 (batch-invariant decode; a multiple of BLOCK_N): every split holds SPLIT_KEYS keys from the
    sequence's first live block whatever num_splits, so the boundaries follow from the sequence's own length
    alone; splits past its end are empty."""
    kv_lo = 0
    if WINDOW:  # keys left of every row's window are skipped entirely; align so blocks stay page-aligned
        kv_lo = (tl.maximum(seqlen - SEQLEN_Q - window_left, 0) // BLOCK_N) * BLOCK_N
    if SPLIT_KEYS > 0:
        chunk = SPLIT_KEYS
    else:
        live = tl.maximum(seqlen - kv_lo, 0)
        chunk = tl.maximum(tl.cdiv(live, num_splits * BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = kv_lo + split * chunk
    end = tl.minimum(start + chunk, seqlen)
    return start, end


@triton.jit
def stale_split_range(SEQLENS, b, split, num_splits, capacity, window_left, SEQLEN_Q: tl.constexpr,
                       BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, WINDOW: tl.constexpr,
                       SPLIT_KEYS: tl.constexpr = 0):
    """[start, end) of the split from sequence b's length read before gdc_wait (.cg: never cached in L1, so the
    read after the wait cannot hit a stale line): a guess that steers hints and speculative loads, never the
    result; clamped into [0, capacity] whatever was read."""
    seqlen = tl.maximum(tl.minimum(tl.load(SEQLENS + b, cache_modifier=".cg"), capacity), 0)
    return split_range(seqlen, split, window_left, SEQLEN_Q, num_splits, BLOCK_N, MIN_CHUNK, WINDOW, SPLIT_KEYS)


@triton.jit
def device_split_counts(lens, in_batch, slots, programs, KVP: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         MIN_CHUNK: tl.constexpr, MAX_SPLIT_KEYS: tl.constexpr, QUEUE_SPLITS: tl.constexpr,
                         QUEUE_FULL_FRACTION: tl.constexpr, QUEUE_SPLIT_COST: tl.constexpr):
    """Splits per sequence from the live lengths (BATCH_PAD,), computed by every program alike: each sequence's
    share of the ``slots`` program slots, slots * len / (KVP * total) rounded down (KVP programs per split: kv heads
    x row blocks), at least 1, at most NUM_SPLITS (the partial buffer) and at most one per MIN_CHUNK keys. Equal
    lengths give num_sms / (batch x KVP) - one split each at batch 9-16 with 8 kv heads - while one long sequence
    among short ones gets about num_sms / KVP (heuristics.decode_num_splits's balance, on the device).
    MAX_SPLIT_KEYS (0 = no bound): at least cdiv(len, MAX_SPLIT_KEYS) splits, so that no split spans more pages
    than the kernel preloads (the launcher guarantees that NUM_SPLITS splits always suffice).

    QUEUE_SPLITS > 0 (the work queue): also at least s x the sequence's share of n_eff = (sum len)^2 / sum len^2
    sequences (rounded), s from queue_split_ways for n_eff x KVP pairs: n equal lengths split s ways, as do n
    long ones among a bucket's padding of one-token rows, while a lone long sequence keeps the programs' share.

    Finer splits do not pay here: every work item refills the load pipeline (72 programs already saturate the
    memory bandwidth), and items smaller than a program's share can land two on one program (docs/decisions.md,
    "Persistent device split counts")."""
    lens64 = tl.where(in_batch, lens, 0).to(tl.int64)
    total = tl.maximum(tl.sum(lens64, 0), 1)
    share = (slots * lens64) // (KVP * total)
    if QUEUE_SPLITS > 0:
        lens_f = lens64.to(tl.float32)
        total_f = total.to(tl.float32)
        n_eff = total_f * total_f / tl.maximum(tl.sum(lens_f * lens_f, 0), 1.0)
        ways = queue_split_ways(n_eff * KVP, programs, QUEUE_SPLITS, QUEUE_FULL_FRACTION, QUEUE_SPLIT_COST)
        share = tl.maximum(share, tl.floor(ways * n_eff * lens_f / total_f + 0.5).to(tl.int64))
    splits = tl.minimum(tl.maximum(share, 1), NUM_SPLITS)
    splits = tl.minimum(splits, tl.maximum(tl.cdiv(lens64, MIN_CHUNK), 1))
    if MAX_SPLIT_KEYS > 0:
        splits = tl.maximum(splits, tl.cdiv(lens64, MAX_SPLIT_KEYS))
    return splits.to(tl.int32)


@triton.jit
def planned_item(SEQLENS, item, batch, capacity, DEVICE_SPLITS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  MIN_CHUNK: tl.constexpr, CACHE: tl.constexpr):
    """Work item ``item`` of decode_split_kernel's DEVICE_SPLITS grid: (b, pid_hm, split, splits of b, length of
    b), items in the order (sequence, kv head x row block, split), each sequence split as device_split_counts
    decides from all ``batch`` lengths (SEQLENS int32, clamped to ``capacity``; read with cache modifier CACHE) for
    DEVICE_SPLITS.slots items; b == batch past the last item. DEVICE_SPLITS: kernels/decode_args.DeviceSplits."""
    BATCH_PAD: tl.constexpr = DEVICE_SPLITS.batch_pad
    slots: tl.constexpr = DEVICE_SPLITS.slots
    KVP: tl.constexpr = DEVICE_SPLITS.kv_programs
    offs_b = tl.arange(0, BATCH_PAD)
    in_batch = offs_b < batch
    lens = tl.maximum(tl.minimum(tl.load(SEQLENS + offs_b, mask=in_batch, other=0, cache_modifier=CACHE),
                                 capacity), 0)
    splits_b = device_split_counts(lens, in_batch, slots, slots, KVP, NUM_SPLITS, MIN_CHUNK,
                                    DEVICE_SPLITS.max_split_keys, 0, 0.5, 0.0)
    items_b = tl.where(in_batch, splits_b * KVP, 0)
    return item_of(item, offs_b, lens, splits_b, items_b, tl.cumsum(items_b, 0))


@triton.jit
def item_of(w, offs_b, lens, splits_b, items_b, items_end):
    """Work item w of the item order (sequence, kv head x row block, split): (b, pid_hm, split, splits of b,
    length of b). offs_b: arange(BATCH_PAD); lens, splits_b, items_b (splits x KVP, 0 outside the batch) and
    items_end (their cumulative sum): (BATCH_PAD,). Past the last item b is the batch size (and 1 split)."""
    b = tl.sum((items_end <= w).to(tl.int32), 0)  # the sequence whose items cover w
    pick = offs_b == b
    num_splits = tl.maximum(tl.sum(tl.where(pick, splits_b, 0), 0), 1)
    r = w - tl.sum(tl.where(pick, items_end - items_b, 0), 0)
    return b, r // num_splits, r % num_splits, num_splits, tl.sum(tl.where(pick, lens, 0), 0)


@triton.jit
def queue_split_ways(pairs, programs, QUEUE_SPLITS: tl.constexpr, QUEUE_FULL_FRACTION: tl.constexpr,
                      QUEUE_SPLIT_COST: tl.constexpr):
    """Ways (1..QUEUE_SPLITS) to split each of ``pairs`` equal (sequence, kv head) items (fp32 scalar, may be
    fractional) for ``programs`` drawing from the work queue: the fewest that minimise the modelled time - rounds
    of ``programs`` items of 1/s of a sequence, the last round, if it holds fewer than QUEUE_FULL_FRACTION of the
    programs, costing as if it held that many (too few programs in flight to saturate the memory bandwidth), and
    every further split QUEUE_SPLIT_COST more (pipeline refill, partials, merge). E.g. 132 programs: 136 pairs
    split 4 ways (a 5th round of 16 items instead of a 2nd of 4), 256 or 512 not at all (a last round of 124 or
    116 items). pairs: fp32 scalar, programs: int32 scalar; returns an int32 scalar."""
    programs_f = programs.to(tl.float32)
    best_ways = 1
    best_time = float("inf")
    for ways in tl.static_range(1, QUEUE_SPLITS + 1):
        items = tl.floor(pairs * ways + 0.5)
        full_rounds = tl.floor(items / programs_f)
        tail = items - full_rounds * programs_f
        tail_time = tl.where(tail > 0, tl.maximum(tail / programs_f, QUEUE_FULL_FRACTION), 0.0)
        time = (full_rounds + tail_time) / ways * (1 + QUEUE_SPLIT_COST * (ways - 1))
        better = time < best_time * (1 - 1e-4)  # ties keep the fewer splits
        best_ways = tl.where(better, ways, best_ways)
        best_time = tl.where(better, time, best_time)
    return best_ways


@triton.jit
def items_before(share, lens, in_batch, splits_b, programs, KVP: tl.constexpr):
    """How many work items (in item order: sequence, then kv head x row block, then split) have their midpoint
    before the start of program share ``share`` (0..programs), all sequences summed.

    Costs in keys: sequence b weighs w_b = max(len_b, 1) (an empty sequence still needs its items run) per kv
    program, its KVP * splits_b items w_b / splits_b each; laid end to end the items span T = KVP * sum(w), and
    share p starts at p * T / programs. In integers: item i of b (cum_b keys of earlier sequences per kv program)
    lies before share p iff (2i + 1) * programs * w_b < 2 * splits_b * KVP * (p * sum(w) - programs * cum_b)."""
    w = tl.where(in_batch, tl.maximum(lens, 1), 0).to(tl.int64)
    cum = tl.cumsum(w, 0) - w
    splits = splits_b.to(tl.int64)
    n = 2 * splits * KVP * (share.to(tl.int64) * tl.sum(w, 0) - programs * cum)
    a = tl.maximum(programs * w, 1)
    count = tl.where(n > a, tl.cdiv(n - a, 2 * a), 0)
    return tl.sum(tl.minimum(count, tl.where(in_batch, splits * KVP, 0)), 0)
