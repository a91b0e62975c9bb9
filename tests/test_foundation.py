"""Package-level checks: device policy defaults and the CLI demo."""

import subprocess
import sys

import torch

from flashdecode import heuristics
from conftest import DEVICE
from flashdecode.cli import build_parser, demo_rows


def test_num_sms_defaults_to_h100_on_cpu():
    assert heuristics.num_sms("cpu") == heuristics.DEFAULT_NUM_SMS == 132
    if torch.cuda.is_available():
        assert heuristics.num_sms("cuda") == torch.cuda.get_device_properties(0).multi_processor_count


def test_cdiv_and_next_power_of_2():
    assert [heuristics.cdiv(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert [heuristics.next_power_of_2(n) for n in (0, 1, 2, 3, 17, 64)] == [1, 1, 2, 4, 32, 64]


def test_demo_reference_rows_are_exact():
    rows = demo_rows(DEVICE, torch.Generator().manual_seed(0))
    names = [r[0] for r in rows]
    assert any("blockwise" in n for n in names) and any("split-KV" in n for n in names)
    for name, dtype, out_err, lse_err, _ in rows:
        limit = 1e-12 if dtype == "float64" else 1e-2
        assert out_err <= limit and lse_err <= limit, (name, out_err, lse_err)


def test_cli_demo_prints_table():
    proc = subprocess.run([sys.executable, "-m", "flashdecode", "demo"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "blockwise online softmax" in proc.stdout and "max|out err|" in proc.stdout


def test_cli_parser_has_demo():
    args = build_parser().parse_args(["demo", "--seed", "3"])
    assert args.seed == 3
