"""The Gluon launcher's host path without a GPU: the kernel launch is stubbed, so these tests check what the
launcher hands to Triton - one JIT launch per launch key, then direct launches of the compiled kernel with a 3-entry
grid, the kernel's full argument list and descriptors equal to the JIT launch's - and the dispatch entry point's
refusals (None: the caller takes the Triton path)."""

import pytest
import torch

from flashdecode.kernels.gluon.attn_fwd import attn_fwd_ws_kernel
from flashdecode.ops import checks
from flashdecode.ops import gluon_attention as ga
from flashdecode.ops import gluon_plan
from helpers import FakeCompiled as _FakeCompiled
from helpers import FakeTmaDriver, triton_launcher


@pytest.fixture
def stubbed(monkeypatch):
    """A fake Hopper: every launch key's first launch goes to a recording stub instead of Triton's JIT."""
    jit_calls = []
    compiled = _FakeCompiled()

    def fake_jit(grid, args, constexprs):
        jit_calls.append((grid, args, constexprs))
        return compiled

    monkeypatch.setattr(ga, "is_hopper", lambda device: True)
    monkeypatch.setattr(gluon_plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(gluon_plan, "_jit_launch", fake_jit)
    monkeypatch.setattr(gluon_plan, "_current_stream", lambda index: 7)
    monkeypatch.setattr(gluon_plan, "_current_device", lambda: None)  # CPU tensors' device index
    gluon_plan.PLANS.clear()
    yield jit_calls, compiled
    gluon_plan.PLANS.clear()  # no fake kernel outlives the test


def _qkv(sq=300, sk=200, h=4, hkv=2, d=128):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, sq, h, d, generator=gen, dtype=torch.float16),
            torch.randn(2, sk, hkv, d, generator=gen, dtype=torch.float16),
            torch.randn(2, sk, hkv, d, generator=gen, dtype=torch.float16))


