"""parallel.head=tokens as data: the schedules with the helper's HEAD actions, their invariants, the cost
model's balanced step time, the share the cost model picks, and the config's refusals."""

from __future__ import annotations

import dataclasses

import pytest

from asyncpp.config import ConfigError, RunConfig
from asyncpp.core.head_split import best_share, plan_head_split, stage_costs
from asyncpp.core.layer_costs import layer_costs
from asyncpp.core.layer_split import balanced_split
from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.build import build_pipeline, build_schedule
from asyncpp.schedules.costmodel import OpCosts, predict, simulate, steady_delays
from asyncpp.schedules.invariants import ScheduleError, check_schedules, max_versions_for
from model_zoo.registry import get_model_config


def _check(kind: str, P: int, m: int, delays: list[list[int]]) -> list[list[Action]]:
    schedules = build_pipeline(kind, P, m, delays, head_split=True)
    check_schedules(schedules, m, [max_versions_for(kind, s, P) for s in range(P)], step_delays=delays)
    return schedules


@pytest.mark.parametrize("kind", ["2bw", "1f1b", "sync"])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_invariants_hold(kind: str, P: int) -> None:
    for m in (P, 2 * P + 1):
        schedules = _check(kind, P, m, steady_delays(kind, P, 5))
        heads = [a for a in schedules[0] if a.op is Op.HEAD]
        assert len(heads) == 5 * m and not any(a.op is Op.HEAD for s in schedules[1:] for a in s)


def test_invariants_hold_with_sync_start_and_cooldown() -> None:
    delays = [[0, 0, 1, 1, 1, 0]] * 2
    _check("2bw", 2, 4, delays)


def test_steady_unit_of_the_helper() -> None:
    """Stage 0 runs F(k+P), H(k+d), B(k) in the steady state, d = head_lag(P) (1 at P=2, 2 at P=4)."""
    s0 = build_schedule("2bw", 0, 2, 8, [1], head_split=True)
    compute = [f"{a.op.value}{a.microbatch}" for a in s0 if a.op in (Op.FORWARD, Op.BACKWARD, Op.HEAD)]
    assert compute[:9] == ["F0", "F1", "F2", "H0", "H1", "B0", "F3", "H2", "B1"]
    s0 = build_schedule("2bw", 0, 4, 8, [1], head_split=True)
    compute = [f"{a.op.value}{a.microbatch}" for a in s0 if a.op in (Op.FORWARD, Op.BACKWARD, Op.HEAD)]
    assert compute[:13] == ["F0", "F1", "F2", "F3", "F4", "H0", "H1", "H2", "B0", "F5", "H3", "B1", "F6"]


def _moved(schedule: list[Action], i: int, j: int) -> list[Action]:
    out = list(schedule)
    out.insert(j, out.pop(i))
    return out


def test_invariants_catch_misplaced_heads() -> None:
    schedules = build_pipeline("2bw", 2, 4, steady_delays("2bw", 2, 3), head_split=True)
    s0 = schedules[0]
    h = next(i for i, a in enumerate(s0) if a.op is Op.HEAD and a.microbatch == 3 and a.step == 0)
    u0 = next(i for i, a in enumerate(s0) if a.op is Op.UPDATE_START and a.step == 0)
    with pytest.raises(ScheduleError, match="H0.3 must run"):  # after its step's UPDATE_START
        check_schedules([_moved(s0, h, u0), schedules[1]], 4, 2)
    h1 = next(i for i, a in enumerate(s0) if a.op is Op.HEAD and a.microbatch == 1 and a.step == 0)
    with pytest.raises(ScheduleError, match="FIFO"):  # H0.2 consumed before H0.1 on the hidden-state channel
        check_schedules([_moved(s0, h1, h1 + 3), schedules[1]], 4, 2)
    stray = list(schedules[1]) + [Action(Op.HEAD, 0, 0, 0)]
    with pytest.raises(ScheduleError, match="stage 0, only"):
        check_schedules([s0, stray], 4, 2)
    with pytest.raises(ScheduleError, match="HEAD must run once"):
        check_schedules([[a for a in s0 if not (a.op is Op.HEAD and a.step == 2)], schedules[1]], 4, 2)


@pytest.mark.parametrize("kind", ["gpipe", "pipedream"])
def test_builder_refuses_unsupported_kinds(kind: str) -> None:
    with pytest.raises(ValueError, match="head=tokens with schedule="):
        build_schedule(kind, 0, 2, 4, [0] * 2, head_split=True)


def _tiny_costs():
    return layer_costs(get_model_config("tiny_dense"), 128, 4, "cpu")


def test_plan_balances_stage_zero_and_the_last_stage() -> None:
    costs = _tiny_costs()
    plan = plan_head_split(costs, 2, 512)
    c = stage_costs(costs, plan.sizes, plan.helper_tokens / plan.tokens)
    # Balanced to one token's share of the head (the share is a whole number of tokens).
    assert abs(c[0] - c[1]) <= costs.head / plan.tokens
    unsplit = costs.stage_costs(balanced_split(costs, 2))
    assert max(c) < 0.8 * max(unsplit)  # the head was what capped the split: the slowest stage gets cheaper
    fixed = plan_head_split(costs, 2, 512, sizes=[2, 2])
    assert fixed.sizes == (2, 2) and fixed.helper_tokens == round(best_share(costs, [2, 2]) * 512)
    assert plan_head_split(costs, 2, 512, sizes=[2, 2], helper_tokens=600).helper_tokens == 511  # clamped


