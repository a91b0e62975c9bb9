"""benchmarks/probes/kernel_time.py times what it names: a fwd step is the implementation's forward alone, a fwd+bwd
step also differentiates q, k and v (on fresh leaves, so the caller's tensors keep no graph)."""

import pytest
import torch

from helpers import randn

pytestmark = pytest.mark.probes


def test_steps_run_the_forward_and_the_backward(monkeypatch):
    from benchmarks.probes.kernel_time import _step

    gen = torch.Generator().manual_seed(0)
    q, k, v = (randn(1, 33, h, 32, gen=gen, dtype=torch.float16) for h in (4, 2, 2))
    fn, args = _step("ours", "fwd", q, k, v, causal=True)
    out = fn(*args)
    assert out.shape == q.shape and not out.requires_grad
    grads = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **kw: grads.append(real(*a, **kw)) or grads[-1])
    fn, args = _step("ours", "fwd+bwd", q, k, v, causal=True)
    assert args == () and not q.requires_grad
    fn()
    (dq, dk, dv), = grads
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in (dq, dk, dv))


def test_rows_get_their_share_of_the_matmul_rate():
    from benchmarks.probes.kernel_time import with_matmul_share

    rows = [dict(impl="ours", tflops=600.0), dict(impl="cuDNN", tflops=450.0)]
    shared = with_matmul_share(rows, 750.0)
    assert [r["pct_matmul"] for r in shared] == [80.0, 60.0]
    assert "pct_matmul" not in rows[0]  # the input rows stay as they were


def test_the_record_is_a_latest_record_the_benchmarks_page_draws(tmp_path, monkeypatch):
    """main() writes kind kernel_time with env, commit and command (flashdecode/bench/report.py), which
    scripts/write_benchmarks_md.py draws as the kernel-time section (timings stubbed: no GPU here)."""
    import importlib.util
    import json
    import sys

    from benchmarks.probes import kernel_time
    from flashdecode.bench import report

    def point(args, mode, d, b, s, h, hkv, causal):
        return [dict(mode=mode, d=d, b=b, s=s, h=h, hkv=hkv, causal=causal, impl=impl, us=1.0, us_rounds=[1.0],
                     tflops=tflops) for impl, tflops in (("ours", 600.0), ("cuDNN", 500.0))]

    monkeypatch.setattr(kernel_time, "time_point", point)
    monkeypatch.setattr(kernel_time, "matmul_tflops", lambda **kw: 800.0)
    monkeypatch.setattr(sys, "argv", ["benchmarks/probes/kernel_time.py", "--headdims", "128", "--out", str(tmp_path)])
    assert kernel_time.main() == 0
    (path,) = tmp_path.glob("kernel_time_*.json")
    record = json.loads(path.read_text())
    assert record["kind"] == "kernel_time" and record["command"].startswith("python -m benchmarks.probes.kernel_time")
    assert record["bf16_matmul_tflops"] == 800.0 and record["rows"][0]["pct_matmul"] == 75.0
    spec = importlib.util.spec_from_file_location("md", report.REPO_ROOT / "scripts" / "write_benchmarks_md.py")
    md = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(md)
    assert md.benchmark_key(record) == "kernel_time:fwd"
    assert "| fwd | 128 | 1x16k | no | 600.0 | 500.0 | 1.20 | 75 |" in md._kernel_time_section({path.name: record})
