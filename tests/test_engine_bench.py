"""bench e2e's measuring functions on a tiny model on the CPU (the GPU run is `flashdecode bench e2e`)."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch

from flashdecode.bench import e2e, hf_peer, roofline
from flashdecode.engine.config import config_from_dict, named_config
from flashdecode.engine.models import model_class


def test_decode_and_prefill_measurements_and_report(tmp_path):
    cfg = config_from_dict(dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    model = model_class(cfg)(cfg, torch.float32, torch.device("cpu"), 512)
    model.init_random_(0)
    rows = []
    for backend in ("torch", "sdpa"):
        rate = e2e.decode_tokens_per_s(model, backend, context=70, batch=2, steps=3, repeats=1, page_size=16)
        assert rate > 0
        rows.append(dict(kind="decode", backend=backend, context=70, batch=2, tokens_per_s=rate))
    secs = e2e.prefill_seconds(model, "sdpa", 200, 16)
    rows.append(dict(kind="prefill", backend="sdpa", context=200, batch=1, seconds=secs, tokens_per_s=200 / secs))
    rows[0]["backend"] = "flashdecode"  # the report keys its speedups on this name
    args = argparse.Namespace(quick=True, contexts="70", batch="2", page_size=16, out=str(tmp_path))
    env = {"device": "cpu", "torch": torch.__version__, "triton": "-", "date": "2026-01-01 00:00 UTC"}
    e2e._write(args, env, rows, cfg, "tiny", "tiny", 3e12, ["flashdecode", "sdpa"])
    record = json.loads(next(tmp_path.glob("e2e_*.json")).read_text())
    assert record["summary"][0].startswith("b2 ctx70:") and "x sdpa" in record["summary"][0]
    assert any(s.startswith("prefill 200") for s in record["summary"])
    assert isinstance(record["command"], str) and "--out" not in record["command"]  # (argv is pytest's here)
    assert "git_commit" in record
    if importlib.util.find_spec("matplotlib"):
        assert next(tmp_path.glob("e2e_*.png")).stat().st_size > 0


def test_pdl_both_pairs_every_flashdecode_point_with_a_pdl_twin(tmp_path):
    """--pdl both: each flashdecode point is followed by its '+pdl' twin (PDL on; the original off), other backends
    run once; the report gives the twins' % of the roofline and their speed-up over the same column without PDL."""
    fd, fp8, sdpa = ("flashdecode", "auto", "flashdecode"), ("flashdecode", "fp8", "flashdecode+fp8"), \
        ("sdpa", "auto", "sdpa")
    points = [(fd, 4096, 16), (sdpa, 4096, 16), (fp8, 4096, 16)]
    columns = [fd, sdpa, fp8]
    assert e2e.with_pdl_twins(points, columns, "on") == (points, columns)
    paired, cols = e2e.with_pdl_twins(points, columns, "both")
    assert [(c[2], ctx, bs) for c, ctx, bs in paired] == [
        ("flashdecode", 4096, 16), ("flashdecode+pdl", 4096, 16), ("sdpa", 4096, 16), ("flashdecode+fp8", 4096, 16),
        ("flashdecode+fp8+pdl", 4096, 16)]
    assert [c[2] for c in cols] == ["flashdecode", "sdpa", "flashdecode+fp8", "flashdecode+pdl", "flashdecode+fp8+pdl"]
    assert [e2e.point_pdl(c[2], "both") for c, _, _ in paired] == [False, True, False, False, True]
    assert e2e.point_pdl("flashdecode", "auto") == "auto" and e2e.point_pdl("sdpa", "on") is True
    assert e2e.point_pdl("flashdecode+cublas", "off") is False

    cfg = named_config("llama3-8b")
    roof = e2e.roofline_tokens_per_s(cfg, 4096, 16, 3e12)
    rows = [dict(kind="decode", backend=b, context=4096, batch=16, tokens_per_s=rate, pct_roofline=100 * rate / roof)
            for b, rate in (("flashdecode", 0.88 * roof), ("flashdecode+pdl", 0.92 * roof), ("sdpa", 0.8 * roof))]
    args = argparse.Namespace(quick=False, contexts="4096", batch="16", page_size=128, out=str(tmp_path), pdl="both")
    env = {"device": "cpu", "torch": torch.__version__, "triton": "-", "date": "2026-01-01 00:00 UTC"}
    e2e._write(args, env, rows, cfg, "llama3-8b", "llama3-8b", 3e12, ["flashdecode", "sdpa", "flashdecode+pdl"])
    record = json.loads(next(tmp_path.glob("e2e_*.json")).read_text())
    table, = record["table"]
    assert table["flashdecode+pdl % roofline"] == pytest.approx(92.0)
    assert table["flashdecode+pdl speed-up"] == pytest.approx(0.92 / 0.88)
    assert "x vs flashdecode+pdl" not in table and table["x vs sdpa"] == pytest.approx(0.88 / 0.8)
    assert "flashdecode+pdl" in record["summary"][0] and "92.0% roofline" in record["summary"][0]