@pytest.mark.parametrize("kind", ["2bw", "1f1b"])
@pytest.mark.parametrize("m", [4, 8])
def test_cost_model_predicts_the_balanced_time(kind: str, m: int) -> None:
    """Costs of the tiny_dense plan (backward = 2 x forward; H = the helper's share of the head): the 2BW step
    takes m x the balanced per-microbatch time, nothing more, with messages in flight; 1F1B adds its flush."""
    costs = _tiny_costs()
    plan = plan_head_split(costs, 2, 512, sizes=[2, 2])
    x = plan.helper_tokens / plan.tokens
    body = costs.stage_costs([2, 2])
    body[1] -= costs.head  # the last stage's layers; its head share is added below
    own = [body[0], body[1] + (1 - x) * costs.head]
    ops = OpCosts(forward=[c / 3 for c in own], backward=[2 * c / 3 for c in own], head=x * costs.head,
                  comm=0.02 * max(own))
    balanced = max(own[0] + x * costs.head, own[1])
    r = predict(kind, 2, m, 12, ops, head_split=True)
    if kind == "2bw":
        assert r["step_time"] == pytest.approx(m * balanced, rel=1e-9)
    else:  # a flush per step costs at most one extra forward+backward chain through both stages
        assert m * balanced < r["step_time"] <= m * balanced + sum(own) + x * costs.head + 4 * ops.comm
    unsplit = OpCosts(forward=[body[0] / 3, (body[1] + costs.head) / 3],
                      backward=[2 * body[0] / 3, 2 * (body[1] + costs.head) / 3], comm=ops.comm)
    assert predict(kind, 2, m, 12, unsplit)["step_time"] > 1.2 * r["step_time"]


def test_cost_model_timeline_has_heads_on_stage_zero() -> None:
    schedules = build_pipeline("2bw", 2, 4, steady_delays("2bw", 2, 3), head_split=True)
    tl = simulate(schedules, OpCosts(forward=1.0, backward=2.0, head=0.5))
    assert {e.stage for e in tl.events if e.kind == "H"} == {0} and sum(e.kind == "H" for e in tl.events) == 12


def _cfg(**parallel) -> RunConfig:
    cfg = RunConfig()
    cfg.model.name = "tiny_dense"
    cfg.schedule.name = parallel.pop("schedule", "2bw")
    cfg.parallel = dataclasses.replace(cfg.parallel, pp=2, stage_layers=(2, 2), **parallel)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=4, seq_len=128, num_microbatches=4)
    return cfg


def test_config_refusals() -> None:
    limits = get_model_config("tiny_dense")
    _cfg(head="tokens").validate(limits)
    _cfg(head="tokens", head_split_tokens=100).validate(limits)
    with pytest.raises(ConfigError, match="head=tokens with schedule=pipedream"):
        _cfg(head="tokens", schedule="pipedream").validate(limits)
    with pytest.raises(ConfigError, match=r"head_split_tokens=512 must be in \[1, 511\]"):
        _cfg(head="tokens", head_split_tokens=512).validate(limits)
    with pytest.raises(ConfigError, match="head_split_tokens=5 needs parallel.head=tokens"):
        _cfg(head_split_tokens=5).validate(limits)
    with pytest.raises(ConfigError, match="head=tokens with parallel.tp=2"):
        _cfg(head="tokens", tp=2).validate(limits)
    # Lifted by issue 30 (tests/dist/test_head_split.py runs each against the simulator).
    _cfg(head="tokens", dp=2, distributed_optimizer=True).validate(limits)


def test_a_stop_inside_a_segment_cuts_a_head_split_stream() -> None:
    """pipeline/stopping.py's lookahead also serves the head split's streams (one more warm-up forward, H on
    stage 0): after a stop learned at UPDATE(t), every stage runs exactly the [t0, s) stream's actions, and the
    stages' streams together (with the head link's channels) are deadlock-free and FIFO."""
    from asyncpp.pipeline.stopping import stop_lookahead
    from tests.unit.test_stop_midsegment import violations

    assert violations(stop_lookahead, kinds=("sync", "1f1b", "2bw"), head_split=True) == []


@pytest.mark.parametrize("P", [2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("head", [0.3, 2.0])
def test_no_bubble_beyond_the_balance_at_any_depth(P: int, head: float, monkeypatch) -> None:
    """Stages of equal cost 3 (backward = 2 x forward), stage 0's made of its layers and its H: 2BW's step is
    m x 3 exactly, i.e. the helper's H (placed by build.head_lag) adds no bubble. The placement is what does
    it: with H one microbatch earlier (lag - 1) the same costs bubble at P >= 3."""
    from asyncpp.schedules import build

    body = 3.0 - head
    costs = OpCosts(forward=[body / 3] + [1.0] * (P - 1), backward=[2 * body / 3] + [2.0] * (P - 1), head=head)
    m = 2 * P
    assert predict("2bw", P, m, 8, costs, head_split=True)["step_time"] == pytest.approx(3.0 * m, rel=1e-9)
    if P >= 3:
        lag = build.head_lag(P)
        monkeypatch.setattr(build, "head_lag", lambda num_stages: lag - 1)
        assert predict("2bw", P, m, 8, costs, head_split=True)["step_time"] > 1.05 * 3.0 * m
