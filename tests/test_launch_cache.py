"""The launch cache (ops/launch_cache.py) and the decode host path (ops/decode_host.py): a key is recorded once
and never serves a launch whose arguments Triton would specialise differently; a repeated decode call re-checks
nothing it need not, yet every check still raises; the CPU interpreter falls back to Triton's own launch; `import
flashdecode` loads neither torch._dynamo nor the engine."""

import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import flashdecode
from flashdecode import reference
from flashdecode.ops import decode_host, launch_cache

from helpers import DEVICE, randn


@pytest.fixture(autouse=True)
def _checked_keys():
    before = launch_cache.check_keys(True)
    launch_cache.clear()
    decode_host.clear()
    yield
    launch_cache.check_keys(before)


@triton.jit
def _scale_kernel(X, Y, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * factor, mask=offs < n)


_SITE = launch_cache.LaunchSite(_scale_kernel, "scale")


def test_site_records_once_and_falls_back_to_the_jit_in_the_interpreter(gen):
    x = randn(40, gen=gen)
    for factor in (2.0, 3.0):
        y = torch.empty_like(x)
        _SITE.launch(("k", 40), (3, 1, 1), (x, y, 40, factor), lambda: dict(BLOCK=16), x.device)
        torch.testing.assert_close(y, x * factor)
    assert _SITE.runtime_names == ("X", "Y", "n", "factor")
    assert list(_SITE.records) == [("k", 40)]
    record = _SITE.records[("k", 40)]
    if not torch.cuda.is_available():  # the interpreter has no compiled kernel: Triton's launch every time
        assert record.direct is None and _SITE.jit_launches == 2
    else:
        assert record.direct is not None and record.launches == 1


@pytest.mark.parametrize("n, other", [(40, 1), (32, 40), (40, 2**33)])
def test_a_key_that_misses_a_specialisation_is_caught(gen, n, other):
    """n == 1, n % 16 == 0 and n beyond int32 compile different kernels: one key for both raises."""
    x = randn(64, gen=gen)
    y = torch.empty_like(x)
    _SITE.launch("same", (1, 1, 1), (x, y, n, 1.0), lambda: dict(BLOCK=64), x.device)
    with pytest.raises(RuntimeError, match="misses a fact"):
        _SITE.launch("same", (1, 1, 1), (x, y, other, 1.0), lambda: dict(BLOCK=64), x.device)
    with pytest.raises(RuntimeError, match="misses a fact"):  # a pointer off 16-byte alignment
        _SITE.launch("same", (1, 1, 1), (x[1:], y, n, 1.0), lambda: dict(BLOCK=64), x.device)