def test_8bit_page_columns_report_their_own_roofline_and_the_ratio_to_model_dtype_pages(tmp_path):
    """bench e2e --kv-cache-dtype auto,fp8: the fp8 column gets its % of the fp8 roofline (fewer KV bytes) and its
    tokens/s over the bf16 pages' - not an 'x vs' peer ratio."""
    cfg = named_config("llama3-8b")
    roof = e2e.roofline_tokens_per_s(cfg, 65536, 1, 3e12)
    roof8 = e2e.roofline_tokens_per_s(cfg, 65536, 1, 3e12, "fp8")
    assert roof8 > roof
    rows = [dict(kind="decode", backend="flashdecode", kv_cache_dtype="auto", context=65536, batch=1,
                 tokens_per_s=0.9 * roof, pct_roofline=90.0),
            dict(kind="decode", backend="flashdecode+fp8", kv_cache_dtype="fp8", context=65536, batch=1,
                 tokens_per_s=0.8 * roof8, pct_roofline=80.0)]
    args = argparse.Namespace(quick=False, contexts="65536", batch="1", page_size=128, out=str(tmp_path), pdl="auto")
    env = {"device": "cpu", "torch": torch.__version__, "triton": "-", "date": "2026-01-01 00:00 UTC"}
    e2e._write(args, env, rows, cfg, "llama3-8b", "llama3-8b", 3e12, ["flashdecode", "flashdecode+fp8"])
    record = json.loads(next(tmp_path.glob("e2e_*.json")).read_text())
    table, = record["table"]
    assert table["flashdecode+fp8 % roofline"] == pytest.approx(80.0)
    assert table["flashdecode+fp8 vs model-dtype pages"] == pytest.approx(0.8 * roof8 / (0.9 * roof))
    assert "x vs flashdecode+fp8" not in table
    assert "80.0% of its roofline" in record["summary"][0]


