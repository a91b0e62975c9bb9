"""benchmarks/probes/fp8_decode.py's --sweep entries: each maps the configs 8-bit caches resolve on Hopper (b1 16/2
at 128k: the split grid; the Llama-3-8B shape at b16 8k: the device-split grid) to a config that passes the config
check, or to None where it does not apply. CPU only: the configs, no kernel."""

import dataclasses

import pytest

from benchmarks.probes.fp8_decode import _SWEEP
from flashdecode import heuristics as hx
from flashdecode.config import DecodePath, check_decode_config

_HOPPER = hx.DecodeDevice(num_sms=132, interpret=False, hopper=True, pdl=True)


def _resolved(batch, live, nheads_kv, group):
    p = hx.DecodeProblem(batch=batch, grid_batch=batch, seqlen_q=1, group=group, nheads_kv=nheads_kv, headdim=128,
                         elem_bytes=1, page_size=0, capacity=live, window_left=-1, live_keys=live,
                         total_keys=batch * live)
    return hx.resolve_decode_config(p, _HOPPER)


@pytest.mark.parametrize("name", sorted(_SWEEP))
def test_sweep_entry_gives_a_valid_config_or_none(name):
    b1, b16 = _resolved(1, 131072, 2, 8), _resolved(16, 8192, 8, 4)
    assert b1.path is DecodePath.SPLIT_GRID and b16.path is DecodePath.DEVICE_SPLIT_GRID
    applied = 0
    for config, context in ((b1, 131072), (b16, 8192)):
        changes = _SWEEP[name](config, context)
        if changes is None:
            continue
        applied += 1
        check_decode_config(dataclasses.replace(config, **changes))
    if name in ("resolved", "in-kernel merge", "merge kernel", "all reads", "x0.5"):
        assert applied, name


def test_merge_entries_apply_to_the_device_split_grid_only():
    b1, b16 = _resolved(1, 131072, 2, 8), _resolved(16, 8192, 8, 4)
    assert b16.merge_in_kernel and b16.merge_live_only
    assert _SWEEP["merge kernel"](b16, 8192) == dict(merge_in_kernel=False)
    assert _SWEEP["all reads"](b16, 8192) == dict(merge_live_only=False, merge_in_kernel=False)
    assert _SWEEP["merge kernel"](b1, 131072) is None
