"""Per-program timeline of the real decode stage 1 at b1 16/2 hd128 bf16, contiguous vs page 16 (GPU only; a
measurement, not a test). Copies the flashdecode package into a temporary directory, instruments that copy's stage 1
(decode_split_kernel: %globaltimer at the program's start, after gdc_wait, once the sequence length has arrived,
and at its end, written through the TICKETS pointer that a non-fused launch leaves unused), imports the copy and
times DecodePlan calls as ``flashdecode bench decode`` does (CUDA-graph replay, rotated K/V sets). The records are
the graph's last call's. The source edits assert the lines they patch, so a changed kernel fails loudly here.

    PYTHONPATH=. python3 scripts/stage1_timeline.py [CONTEXTS] [OUT_DIR]
"""
import os
import pathlib
import shutil
import sys
import tempfile

copy = pathlib.Path(tempfile.mkdtemp()) / "flashdecode"
shutil.copytree(pathlib.Path(__file__).resolve().parent.parent / "flashdecode", copy)
sys.path.insert(0, str(copy.parent))
kp = copy / "kernels" / "decode.py"
s = kp.read_text()
helpers = '''

@triton.jit
def _tl_now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _tl_now_after(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _tl_write(TICKETS, idx, g0, gw, gl):
    """Record idx: SM id, start, after the wait, length ready, now (int64 through the TICKETS pointer)."""
    g1 = _tl_now()
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    base = TICKETS.to(tl.pointer_type(tl.int64)) + idx.to(tl.int64) * 5
    tl.store(base, smid.to(tl.int64))
    tl.store(base + 1, g0)
    tl.store(base + 2, gw)
    tl.store(base + 3, gl)
    tl.store(base + 4, g1)
'''
anchor = "\n\n@triton.jit\ndef decode_split_kernel("
s = s.replace(anchor, helpers + anchor, 1)
first = "    SPEC: tl.constexpr = SPEC_PAGES and PAGE_SIZE > 0 and PRELOAD_PAGES > 0 and not DEVICE_SPLITS\n"
assert first in s
s = s.replace(first, first + "    _g0 = _tl_now()\n", 1)
wait = """        gdc_wait()
    if USE_PDL:
        gdc_launch_dependents()
"""  # decode_split_kernel's, the file's first
assert wait in s
s = s.replace(wait, wait + "    _gw = _tl_now()\n", 1)
rng = """    start, end = split_range(seqlen, split, window_left, SEQLEN_Q, num_splits, BLOCK_N, MIN_CHUNK, WINDOW)

    o_rows"""
assert rng in s
s = s.replace(rng, rng.replace("\n\n    o_rows", "\n    _gl = _tl_now_after(seqlen)\n\n    o_rows"), 1)
end = """        tl.store(o_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptrs, lse2, mask=row_ok)
"""
assert end in s
s = s.replace(end, end + """        if not FUSED_MERGE and not DEVICE_SPLITS:
            _tl_write(TICKETS, (b * tl.num_programs(1) + pid_hm) * NUM_SPLITS + split, _g0, _gw, _gl)
""", 1)
kp.write_text(s)

mp = copy / "kernels" / "merge.py"
s = mp.read_text()
sig = "    O_IN, LSE_IN, O_OUT, LSE_OUT, num_states, num_inner,\n"
assert sig in s
s = s.replace(sig, "    O_IN, LSE_IN, O_OUT, LSE_OUT, TL_TIMES, num_states, num_inner,\n", 1)
body = """    if USE_PDL:
        if EARLY_TRIGGER:
            gdc_launch_dependents()
        gdc_wait()
        if not EARLY_TRIGGER:
            gdc_launch_dependents()
"""
assert body in s
s = s.replace(body, "    _m0 = _tl_now()\n" + body + "    _mw = _tl_now()\n", 1)
store = "    tl.store(LSE_OUT + r_outer * stride_loo + r_inner * stride_loi, lse2 * LN2, mask=r_ok & (d_chunk == 0))\n"
assert store in s
s = s.replace(store, store + """    _mid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    _tl_write(TL_TIMES, _mid, _m0, _mw, _mw)
""", 1)
s = s.replace("from flashdecode.kernels.softmax_state import", "from flashdecode.kernels.decode_timeline import _tl_now, _tl_write\nfrom flashdecode.kernels.softmax_state import", 1)
mp.write_text(s)
(copy / "kernels" / "decode_timeline.py").write_text("import triton\nimport triton.language as tl\n" + helpers)
mo = copy / "ops" / "merge.py"
s = mo.read_text()
call = "        o_in_s, lse_in_s, o_out, lse_out, num_states, inner,\n"
assert call in s
s = s.replace(call, "        o_in_s, lse_in_s, o_out, lse_out, _tl_merge_times(o_out.device), num_states, inner,\n", 1)
s += """

_TLM = {}


def _tl_merge_times(device):
    if device not in _TLM:
        _TLM[device] = torch.zeros(1 << 14, dtype=torch.int64, device=device)
    return _TLM[device]
"""
if "\nimport torch\n" not in s:
    s = "import torch\n" + s