def test_roofline_matches_hand_computed_llama3_8b():
    """Llama-3-8B's decode-step bytes from its architecture alone (4096 hidden, 14336 ffn, 32 layers, 32 / 8 heads
    of 128, vocab 128256, untied), not from the code's formula: every weight matrix and norm once, the lm_head, one
    embedding row per sequence (never the 1.05 GB input table), each sequence's K/V (+ float32 scales on 8-bit
    pages)."""
    hidden, ffn, layers, heads, kv_heads, hd, vocab = 4096, 14336, 32, 32, 8, 128, 128256
    per_layer = (hidden * heads * hd + 2 * hidden * kv_heads * hd  # q, k, v
                 + heads * hd * hidden  # o
                 + 3 * hidden * ffn  # gate, up, down
                 + 2 * hidden)  # input and post-attention norms
    assert per_layer == 218_112_000
    lm_head, final_norm = vocab * hidden, hidden

    def weight_bytes(batch):
        return 2 * (layers * per_layer + lm_head + final_norm + batch * hidden)

    kv_token = layers * kv_heads * hd * 2 * 2  # K and V, bf16: 128 KiB a token
    kv8_token = layers * kv_heads * hd * 2 * 1 + layers * kv_heads * 2 * 4  # e4m3 codes + a float32 scale each
    assert weight_bytes(1) == 15_009_857_536  # 15.0 GB, not 16.06 (num_parameters() * 2)
    cfg = named_config("llama3-8b")
    for ctx, bs in ((512, 1), (4096, 1), (16384, 1), (65536, 1), (4096, 16), (4096, 64)):
        want = weight_bytes(bs) + bs * ctx * kv_token
        assert roofline.decode_step_bytes(cfg, ctx, bs) == want
        assert roofline.decode_step_bytes(cfg, ctx, bs, kv_cache_dtype="fp8") == weight_bytes(bs) + bs * ctx * kv8_token
        assert e2e.roofline_tokens_per_s(cfg, ctx, bs, 3.02e12) == pytest.approx(bs * 3.02e12 / want, rel=1e-12)
    # the figures the records quote: 200.3 tok/s at 512 tokens, 128.0 at 64k (3.02 TB/s)
    assert round(e2e.roofline_tokens_per_s(cfg, 512, 1, 3.02e12), 1) == 200.3
    assert round(e2e.roofline_tokens_per_s(cfg, 65536, 1, 3.02e12), 1) == 128.0


@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("qwen2", dict(tie_word_embeddings=True))])
def test_roofline_weight_bytes_are_the_models_tensors_less_the_embedding_table(model_type, extra):
    """Against the built model's own tensors: every parameter once, except that an untied input-embedding table is
    gathered one row per sequence (a tied one is the lm_head, read whole)."""
    model = _tiny_model(model_type, **extra)
    batch = 3
    elements = sum(p.numel() for p in model.parameters())
    table = model.model.embed_tokens.weight
    if not model.config.tie_word_embeddings:
        elements += batch * table.shape[1] - table.numel()
    assert roofline.weight_bytes_per_step(model.config, batch, torch.float32) == 4 * elements
    assert roofline.kv_bytes_per_layer_token(model.config, torch.float32) == 2 * 2 * 16 * 4  # K/V, heads, d, fp32
    assert roofline.kv_bytes_per_step(model.config, 70, batch, torch.float32) == batch * 70 * 2 * (2 * 2 * 16 * 4)


def test_roofline_shares_give_the_copy_and_read_stream_rooflines(tmp_path):
    """bench e2e records both shares: of the copy-bandwidth roofline (the targets' measure) and, beside it, of the
    read-stream roofline (a read stream outruns a copy, so its share is the smaller)."""
    cfg = named_config("llama3-8b")
    shares = e2e.roofline_shares(150.0, cfg, 4096, 1, {"copy": 3.0e12, "read": 3.2e12})
    assert shares["pct_roofline"] == shares["pct_copy_roofline"] == pytest.approx(
        100 * 150.0 / e2e.roofline_tokens_per_s(cfg, 4096, 1, 3.0e12))
    assert shares["pct_read_roofline"] == pytest.approx(shares["pct_copy_roofline"] * 3.0 / 3.2)
    rows = [dict(kind="decode", backend="flashdecode", kv_cache_dtype="auto", context=4096, batch=1,
                 tokens_per_s=150.0, **shares)]
    args = argparse.Namespace(quick=False, contexts="4096", batch="1", page_size=128, out=str(tmp_path))
    env = {"device": "cpu", "torch": torch.__version__, "triton": "-", "date": "2026-01-01 00:00 UTC"}
    e2e._write(args, env, rows, cfg, "llama3-8b", "llama3-8b", 3.0e12, ["flashdecode"], read_bandwidth=3.2e12,
               readers={"torch_sum": 3.1e12, "triton_block_sum": 3.2e12})
    record = json.loads(next(tmp_path.glob("e2e_*.json")).read_text())
    table, = record["table"]
    assert table["flashdecode % read roofline"] == pytest.approx(shares["pct_read_roofline"])
    assert record["read_bandwidth_bytes_per_s"] == 3.2e12 and record["read_stream_rates"]["torch_sum"] == 3.1e12
    pct, read = shares["pct_copy_roofline"], shares["pct_read_roofline"]
    assert f"({pct:.1f}% roofline, {read:.1f}% of its read-stream roofline)" in record["summary"][0]


