"""bench/real_stage.py's harness on the CPU (its GPU run: the paper layouts' stages on a real device)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from asyncpp.analysis.traced import TRACED_STEPS
from bench import real_stage


@pytest.mark.slow
def test_real_stage_smoke_runs_a_vocab_head_stage_and_restores_the_collectives(tmp_path):
    saved = dist.all_to_all_single, dist.all_gather_into_tensor, dist.broadcast
    results = real_stage.main(["--smoke", "--stages", "1", "--out", str(tmp_path)])
    ((key, d),) = results.items()
    assert "error" not in d, d
    assert key == "tiny_moe_2stage/vocab/1"
    assert d["plan"]["total_bytes"] > 0 and d["peak_bytes"] > d["start_bytes"] > 0  # a step really ran
    assert d["comm_count"] > 0  # the vocabulary head's collectives went through the (filled) fake group
    assert [u["skipped"] for u in d["updates"]] == [False] * TRACED_STEPS  # every step's update ran: none fed garbage
    assert (dist.all_to_all_single, dist.all_gather_into_tensor, dist.broadcast) == saved
    assert (tmp_path / "real_stage.json").exists()
