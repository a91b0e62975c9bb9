"""The flat GEMM for batched decode (flashdecode.engine.layers.flat_gemm) and its prologues against the PyTorch ops
they replace (float64 reference, the FlashAttention error rule), and the per-shape choice table's decision rule.
On the CPU the kernel runs in the Triton interpreter (fp16/fp32, small shapes)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, HAS_CUDA
from flashdecode.engine.layers import flat_gemm as fg
from flashdecode.engine.layers.norm import RMSNorm
from test_engine_gemv import _assert_linear_close, _rand

pytestmark = pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float16, torch.float32]
SMALL = fg.FlatGemmConfig(block_n=32, block_k=64, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(2, 40, 96), (5, 64, 72), (17, 33, 128), (64, 32, 64)])
def test_flat_gemm_plain_and_bias(dtype, m, n, k):
    """Odd M (one row past a 16-row tile), N and K not multiples of the tiles: the masked paths."""
    gen = torch.Generator().manual_seed(m * n + k)
    x, w, b = (_rand(m, k, dtype=dtype, gen=gen), _rand(n, k, dtype=dtype, gen=gen),
               _rand(n, dtype=dtype, gen=gen))
    _assert_linear_close(fg.flat_gemm(x, w, config=SMALL), x, w)
    _assert_linear_close(fg.flat_gemm(x, w, b, config=SMALL), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flat_gemm_strided_rows(dtype):
    """x a row-strided view (a slice of a wider buffer): strides are honoured, nothing else is read."""
    gen = torch.Generator().manual_seed(7)
    wide = _rand(6, 100, dtype=dtype, gen=gen)
    x = wide[:, 10:90]
    w = _rand(24, 80, dtype=dtype, gen=gen)
    _assert_linear_close(fg.flat_gemm(x, w, config=SMALL), x, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flat_gemm_prologues_match_the_ops_they_replace(dtype):
    gen = torch.Generator().manual_seed(3)
    m, n, k = 3, 24, 80
    w = _rand(n, k, dtype=dtype, gen=gen)
    gate_up = _rand(m, 2 * k, dtype=dtype, gen=gen, scale=2.0)
    act = F.silu(gate_up[:, :k]) * gate_up[:, k:]
    _assert_linear_close(fg.flat_gemm(gate_up, w, prologue=fg.SILU_MUL, config=SMALL), act, w)

    norm = RMSNorm(k, 1e-5, dtype, DEVICE)
    norm.weight.data.copy_(_rand(k, dtype=dtype, gen=gen))
    x, res = _rand(m, k, dtype=dtype, gen=gen), _rand(m, k, dtype=dtype, gen=gen, scale=3.0)
    _assert_linear_close(fg.flat_gemm(x, w, prologue=fg.RMSNORM, norm_weight=norm.weight, eps=1e-5, config=SMALL),
                         norm(x), w)
    h, s = norm(x, res)
    res_before = res.clone()
    y, s_out = fg.flat_gemm(x, w, prologue=fg.ADD_NORM, residual=res, norm_weight=norm.weight, eps=1e-5,
                            config=SMALL)
    assert torch.equal(s_out, s) and torch.equal(res, res_before)  # new residual, input untouched
    _assert_linear_close(y, h, w)


def test_flat_gemm_rejects_bad_inputs():
    w = torch.zeros(8, 16, device=DEVICE)
    for x, match in ((torch.zeros(65, 16, device=DEVICE), "rows"), (torch.zeros(2, 15, device=DEVICE), "x must"),
                     (torch.zeros(2, 32, device=DEVICE)[:, ::2], "x must"),
                     (torch.zeros(2, 16, device=DEVICE, dtype=torch.float16), "dtype")):
        with pytest.raises((ValueError, TypeError), match=match):
            fg.flat_gemm(x, w)
    with pytest.raises(ValueError, match="norm_weight"):
        fg.flat_gemm(torch.zeros(2, 16, device=DEVICE), w, prologue=fg.RMSNORM)
    with pytest.raises(ValueError, match="residual"):
        fg.flat_gemm(torch.zeros(2, 16, device=DEVICE), w, prologue=fg.ADD_NORM, norm_weight=torch.ones(16))
    with pytest.raises(ValueError, match="prologue"):
        fg.flat_gemm(torch.zeros(2, 16, device=DEVICE), w, prologue=9)


def _grid(*shape, dtype, gen, steps=64):
    """Multiples of 1/steps in [-1, 1]: exact in fp16 / bf16 / fp32 (7 significant bits), and at K <= 128 every
    float32 sum of their products is exact too (< 20 bits), so a dot gives the same bits whatever its accumulation
    order (the interpreter's numpy matmul, or the tensor cores' order on a GPU) - while rounding such a sum to
    fp16 / bf16 does change it, so the roundings before silu are tested."""
    return (torch.randint(-steps, steps + 1, shape, generator=gen) / steps).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,inter,k", [(1, 48, 64), (3, 80, 96), (16, 72, 80)])
def test_silu_mul_epilogue_is_silu_and_mul_of_the_gemm_bit_for_bit(dtype, m, inter, k):
    """EPILOGUE_SILU_MUL = fused.silu_and_mul(flat_gemm(x, w)) in every bit, with and without a bias: the gate and
    up sums are rounded to the dtype, then silu and the product as silu_and_mul rounds them. inter is not a
    multiple of BLOCK_N (the masked last tile; its up rows start mid-tile of the unfused GEMM's grid), K not of
    BLOCK_K. The sums reach +-10 or so: silu sees both its tails and its bend."""
    from flashdecode.engine.layers.fused import silu_and_mul

    gen = torch.Generator().manual_seed(m * inter + k)
    x, w, b = _grid(m, k, dtype=dtype, gen=gen), _grid(2 * inter, k, dtype=dtype, gen=gen), \
        _grid(2 * inter, dtype=dtype, gen=gen)
    for bias in (None, b):
        want = silu_and_mul(fg.flat_gemm(x, w, bias, config=SMALL))
        got = fg.flat_gemm(x, w, bias, config=SMALL, epilogue=fg.EPILOGUE_SILU_MUL)
        assert got.shape == (m, inter) and got.dtype == dtype
        assert torch.equal(got, want)
    # and the PyTorch ops the MLP's unfused path runs, within rounding
    gate, up = F.linear(x, w).split(inter, dim=-1)
    torch.testing.assert_close(got.float(), (F.silu(gate + b[:inter]) * (up + b[inter:])).float(),
                               rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_epilogue_after_a_prologue(dtype):
    """A prologue and the epilogue together (ADD_NORM: the MLP's residual add + post-attention norm, gate_up and
    silu*mul in one launch): the same bits as the epilogue-free launch followed by silu_and_mul, and the same new
    residual. BLOCK_N 16: several N tiles, so the residual store by the first one alone is exercised."""
    from flashdecode.engine.layers.fused import silu_and_mul

    gen = torch.Generator().manual_seed(11)
    m, inter, k = 5, 40, 64
    cfg = fg.FlatGemmConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)
    x, res, w = _grid(m, k, dtype=dtype, gen=gen), _grid(m, k, dtype=dtype, gen=gen), \
        _grid(2 * inter, k, dtype=dtype, gen=gen)
    norm_w = torch.ones(k, device=DEVICE, dtype=dtype)
    args = dict(prologue=fg.ADD_NORM, residual=res, norm_weight=norm_w, eps=1e-5, config=cfg)
    y, s = fg.flat_gemm(x, w, **args)
    got, s_got = fg.flat_gemm(x, w, **args, epilogue=fg.EPILOGUE_SILU_MUL)
    assert torch.equal(s_got, s)
    # the normalised input is off the grid, so the dots are exact only up to their summation order: the same in both
    # launches on a GPU (same tiles, same K loop, per-element MMA order), not promised by the interpreter's numpy
    # matmul (an up row sits at another column of its tile than in the epilogue-free launch)
    tol = 0 if HAS_CUDA else 2 ** -9
    torch.testing.assert_close(got.float(), silu_and_mul(y).float(), rtol=tol, atol=tol)


def test_silu_mul_epilogue_rejects_bad_arguments():
    w = torch.zeros(8, 16, device=DEVICE)
    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="even N"):
        fg.flat_gemm(x, torch.zeros(7, 16, device=DEVICE), epilogue=fg.EPILOGUE_SILU_MUL)
    for bad in (2, -1, "silu_mul", None, True):
        with pytest.raises(ValueError, match="epilogue"):
            fg.flat_gemm(x, w, epilogue=bad)
    with pytest.raises(ValueError, match="bias"):  # the bias covers all 2 I rows, as the unfused GEMM's does
        fg.flat_gemm(x, w, torch.zeros(4, device=DEVICE), epilogue=fg.EPILOGUE_SILU_MUL)
    assert fg.flat_gemm(x, w, epilogue=fg.EPILOGUE_SILU_MUL).shape == (2, 4)


def test_choice_table_keeps_the_flat_gemm_only_where_it_wins():
    """A fake timer: cuBLAS costs 10 us; the flat GEMM 7 us for N = 64 and 9.9 us (inside the noise margin)
    for N = 32. The table picks flat (with the faster config) only for N = 64, buckets M like the CUDA graphs,
    and answers cuBLAS for M = 1, M > 64 and unmeasured shapes."""
    configs = (fg.FlatGemmConfig(32, 64, 4, 2), fg.FlatGemmConfig(64, 64, 4, 2))

    def timer(fns):
        assert len(fns) == 2  # one closure per weight copy
        fn = fns[0]
        name = fn.__code__.co_names
        if "linear" in name:
            return 10.0
        cfg = fn.__defaults__[1]
        n = timer.n
        return (7.0 if n == 64 else 9.9) + (0.5 if cfg.block_n == 32 else 0.0)

    table = fg.ChoiceTable()
    for n in (64, 32):
        timer.n = n
        table.measure([(n, 16)], torch.float32, "cpu", m_values=(2, 8), configs=configs, timer=timer,
                      copies=2)
    assert table.choose(2, 64, 16) == configs[1] and table.choose(7, 64, 16) == configs[1]
    assert table.choose(2, 32, 16) is None
    assert table.choose(1, 64, 16) is None and table.choose(65, 64, 16) is None
    assert table.choose(32, 64, 16) is None  # bucket 32 not measured
    rows = table.rows()
    assert {(r["M"], r["N"], r["kernel"]) for r in rows} == {(2, 32, "cublas"), (8, 32, "cublas"),
                                                            (2, 64, "flat"), (8, 64, "flat")}
    assert all(abs(r["speedup"] - r["cublas_us"] / r["flat_us"]) < 1e-12 for r in rows)


def test_linear_shapes_of_a_model():
    from flashdecode.engine.config import named_config
    from flashdecode.engine.models import model_class

    cfg = named_config("llama3.2-1b", num_layers=1)
    model = model_class(cfg)(cfg, torch.float32, "meta", max_positions=16)
    shapes = set(fg.linear_shapes(model))
    h, i = cfg.hidden_size, cfg.intermediate_size
    assert {(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size), (2 * i, h), (h, i)} <= shapes


def _greedy_through_a_table(tmp_path, monkeypatch, fill, record, fused_kernels=False, seed=41):
    """A tiny Llama engine (float32: IEEE products) with a ChoiceTable that ``fill(table, model)`` fills, installed
    before greedy decoding of three prompts at batches up to 4: asserts the tokens equal transformers' and returns
    (engine path, what ``record(args, kwargs)`` noted of every flat_gemm call). fused_kernels: the Triton
    elementwise kernels, as on CUDA, also on the CPU."""
    from engine_helpers import hf_greedy, hf_model, random_prompts, save_tiny
    from flashdecode.engine import LLM, SamplingParams

    path = save_tiny(tmp_path / "m", "llama")
    calls = []
    real = fg.flat_gemm
    monkeypatch.setattr(fg, "flat_gemm", lambda *a, **kw: calls.append(record(a, kw)) or real(*a, **kw))
    llm = LLM(path, device=DEVICE, dtype="float32", max_num_seqs=4, use_tqdm=False)
    llm.model.use_fused = llm.model.use_fused or fused_kernels
    table = fg.ChoiceTable()
    fill(table, llm.model)
    fg.install(llm.model, table)
    prompts = random_prompts((4, 7, 3), seed=seed)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5), use_tqdm=False)
    hf = hf_model(path)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 5) for p in prompts]
    return path, calls


def test_engine_decodes_through_the_flat_gemm(tmp_path, monkeypatch):
    """A choice table that picks the flat GEMM for every linear at batches 2..4: the engine's greedy tokens still
    equal transformers', and the flat GEMM really ran."""
    from flashdecode.engine import LLM

    def fill(table, model):
        for n, k in fg.linear_shapes(model):
            for m in (2, 4):
                table.choices[(m, n, k)] = fg.Choice("flat", SMALL, 1.0, 2.0)

    path, calls = _greedy_through_a_table(tmp_path, monkeypatch, fill, lambda a, kw: a[0].shape[0])
    assert calls and set(calls) <= {2, 3, 4}
    with pytest.raises(ValueError, match="flat_gemm"):
        LLM(path, device=DEVICE, use_tqdm=False, flat_gemm="yes")
    with pytest.raises(TypeError, match="flat_gemm"):
        LLM(path, device=DEVICE, use_tqdm=False, flat_gemm=3)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="CUDA"):
            LLM(path, device=DEVICE, use_tqdm=False, flat_gemm=True)


