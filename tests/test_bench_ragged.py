"""The ragged prefill bench's peer list (flashdecode/bench/prefill_ragged.py) on a faked Hopper: which Gluon A/B
peers each --variants value adds (the timings themselves need the GPU)."""

import importlib.util

import pytest
import torch

from flashdecode.bench import prefill_ragged


@pytest.fixture
def hopper_without_flashinfer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))


@pytest.mark.parametrize("variants,added", [((), []), (("vtail",), ["gluon_vtail", "gluon_novtail"]),
                                            (("vbound",), ["gluon_vtail", "gluon_novtail", "gluon_vbound"])])
def test_variants_add_the_v_tail_peers(hopper_without_flashinfer, variants, added):
    peers = prefill_ragged.peers_available(("fwd",), variants)
    assert peers[:2] == ["ours", "triton"]
    assert [p for p in peers if p.startswith("gluon_")] == added
    assert all(p in prefill_ragged.BUILDERS for p in peers)
    # the A/B is forward only
    assert not [p for p in prefill_ragged.peers_available(("fwd+bwd",), variants) if p.startswith("gluon_v")]
