"""bench/op_counts.py counts what it says: the chunk loop's kernels grow by ~36 per chunk of the sequence, the
batched delta rule's by less than one (model_zoo/delta_rule.affine_scan: ~2 sqrt(2N) sequential kernels each way)."""

from __future__ import annotations

import torch

from asyncpp.analysis.trace import StandIns
from bench.op_counts import count, delta_rule_case, launches
from model_zoo.delta_rule import batched_chunk_gated_delta_rule, chunk_gated_delta_rule

aten = torch.ops.aten


def _kernels(form, t: int) -> int:
    return count(delta_rule_case(form, 1, t, 2, 16, 32), StandIns(), backward=True)["kernels"]


def test_kernels_per_chunk_of_each_form():
    # Chunks of 64 tokens; only the sequential part grows with them.
    batched = _kernels(batched_chunk_gated_delta_rule, 4096) - _kernels(batched_chunk_gated_delta_rule, 1024)
    assert 0 < batched < 48  # 16 -> 64 chunks: ~2 sqrt(2N) each way, 2 x (23 - 11) = 24; one per chunk would be 96
    loop = _kernels(chunk_gated_delta_rule, 512) - _kernels(chunk_gated_delta_rule, 256)
    assert loop >= 30 * 4  # 4 -> 8 chunks


def test_what_launches_a_kernel():
    assert launches(aten.bmm.default) and launches(aten.add_.Tensor) and launches(aten.baddbmm.out)
    assert not launches(aten.view.default) and not launches(aten.transpose.int) and not launches(aten.unbind.int)
    assert not launches(aten._unsafe_view.default) and not launches(aten.empty.memory_format)
    assert not launches(aten.promote_types.default)