def _cache(gen, batch, cap, hk, d, dtype, page_size=0, layout="contiguous"):
    if page_size:
        pages = batch * (cap // page_size)
        k = randn(pages, page_size, hk, d, gen=gen, dtype=dtype)
        v = randn(pages, page_size, hk, d, gen=gen, dtype=dtype)
        table = torch.randperm(pages, generator=gen).view(batch, -1).to(torch.int32).to(DEVICE)
        return k, v, table
    if layout == "strided":  # the cache's heads interleaved with unused ones: other strides, same shape
        k = randn(batch, cap, 2 * hk, d, gen=gen, dtype=dtype)[:, :, ::2]
        v = randn(batch, cap, 2 * hk, d, gen=gen, dtype=dtype)[:, :, ::2]
        return k, v, None
    return randn(batch, cap, hk, d, gen=gen, dtype=dtype), randn(batch, cap, hk, d, gen=gen, dtype=dtype), None


CASES = [  # (dtype, page_size, layout): one shape, reused with other layouts, dtypes and page sizes
    (torch.float16, 0, "contiguous"), (torch.float16, 0, "strided"), (torch.float32, 0, "contiguous"),
    (torch.float16, 16, "contiguous"), (torch.float16, 8, "contiguous"), (torch.float16, 0, "contiguous"),
]


def test_decode_reuses_shapes_with_other_layouts_and_matches_the_reference(gen, device_resident):
    batch, h, hk, d, cap = 3, 4, 2, 16, 32
    lens = torch.tensor([32, 5, 17], dtype=torch.int32, device=DEVICE)
    hits = 0
    for dtype, page_size, layout in CASES * 2:
        k, v, table = _cache(gen, batch, cap, hk, d, dtype, page_size, layout)
        q = randn(batch, h, d, gen=gen, dtype=dtype)
        for use_out in (False, True):
            out = torch.empty(batch, h, 2 * d, dtype=dtype, device=DEVICE)[..., ::2] if use_out else None
            known = len(decode_host._CALLS)
            got, lse = flashdecode.flash_decode(q, k, v, lens, block_table=table, out=out, return_lse=True)
            hits += len(decode_host._CALLS) == known
            ref, ref_lse = reference.decode_ref(q.double(), k.double(), v.double(), lens, block_table=table)
            torch.testing.assert_close(got.double(), ref, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-3, rtol=2e-3)
            if use_out:
                assert got is out
    assert hits >= len(CASES)  # the second round found its calls remembered


def test_plan_runs_reuse_shapes_with_other_page_sizes(gen, device_resident):
    batch, h, hk, d, cap = 2, 4, 1, 16, 32
    plan = flashdecode.DecodePlan(batch, h, hk, d, max_seqlen_k=cap, dtype=torch.float16, device=DEVICE)
    lens = torch.tensor([30, 9], dtype=torch.int32, device=DEVICE)
    for page_size in (0, 16, 4, 0, 16):
        k, v, table = _cache(gen, batch, cap, hk, d, torch.float16, page_size)
        q = randn(batch, h, d, gen=gen, dtype=torch.float16)
        got = plan.run(q, k, v, lens, block_table=table)
        ref, _ = reference.decode_ref(q.double(), k.double(), v.double(), lens, block_table=table)
        torch.testing.assert_close(got.double(), ref, atol=2e-3, rtol=2e-3)


def test_plan_runs_reuse_shapes_with_other_outputs_and_options(gen, device_resident):
    """A DecodePlan keeps what it launches per exact call key: runs of one shape that differ in out= (none, a
    strided view, a contiguous one), the softmax scale (3 against 3.0: the same value, other types) or the window
    each match the reference - no run replays another's decision -, and an out= or dtype that does not fit raises
    after all those keys were remembered."""
    batch, h, hk, d, cap = 2, 4, 2, 16, 32
    plan = flashdecode.DecodePlan(batch, h, hk, d, max_seqlen_k=cap, dtype=torch.float32, device=DEVICE)
    lens = torch.tensor([30, 9], dtype=torch.int32, device=DEVICE)
    k, v, _ = _cache(gen, batch, cap, hk, d, torch.float32)
    q = randn(batch, h, d, gen=gen)
    for _ in range(2):
        for out in (None, torch.empty(batch, h, 2 * d, device=DEVICE)[..., ::2], torch.empty(batch, h, d,
                                                                                          device=DEVICE)):
            for scale, window in ((None, (-1, -1)), (3, (-1, -1)), (3.0, (-1, -1)), (None, (4, -1))):
                got = plan.run(q, k, v, lens, out=out, softmax_scale=scale, window_size=window)
                ref, _ = reference.decode_ref(q.double(), k.double(), v.double(), lens, softmax_scale=scale,
                                              window_size=window)
                torch.testing.assert_close(got.double(), ref, atol=2e-3, rtol=2e-3)
                if out is not None:
                    assert got is out
    with pytest.raises(ValueError, match="out"):  # a remembered key's shapes with an out that does not fit
        plan.run(q, k, v, lens, out=torch.empty(batch, h, d + 1, device=DEVICE))
    with pytest.raises(TypeError, match="k_cache dtype"):  # the same shapes in another dtype
        plan.run(q.half(), k.half(), v.half(), lens)


def test_merge_states_alternating_views_and_permuted_copies_match_exactly(gen):
    """merge_states keeps its launch per exact key, whether the inputs' rows are views of them (launched as they
    are) or copies (a permuted layout): calls of one shape alternating between the two layouts each give the
    contiguous inputs' exact result."""
    o_a, o_b = randn(4, 2, 3, 32, gen=gen), randn(4, 2, 3, 32, gen=gen)
    l_a, l_b = randn(4, 2, 3, gen=gen), randn(4, 2, 3, gen=gen)
    ref = flashdecode.merge_states(o_a, l_a, o_b, l_b)
    permuted = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (o_a, l_a, o_b, l_b)]
    for _ in range(2):
        for args in ((o_a, l_a, o_b, l_b), permuted):
            o, lse = flashdecode.merge_states(*args)
            assert torch.equal(o, ref[0]) and torch.equal(lse, ref[1]) and o.is_contiguous()