def test_roofline_reads_a_sliding_layers_window_only():
    """Gemma-3-12B: 40 of 48 layers read at most their 1024-key window, so at 64k its KV bytes are 8/48 + 40/48 *
    1024/65536 of a cache whose every layer reads all keys."""
    cfg = named_config("gemma3-12b")
    kv_per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    weights = roofline.weight_bytes_per_step(cfg, 1)
    expected = 3e12 / (weights + kv_per_token * (8 * 65536 + 40 * 1024))
    assert e2e.roofline_tokens_per_s(cfg, 65536, 1, 3e12) == pytest.approx(expected)


@pytest.mark.parametrize("model_type,extra", [("qwen3", dict(head_dim=32)),
                                              ("gemma3_text", dict(head_dim=32, sliding_window=8,
                                                                   sliding_window_pattern=2))])
def test_decode_measurement_runs_the_new_architectures(model_type, extra):
    """bench e2e's decode loop (random pages instead of a prefill, the engine's step) on Qwen3 / Gemma 3 shapes."""
    model = _tiny_model(model_type, **extra)
    assert e2e.decode_tokens_per_s(model, "torch", context=40, batch=2, steps=3, repeats=1, page_size=16) > 0


def _tiny_model(model_type: str, **extra):
    raw = dict(model_type=model_type, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **extra)
    cfg = config_from_dict(raw)
    model = model_class(cfg)(cfg, torch.float32, torch.device("cpu"), 512)
    model.init_random_(0)
    return model


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}


@pytest.mark.parametrize("model_type,extra", [("llama", dict(rope_parameters=LLAMA3_ROPE)),
                                              ("qwen2", dict(tie_word_embeddings=True))])
