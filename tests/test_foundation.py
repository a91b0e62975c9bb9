"""Package-level checks: device policy defaults and the CLI demo."""

import subprocess
import sys

import torch

from flashdecode import heuristics
from conftest import DEVICE
from helpers import SUBPROCESS_TIMEOUT_S
from flashdecode.cli import build_parser, demo_rows


def test_num_sms_defaults_to_h100_on_cpu():
    assert heuristics.num_sms("cpu") == heuristics.DEFAULT_NUM_SMS == 132
    if torch.cuda.is_available():
        assert heuristics.num_sms("cuda") == torch.cuda.get_device_properties(0).multi_processor_count


def test_cdiv_and_next_power_of_2():
    assert [heuristics.cdiv(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert [heuristics.next_power_of_2(n) for n in (0, 1, 2, 3, 17, 64)] == [1, 1, 2, 4, 32, 64]


def test_demo_rows_are_exact_or_within_the_flash_attention_rule():
    rows = demo_rows(DEVICE, torch.Generator().manual_seed(0))
    names = [r["algorithm"] for r in rows]
    assert any("blockwise" in n for n in names) and any("split-KV" in n for n in names)
    assert any("flash_attn" in n for n in names) and any("flash_decode" in n for n in names)
    for r in rows:
        if r["dtype"] == "float64":
            assert r["out_err"] <= 1e-12 and r["lse_err"] <= 1e-12, r
        else:  # kernels: within 3x of naive attention in the same dtype (the decode factor of the rule)
            assert r["out_err"] <= 3 * r["torch_same_dtype_err"] + 1e-3, r
            assert r["lse_err"] <= 1e-2, r


def test_cli_demo_prints_table():
    proc = subprocess.run([sys.executable, "-m", "flashdecode", "demo"], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert "blockwise online softmax" in proc.stdout and "max|out err|" in proc.stdout


def test_cli_parser_has_demo():
    args = build_parser().parse_args(["demo", "--seed", "3"])
    assert args.seed == 3