def test_remembered_calls_still_raise(gen, device_resident):
    batch, h, hk, d, cap = 2, 4, 2, 16, 16
    k, v, _ = _cache(gen, batch, cap, hk, d, torch.float16)
    q = randn(batch, h, d, gen=gen, dtype=torch.float16)
    lens = torch.tensor([16, 3], dtype=torch.int32, device=DEVICE)
    flashdecode.flash_decode(q, k, v, lens, max_seqlen_k=16)
    flashdecode.flash_decode(q, k, v, lens, max_seqlen_k=16)
    with pytest.raises(TypeError, match="max_seqlen_k"):  # 16.0 == 16 as a dict key, not as an argument
        flashdecode.flash_decode(q, k, v, lens, max_seqlen_k=16.0)
    with pytest.raises(TypeError, match="validate"):  # 0 == False as a flag, not as an argument
        flashdecode.flash_decode(q, k, v, lens, max_seqlen_k=16, validate=0)
    with pytest.raises(TypeError, match="q"):
        flashdecode.flash_decode(q.float(), k, v, lens, max_seqlen_k=16)
    with pytest.raises(ValueError, match="out"):
        flashdecode.flash_decode(q, k, v, lens, max_seqlen_k=16, out=torch.empty(batch, h, d + 1, device=DEVICE,
                                                                                 dtype=torch.float16))
    with pytest.raises(TypeError, match="cache_seqlens"):
        flashdecode.flash_decode(q, k, v, lens.long(), max_seqlen_k=16)
    with pytest.raises(TypeError):
        flashdecode.flash_decode(q, k, v, [16, 3])