def test_hf_peer_shares_our_weights_and_matches_our_model(model_type, extra):
    """The transformers peer is a fair one: same tensors (no copy), same logits and greedy tokens as our engine."""
    pytest.importorskip("transformers")
    from flashdecode.engine import LLM, SamplingParams

    model = _tiny_model(model_type, **extra)
    llm = LLM(model, attn_backend="torch", max_model_len=256, max_num_seqs=1)
    ids = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    ours_logits = llm.prompt_logits(ids)
    ours_tokens = llm.generate([ids], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    ours_ptrs = {p.data_ptr() for p in model.parameters()}
    for impl in hf_peer.HF_IMPLEMENTATIONS:
        hf = hf_peer.build_hf_peer(model, impl)
        assert hf.config._attn_implementation == impl
        for name, p in hf.named_parameters():  # views of our storage (fused qkv / gate_up rows): no second copy
            assert p.untyped_storage().data_ptr() in ours_ptrs, name
        with torch.inference_mode():
            theirs_logits = hf(torch.tensor([ids])).logits[0].float()
            cache = hf_peer.hf_prefilled_cache(hf, 0)
            out = hf(torch.tensor([ids]), use_cache=True, **{hf_peer.hf_cache_kwarg(hf): cache})
            first = out.logits[:, -1].argmax(-1, keepdim=True)
            rest = [first]
            for _ in range(11):  # the bench's own decode loop, one step at a time
                rest.append(hf_peer.hf_greedy_steps(hf, cache, rest[-1], 1))
        torch.testing.assert_close(theirs_logits, ours_logits, atol=1e-4, rtol=1e-4)
        assert [t.item() for t in rest] == ours_tokens, impl


def test_hf_peer_measurements_and_report(tmp_path):
    pytest.importorskip("transformers")
    model = _tiny_model("llama", rope_parameters=LLAMA3_ROPE)
    hf = hf_peer.build_hf_peer(model, "sdpa")
    cache = hf_peer.hf_prefilled_cache(hf, 70)
    assert cache.get_seq_length() == 70
    rows = hf_peer.hf_peer_rows(model, ["sdpa", "eager"], [70], steps=3, repeats=1, prefill=200)
    decode = {r["backend"]: r for r in rows if r["kind"] == "decode"}
    assert set(decode) == {"hf-sdpa", "hf-eager"} and all(r["tokens_per_s"] > 0 for r in decode.values())
    prefill = [r for r in rows if r["kind"] == "prefill"]
    assert [r["backend"] for r in prefill] == ["hf-sdpa"] and prefill[0]["seconds"] > 0
    ours = e2e.decode_tokens_per_s(model, "torch", context=70, batch=1, steps=3, repeats=1, page_size=16)
    rows.append(dict(kind="decode", backend="flashdecode", context=70, batch=1, tokens_per_s=ours))
    rows.append(dict(kind="prefill", backend="flashdecode", context=200, batch=1, seconds=0.5, tokens_per_s=400))
    args = argparse.Namespace(quick=False, contexts="70", batch="1", page_size=16, out=str(tmp_path), hf="sdpa,eager",
                              hf_note="hf peer: test")
    env = {"device": "cpu", "torch": torch.__version__, "triton": "-", "date": "2026-01-01 00:00 UTC"}
    e2e._write(args, env, rows, model.config, "tiny", "tiny", 3e12, ["flashdecode", "hf-sdpa", "hf-eager"])
    record = json.loads(next(tmp_path.glob("e2e_*.json")).read_text())
    assert "x hf-sdpa" in record["summary"][0] and "x hf-eager" in record["summary"][0]
    assert "x vs hf-sdpa" in record["table"][0] and "hf-eager tok/s" in record["table"][0]
    assert any("x hf-sdpa)" in s for s in record["summary"] if s.startswith("prefill 200: flashdecode"))
    assert "hf peer: test" in record["notes"]


def test_hf_plan_parses_and_rejects():
    args = argparse.Namespace(hf="auto", quick=True, batch="1")
    impls, note = e2e._hf_plan(args)
    if hf_peer.hf_unavailable_reason() is None:
        assert impls == ["sdpa"]
        args.quick = False
        assert e2e._hf_plan(args)[0] == ["sdpa", "eager"]
        assert e2e._hf_plan(argparse.Namespace(hf="auto", quick=False, batch="16"))[0] == []
    assert e2e._hf_plan(argparse.Namespace(hf="none", quick=False, batch="1")) == ([], "hf peer: not run (--hf none)")
    if hf_peer.hf_unavailable_reason() is None:
        assert e2e._hf_plan(argparse.Namespace(hf="sdpa", quick=False, batch="1"), "gemma3_text")[0] == []
    with pytest.raises(ValueError, match="--hf"):
        e2e._hf_plan(argparse.Namespace(hf="flash", quick=False, batch="1"))


def test_read_stream_kernel_sums_every_block_and_rejects_bad_buffers():
    """The read-stream reader of flashdecode.timing reads every element (its block sums are the tensor's)."""
    from flashdecode import timing

    x = torch.randn(3 * timing.READ_BLOCK, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    out = torch.full((4,), float("nan"))
    timing.read_sum(x, out)
    torch.testing.assert_close(out[:3], x.float().view(3, -1).sum(1), rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="x must"):
        timing.read_sum(x[:-1], out)
    with pytest.raises(ValueError, match="out must"):
        timing.read_sum(x, out[:2])


@pytest.mark.gpu
def test_read_stream_rates_on_the_gpu():
    from flashdecode import timing

    rates = timing.read_stream_rates(256 * 2**20)
    assert set(rates) == {"torch_sum", "triton_block_sum"} and all(r > 1e11 for r in rates.values())
    assert timing.read_bandwidth_bytes_per_s(256 * 2**20) == max(rates.values())


def test_step_breakdown_families_gaps_and_overlap():
    """A step's kernels (name, start us, end us): families by name, kernel time as the union of the intervals (an
    overlap under PDL counts once), gaps = span - kernel time, shares of the summed kernel time."""
    from flashdecode.bench import step_profile as sp

    assert sp.kernel_family("_gemv_kernel") == sp.kernel_family("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT") == "linear"
    assert sp.kernel_family("decode_split_kernel") == sp.kernel_family("merge_many_kernel") == "attention"
    assert sp.kernel_family("_add_rms_norm_kernel") == "norm" and sp.kernel_family("_rope_store_kernel") == \
        "rope + kv store"
    assert sp.kernel_family("_silu_mul_kernel") == "activation" and sp.kernel_family("Memset (Device)") == \
        "copy / fill"
    assert sp.kernel_family("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
                            "at::native::ArgMaxOps<float>") == "sampling"
    assert sp.kernel_family("mystery") == "other"
    step = [("_add_rms_norm_kernel", 0.0, 2.0), ("_gemv_kernel", 3.0, 13.0), ("decode_split_kernel", 12.0, 20.0),
            ("merge_many_kernel", 25.0, 27.0)]
    s = sp.step_summary(step)
    assert s["span_us"] == 27.0 and s["kernel_us"] == 2.0 + 10.0 + 7.0 + 2.0 and s["gap_us"] == 1.0 + 5.0
    assert s["families_us"] == {"linear": 10.0, "attention": 10.0, "norm": 2.0}
    assert sum(s["family_share"].values()) == pytest.approx(1.0) and s["family_share"]["norm"] == pytest.approx(2 / 22)
    assert [g["us"] for g in s["largest_gaps"]] == [5.0, 1.0] and s["largest_gaps"][0]["before"] == "merge_many_kernel"
    steps = sp.split_steps(step + [(n, a + 100, b + 100) for n, a, b in step], 2)
    assert [len(x) for x in steps] == [4, 4] and steps[1][0][1] == 100.0
    uneven = step + [(n, a + 100, b + 100) for n, a, b in step[1:]]  # a replay traced one event fewer: cut at
    assert [len(x) for x in sp.split_steps(uneven, 2)] == [4, 3]  # the longest idle gap (76 us) instead
    with pytest.raises(ValueError, match="cannot hold"):
        sp.split_steps(step[:1], 2)
    assert sp.median_step([dict(span_us=3), dict(span_us=1), dict(span_us=2)])["span_us"] == 2
    assert sp.top_kernel_times(step + step, top=1) == [dict(name="_gemv_kernel", us=20.0, count=2, family="linear")]


def test_step_breakdown_record_and_figure(tmp_path):
    """The e2e_step record's figure: one stacked bar per batch (families, gaps, host) with the floor marked."""
    pytest.importorskip("matplotlib")
    from flashdecode.bench import report

    row = dict(batch=1, context=4096, kv_cache_dtype="auto", families_us={"linear": 5000.0, "attention": 300.0},
               gap_us=150.0, host_ms=0.05, floors={"copy": {"step_us": 5100.0}, "read": {"step_us": 4900.0}})
    env = {"device": "cpu", "torch": torch.__version__, "triton": "-", "date": "2026-01-01 00:00 UTC"}
    path = report.write_json(tmp_path / "e2e_step_cpu_2026-01-01T0000.json", "e2e_step", env,
                             [row, dict(row, batch=16)])
    record = json.loads(path.read_text())
    assert record["plots"] == ["e2e_step_cpu_2026-01-01T0000.png"]
    assert (tmp_path / record["plots"][0]).stat().st_size > 0


@pytest.mark.gpu
def test_decode_step_breakdown_on_the_gpu():
    """One CUDA-graphed step of a small random Llama traced by CUPTI: linear layers and attention present, the
    step's span split into kernels and gaps, the graph replay within the engine step."""
    from flashdecode.bench import step_profile as sp

    cfg = named_config("llama3.2-1b", 2)
    model = model_class(cfg)(cfg, torch.bfloat16, torch.device("cuda"), 2048)
    model.init_random_(0)
    r = sp.decode_step_breakdown(model, 4, 1000, 16, {"copy": 3e12, "read": 3.2e12}, steps=5)
    assert {"linear", "attention"} <= set(r["families_us"])
    assert r["span_us"] == pytest.approx(r["kernel_us"] + r["gap_us"]) and r["gap_us"] >= 0
    assert 0 < r["replay_ms"] <= r["engine_step_ms"] * 1.05 and r["floors"]["read"]["step_us"] > 0


def test_flashinfer_peer_column_and_the_target_line(tmp_path, monkeypatch):
    """The flashinfer backend as an e2e column: dropped with the reason where its package does not import; its
    points measured through the same engine loop (a stand-in flashinfer on the CPU); the report's 'x vs
    flashinfer' per point and the line on the target (flashdecode >= 1.0x at every point)."""
    import sys

    from flashdecode.engine import flashinfer_backend as fib
    from flashinfer_fake import fake_module

    monkeypatch.setitem(sys.modules, "flashinfer", None)
    backends, note = e2e.flashinfer_plan(["flashdecode", "flashinfer", "sdpa"])
    assert backends == ["flashdecode", "sdpa"] and note.startswith("flashinfer peer: skipped")
    monkeypatch.setitem(sys.modules, "flashinfer", fake_module())
    monkeypatch.setattr(fib.FlashInferBackend, "check_engine", staticmethod(lambda device, dtype, cfg: None))
    assert e2e.flashinfer_plan(["flashdecode", "flashinfer"])[0] == ["flashdecode", "flashinfer"]
    cfg = config_from_dict(dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    model = model_class(cfg)(cfg, torch.float32, torch.device("cpu"), 512)
    model.init_random_(0)
    assert e2e.decode_tokens_per_s(model, "flashinfer", context=70, batch=2, steps=3, repeats=1, page_size=16) > 0

    cfg = named_config("llama3-8b")
    rows = [dict(kind="decode", backend=b, context=ctx, batch=bs, tokens_per_s=rate)
            for b, ctx, bs, rate in (("flashdecode", 512, 1, 160.0), ("flashinfer", 512, 1, 150.0),
                                     ("flashdecode", 4096, 16, 2000.0), ("flashinfer", 4096, 16, 2100.0))]
    args = argparse.Namespace(quick=False, contexts="512", batch="1", page_size=128, out=str(tmp_path), pdl="auto",
                              flashinfer_note="flashinfer peer: test")
    env = {"device": "cpu", "torch": torch.__version__, "triton": "-", "date": "2026-01-01 00:00 UTC"}
    e2e._write(args, env, rows, cfg, "llama3-8b", "llama3-8b", 3e12, ["flashdecode", "flashinfer"])
    record = json.loads(next(tmp_path.glob("e2e_*.json")).read_text())
    assert record["table"][0]["x vs flashinfer"] == pytest.approx(160 / 150)
    assert record["vs_flashinfer"] == {"b1 ctx512": pytest.approx(160 / 150), "b16 ctx4096": pytest.approx(2000 / 2100)}
    assert ">= 1.0x at every point: no (lowest b16 ctx4096)" in " ".join(record["summary"])
    assert "flashinfer peer: test" in record["notes"]
