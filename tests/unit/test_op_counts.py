"""bench/op_counts.py counts what it says: per chunk of the sequence, the batched delta rule adds two kernels (one
baddbmm forward, one backward: the state recurrence of model_zoo/delta_rule.ChunkStates), the chunk loop ~36."""

from __future__ import annotations

import torch

from asyncpp.analysis.trace import StandIns
from bench.op_counts import count, delta_rule_case, launches
from model_zoo.delta_rule import batched_chunk_gated_delta_rule, chunk_gated_delta_rule

aten = torch.ops.aten


def _kernels(form, t: int) -> int:
    return count(delta_rule_case(form, 1, t, 2, 16, 32), StandIns(), backward=True)["kernels"]


def test_kernels_per_chunk_of_each_form():
    # 4 more chunks of 64 tokens: only the sequential part grows.
    batched = _kernels(batched_chunk_gated_delta_rule, 512) - _kernels(batched_chunk_gated_delta_rule, 256)
    loop = _kernels(chunk_gated_delta_rule, 512) - _kernels(chunk_gated_delta_rule, 256)
    assert batched == 2 * 4
    assert loop >= 30 * 4


def test_what_launches_a_kernel():
    assert launches(aten.bmm.default) and launches(aten.add_.Tensor) and launches(aten.baddbmm.out)
    assert not launches(aten.view.default) and not launches(aten.transpose.int) and not launches(aten.unbind.int)
    assert not launches(aten._unsafe_view.default) and not launches(aten.empty.memory_format)
    assert not launches(aten.promote_types.default)