def test_repeated_calls_launch_the_compiled_kernel_directly(stubbed):
    jit_calls, compiled = stubbed
    q, k, v = _qkv()
    out, lse = ga.gluon_attention_forward(q, k, v, causal=True)
    assert len(jit_calls) == 1 and not compiled.launches
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (2, 4, 300) and lse.dtype == torch.float32
    (grid, jit_args, constexprs), = jit_calls
    for _ in range(3):  # new tensors, same launch key
        q, k, v = _qkv()
        out, lse = ga.gluon_attention_forward(q, k, v, causal=True, softmax_scale=0.5)
    assert len(jit_calls) == 1 and len(compiled.launches) == 3 and len(gluon_plan.PLANS) == 1
    plan, = gluon_plan.PLANS.values()
    assert plan.direct_launches == 3
    launch = compiled.launches[-1]
    g0, g1, g2, stream, function, packed = launch[:6]
    args = launch[9:]
    cfg = ga.resolve_gluon_config(128, True, 200)
    num_tiles = -(-300 // cfg.block_m) * 2 * 4
    # causal short keys: persistent CTAs over units of two tiles (3 query blocks -> 2 units per head)
    assert cfg.tile_order == "pairs" and cfg.persistent
    units = -(-(num_tiles // 8) // 2) * 2 * 4
    assert (g0, g1, g2) == (units, 1, 1) and grid == (units, 1, 1)
    assert (stream, function, packed) == (7, "function-handle", "packed")
    # the kernel's whole parameter list: runtime arguments, then every constexpr in declaration order
    assert len(args) == len(attn_fwd_ws_kernel.arg_names) == len(jit_args) + len(constexprs)
    assert args[5:9] == (num_tiles, 300, 200, 0.5 * checks.LOG2E)
    assert args[9:] == tuple(constexprs[n] for n in attn_fwd_ws_kernel.arg_names[9:])
    assert constexprs["GROUP"] == 2 and constexprs["CAUSAL"] is True
    for host, jit, x in zip(args[:3], jit_args[:3], (q, k, v)):  # descriptors: what the JIT launch described
        assert host.base is x and host.padding == "zero"
        assert list(host.shape) == list(jit.shape) and list(host.strides) == list(jit.strides)
    # out and lse as their addresses (the C launcher takes ints as they are: no data_ptr() call, no driver query)
    assert args[3:5] == (out.data_ptr(), lse.data_ptr()) and lse.shape == (2, 4, 300) and out.shape == q.shape


def test_each_launch_key_gets_its_own_plan(stubbed):
    jit_calls, compiled = stubbed
    q, k, v = _qkv()
    ga.gluon_attention_forward(q, k, v)
    ga.gluon_attention_forward(q, k, v, causal=True)
    ga.gluon_attention_forward(q[:, :100].contiguous(), k, v)  # another seqlen_q
    qkv = torch.stack(_qkv(sq=200, hkv=4), dim=2)  # packed (batch, seqlen, 3, heads, dim): other strides
    ga.gluon_attention_forward(*qkv.unbind(2))
    assert len(jit_calls) == len(gluon_plan.PLANS) == 4 and not compiled.launches
    persistent_grid = jit_calls[0][0]  # non-causal short keys: persistent, at most one CTA per SM
    assert persistent_grid == (min(-(-300 // 128) * 8, 132), 1, 1)


def test_cpu_tensors_never_take_the_gluon_path():
    assert not ga.is_hopper(torch.device("cpu"))
    q, k, v = _qkv()
    assert ga.dispatch_plan(q, k, v) is None


def test_dispatch_entry_refuses_what_the_gluon_kernel_does_not_take(stubbed, monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ga.gluon_forward_if_supported(q, k, v, 0.1) is None  # the CPU interpreter: never Gluon
    monkeypatch.delenv("TRITON_INTERPRET")
    for kwargs in (dict(window_left=8, window_right=0), dict(window_right=4), dict(softcap=30.0),
                   dict(varlen=True)):
        assert ga.gluon_forward_if_supported(q, k, v, 0.1, **kwargs) is None, kwargs
    assert not ga.supported_problem(q.float(), k.float(), v.float())
    assert not ga.supported_problem(q[..., :96], k[..., :96], v[..., :96])
    assert not ga.supported_problem(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert not ga.supported_problem(q[:, :0], k, v)
    assert not ga.supported_problem(q[:, :100], k, v)  # batch rows do not follow each other's seq rows
    misaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    assert ga.supported_problem(misaligned, k, v) and not ga.gluon_supported(misaligned, k, v)


def test_dispatch_rule_decides_once_per_launch_key(stubbed):
    """gluon_pays (hd128 always; hd64 from GLUON_HD64_MIN_KEYS keys) is applied when a key's plan is built and the
    answer is cached: a key it rules out stays on the Triton path without another check."""
    assert ga.gluon_pays(128, 128) and ga.gluon_pays(64, ga.GLUON_HD64_MIN_KEYS)
    assert not ga.gluon_pays(64, ga.GLUON_HD64_MIN_KEYS - 1)
    short64 = _qkv(sq=128, sk=512, d=64)
    assert ga._plan_for(*short64, True, None) is ga.NOT_APPLICABLE
    assert isinstance(ga._plan_for(*_qkv(sq=128, sk=1024, d=64), True, None), ga.GluonPlan)
    assert isinstance(ga._plan_for(*_qkv(sq=128, sk=128), False, None), ga.GluonPlan)
    assert isinstance(ga._plan_for(*short64, True, ga.resolve_gluon_config(64, True, 512)), ga.GluonPlan)
    assert len(gluon_plan.PLANS) == 4


def _triton_launcher(c_calls: list):
    """helpers.triton_launcher for attn_fwd_ws_kernel's signature: three host tensor descriptors first."""
    names = attn_fwd_ws_kernel.arg_names
    signature = {i: ("tensordesc<fp16[64,128]>" if i < 3 else "*fp16" if i < 5 else "i32") for i in range(len(names))}
    metas = [dict(swizzle=128, elem_size=2, elem_type=6, block_size=[rows, 128], fp4_padded=False)
             for rows in (64, 128, 128)]
    return triton_launcher(c_calls, signature, metas)


def test_direct_launch_hands_the_c_launcher_what_tritons_wrappers_do(stubbed, monkeypatch):
    """With Triton's real launcher wrappers around a recording C launch: the plan's direct launch
    (direct_launch.TensormapLauncher) passes the C launcher the same arguments as Triton's own path (taken while a
    launch hook is registered), except the metadata and hooks; the CUtensorMaps are filled once per address."""
    import triton

    fake = FakeTmaDriver()
    monkeypatch.setattr(triton.runtime.driver, "_active", fake)
    c_calls = []
    compiled = _FakeCompiled()
    compiled.run = _triton_launcher(c_calls)
    monkeypatch.setattr(gluon_plan, "_jit_launch", lambda grid, args, constexprs: compiled)
    q, k, v = _qkv()
    ga.gluon_attention_forward(q, k, v, causal=True)  # the key's JIT launch (stubbed)
    plan, = gluon_plan.PLANS.values()
    assert isinstance(plan.direct, gluon_plan.direct_launch.TensormapLauncher)
    ga.gluon_attention_forward(q, k, v, causal=True, softmax_scale=0.25)
    ga.gluon_attention_forward(q, k, v, causal=True, softmax_scale=0.25)
    assert len(c_calls) == 2 and len(fake.fills) == 3 and plan.direct.fills == 3  # one fill per operand address
    hooks = triton.knobs.runtime.launch_enter_hook

    def hook(metadata):
        return None
    hooks.add(hook)
    try:
        ga.gluon_attention_forward(q, k, v, causal=True, softmax_scale=0.25)
    finally:
        hooks.remove(hook)
    direct, wrapped = c_calls[1], c_calls[2]
    assert direct[10:13] == (None, None, None) and wrapped[11:13] == (hooks, triton.knobs.runtime.launch_exit_hook)
    assert direct[:10] == wrapped[:10]  # grid, stream, function, cooperative, pdl, scratch, packed metadata
    out_at = 13 + 3 * 5  # each descriptor: the map, 2 shape and 2 stride entries
    assert direct[13:out_at] == wrapped[13:out_at] and direct[13] == ("tensormap", q.data_ptr(), 128, 2, 6,
                                                                      (64, 128), (600, 512), (512, 1), 0)
    assert direct[out_at + 2:] == wrapped[out_at + 2:]  # runtime arguments and constexprs
    assert all(type(a) is int for a in direct[out_at:out_at + 2] + wrapped[out_at:out_at + 2])
    q2 = q.clone()  # a new address: one more fill, for q only
    ga.gluon_attention_forward(q2, k, v, causal=True)
    assert plan.direct.fills == 4 and c_calls[-1][13][1] == q2.data_ptr()


def test_resolved_launch_rule():
    """resolve_gluon_config's measured rule (docs/decisions.md): persistent CTAs to 2k keys, to 8k for causal
    launches and hd64; causal persistent CTAs take tile pairs; hd128 takes host-made (lpt) tile lists with the
    overlapped loop (FA3's intra-warpgroup overlap, K and V released apart) for causal launches beyond 4k keys and
    non-causal ones of 1k-8k keys, and the overlapped loop one CTA per tile for longer non-causal ones; hd64 from
    16k keys on three consumer warpgroups, one CTA per tile; every config valid for its kernel (two Q buffer sets
    exactly where CTAs are persistent)."""
    for d in (64, 128):
        for causal in (False, True):
            for seqlen_k in (1, 1023, 1024, 2048, 4096, 4097, 8192, 8193, 16384, 65536):
                cfg = ga.resolve_gluon_config(d, causal, seqlen_k)
                lpt = d == 128 and (seqlen_k > 4096 if causal else 1024 <= seqlen_k <= 8192)
                persistent = seqlen_k <= 2048 or (seqlen_k <= 8192 and (causal or d == 64)) or lpt
                assert cfg.persistent == persistent, (d, causal, seqlen_k)
                assert cfg.q_buffers == (2 if persistent else 1)
                assert cfg.tile_order == ("lpt" if lpt else "pairs" if persistent and causal else "round_robin")
                assert cfg.num_consumers == (3 if d == 64 and seqlen_k >= ga.THREE_CONSUMERS_MIN_KEYS else 2)
                fa3_loop = d == 128 and (lpt or not persistent)
                assert cfg.overlap == fa3_loop and cfg.split_release == fa3_loop, (d, causal, seqlen_k)


def test_resolved_fp8_launch_rule():
    """resolve_gluon_fp8_config: hd128 from FP8_BN256_MIN_KEYS keys on 256-key blocks in two stages (the configs
    tests/test_gluon_gpu.py test_gluon_fp8_forward_every_config checks on the GPU), persistent with two Q buffer
    sets where not causal; persistent CTAs otherwise only for non-causal launches to 2k keys; the stage counts that
    fill shared memory elsewhere."""
    for d, stages in ((64, 4), (128, 3), (256, 2)):
        for causal in (False, True):
            for seqlen_k in (1, 2048, 4096, 16383, 16384, 65536):
                cfg = ga.resolve_gluon_fp8_config(d, causal, seqlen_k)
                long128 = d == 128 and seqlen_k >= ga.FP8_BN256_MIN_KEYS
                assert (cfg.block_n, cfg.num_stages) == ((256, 2) if long128 else (128, stages)), (d, causal, seqlen_k)
                assert cfg.persistent == (not causal and (seqlen_k <= 2048 or long128))
                assert cfg.tile_order == "round_robin"
                assert cfg.q_buffers == (2 if long128 and not causal else 1)


def test_lpt_schedule_hands_every_tile_to_one_cta_and_balances_the_work():
    """lpt_schedule (tile_order "lpt"): every tile in exactly one CTA's list, each list in the grid's order, rows
    padded to an even width with the "no tile" value, and the estimated work per CTA within one tile of the mean
    (causal 16k x 16 heads: 2048 tiles of 1..128 key blocks on 132 CTAs; a ragged causal GQA case with rows that
    see no key: tiles of 0 blocks)."""
    cfg = ga.GluonFwdConfig(persistent=True, q_buffers=2, tile_order="lpt")
    for sq, sk, heads, ctas in ((16384, 16384, 16, 132), (1600, 1000, 3 * 8, 132), (300, 200, 2, 7)):
        blocks = ga.tile_key_blocks(sq, sk, heads, cfg, causal=True)
        assert len(blocks) == -(-sq // cfg.block_m) * heads
        sched = ga.lpt_schedule(blocks, ctas)
        stride = int(sched[0])
        rows = sched[1:].view(ctas, stride).tolist()
        assert stride % 2 == 1  # 1 + an even width
        lists = [row[1:1 + row[0]] for row in rows]
        assert sorted(t for tiles in lists for t in tiles) == list(range(len(blocks)))
        assert all(tiles == sorted(tiles) for tiles in lists)
        assert all(x == len(blocks) for row in rows for x in row[1 + row[0]:])
        work = [sum(blocks[t] + ga.LPT_TILE_OVERHEAD_BLOCKS for t in tiles) for tiles in lists]
        assert max(work) - min(work) <= max(blocks) + ga.LPT_TILE_OVERHEAD_BLOCKS
    assert ga.tile_key_blocks(300, 200, 1, cfg, causal=False) == [2, 2, 2]
    assert ga.tile_key_blocks(300, 200, 1, cfg, causal=True) == [2, 2, 1]  # heaviest first
    assert ga.tile_key_blocks(300, 100, 1, cfg, causal=True) == [1, 1, 0]  # rows 0..199 see no key


def test_lpt_plans_launch_their_own_kernel_with_the_tile_lists(stubbed, monkeypatch):
    """tile_order "lpt": the JIT launch goes to attn_fwd_ws_lpt_kernel with the plan's int32 tile lists after
    qk_scale_log2 and its constexprs only; direct launches pass the lists' address there and the same constexpr
    tail; the grid is one CTA per list (at most the SMs)."""
    from flashdecode.kernels.gluon.attn_fwd import attn_fwd_ws_lpt_kernel

    _, compiled = stubbed
    lpt_calls = []

    def fake_jit(grid, args, constexprs, **kernel):
        lpt_calls.append((grid, args, constexprs, kernel))
        return compiled

    monkeypatch.setattr(gluon_plan, "_jit_launch", fake_jit)
    cfg = ga.GluonFwdConfig(persistent=True, q_buffers=2, tile_order="lpt")
    q, k, v = _qkv(sq=1000, sk=1000)
    for _ in range(2):
        ga.gluon_attention_forward(q, k, v, causal=True, config=cfg)
    (grid, args, constexprs, kernel), = lpt_calls
    plan, = gluon_plan.PLANS.values()
    num_tiles = -(-1000 // 128) * 2 * 4
    assert kernel == dict(lpt=True) and grid == (min(num_tiles, 132), 1, 1) == plan.grid
    assert args[9] is plan.sched[0] and plan.sched[0].dtype == torch.int32
    assert len(args) + len(constexprs) == len(attn_fwd_ws_lpt_kernel.arg_names)
    assert set(constexprs) == set(attn_fwd_ws_lpt_kernel.arg_names[10:])
    launch = compiled.launches[-1][9:]
    assert launch[5:10] == (num_tiles, 1000, 1000, q.shape[-1] ** -0.5 * checks.LOG2E, plan.sched_ptr[0])
    assert launch[10:] == tuple(constexprs[n] for n in attn_fwd_ws_lpt_kernel.arg_names[10:])
    with pytest.raises(ValueError, match="tile_order"):
        ga.GluonFwdConfig(q_buffers=2, tile_order="lpt")  # lists per persistent CTA


@pytest.mark.parametrize("batch,sk,tile_order,v_tail", [(2, 200, "round_robin", True), (2, 256, "round_robin", False),
                                                        (1, 200, "round_robin", False), (2, 1000, "lpt", True)])
def test_batches_whose_keys_end_inside_a_block_zero_the_next_sequences_values(stubbed, monkeypatch, batch, sk,
                                                                               tile_order, v_tail):
    """A fixed-length batch reads its K / V as packed rows: where a sequence's keys end inside a key block and
    another sequence follows, the launch sets V_TAIL (the consumers zero those V rows before PV, or a NaN value
    of the next sequence reaches this one); other launches keep V_TAIL off (their instructions unchanged)."""
    calls = []
    _, compiled = stubbed

    def fake_jit(grid, args, constexprs, **kernel):
        calls.append(constexprs)
        return compiled

    monkeypatch.setattr(gluon_plan, "_jit_launch", fake_jit)
    q, k, v = (x[:batch] for x in _qkv(sq=300, sk=sk))
    persistent = tile_order == "lpt"
    cfg = ga.GluonFwdConfig(persistent=persistent, q_buffers=2 if persistent else 1, tile_order=tile_order)
    ga.gluon_attention_forward(q, k, v, causal=True, config=cfg)
    assert calls[-1]["V_TAIL"] is v_tail


@pytest.mark.parametrize("v_bound", [False, True])
def test_ragged_v_bound_passes_the_v_tensor_and_turns_the_consumers_zeroing_off(stubbed, monkeypatch, v_bound):
    """GluonFwdConfig.v_bound (ragged launches): the kernel takes V_BOUND and, as its v_rows_ptr, v itself (the
    first launch) or v's address (direct launches), with V_TAIL off (the producer's bounded loads give the zeros);
    without it v_rows_ptr is None (compiled without the parameter) and the consumers zero the tail (V_TAIL)."""
    from flashdecode.kernels.gluon.attn_fwd import attn_fwd_ws_varlen_kernel

    calls = []
    _, compiled = stubbed

    def fake_jit(grid, args, constexprs, **kernel):
        calls.append((args, constexprs, kernel))
        return compiled

    monkeypatch.setattr(gluon_plan, "_jit_launch", fake_jit)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter never takes the Gluon path
    gen = torch.Generator().manual_seed(0)
    lens = [100, 37, 300]
    total = sum(lens)
    q = torch.randn(total, 4, 128, generator=gen, dtype=torch.float16)
    k, v = (torch.randn(total, 2, 128, generator=gen, dtype=torch.float16) for _ in range(2))
    cu = torch.tensor([0, 100, 137, 437], dtype=torch.int32)
    out, lse = torch.empty_like(q), torch.empty(4, total)
    cfg = ga.GluonFwdConfig(v_bound=v_bound)
    for _ in range(2):
        assert ga.gluon_varlen_forward_into(q, k, v, out, lse, cu, cu, max(lens), 0.1, -1, 0, 0.0, cfg)
    (args, constexprs, kernel), = calls
    assert kernel == dict(ragged=True)
    assert constexprs["V_BOUND"] is v_bound and constexprs["V_TAIL"] is (not v_bound)
    assert len(args) + len(constexprs) == len(attn_fwd_ws_varlen_kernel.arg_names)
    names = attn_fwd_ws_varlen_kernel.arg_names
    assert args[names.index("v_rows_ptr")] is (v if v_bound else None)
    launch = compiled.launches[-1][9:]  # the direct launch: its arguments after the C launcher's own
    assert launch[names.index("v_rows_ptr")] == (v.data_ptr() if v_bound else None)
    with pytest.raises(TypeError, match="v_bound"):
        ga.GluonFwdConfig(v_bound=1)


def test_direct_launch_of_a_kernel_with_global_scratch_hands_it_an_aligned_buffer(stubbed, monkeypatch):
    """A kernel that makes descriptors on the device (GluonFwdConfig.v_bound's ragged launch) needs global scratch:
    the plan's C launcher (direct_launch.TensormapLauncher, given the plan's device) hands each launch an aligned
    address in the stream's SCRATCH buffer of grid * per-program bytes, reused while it is large enough; without a
    device, or with programmatic dependent launch, it refuses such a kernel (Triton's own launcher takes it)."""
    import triton

    monkeypatch.setattr(triton.runtime.driver, "_active", FakeTmaDriver())
    c_calls = []
    compiled = _FakeCompiled()
    compiled.run = _triton_launcher(c_calls)
    compiled.run.global_scratch_size, compiled.run.global_scratch_align = 128, 128
    monkeypatch.setattr(gluon_plan, "_jit_launch", lambda grid, args, constexprs: compiled)
    q, k, v = _qkv()
    ga.gluon_attention_forward(q, k, v, causal=True)  # the key's JIT launch (stubbed)
    plan, = gluon_plan.PLANS.values()
    direct = plan.direct
    assert isinstance(direct, gluon_plan.direct_launch.TensormapLauncher)
    grid = plan.grid[0] * plan.grid[1] * plan.grid[2]
    assert direct.scratch == (128 * grid, 128, q.device)
    allocations = gluon_plan.direct_launch.SCRATCH.allocations
    for _ in range(2):
        ga.gluon_attention_forward(q, k, v, causal=True)
    first, second = c_calls
    assert type(first[7]) is int and first[7] % 128 == 0 and first[7] == second[7]
    out_at = 13 + 3 * 5  # the descriptors' arguments end here (then out and lse: each call's own)
    assert first[:7] == second[:7] and first[8:out_at] == second[8:out_at]
    buffer = gluon_plan.direct_launch.SCRATCH.buffers[(q.device, 7)]  # the stubbed stream
    assert buffer.numel() >= 128 * grid and buffer.data_ptr() <= first[7] < buffer.data_ptr() + 128
    assert gluon_plan.direct_launch.SCRATCH.allocations <= allocations + 1
    assert gluon_plan.direct_launch.TensormapLauncher.of(compiled, plan.views, plan.grid) is None  # no device
    compiled.run.launch_pdl = True
    assert gluon_plan.direct_launch.TensormapLauncher.of(compiled, plan.views, plan.grid, q.device) is None