def test_merge_states_reuses_shapes_with_other_layouts(gen):
    for transpose in (False, True, False):
        o_a, o_b = randn(3, 4, 16, gen=gen), randn(3, 4, 16, gen=gen)
        l_a, l_b = randn(3, 4, gen=gen), randn(3, 4, gen=gen)
        if transpose:
            o_a = randn(4, 3, 16, gen=gen).transpose(0, 1)
        o, lse = flashdecode.merge_states(o_a, l_a, o_b, l_b)
        ref_lse = torch.logaddexp(l_a, l_b)
        ref = (torch.exp(l_a - ref_lse)[..., None] * o_a + torch.exp(l_b - ref_lse)[..., None] * o_b)
        torch.testing.assert_close(lse, ref_lse)
        torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_import_loads_neither_dynamo_nor_the_engine():
    code = ("import sys, flashdecode; print('torch._dynamo' in sys.modules, "
            "any(m.startswith('flashdecode.engine') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_warmup_runs_each_variant_and_reads_a_model_shape(tmp_path):
    import json

    from flashdecode import warm

    (tmp_path / "config.json").write_text(json.dumps(dict(num_attention_heads=4, num_key_value_heads=2,
                                                          hidden_size=64, torch_dtype="float16")))
    shape = warm.model_shape(tmp_path)
    assert shape == dict(nheads=4, nheads_kv=2, headdim=16, dtype=torch.float16)
    times = flashdecode.warmup(**shape, device=DEVICE, batches=(1, 2), capacities=(16,), prefill_seqlens=(16,),
                               workers=2)
    assert sorted(times) == ["decode b1 cap16 page0", "decode b2 cap16 page0", "prefill 16"]
    assert all(t > 0 for t in times.values())


def test_append_kv_reuses_shapes_with_other_layouts(gen, device_resident):
    batch, hk, d, cap = 2, 2, 16, 16
    lens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    for dtype, page_size, layout in CASES[:5] * 2:
        k, v, table = _cache(gen, batch, cap, hk, d, dtype, page_size, layout)
        new_k, new_v = randn(batch, 2, hk, d, gen=gen, dtype=dtype), randn(batch, 2, hk, d, gen=gen, dtype=dtype)
        flashdecode.append_kv(k, v, new_k, new_v, lens, table)
        for b in range(batch):
            for t in range(2):
                pos = int(lens[b]) + t
                if table is None:
                    row_k, row_v = k[b, pos], v[b, pos]
                else:
                    page = int(table[b, pos // page_size])
                    row_k, row_v = k[page, pos % page_size], v[page, pos % page_size]
                torch.testing.assert_close(row_k, new_k[b, t], atol=0, rtol=0)
                torch.testing.assert_close(row_v, new_v[b, t], atol=0, rtol=0)


def test_eager_pool_views_follow_the_buffers_as_they_grow():
    from flashdecode.ops.decode_workspace import _Workspace

    pool = _Workspace(torch.device("cpu"))
    small = pool.take_eager((1, 1, 2, 2, 4), 3, (1, 1, 2))
    assert pool.take_eager((1, 1, 2, 2, 4), 3, (1, 1, 2)) is small  # kept: nothing sliced again
    big = pool.take_eager((2, 1, 4, 8, 16), 40, (2, 1, 4))
    assert [tuple(x.shape) for x in big] == [(2, 1, 4, 8, 16), (2, 1, 4, 8), (40,), (2, 1, 4), (2,)]
    assert big[4].data_ptr() == big[2][38:].data_ptr()  # the persistent kernel's queue: the last two tickets
    again = pool.take_eager((1, 1, 2, 2, 4), 3, (1, 1, 2))
    assert again is not small and again[0].data_ptr() == pool.o.data_ptr()  # views of the grown buffers
    assert again[2].data_ptr() == pool.tickets.data_ptr() and torch.all(pool.tickets == 0)
    assert again[4].data_ptr() == pool.tickets[1:].data_ptr()


def _counted_resolver(monkeypatch) -> list:
    """The capacities heuristics.resolve_decode_config is asked for, one entry per resolution."""
    from flashdecode import heuristics

    asked, real = [], heuristics.resolve_decode_config

    def counted(problem, dev):
        asked.append(problem.capacity)
        return real(problem, dev)

    monkeypatch.setattr(heuristics, "resolve_decode_config", counted)
    return asked


def _check_decode(got, q, k, v, lens, atol=2e-3):
    """got vs the float64 reference of q against k/v's keys [0, min(lens, k's length))."""
    seen = lens.clamp(max=k.shape[1])
    ref, _ = reference.decode_ref(q.double(), k.double(), v.double(), seen)
    torch.testing.assert_close(got.double(), ref, atol=atol, rtol=atol)


@pytest.mark.parametrize("form", ["view", "new_tensor", "dense_new_tensor", "kvcache_int"])
def test_a_growing_cache_resolves_and_records_once(gen, device_resident, monkeypatch, form):
    """A generation's decode steps (the cache one token longer each step): a view k[:, :L] of one buffer,
    transformers' DynamicCache (a new (b, hk, L, d) tensor each step, read transposed), a new dense (b, L, hk, d)
    tensor each step, or flash_attn_with_kvcache
    with a growing int cache_seqlens - one resolution and one remembered call for every step of a capacity bucket,
    every step equal to the reference (the launch keys checked against Triton's specialisation: autouse fixture)."""
    from flashdecode import flash_attn_interface as fai

    asked = _counted_resolver(monkeypatch)
    batch, h, hk, d, start, steps = 2, 4, 2, 16, 44, 6  # lengths 44..49: one bucket (64), 48 specialises apart
    dtype = torch.float16 if form == "dense_new_tensor" else torch.float32
    buf_k, buf_v = randn(batch, 64, hk, d, gen=gen, dtype=dtype), randn(batch, 64, hk, d, gen=gen, dtype=dtype)
    for length in range(start, start + steps):
        q = randn(batch, h, d, gen=gen, dtype=dtype)
        if form == "view":
            k, v = buf_k[:, :length], buf_v[:, :length]
            lens = torch.tensor([length, length - 7], dtype=torch.int32, device=DEVICE)
            got = flashdecode.flash_decode(q, k, v, lens, max_seqlen_k=length)
        elif form in ("new_tensor", "dense_new_tensor"):  # dense: rows a TMA descriptor reads (on sm_90)
            k, v = (x[:, :length].contiguous() if form == "dense_new_tensor"
                    else x[:, :length].transpose(1, 2).contiguous().transpose(1, 2) for x in (buf_k, buf_v))
            lens = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
            got = flashdecode.flash_decode(q, k, v, lens, max_seqlen_k=length)
        else:  # append this step's token at position length - 1 and attend to [0, length)
            k, v = buf_k, buf_v
            lens = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
            new_k, new_v = randn(batch, 1, hk, d, gen=gen), randn(batch, 1, hk, d, gen=gen)
            got = fai.flash_attn_with_kvcache(q.unsqueeze(1), buf_k, buf_v, k=new_k, v=new_v,
                                              cache_seqlens=length - 1)[:, 0]
            torch.testing.assert_close(buf_k[:, length - 1], new_k[:, 0], atol=0, rtol=0)
        _check_decode(got, q, k, v, lens)
    assert len(asked) == 1 and len(decode_host._CALLS) <= 2  # (append_kv keeps its launch beside)


def test_a_growing_cache_record_never_serves_a_stale_decision(gen, device_resident, monkeypatch):
    """Calls that share a growing cache's key except for one fact: a length beyond the record's bucket, the TMA row
    view (a dense cache after views of a longer buffer), dtype, token stride, kv heads, out=, each re-resolves or
    misses and matches the reference; lengths past a view's end read only the view (clamped to its length)."""
    asked = _counted_resolver(monkeypatch)
    batch, h, d = 2, 4, 16
    buf = {hk: (randn(batch, 96, hk, d, gen=gen), randn(batch, 96, hk, d, gen=gen)) for hk in (1, 2)}

    def call(length, hk=2, dtype=torch.float32, stride_heads=False, lens=None, out=None):
        k, v = (x[:, :length].to(dtype) for x in buf[hk])
        if stride_heads:  # the same shape, another token stride
            k, v = (torch.cat([x, x], 2)[:, :, ::2] for x in (k, v))
        q = randn(batch, h, d, gen=gen, dtype=dtype)
        lens = torch.full((batch,), length, dtype=torch.int32, device=DEVICE) if lens is None else lens
        got = flashdecode.flash_decode(q, k, v, lens, max_seqlen_k=length, out=out)
        _check_decode(got, q, k, v, lens)
        return len(asked)

    assert call(40) == 1
    assert call(41) == 1
    # lengths beyond the view (and within the bucket): the kernels clamp them to the view's 42 keys
    assert call(42, lens=torch.tensor([60, 42], dtype=torch.int32, device=DEVICE)) == 1
    assert call(70) == 2  # beyond the bucket of 64: resolved for 80
    dense = [x[:, :50].contiguous() for x in buf[2]]  # the view's key but for the TMA row view's fact
    before = len(asked)
    q = randn(batch, h, d, gen=gen)
    lens = torch.full((batch,), 50, dtype=torch.int32, device=DEVICE)
    _check_decode(flashdecode.flash_decode(q, *dense, lens, max_seqlen_k=50), q, *dense, lens)
    assert len(asked) == before + 1
    assert call(51) == before + 1  # the view again: its own record, kept beside the dense cache's
    assert call(52, dtype=torch.float16) == before + 2
    assert call(53, stride_heads=True) == before + 3
    assert call(54, hk=1) == before + 4
    out = torch.empty(batch, h, 2 * d, device=DEVICE)[..., ::2]
    assert call(55, out=out) == before + 5
    with pytest.raises(ValueError, match="out"):
        call(56, out=torch.empty(batch, h, d + 1, device=DEVICE))


def test_descriptor_launcher_hands_the_c_launcher_what_tritons_wrappers_do(monkeypatch):
    """A LaunchSite kernel with host tensor descriptors past its first parameter (decode stage 1 reads K and V so):
    direct_launch.DescriptorLauncher passes the C launcher what Triton's CudaLauncher and wrap_handle_tensordesc
    pass it, and fills a CUtensorMap once per descriptor parameter and (address, extent): a cache that grows gets a
    new one, the same cache again none."""
    import triton

    from flashdecode.ops import direct_launch
    from flashdecode.ops.decode_launch import _descriptor
    from helpers import FakeCompiled, FakeTmaDriver, triton_launcher

    monkeypatch.setattr(triton.runtime.driver, "_active", FakeTmaDriver())
    monkeypatch.setattr(direct_launch, "DESCRIPTOR_LAUNCHER", True)
    c_calls = []
    signature = {0: "*fp16", 1: "tensordesc<fp16[64,16]>", 2: "tensordesc<fp16[64,16]>", 3: "i32", 4: "constexpr"}
    metas = [dict(swizzle=32, elem_size=2, elem_type=6, block_size=[64, 16], fp4_padded=False) for _ in range(2)]
    compiled = FakeCompiled()
    compiled.run = triton_launcher(c_calls, signature, metas)
    direct = direct_launch.DescriptorLauncher.of(compiled)
    assert direct is not None and direct_launch.PlainLauncher.of(compiled) is None
    q = torch.zeros(8, dtype=torch.float16)
    caches = {rows: (torch.zeros(rows, 16, dtype=torch.float16), torch.zeros(rows, 16, dtype=torch.float16))
              for rows in (128, 192)}
    for rows in (128, 128, 192, 128):
        k, v = caches[rows]
        args = [q, _descriptor(k, rows, 16, [64, 16]), _descriptor(v, rows, 16, [64, 16]), rows, 64]
        compiled.run(2, 1, 1, 7, compiled.function, compiled.packed_metadata, None, None, None, *args)  # Triton's
        direct((2, 1, 1), 7, torch.device("cpu"), args)
        wrapped, ours = c_calls[-2], c_calls[-1]
        assert ours == wrapped and len(ours) == 13 + 1 + 2 * 5 + 2  # each descriptor: its map, 2 shape, 2 strides
        assert ours[14] == ("tensormap", k.data_ptr(), 32, 2, 6, (64, 16), (rows, 16), (16, 1), 0)
        assert ours[19][1] == v.data_ptr()
    assert direct.fills == 4 and direct.launches == 4


@pytest.fixture
def proxy_launches(monkeypatch):
    """bench.host's CPU proxy (a faked Hopper of 132 SMs, device-resident metadata, every launch site's kernel a
    stub recorded as the GPU records a compiled one), undone after the test: yields (direct, jit), the launches
    made directly from a record, [(grid, full argument list)], and through Triton's JIT, [(parameter names,
    keyword arguments)]."""
    from flashdecode.bench import host

    host.stub_launches(monkeypatch)
    launch_cache.check_keys(False)  # (the check's specialisation of a descriptor imports Gluon, which needs the
    launch_cache.clear()            # interpreter this process loaded Triton under; the autouse fixture restores it)
    decode_host.clear()
    direct, jit = [], []
    real_direct, real_compiled = launch_cache._launch_direct, host._StubJit._compiled

    def recorded_direct(record, grid, args, device):
        direct.append((grid, list(args)))
        real_direct(record, grid, args, device)

    def recorded_compiled(self, *args, **kwargs):
        jit.append((self.arg_names, kwargs))
        return real_compiled(self, *args, **kwargs)
    monkeypatch.setattr(launch_cache, "_launch_direct", recorded_direct)
    monkeypatch.setattr(host._StubJit, "_compiled", recorded_compiled)
    yield direct, jit
    launch_cache.clear()  # no stub kernel outlives the test
    decode_host.clear()


def _same_argument(a, b, alias: dict) -> bool:
    """Two launch arguments the kernel reads alike: tensors at one address (``alias``: the address of the first
    call's output -> the second's) of one dtype, host tensor descriptors over one address with one shape and
    strides, tuples element by element, anything else equal."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and alias.get(a.data_ptr(), a.data_ptr()) == b.data_ptr()
    if isinstance(a, TensorDescriptor) or isinstance(b, TensorDescriptor):
        return _same_argument(a.base, b.base, alias) and list(a.shape) == list(b.shape) \
            and list(a.strides) == list(b.strides)
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) \
            and all(_same_argument(x, y, alias) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _assert_direct_launches_bind_as_the_jit(proxy_launches, first, again):
    """first() records the launches of a call layout; again() (other tensors, or another extent of a growing cache,
    with the same records) launches directly, from each key's BoundLaunch or record: its full argument lists must be
    what Triton's JIT binds for that very call (again() once more with the sites' records dropped; its new output
    stands for the first one's)."""
    direct, jit = proxy_launches
    first()
    assert jit
    del direct[:], jit[:]
    out = again()
    launched = list(direct)
    assert launched and not jit
    for site in launch_cache.sites():
        site.records.clear()  # (the per-key argument plans stay: the JIT launches bind what they fill in)
    del direct[:]
    out_again = again()
    assert len(jit) == len(launched) and not direct
    alias = {} if out is None else {out.data_ptr(): out_again.data_ptr()}  # (append_kv returns nothing)
    for (grid, full), (names, kwargs) in zip(launched, jit):
        assert len(full) == len(names)
        for name, value in zip(names, full):
            if name in kwargs:
                assert _same_argument(value, kwargs[name], alias), (name, value, kwargs[name])


@pytest.mark.parametrize("table", ["uniform", "mixed"])
def test_direct_decode_launches_bind_what_the_jit_binds(proxy_launches, table):
    """bench.host's rows (Llama-3-8B heads, bf16; "uniform": a contiguous cache read through tensor descriptors,
    the device-split grid and the merge; "mixed": pages, the persistent kernel) on the faked Hopper: flash_decode,
    DecodePlan.run, flash_attn_with_kvcache (with an append) and append_kv launch directly with the arguments the
    JIT binds."""
    from flashdecode.bench import host

    device = torch.device("cpu")
    one, two = (host._decode_calls(device, reference=False) if table == "uniform" else host.mixed_calls(device)
                for _ in range(2))
    for name in one:
        if name == "merge_states":
            continue
        # (each table has its own DecodePlan, whose runs are keyed apart: the plan's call again)
        _assert_direct_launches_bind_as_the_jit(proxy_launches, one[name], (one if "Plan" in name else two)[name])


def test_direct_decode_launches_follow_a_growing_cache(proxy_launches, gen):
    """A contiguous cache one token longer per step (one record per capacity bucket): each step's direct launches
    carry that step's capacity, strides and addresses, as the JIT binds them."""
    buf = randn(2, 64, 2, 16, gen=gen)

    def step(length):
        k = buf[:, :length].transpose(1, 2).contiguous().transpose(1, 2)  # a new tensor per step (DynamicCache)
        q, lens = randn(2, 4, 16, gen=gen), torch.full((2,), length, dtype=torch.int32)
        return lambda: flashdecode.flash_decode(q, k, k, lens)
    _assert_direct_launches_bind_as_the_jit(proxy_launches, step(40), step(41))
