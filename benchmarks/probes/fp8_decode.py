"""Decode on 8-bit KV caches vs our bf16 cache and FlashInfer's FP8 paged decode (GPU only; a measurement).

Issue 23's targets: b1, 16 q / 2 kv heads, head dim 128 at 512..128k keys - our e4m3 cache with per-token-head
scales and with one scalar scale (contiguous and pages of 16) vs our bf16 cache (contiguous, page 16) vs
FlashInfer's BatchDecodeWithPagedKVCacheWrapper with kv_data_type=torch.float8_e4m3fn (page 16; and its bf16 run),
plus the Llama-3-8B shape (32 / 8 heads) at batch 16 and 64, 8k keys. Method as ``flashdecode bench decode``:
CUDA-graph replays (flashdecode.timing) over input sets rotated until they exceed L2 4x, medians. Beside every row:
the 8-bit floor (8-bit K/V bytes + their float32 scales / measured copy bandwidth, the read+write anchor of bench
decode) and a bare read of the same 8-bit bytes (benchmarks.probes.stream's read kernel, best of its variants):
what any kernel pays just to stream them. FlashInfer is skipped (with the reason) where it is not installed. On
pages of 16 the 8-bit tile rules' A/B (docs/decisions.md, "8-bit cache tiles") runs beside the resolved config:
128-key tiles at 4 warps (bn128w4), 64-key tiles at 4 warps (bn64w4), V converted after its shared-memory stage
(vlate).

``--convert-ab``: instead, the A/B of how e4m3 tiles become 16-bit dot operands (DecodeConfig.quant_convert and
quant_k_convert_first, kernels/kv_quant.py; docs/decisions.md, "8-bit cache tiles"): the conversion instructions
with K converted after its layout change (cvt: the earlier resolution) and before it (cvt-kfirst), packed PTX bit
operations with K after (bits-klate), Triton bit ops with K first (bits-tl), packed PTX bit ops with K first (bits:
the resolved config) and the same on 128-key tiles of 4 warps (bits-w4), in the same run on the same caches,
contiguous and pages of 16, per-token-head and scalar scales, beside our bf16 cache, with % of the 8-bit floor;
each row also says whether the outputs of the 8-warp columns are bitwise equal (they should be: every conversion is
exact; bits-w4 reduces in another order).

    PYTHONPATH=. python3 -m benchmarks.probes.fp8_decode [--contexts 512,...,131072] [--batched 16,64] [--out DIR]
    PYTHONPATH=. python3 -m benchmarks.probes.fp8_decode --convert-ab [--contexts 4096,...] [--batched 16]

``--sweep``: the e4m3 decode (contiguous, per-token-head scales) over a small grid of DecodeConfig changes around the
resolved config (_SWEEP: twice the splits, 4 warps, 64-key tiles, 2 / 3 / 4 pipeline stages, a 128-register cap
that lets two 8-warp programs share an SM, the persistent kernel at two programs per SM or as a split grid, the
split grid as the persistent kernel, the softmax row sums summed once after the KV loop, the keys split across the
warps or not), at b1 16/2 hd128 4k / 32k / 128k and the Llama-3-8B shape b16 8k; one row per point and
config (splits, tile, warps, stages, us, % of a bare read of the 8-bit bytes and of the 8-bit floor, our bf16 cache
/ it, max |difference| from the resolved config's output), the fastest per point marked *. About three minutes on an
H100 (mostly compiles; --sweep-configs runs fewer).

    PYTHONPATH=. python3 -m benchmarks.probes.fp8_decode --sweep [--sweep-configs resolved,x2,...] [--contexts ...]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

FP8 = torch.float8_e4m3fn


def _quant_set(s, per_token: bool):
    """An e4m3 copy of a bf16 set's K/V (values scaled into range) with per-token-head or scalar float32 scales."""
    out = dict(s)
    for name in ("k", "v"):
        x = s[name]
        if per_token:
            scale = (x.float().abs().amax(-1) / 448.0).clamp_min(1e-12)
        else:
            scale = (x.float().abs().amax() / 448.0).clamp_min(1e-12).reshape(())
        out[name] = (x.float() / scale.expand(x.shape[:-1])[..., None]).clamp(-448, 448).to(FP8)
        out[f"{name}_scale"] = scale.contiguous()
    return out


