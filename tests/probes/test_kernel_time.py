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