mo.write_text(s)

op = copy / "ops" / "decode.py"
s = op.read_text()
line = "    fo4, flse3, tickets = fused if fused is not None else (o4, lse3, cache_seqlens)  # unused when not fused\n"
assert line in s
s = s.replace(line, line.replace("cache_seqlens)", "_tl_times(cache_seqlens.device))"), 1)
s = s.replace("\ndef _launch_stage1(", '''
_TL = {}


def _tl_times(device):
    if device not in _TL:
        _TL[device] = torch.zeros(1 << 16, dtype=torch.int64, device=device)
    return _TL[device]


def _launch_stage1(''', 1)
assert "_tl_times(device)" in s
op.write_text(s)
import torch  # noqa: E402

import flashdecode  # noqa: E402

assert pathlib.Path(flashdecode.__file__).parent == copy, flashdecode.__file__

from flashdecode.bench.decode import _make_set, _ours  # noqa: E402
from flashdecode.bench.timing import cuda_graph_time_us, rotation_count  # noqa: E402
from flashdecode.ops import decode as ops_decode  # noqa: E402


def pct(v, q):
    """The q-quantile of v (nearest rank)."""
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


gen = torch.Generator(device="cuda").manual_seed(0)
contexts = sys.argv[1] if len(sys.argv) > 1 else "4096,8192,32768"
lines = []
for rep in range(2):
    for ctx in [int(c) for c in contexts.split(",")]:
        for page in (0, 16):
            kv_bytes = 2 * ctx * 2 * 128 * 2
            sets = [_make_set(1, [ctx], 16, 2, 128, page, torch.bfloat16, gen)
                    for _ in range(rotation_count(kv_bytes))]
            calls, info = _ours(sets)
            us = cuda_graph_time_us(calls, reps=20)
            n = 2 * info["num_splits"]
            rec = ops_decode._tl_times(torch.device("cuda", 0))[: n * 5].view(n, 5).cpu()
            sm, g0, gw, gl, g1 = (rec[:, i].double() for i in range(5))
            t0 = g0.min()
            starts, waits, lens, ends = ([round((v - float(t0)) / 1e3, 2) for v in x.tolist()]
                                         for x in (g0, gw, gl, g1))
            from flashdecode.ops import merge as ops_merge
            mrec = ops_merge._tl_merge_times(torch.device("cuda", 0))[:16 * 5].view(16, 5).cpu()
            used = mrec[:, 1] > 0
            mrec = mrec[used].double()
            m0, mw, m1 = ([round((v - float(t0)) / 1e3, 2) for v in mrec[:, i].tolist()] for i in (1, 2, 4))
            ops_merge._tl_merge_times(torch.device("cuda", 0)).zero_()
            lines.append(f"rep{rep} ctx {ctx:>6} page {page:>2} {us:6.2f} us  splits {info['num_splits']}  "
                  f"start p50/max {pct(starts, .5)}/{max(starts)}  "
                  f"wait-out min/p50/max {min(waits)}/{pct(waits, .5)}/{max(waits)}  "
                  f"len-ready p50/max {pct(lens, .5)}/{max(lens)}  "
                  f"end min/p50/max {min(ends)}/{pct(ends, .5)}/{max(ends)}  "
                  f"run(end-waitout) p50 {pct([e - w for e, w in zip(ends, waits)], .5):.2f}  "
                  f"merge x{len(m0)} start max {max(m0) if m0 else None} wait-out min/max "
                  f"{min(mw) if mw else None}/{max(mw) if mw else None} end max {max(m1) if m1 else None}")
            print(lines[-1], flush=True)
            del sets
out = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", "benchmarks/results"))
out.mkdir(parents=True, exist_ok=True)
from flashdecode.bench.report import result_stem  # noqa: E402
from flashdecode.bench.timing import env_info  # noqa: E402

name = out / f"{result_stem('stage1_timeline', env_info())}.txt"
name.write_text("python3 scripts/stage1_timeline.py " + " ".join(sys.argv[1:]) + "\n"
                "us from the call's first program start (%globaltimer); 'wait-out': gdc_wait returned (the previous "
                "call's merge done); 'len-ready': the sequence length arrived; 'run': end - wait-out\n"
                + "\n".join(lines) + "\n")
print(f"wrote {name}")