def _ours(sets, changes=None, config_out=False):
    """Our DecodePlan over the sets (8-bit caches: kv_dtype and the sets' scales); changes: DecodeConfig fields that
    replace the resolved config's (e.g. the 4-warp tiles 8-bit caches had before heuristics.decode_quant_tile).
    Returns (calls, a summary of the config), or with config_out (calls, the DecodeConfig itself)."""
    import dataclasses

    import flashdecode

    s0 = sets[0]
    batch, nheads, headdim = s0["q"].shape
    kw = dict(max_seqlen_k=max(s0["context_lens"]), dtype=s0["q"].dtype, device=s0["q"].device,
              kv_dtype=s0["k"].dtype)
    scales0 = {"k_scale": s0["k_scale"], "v_scale": s0["v_scale"]} if "k_scale" in s0 else {}
    plan = flashdecode.DecodePlan(batch, nheads, s0["k"].shape[2], headdim, **kw)
    if changes:
        config = plan.config_for(s0["q"], s0["k"], s0["v"], s0["lens"], block_table=s0["table"], **scales0)
        plan = flashdecode.DecodePlan(batch, nheads, s0["k"].shape[2], headdim, **kw,
                                      config=dataclasses.replace(config, **changes))

    def call(s):
        scales = dict(k_scale=s["k_scale"], v_scale=s["v_scale"]) if "k_scale" in s else {}
        return lambda: plan.run(s["q"], s["k"], s["v"], s["lens"], block_table=s["table"], **scales)
    config = plan.config_for(s0["q"], s0["k"], s0["v"], s0["lens"], block_table=s0["table"], **scales0)
    if config_out:
        return [call(s) for s in sets], config
    return [call(s) for s in sets], {"path": config.path.name, "splits": config.num_splits, "block_n": config.block_n,
                                     "num_warps": config.num_warps}


def _bare_read(sets, out):
    """The best of benchmarks.probes.stream's flat read-only sweeps over the 8-bit K/V bytes (uint8 views)."""
    from benchmarks.probes.stream import READ_VARIANTS, _read_calls
    from flashdecode.timing import cuda_graph_time_us

    pairs = [(s["k"].view(torch.uint8).reshape(-1), s["v"].view(torch.uint8).reshape(-1)) for s in sets]
    best = None
    for _, block, warps in READ_VARIANTS:
        if pairs[0][0].numel() % block:
            continue
        t = cuda_graph_time_us(_read_calls(pairs, block, warps, out))
        best = t if best is None else min(best, t)
    return best


# config changes of the A/B rows (suffix of the row name)
_TILE_AB = {"bn128w4": dict(block_n=128, num_warps=4), "bn64w4": dict(block_n=64, num_warps=4),
            "vlate": dict(quant_v_convert_first=False)}


