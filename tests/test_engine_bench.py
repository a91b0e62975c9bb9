"""bench e2e's measuring functions on a tiny model on the CPU (the GPU run is `flashdecode bench e2e`)."""

from __future__ import annotations

import argparse
import json

import torch

from flashdecode.bench import e2e
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


def test_roofline_matches_benchmarking_md():
    """BENCHMARKING.md: 187 tok/s at 512 and 122 at 64k for Llama-3-8B at 3.02 TB/s."""
    cfg = named_config("llama3-8b")
    assert round(e2e.roofline_tokens_per_s(cfg, 512, 1, 3.02e12)) == 187
    assert round(e2e.roofline_tokens_per_s(cfg, 65536, 1, 3.02e12)) in (122, 123)