def test_flat_gemm_false_takes_a_shared_models_table_away():
    """Engines sharing a model (bench e2e's columns): flat_gemm=False means cuBLAS everywhere even where an engine
    before installed a table on the model."""
    from flashdecode.engine import LLM
    from flashdecode.engine.config import config_from_dict
    from flashdecode.engine.models import model_class

    cfg = config_from_dict(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    model = model_class(cfg)(cfg, torch.float32, torch.device("cpu"), 64)
    fg.install(model, fg.ChoiceTable())
    LLM(model, device="cpu", use_tqdm=False, flat_gemm=False, max_model_len=64)
    assert model.flat_table is None and all(mod.choice_table is None for mod in fg._linears(model))


def test_choice_table_json_round_trip_and_the_per_gpu_cache(tmp_path, monkeypatch):
    """rows() / from_json keep every choice; cached_table_for_model measures once per key, then reads the file
    (a changed key - another GPU, software or shape - measures again; an unreadable file is measured over)."""
    from types import SimpleNamespace

    table = fg.ChoiceTable()
    table.choices[(16, 64, 32)] = fg.Choice("flat", SMALL, 7.0, 9.0)
    table.choices[(32, 64, 32)] = fg.Choice("cublas", None, 12.0, 9.0)
    back = fg.ChoiceTable.from_json(json.loads(json.dumps(table.rows())))
    assert back.choices == table.choices
    measured = []
    monkeypatch.setattr(fg, "measure_for_model", lambda *a: measured.append(a) or table)
    props = SimpleNamespace(name="GPU-A", multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    model = torch.nn.Linear(32, 64)
    monkeypatch.setattr(fg, "linear_shapes", lambda m: [(64, 32)])
    first = fg.cached_table_for_model(model, torch.bfloat16, "cuda", directory=tmp_path)
    again = fg.cached_table_for_model(model, torch.bfloat16, "cuda", directory=tmp_path)
    assert len(measured) == 1 and first.choices == again.choices == table.choices
    props.name = "GPU-B"
    fg.cached_table_for_model(model, torch.bfloat16, "cuda", directory=tmp_path)
    assert len(measured) == 2 and len(list(tmp_path.glob("*.json"))) == 2
    for f in tmp_path.glob("*.json"):
        f.write_text("{not json")
    fg.cached_table_for_model(model, torch.bfloat16, "cuda", directory=tmp_path)
    assert len(measured) == 3


def test_auto_measures_only_models_whose_weights_stream_from_memory():
    from flashdecode.engine.config import named_config
    from flashdecode.engine.models import model_class

    def model(name, layers):
        cfg = named_config(name, num_layers=layers)
        return model_class(cfg)(cfg, torch.bfloat16, "meta", max_positions=16)

    from flashdecode.engine.layers.linear import Linear

    assert fg.worth_measuring(model("llama3.2-1b", 1))  # 2048 x 8192 bf16 MLP weights: 32 MiB
    assert not fg.worth_measuring(Linear(256, 512, False, torch.bfloat16, "meta"))  # the tests' tiny models
    assert not fg.worth_measuring(torch.nn.Sequential())


def test_choice_table_takes_the_silu_mul_epilogue_only_where_it_wins():
    """A fake timer: the plain GEMM choice is cuBLAS (10 us); cuBLAS + silu_and_mul costs 12 us; the fused launch
    11.9 us (inside the noise margin) for N = 64 and 9 us for N = 128. The epilogue is chosen only for N = 128,
    the rows and from_json keep it apart from the plain choices, and a model's [gate | up] layers are its shapes."""
    configs = (fg.FlatGemmConfig(32, 64, 4, 2), )

    def timer(fns):
        fn = fns[0]
        names = fn.__code__.co_names
        if "silu_and_mul" in names:
            return 12.0
        if "linear" in names:
            return 10.0
        if "EPILOGUE_SILU_MUL" in names:
            return 11.9 if timer.n == 64 else 9.0
        return 10.5  # the plain flat GEMM: loses to cuBLAS

    table = fg.ChoiceTable()
    for n in (64, 128):
        timer.n = n
        table.measure([(n, 16)], torch.float32, "cpu", m_values=(2, 8), configs=configs, timer=timer, copies=2,
                      silu_mul_shapes=[(n, 16)])
    assert table.choose(2, 128, 16) is None  # the plain GEMM stays on cuBLAS
    assert table.choose_silu_mul(2, 128, 16) == configs[0] and table.choose_silu_mul(8, 128, 16) == configs[0]
    assert table.choose_silu_mul(2, 64, 16) is None and table.choose_silu_mul(1, 128, 16) is None
    assert table.choose_silu_mul(2, 128, 32) is None  # unmeasured shape
    back = fg.ChoiceTable.from_json(json.loads(json.dumps(table.rows())))
    assert back.choices == table.choices and back.silu_mul == table.silu_mul and len(table.silu_mul) == 4
    assert {r["epilogue"] for r in table.rows()} == {"none", "silu_mul"}

    from triton.runtime.errors import OutOfResources

    def no_room(fns):  # every fused config is too big for shared memory: the layer keeps GEMM + silu_and_mul
        if "EPILOGUE_SILU_MUL" in fns[0].__code__.co_names:
            raise OutOfResources(300000, 232448, "shared memory")
        return timer(fns)

    small = fg.ChoiceTable().measure([(128, 16)], torch.float32, "cpu", m_values=(2, ), configs=configs,
                                     timer=no_room, copies=2, silu_mul_shapes=[(128, 16)])
    assert small.choose_silu_mul(2, 128, 16) is None and small.silu_mul[(2, 128, 16)].kernel == "cublas"

    from flashdecode.engine.config import named_config
    from flashdecode.engine.models import model_class

    cfg = named_config("llama3.2-1b", num_layers=1)
    model = model_class(cfg)(cfg, torch.float32, "meta", max_positions=16)
    assert fg.silu_mul_shapes(model) == [(2 * cfg.intermediate_size, cfg.hidden_size)]


def test_engine_decodes_through_the_silu_mul_epilogue(tmp_path, monkeypatch):
    """A table that picks the silu*mul epilogue for the MLPs at batches 2..4 (with the fused kernels, as on CUDA):
    greedy tokens equal transformers' and the fused launch really ran."""
    def fill(table, model):
        for n, k in fg.silu_mul_shapes(model):
            for m in (2, 4):
                table.silu_mul[(m, n, k)] = fg.Choice("flat", SMALL, 1.0, 2.0)

    _, calls = _greedy_through_a_table(tmp_path, monkeypatch, fill, lambda a, kw: kw.get("epilogue"),
                                       fused_kernels=True, seed=43)
    assert calls and set(calls) == {fg.EPILOGUE_SILU_MUL}