def bench_point(label, batch, context, nheads, nheads_kv, headdim, reps, bandwidth, gen):
    from flashdecode.bench.decode import BUILDERS, _make_set
    from flashdecode.timing import cuda_graph_time_us, rotation_count

    lens = [context] * batch
    bf16_bytes = 2 * batch * context * nheads_kv * headdim * 2
    fp8_bytes = bf16_bytes // 2
    scale_bytes = 2 * batch * context * nheads_kv * 4
    n_sets = rotation_count(bf16_bytes)
    row = dict(shape=label, batch=batch, context=context, nheads=nheads, nheads_kv=nheads_kv, headdim=headdim,
               rotated_sets=n_sets, bf16_floor_us=bf16_bytes / bandwidth * 1e6,
               fp8_floor_us=(fp8_bytes + scale_bytes) / bandwidth * 1e6)
    out = torch.empty(fp8_bytes // 1024 + 1, dtype=torch.float32, device="cuda")
    for page in (0, 16):
        base = [_make_set(batch, lens, nheads, nheads_kv, headdim, page, torch.bfloat16, gen) for _ in range(n_sets)]
        layout = "contig" if page == 0 else "page16"
        variants = {f"ours bf16 {layout}": base,
                    f"ours fp8-token {layout}": [_quant_set(s, True) for s in base]}
        if page == 0:
            variants["ours fp8-scalar contig"] = [_quant_set(s, False) for s in base]
        else:  # the rules' A/B (docs/decisions.md, "8-bit cache tiles"): 4-warp tiles of 128 and 64 keys, and V
            # converted after its shared-memory stage (Triton's own order)
            for ab in _TILE_AB:
                variants[f"ours fp8-token page16 {ab}"] = variants["ours fp8-token page16"]
        for name, sets in variants.items():
            try:
                fns, info = _ours(sets, _TILE_AB.get(name.rsplit(" ", 1)[-1]))
                row[name] = cuda_graph_time_us(fns, reps=reps)
                row[f"{name} config"] = info
            except Exception as e:  # reported, not fatal
                row[name] = None
                row[f"{name} skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if page == 0:
            row["bare read fp8 us"] = _bare_read(variants["ours fp8-token contig"], out)
        else:
            fp8_sets = [dict(s, k=q["k"], v=q["v"]) for s, q in zip(base, variants["ours fp8-token page16"])]
            for name, sets in (("FlashInfer bf16 page16", base), ("FlashInfer fp8 page16", fp8_sets)):
                try:
                    fns, _ = BUILDERS["FlashInfer"](sets)
                    row[name] = cuda_graph_time_us(fns, reps=reps)
                except Exception as e:
                    row[name] = None
                    row[f"{name} skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        del base, variants
        torch.cuda.empty_cache()
    for name in [k for k in list(row) if k.startswith(("ours fp8", "FlashInfer fp8")) and row.get(k)]:
        if isinstance(row[name], float):
            row[f"{name} %floor"] = 100.0 * row["fp8_floor_us"] / row[name]
            if row.get("bare read fp8 us"):
                row[f"{name} %bare"] = 100.0 * row["bare read fp8 us"] / row[name]
    for layout in ("contig", "page16"):
        bf, f8 = row.get(f"ours bf16 {layout}"), row.get(f"ours fp8-token {layout}")
        if bf and f8:
            row[f"speedup fp8-token vs bf16 {layout}"] = bf / f8
    if row.get("ours fp8-token page16") and row.get("FlashInfer fp8 page16"):
        row["ours fp8 vs FlashInfer fp8 (page16)"] = row["FlashInfer fp8 page16"] / row["ours fp8-token page16"]
    return row


# --convert-ab columns: DecodeConfig changes (quant_convert 0 conversion instructions, 1 Triton bit ops, 2 packed
# PTX bit ops; quant_k_convert_first: K converted before its layout change). "cvt" is the earlier resolution, "bits"
# the current one.
_CONVERTS = {"cvt": dict(quant_convert=0, quant_k_convert_first=False),
             "cvt-kfirst": dict(quant_convert=0, quant_k_convert_first=True),
             "bits-klate": dict(quant_convert=2, quant_k_convert_first=False),
             "bits-tl": dict(quant_convert=1, quant_k_convert_first=True),
             "bits": dict(quant_convert=2, quant_k_convert_first=True),
             # the 128-key tile at 4 warps: ~20% fewer warp-instructions per key than at 8 (SASS), one warp per
             # scheduler (docs/decisions.md, "8-bit cache tiles")
             "bits-w4": dict(quant_convert=2, quant_k_convert_first=True, block_n=128, num_warps=4)}


def bench_convert_point(label, batch, context, nheads, nheads_kv, headdim, reps, bandwidth, gen, pages=(0, 16),
                        scales=("token", "scalar"), columns=tuple(_CONVERTS)) -> list[dict]:
    """--convert-ab rows of one shape: per layout (``pages``: 0 contiguous, else the page size) and scale granularity
    (per token and kv head, one scalar), our e4m3 cache under each of ``columns`` (_CONVERTS), our bf16 cache, the
    8-bit floor."""
    from flashdecode.bench.decode import _make_set
    from flashdecode.timing import cuda_graph_time_us, rotation_count

    lens = [context] * batch
    bf16_bytes = 2 * batch * context * nheads_kv * headdim * 2
    n_sets = rotation_count(bf16_bytes)
    rows = []
    for page in pages:
        base = [_make_set(batch, lens, nheads, nheads_kv, headdim, page, torch.bfloat16, gen) for _ in range(n_sets)]
        fns, _ = _ours(base)
        bf16_us = cuda_graph_time_us(fns, reps=reps)
        for per_token in [g == "token" for g in scales]:
            sets = [_quant_set(s, per_token) for s in base]
            scale_bytes = 2 * batch * context * nheads_kv * 4 if per_token else 0
            floor = (bf16_bytes // 2 + scale_bytes) / bandwidth * 1e6
            row = dict(shape=label, batch=batch, context=context, layout=f"page{page}" if page else "contig",
                       scales="token" if per_token else "scalar", bf16=bf16_us, fp8_floor_us=floor)
            outs = []
            for name, changes in ((n, _CONVERTS[n]) for n in columns):
                try:
                    fns, _ = _ours(sets, changes)
                    row[name] = cuda_graph_time_us(fns, reps=reps)
                except Exception as e:  # reported, not fatal
                    row[name] = None
                    row[f"{name} skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                    continue
                row[f"{name} %floor"] = 100.0 * floor / row[name]
                if "num_warps" not in changes:  # (the resolved warps: the same reduction order)
                    outs.append(fns[0]().clone())
            if row.get("cvt") and row.get("bits"):
                row["cvt/bits"] = row["cvt"] / row["bits"]
                row["bf16/bits"] = bf16_us / row["bits"]
            row["equal"] = all(torch.equal(outs[0], o) for o in outs[1:])  # every conversion is exact
            row["config"] = _ours(sets)[1]
            rows.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()
                              if k != "config"}), flush=True)  # (each row as it is measured)
            del sets
        del base
        torch.cuda.empty_cache()
    return rows


# --sweep: DecodeConfig changes around the resolved config of an e4m3 cache with per-token-head scales (contiguous).
# Each entry maps (the resolved config, the point's context) to its changes, or None where it would repeat another
# entry or leave splits empty (a split holds at least block_n keys). "x2" / "x3": twice / three times the splits
# (half / a third of the keys per split; more CTAs; the split grid only: the persistent kernel's device split counts
# follow its programs); "w4": 4 warps; "st2" / "st3" / "st4": pipeline stages; "p264": the persistent kernel's grid
# at two programs per SM; "grid": the split grid instead of the persistent kernel; "persist": the persistent kernel
# instead of the split grid (no merge launch); "rN": stage 1 under an N-register cap (DecodeConfig.max_registers).
# Occupancy (sm_90 compile on the CPU, b1 16/2 e4m3 split grid, 8 warps): 178 registers and 106 KiB of shared
# memory a program at 3 stages (one program per SM); r128: no spills, +3% loop instructions (two per SM); 2 stages:
# 128 registers, 73 KiB (two per SM), with r80 no spills in the KV loops, +6% (three per SM: "st2 r80 x3", 384
# programs at b1). The persistent kernel takes 250 registers (192 at 2 stages);
# under r128 its KV loops stay free of spills (its work loop spills a few values per item), under r80 they do not.
# "x0.5": half the splits; "pfN": the pre-wait L2 prefetch of a split's first N blocks (DecodeConfig.prefetch_blocks;
# resolved: 1 block where few (batch, kv head) pairs leave the SMs to the splits); "all reads": the merge reads every
# slot's partial output, live or not (DecodeConfig.merge_live_only off), with the merge kernel; "merge kernel" /
# "in-kernel merge": the device-split grid with / without a merge kernel (DecodeConfig.merge_in_kernel).
# "sum": the softmax row sums kept per key column and summed after the KV loop (DecodeConfig.softmax_sum_tile): the
# 8-warp e4m3 loop without its cross-warp sum per block, 8 -> 5 barriers and 639 -> 614 instructions per block.
def _splits_by(factor, block_n=None):
    def changes(c, context):
        from flashdecode.config import DecodePath

        if c.path in (DecodePath.PERSISTENT, DecodePath.PERSISTENT_QUEUE):  # its device splits follow its programs
            return None if factor > 1 else ({} if block_n is None else dict(block_n=block_n))
        bn = block_n or c.block_n
        splits = int(c.num_splits * factor)
        if splits * bn > context or splits > 1024 or splits < 2:  # empty splits, or no split: nothing new
            return None
        return dict(num_splits=splits, **({} if block_n is None else dict(block_n=block_n)))
    return changes


def _with(**fields):
    return lambda c, context: fields


def _then(first, **fields):
    def changes(c, context):
        base = first(c, context)
        return None if base is None else dict(base, **fields)
    return changes


def _on_split_grid(c, context):
    """The persistent and device-split configs as a split grid (one CTA per split and kv head, merge kernel); None
    where already."""
    from flashdecode.config import DecodePath

    if c.path not in (DecodePath.PERSISTENT, DecodePath.PERSISTENT_QUEUE, DecodePath.DEVICE_SPLIT_GRID):
        return None
    return dict(path=DecodePath.SPLIT_GRID, merge_in_kernel=False)


def _grid_splits(splits, **fields):
    def changes(c, context):
        from flashdecode.config import DecodePath

        base = _on_split_grid(c, context)
        if base is None:
            return None
        return dict(base, num_splits=splits, **fields, **({} if splits > 1 else dict(path=DecodePath.UNSPLIT)))
    return changes


def _on_device_split_grid(**fields):
    """The persistent configs as the device-split grid (split counts chosen on the device, one CTA per work item,
    merge kernel), its work items as many as the persistent kernel's programs; None where not persistent."""
    def changes(c, context):
        from flashdecode.config import DecodePath

        if c.path not in (DecodePath.PERSISTENT, DecodePath.PERSISTENT_QUEUE):
            return None
        return dict(path=DecodePath.DEVICE_SPLIT_GRID, device_split_slots=c.persistent_programs, **fields)
    return changes


def _where_device_grid(first=None, **fields):
    """``fields`` (after ``first``'s changes) where the config runs the device-split grid; None elsewhere."""
    def changes(c, context):
        from flashdecode.config import DecodePath

        base = {} if first is None else first(c, context)
        if c.path is not DecodePath.DEVICE_SPLIT_GRID or base is None:
            return None
        return dict(base, **fields)
    return changes


def _on_persistent(factor=1, **fields):
    """The split grid's configs on the persistent kernel (its device split counts, the merge in the last split's
    program: no merge launch), with ``factor`` times the splits; None where already (or where splits are empty)."""
    def changes(c, context):
        from flashdecode.config import DecodePath

        base = {} if factor == 1 else _splits_by(factor)(c, context)
        if c.path is not DecodePath.SPLIT_GRID or base is None:
            return None
        return dict(base, path=DecodePath.PERSISTENT, **fields)
    return changes


def _persistent_programs(factor, **fields):
    def changes(c, context):
        from flashdecode.config import DecodePath

        if c.path not in (DecodePath.PERSISTENT, DecodePath.PERSISTENT_QUEUE):
            return None
        return dict(persistent_programs=c.persistent_programs * factor, **fields)
    return changes


_SWEEP = {
    "resolved": _with(),
    "x2": _splits_by(2),
    "w4 x2": _then(_splits_by(2), num_warps=4),
    "bn64w4": _with(block_n=64, num_warps=4),
    "bn64w4 x2": _then(_splits_by(2, 64), num_warps=4),
    "st2": _with(num_stages=2),
    "st3": _with(num_stages=3),
    "st4": _with(num_stages=4),
    "r128 x2": _then(_splits_by(2), max_registers=128),
    "st2 x2": _then(_splits_by(2), num_stages=2),
    "st2 r80 x3": _then(_splits_by(3), num_stages=2, max_registers=80),
    "persist": _on_persistent(),
    "persist r128 p264 x2": _on_persistent(2, max_registers=128, persistent_programs=264),
    "sum": _with(softmax_sum_tile=True),
    "sum st2": _with(softmax_sum_tile=True, num_stages=2),
    "sum st4": _with(softmax_sum_tile=True, num_stages=4),
    "sum r128 x2": _then(_splits_by(2), softmax_sum_tile=True, max_registers=128),
    "sum st2 r80 x3": _then(_splits_by(3), softmax_sum_tile=True, num_stages=2, max_registers=80),
    "w4 p264": _persistent_programs(2, num_warps=4),
    "r128 p264": _persistent_programs(2, max_registers=128),
    "st2 r128 p264": _persistent_programs(2, num_stages=2, max_registers=128),
    "sum r128 p264": _persistent_programs(2, softmax_sum_tile=True, max_registers=128),
    "shared": _with(quant_warp_split=False),
    "warps": _with(quant_warp_split=True),
    "warps x2": _then(_splits_by(2), quant_warp_split=True),
    "grid x2": _grid_splits(2),
    "warps grid x2": _grid_splits(2, quant_warp_split=True),
    "warps grid x4": _grid_splits(4, quant_warp_split=True),
    "warps grid x1": _grid_splits(1, quant_warp_split=True),
    "dgrid": _on_device_split_grid(),
    "warps dgrid": _on_device_split_grid(quant_warp_split=True),
    "grid x1": _grid_splits(1),
    "r128 grid x2": _grid_splits(2, max_registers=128),
    "st2 r80 grid x3": _grid_splits(3, num_stages=2, max_registers=80),
    "x0.5": _splits_by(0.5),
    "pf2": _with(prefetch_blocks=2),
    "pf4": _with(prefetch_blocks=4),
    "pf8": _with(prefetch_blocks=8),
    "x0.5 pf4": _then(_splits_by(0.5), prefetch_blocks=4),
    "all reads": _where_device_grid(merge_live_only=False, merge_in_kernel=False),
    "merge kernel": _where_device_grid(merge_in_kernel=False),
    "in-kernel merge": _where_device_grid(merge_in_kernel=True),
    "x0.5 in-kernel merge": _where_device_grid(_splits_by(0.5), merge_in_kernel=True),
}
SWEEP_POINTS = (("b1 16/2", 1, 4096, 16, 2), ("b1 16/2", 1, 32768, 16, 2), ("b1 16/2", 1, 131072, 16, 2),
                ("llama3-8b", 16, 8192, 32, 8))


def sweep_point(label, batch, context, nheads, nheads_kv, headdim, reps, bandwidth, gen, names,
                kernel_times=False) -> list[dict]:
    """--sweep rows of one shape: our e4m3 cache (contiguous, per-token-head scales) under each sweep entry that
    applies (_SWEEP), our bf16 cache's resolved config, a bare read of the 8-bit bytes and the 8-bit floor.
    kernel_times: each row also gets "kernels", the device time per call of every kernel a call launches (CUDA
    trace, eager calls over the rotated sets; a PDL-launched kernel's time includes its wait for the one before)."""
    import dataclasses

    from flashdecode.bench.decode import _make_set
    from flashdecode.timing import cuda_graph_time_us, rotation_count

    lens = [context] * batch
    bf16_bytes = 2 * batch * context * nheads_kv * headdim * 2
    floor = (bf16_bytes // 2 + 2 * batch * context * nheads_kv * 4) / bandwidth * 1e6
    n_sets = rotation_count(bf16_bytes)
    base = [_make_set(batch, lens, nheads, nheads_kv, headdim, 0, torch.bfloat16, gen) for _ in range(n_sets)]
    fns, _ = _ours(base)
    bf16_us = cuda_graph_time_us(fns, reps=reps)
    sets = [_quant_set(s, True) for s in base]
    del base, fns
    torch.cuda.empty_cache()
    out = torch.empty(bf16_bytes // 2048 + 1, dtype=torch.float32, device="cuda")
    bare = _bare_read(sets, out)
    fns, resolved = _ours(sets, config_out=True)
    reference = fns[0]().float().clone()  # every row's output is compared with the resolved config's
    common = dict(shape=label, batch=batch, context=context, bf16_us=bf16_us, bare_us=bare, floor_us=floor)
    rows, seen = [], set()
    for name in names:
        changes = _SWEEP[name](resolved, context)
        if changes is None or any(f not in {f.name for f in dataclasses.fields(resolved)} for f in changes):
            continue
        config = dataclasses.replace(resolved, **changes)
        if config in seen:
            continue
        seen.add(config)
        row = dict(common, config=name, path=config.path.name, splits=config.num_splits, block_n=config.block_n,
                   warps=config.num_warps, stages=config.num_stages, changes={k: str(v) for k, v in changes.items()})
        try:
            fns, _ = _ours(sets, changes)
            row["max|diff|"] = (fns[0]().float() - reference).abs().max().item()
            row["us"] = cuda_graph_time_us(fns, reps=reps)
            if kernel_times:
                row["kernels"] = _kernel_times(fns)
            row["%bare"] = 100.0 * bare / row["us"] if bare else None
            row["%floor"] = 100.0 * floor / row["us"]
            row["bf16/fp8"] = bf16_us / row["us"]
        except Exception as e:  # reported, not fatal
            row["us"] = None
            row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        rows.append(row)
    timed = [r for r in rows if r.get("us")]
    if timed:
        best = min(timed, key=lambda r: r["us"])
        for r in rows:
            r["best"] = "*" if r is best else ""
    return rows


def _kernel_times(fns) -> dict:
    """Device us per call of each kernel the calls launch (CUDA trace), three calls per rotated set."""
    import itertools

    from benchmarks.probes.cuda_trace import kernel_times_us

    rotation = itertools.cycle(fns)
    return {name: round(us, 2) for name, us in kernel_times_us(lambda: next(rotation)(), 3 * len(fns)).items()}


SWEEP_COLUMNS = ["shape", "batch", "context", "config", "path", "splits", "block_n", "warps", "stages", "us", "best",
                 "%bare", "%floor", "bf16/fp8", "bf16_us", "bare_us", "max|diff|"]


def _report(args, kind: str, env: dict, rows: list[dict], columns: list[str], fmt: dict, bandwidth: float) -> int:
    """Print the rows as a markdown table and write them as the ``kind`` result file (with the copy bandwidth)."""
    from flashdecode.bench.report import markdown_table, result_stem, results_dir, write_json

    print(markdown_table(rows, columns, fmt))
    path = write_json(results_dir(args.out) / f"{result_stem(kind, env)}.json", kind, env, rows,
                      {"copy_bandwidth_bytes_per_s": bandwidth})
    print(f"wrote {path}")
    return 0


def sweep(args) -> int:
    """--sweep: sweep_point at b1 16/2 4k / 32k / 128k and the Llama-3-8B shape b16 8k (hd128; --contexts and
    --batched replace them), the entries of --sweep-configs (default all of _SWEEP); one table (one row per point
    and config, the fastest per point marked *) and a result file."""
    from flashdecode.timing import copy_bandwidth_bytes_per_s, env_info

    if not torch.cuda.is_available():
        print("fp8_decode needs a CUDA GPU")
        return 2
    names = [n for n in args.sweep_configs.split(",") if n] if args.sweep_configs else list(_SWEEP)
    if set(names) - set(_SWEEP):
        raise SystemExit(f"--sweep-configs: from {list(_SWEEP)}")
    points = list(SWEEP_POINTS)
    if args.contexts is not None:
        points = [("b1 16/2", 1, int(c), 16, 2) for c in args.contexts.split(",") if c]
        points += [p for p in SWEEP_POINTS if p[1] > 1]
    if args.batched is not None:
        points = [p for p in points if p[1] == 1]
        points += [("llama3-8b", int(b), args.batched_context, 32, 8) for b in args.batched.split(",") if b]
    env = env_info()
    bandwidth = copy_bandwidth_bytes_per_s()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape, batch, context, nheads, nheads_kv in points:
        point_rows = sweep_point(shape, batch, context, nheads, nheads_kv, 128, args.reps, bandwidth, gen, names,
                                 kernel_times=args.kernel_times)
        rows += point_rows
        for r in point_rows:  # each row as it is measured (a run cut short keeps what it had)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()
                              if k != "changes"}), flush=True)
    print(f"e4m3 decode config sweep on {env['device']} (torch {env['torch']}, triton {env['triton']}), copy "
          f"bandwidth {bandwidth / 1e12:.2f} TB/s; contiguous, per-token-head scales; us (CUDA-graph replays, K/V "
          f"rotated beyond L2); %bare: a bare read of the 8-bit bytes / ours; %floor: the 8-bit floor / ours")
    fmt = {c: ".1f" for c in ("us", "%bare", "%floor", "bf16_us", "bare_us")}
    fmt.update({"bf16/fp8": ".2f", "max|diff|": ".1e"})
    return _report(args, "fp8_sweep", env, rows, SWEEP_COLUMNS, fmt, bandwidth)


CONVERT_COLUMNS = ["shape", "batch", "context", "layout", "scales", "bf16", "cvt", "cvt-kfirst", "bits-klate",
                   "bits-tl", "bits", "bits-w4", "fp8_floor_us", "cvt %floor", "bits %floor", "cvt/bits", "bf16/bits",
                   "equal"]


COLUMNS = ["shape", "batch", "context", "ours bf16 contig", "ours fp8-token contig", "ours fp8-scalar contig",
           "ours bf16 page16", "ours fp8-token page16", "ours fp8-token page16 bn128w4",
           "ours fp8-token page16 bn64w4", "ours fp8-token page16 vlate", "FlashInfer bf16 page16",
           "FlashInfer fp8 page16",
           "bare read fp8 us", "fp8_floor_us", "ours fp8-token contig %floor", "ours fp8-token contig %bare",
           "ours fp8-token page16 %floor", "speedup fp8-token vs bf16 contig", "speedup fp8-token vs bf16 page16",
           "ours fp8 vs FlashInfer fp8 (page16)"]


def main() -> int:
    from flashdecode.timing import copy_bandwidth_bytes_per_s, env_info

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default=None, help="512..131072 (--convert-ab: 4096..131072)")
    parser.add_argument("--batched", default=None,
                        help="Llama-3-8B shape (32 / 8 heads) batches, '' to skip: 16,64 (--convert-ab: 16)")
    parser.add_argument("--batched-context", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--pages", default="0,16", help="--convert-ab: layouts (0: contiguous, else a page size)")
    parser.add_argument("--scales", default="token,scalar", help="--convert-ab: scale granularities")
    parser.add_argument("--ab-columns", default=",".join(_CONVERTS),
                        help="--convert-ab: which of " + ", ".join(_CONVERTS))
    parser.add_argument("--llama-b1-contexts", default="",
                        help="--convert-ab: also the Llama-3-8B shape (32 / 8 heads) at batch 1 and these contexts")
    parser.add_argument("--sweep", action="store_true",
                        help="time the e4m3 decode over DecodeConfig changes around the resolved config (b1 16/2 "
                             "4k / 32k / 128k and the Llama-3-8B shape b16 8k unless --contexts / --batched say)")
    parser.add_argument("--sweep-configs", default="", help="--sweep: which of " + ", ".join(_SWEEP))
    parser.add_argument("--kernel-times", action="store_true",
                        help="--sweep: also each kernel's device time per call (CUDA trace)")
    parser.add_argument("--convert-ab", action="store_true",
                        help="time the e4m3 -> 16-bit conversions against each other (contexts default 4k..128k, "
                             "--batched default 16)")
    args = parser.parse_args()
    if args.convert_ab:
        return convert_ab(args)
    if args.sweep:
        return sweep(args)
    contexts = "512,1024,2048,4096,8192,16384,32768,65536,131072" if args.contexts is None else args.contexts
    batched = "16,64" if args.batched is None else args.batched
    if not torch.cuda.is_available():
        print("fp8_decode needs a CUDA GPU")
        return 2
    env = env_info()
    bandwidth = copy_bandwidth_bytes_per_s()
    gen = torch.Generator(device="cuda").manual_seed(0)
    points = [("b1 16/2", 1, int(c), 16, 2) for c in contexts.split(",") if c]
    points += [("llama3-8b", int(b), args.batched_context, 32, 8) for b in batched.split(",") if b]
    rows = []
    for shape, batch, context, nheads, nheads_kv in points:
        rows.append(bench_point(shape, batch, context, nheads, nheads_kv, 128, args.reps, bandwidth, gen))
        # each point as it is measured (a run cut short by a time limit keeps what it had)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()
                          if not k.endswith(("config", "skipped"))}), flush=True)
    print(f"fp8 decode on {env['device']} (torch {env['torch']}, triton {env['triton']}), copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s; times in us (CUDA-graph replays, K/V rotated beyond L2)")
    fmt = {c: ".1f" for c in COLUMNS if c not in ("shape", "batch", "context")}
    fmt.update({c: ".2f" for c in COLUMNS if c.startswith(("speedup", "ours fp8 vs"))})
    return _report(args, "fp8_decode", env, rows, COLUMNS, fmt, bandwidth)


