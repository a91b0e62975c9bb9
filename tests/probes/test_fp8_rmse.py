"""benchmarks/probes/fp8_rmse.py measures what it claims: its outlier inputs have the stated outlier fraction, its
RMSE is against float64 on the original inputs (the bf16 row is small, the FP8 rows larger), and the Hadamard
rotation lowers the FP8 error on outlier inputs (the effect the probe exists to measure)."""

import json

import pytest
import torch

pytestmark = pytest.mark.probes


def test_outlier_inputs_have_the_stated_outliers():
    from benchmarks.probes.fp8_rmse import OUTLIER_FRACTION, outlier_inputs

    q, k, v = outlier_inputs(2, 512, 4, 2, 64, seed=0)
    assert q.shape == (2, 512, 4, 64) and k.shape == v.shape == (2, 512, 2, 64)
    big = (q.abs() > 6).float().mean().item()  # N(0, 1) alone exceeds 6 with probability ~2e-9
    assert 0.3 * OUTLIER_FRACTION < big < OUTLIER_FRACTION


def test_probe_table_and_record(tmp_path, capsys):
    from benchmarks.probes.fp8_rmse import SCHEMES, main

    assert main(["--seqlen", "256", "--nheads", "2", "--headdim", "64", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("fp8_rmse_*.json")
    record = json.loads(path.read_text())
    assert record["kind"] == "fp8_rmse" and record["fa3_claim"] == 2.6
    rmse = {r["scheme"]: r["emulated"] for r in record["rows"]}
    assert list(rmse) == list(SCHEMES) and all(r["kernel"] is None for r in record["rows"])
    assert 0 < rmse["bf16"] < rmse["per_head"] / 4
    assert rmse["per_head+hadamard"] < rmse["per_head"] and rmse["per_block+hadamard"] < rmse["per_block"]
    assert "| per_head+hadamard |" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_probe_kernel_rows_match_the_emulation(tmp_path):
    from benchmarks.probes.fp8_rmse import main

    main(["--seqlen", "2048", "--nheads", "4", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("fp8_rmse_*.json")
    for row in json.loads(path.read_text())["rows"]:
        if row["kernel"] is not None:
            assert row["kernel"] <= 1.5 * row["emulated"] + 1e-4, row
