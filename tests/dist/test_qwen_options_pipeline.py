"""The Qwen3-Next options (q/k norm, gated attention output, partial rotary, FLA's l2norm) are just layers: a
2-stage PipeDream-2BW pipeline of tiny_hybrid with all of them on equals the simulator (semantics.md 1),
and its checkpoint exports to transformers' Qwen3NextForCausalLM (tests/unit/test_hf_export.py)."""

from __future__ import annotations

import pytest

from tests.dist.test_pipeline_equivalence import assert_equivalent
from tests.dist.workers import make_config
from tools.hf_roundtrip import QWEN3_NEXT_OPTIONS

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]


def test_two_stage_2bw_with_the_qwen3_next_options_equals_simulator():
    cfg = make_config(model={"name": "tiny_hybrid", "overrides": QWEN3_NEXT_OPTIONS}, parallel={"pp": 2},
                      schedule={"name": "2bw"}, optimizer={"name": "muon"}, train={"steps": 4})
    _, _, results = assert_equivalent(cfg)
    names = {name for r in results for name in r["params"]}
    assert {"layers.3.mixer.q_norm.weight", "layers.3.mixer.gate_proj.weight"} <= names  # the options were on