def convert_ab(args) -> int:
    """--convert-ab: bench_convert_point over the contexts (4k..128k unless given) at b1 16/2 hd128 and the
    Llama-3-8B shape at the --batched batches (16 unless given), 8k; a compact table and a result file."""
    from flashdecode.timing import copy_bandwidth_bytes_per_s, env_info

    if not torch.cuda.is_available():
        print("fp8_decode needs a CUDA GPU")
        return 2
    contexts = "4096,16384,32768,65536,131072" if args.contexts is None else args.contexts
    batched = "16" if args.batched is None else args.batched
    columns = [c for c in args.ab_columns.split(",") if c]
    pages = tuple(int(p) for p in args.pages.split(",") if p)
    scales = tuple(g for g in args.scales.split(",") if g)
    if set(columns) - set(_CONVERTS) or set(scales) - {"token", "scalar"}:
        raise SystemExit(f"--ab-columns: from {sorted(_CONVERTS)}; --scales: token, scalar")
    env = env_info()
    bandwidth = copy_bandwidth_bytes_per_s()
    gen = torch.Generator(device="cuda").manual_seed(0)
    points = [("b1 16/2", 1, int(c), 16, 2) for c in contexts.split(",") if c]
    points += [("llama3-8b", int(b), args.batched_context, 32, 8) for b in batched.split(",") if b]
    points += [("llama3-8b", 1, int(c), 32, 8) for c in args.llama_b1_contexts.split(",") if c]
    rows = []
    for shape, batch, context, nheads, nheads_kv in points:
        rows += bench_convert_point(shape, batch, context, nheads, nheads_kv, 128, args.reps, bandwidth, gen, pages,
                                    scales, columns)
    print(f"e4m3 -> 16-bit conversion A/B on {env['device']} (torch {env['torch']}, triton {env['triton']}), copy "
          f"bandwidth {bandwidth / 1e12:.2f} TB/s; us (CUDA-graph replays, K/V rotated beyond L2); cvt: conversion "
          f"instructions, bits-tl: bit ops in Triton, bits: packed PTX bit ops (resolved)")
    fmt = {c: ".1f" for c in CONVERT_COLUMNS if c not in ("shape", "batch", "context", "layout", "scales", "equal")}
    fmt.update({"cvt/bits": ".2f", "bf16/bits": ".2f"})
    return _report(args, "fp8_convert_ab", env, rows, CONVERT_COLUMNS, fmt, bandwidth)


if __name__ == "__main__":
    raise SystemExit(main())
