"""asyncpp.core.memory: the per-rank accounting against what is really allocated, and the activation count
against a measurement of what autograd saves (saved-tensor hooks; the GPU check with
torch.cuda.max_memory_allocated is in tests/gpu/test_gpu_backends.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from asyncpp.analysis.trace import StepTracer
from asyncpp.config import RunConfig
from asyncpp.core.loss import cross_entropy, lm_loss
from asyncpp.core.memory import (
    ALLOCATED,
    FORWARD_BACKWARD,
    HELD,
    UPDATE,
    action_loads,
    activation_bytes,
    backward_scratch_bytes,
    error_feedback_scratch_bytes,
    in_flight_microbatches,
    materialize_optimizer_state,
    measure_saved_activations,
    optimizer_state_bytes,
    simulator_report,
    stage_actions,
    storage_bytes,
    versions_report,
)
from asyncpp.core.staleness import ErrorFeedback
from asyncpp.host.allocator import heap_stats
from asyncpp.optim import build_from_config
from asyncpp.pipeline.stage import StageSpec, prune_to_stage, stage_forward
from asyncpp.pipeline.weights import WeightVersions
from asyncpp.reference.executor import build_simulator
from asyncpp.schedules.actions import Op
from model_zoo import build_model, get_model_config

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16


def numel(params) -> int:
    return sum(p.numel() for p in params)


def test_storage_bytes_counts_a_storage_once_views_and_meta_included():
    x = torch.zeros(10, 4)
    assert storage_bytes([x, x[2:], x.t(), x.data]) == 160
    counted: set[int] = set()
    assert storage_bytes([x], counted) == 160 and storage_bytes([x, torch.zeros(3)], counted) == 12
    m = torch.empty(5, 5, device="meta", dtype=BF16)
    assert storage_bytes([m, m[1:]]) == 50


def sim_config(precision: str, optimizer: str = "adamw") -> RunConfig:
    return RunConfig.from_dict({
        "model": {"name": "tiny_hybrid"}, "parallel": {"pp": 2}, "schedule": {"name": "2bw"},
        "train": {"steps": 4, "precision": precision, "micro_batch_size": 2, "num_microbatches": 2,
                  "seq_len": 16, "eval_every": 0},
        "optimizer": {"name": optimizer, "schedule": {"kind": "constant", "warmup_steps": 0}},
        "staleness": {"ef_lambda": 1.0},
    })


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_simulator_report_matches_the_allocated_tensors(precision):
    cfg = sim_config(precision)
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny_hybrid"))
    sim = build_simulator(cfg, model, build_from_config(model, cfg.optimizer))
    before = simulator_report(sim, activation_bytes_per_mb=0, title="")
    tokens = torch.randint(0, 8192, (2, 17))
    for t in range(2):
        sim.step(t, [tokens, tokens])
    after = simulator_report(sim, activation_bytes_per_mb=0, title="")
    n = numel(sim.params)
    c = 2 if precision == "bf16" else 4
    # Independently of storage_bytes: numel x element size of what this configuration must hold.
    assert after.get("weights") == n * c
    assert after.get("past versions") == sim.num_past_versions * n * c
    assert after.get("fp32 master weights") == (4 * n if precision == "bf16" else 0)  # fp32: they are the weights
    assert after.get("error feedback") == 4 * n
    steps = sum(1 for s in sim.optimizer.optimizers["adamw"].state.values() for v in s.values() if v.dim() == 0)
    assert after.get("optimizer state") == 2 * 4 * n + 4 * steps  # AdamW: exp_avg, exp_avg_sq; scalar steps
    # Before the first step nothing of this existed: the meta-step estimate is the same number.
    assert before.get("optimizer state") == after.get("optimizer state")
    assert before.get("past versions") == after.get("past versions")
    assert "estimated" in next(i.how for i in before.items if i.name.startswith("optimizer"))
    assert [i.how for i in after.items if i.name.startswith("optimizer")] == [ALLOCATED]
    # Every tensor the simulator keeps is in exactly one allocated item.
    kept = list(sim.params) + [x for v in sim.history for x in v] + list(sim.masters) + \
        list(sim.error_feedback.prev_update) + \
        [v for o in sim.optimizer.optimizers.values() for s in o.state.values() for v in s.values()]
    assert sum(i.nbytes for i in after.items if i.how == ALLOCATED) == storage_bytes(kept)


def stage(device: str, precision_dtype, optimizer: str = "muon"):
    """Stage 0 of 2 of tiny_hybrid with 2BW weight versions, as PipelineExecutor builds it."""
    torch.manual_seed(0)
    model = prune_to_stage(build_model(get_model_config("tiny_hybrid"), device=device), StageSpec(0, 2, 4))
    cfg = sim_config("bf16", optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_from_config(model, cfg.optimizer)
    versions = WeightVersions(params, 2, compute_dtype=precision_dtype)
    versions.retarget(opt)
    return versions, opt, ErrorFeedback(versions.masters, 1.0)


def test_a_dry_run_on_meta_tensors_reports_what_the_real_stage_holds():
    reports = []
    for device in ("cpu", "meta"):
        versions, opt, ef = stage(device, BF16)
        if device == "meta":
            materialize_optimizer_state(opt)  # a dry run may take the step; the real stage is estimated
        reports.append(versions_report(versions, opt, error_feedback=ef.prev_update, activation_bytes_per_mb=10,
                                       in_flight=2, grad_buffers=2, title=device))
    real, meta = reports
    assert [(i.name, i.nbytes) for i in real.items] == [(i.name, i.nbytes) for i in meta.items]
    n = numel(stage("meta", BF16)[0].masters)
    assert real.get("weight versions") == 2 * 2 * n and real.get("fp32 master weights") == 4 * n
    assert real.get("activations") == 20 and real.get("gradients") == 2 * 4 * n
    # The update's scratch and the forward/backward's activations never overlap: the total takes the larger phase.
    held = sum(i.nbytes for i in real.items if i.phase == HELD)
    phases = [sum(i.nbytes for i in real.items if i.phase == p) for p in (FORWARD_BACKWARD, UPDATE)]
    assert phases[0] == 20 and phases[1] == real.get("update scratch (fp32") + real.get("update scratch: error")
    assert real.total == held + max(phases) < sum(i.nbytes for i in real.items)
    assert "weight versions (2 x bf16)" in real.table() and "total" in real.table()


def test_fp32_masters_share_the_newest_version():
    versions, opt, ef = stage("cpu", None, "adamw")
    report = versions_report(versions, opt, error_feedback=ef.prev_update, activation_bytes_per_mb=0,
                             in_flight=1, grad_buffers=1, title="")
    assert report.get("fp32 master weights") == 0 and "share" in report.table()


def test_meta_optimizer_estimate_equals_the_state_after_a_real_step():
    for name in ("muon", "adamw", "lion"):
        model = build_model(get_model_config("tiny_dense"))
        opt = build_from_config(model, RunConfig.from_dict({"optimizer": {"name": name}}).optimizer)
        estimate, how = optimizer_state_bytes(opt)
        assert "meta" in how, (name, how)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        assert optimizer_state_bytes(opt) == (estimate, ALLOCATED), name


def test_in_flight_microbatches_follow_the_schedule():
    assert [in_flight_microbatches("2bw", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight_microbatches("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches("gpipe", 0, 4, 8) == 8
    assert in_flight_microbatches("1f1b", 0, 4, 2) == 2  # never more than m


CASES = [
    ("tiny_dense", {}),
    ("tiny_hybrid", {"moe": None, "ffn_hidden_size": 384}),  # Gated DeltaNet + attention, dense MLP
    ("tiny_hybrid", {}),  # + MoE with a shared expert
    ("smollm2_135m", {"num_layers": 2, "vocab_size": 2048}),  # real widths, GQA 9/3 heads
]


@pytest.mark.parametrize("name, overrides", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_activation_estimate_matches_saved_tensors(name, overrides, dtype):
    """Tolerance 3% (measured: < 0.1%). Sequence length a multiple of the GDN chunk size, as in training.
    MoE layers pad their expert buffer to the busiest expert, so the measured imbalance is passed in."""
    cfg = get_model_config(name, **overrides)
    torch.manual_seed(0)
    model = build_model(cfg).to(dtype)
    b, t = 2, 128
    tokens = torch.randint(0, cfg.vocab_size, (b, t + 1))
    measured, _ = measure_saved_activations(lambda: lm_loss(model, tokens), model.parameters())
    loads = [m.last_expert_load.float() for m in model.moe_layers()]
    imbalance = sum(float(x.max() / x.mean()) for x in loads) / len(loads) if loads else 1.0
    estimate = activation_bytes(cfg, range(cfg.num_layers), dtype=dtype, micro_batch_size=b, seq_len=t,
                                first=True, last=True, moe_imbalance=imbalance)
    assert abs(estimate - measured) / measured < 0.03, (estimate, measured)


def test_activation_estimate_of_a_middle_stage():
    """A stage without embedding and head: only its blocks (the pipeline's per-stage number)."""
    cfg = get_model_config("tiny_dense")
    model = build_model(cfg)
    x = torch.randn(2, 64, cfg.hidden_size, requires_grad=True)
    measured, _ = measure_saved_activations(lambda: model.layers[2](model.layers[1](x)), model.parameters())
    estimate = activation_bytes(cfg, [1, 2], dtype=torch.float32, micro_batch_size=2, seq_len=64,
                                first=False, last=False)
    assert abs(estimate - measured) / measured < 0.03


def test_measure_saved_activations_ignores_parameters():
    lin = nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    saved, out = measure_saved_activations(lambda: lin(x), lin.parameters())
    assert saved == 4 * 8 * 4 and out.shape == (4, 8)  # the input; the weight is not an activation


def test_in_flight_microbatches_of_every_kind_at_every_stage():
    """From the schedule itself: P - s for 1F1B-ordered kinds (pipedream's per-stage delays included), m for GPipe."""
    from asyncpp.core.memory import in_flight_microbatches

    for kind in ("1f1b", "2bw", "pipedream"):
        assert [in_flight_microbatches(kind, s, 4, 4) for s in range(4)] == [4, 3, 2, 1], kind
    assert [in_flight_microbatches("gpipe", s, 4, 4) for s in range(4)] == [4, 4, 4, 4]


class _LiveBytes(TorchDispatchMode):
    """glibc's live bytes (heap in use + mmapped blocks: every malloc'd byte not yet freed) sampled after each
    torch op; `peak` is the highest sample above the level when the mode was entered."""

    def __enter__(self):
        self.start = self.peak = _live()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _live())
        return out


def _live() -> int:
    h = heap_stats()
    return h.heap_in_use_bytes + h.mmapped_bytes


@pytest.mark.skipif(heap_stats() is None, reason="live bytes come from glibc's mallinfo2")
@pytest.mark.parametrize("seq_len", [256, 16])  # 8 T V above the head's gradient G (16 MiB vs 4), and below it
def test_loss_backward_scratch_matches_live_allocations(seq_len):
    """The last stage's backward above its saved activations and its (existing, recycled) gradient sums:
    max(8 T V, G) (+ the compute-dtype copy of the logits' gradient below fp32). Measured: the peak of live
    malloc'd bytes during loss.backward() minus the level before it. Tolerance: 5% of the estimate plus 0.5 MiB;
    the estimate leaves out the [T, hidden] activation gradients and the block's own per-op transients
    (T x ffn x 4 = 0.7 MiB here at T=256, 0.04 MiB at T=16), and the sampling after each op misses nothing
    larger (the largest tensors are op outputs). fp32 only: the CPU's bf16 matmul backward allocates fp32
    temporaries of its own (measured 6.7 MiB against 2.4 estimated at T=16), which the plan does not model."""
    dtype = torch.float32
    cfg = get_model_config("tiny_dense")
    torch.manual_seed(0)
    spec = StageSpec(1, 2, cfg.num_layers, [3, 1])
    model = prune_to_stage(build_model(cfg), spec).to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)  # steady state: the backward adds into the recycled gradient set
    b = 1
    x = torch.randn(b, seq_len, cfg.hidden_size, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, cfg.vocab_size, (b, seq_len))
    loss = cross_entropy(stage_forward(model, spec, x), labels)
    with _LiveBytes() as live:
        loss.backward()
    measured = live.peak - live.start
    estimate = backward_scratch_bytes(params, grad_itemsize=dtype.itemsize, tokens=b * seq_len,
                                      vocab_size=cfg.vocab_size, last=True)
    assert abs(measured - estimate) <= 0.05 * estimate + 2**19, (measured, estimate)


def test_the_update_phase_holds_the_microbatches_in_flight_at_an_update():
    """2BW places UPDATE(t) after a backward in the 1F1B stream: P - s - 1 microbatches wait across it (the
    forward/backward phase's peak is P - s); a flushing schedule updates with nothing in flight."""
    def at(op, kind, s):
        return max(load.in_flight for load in action_loads(stage_actions(kind, s, 4, 8), s == 3) if load.action.op is op)

    assert [at(Op.UPDATE, "2bw", s) for s in range(4)] == [3, 2, 1, 0]
    assert [at(Op.UPDATE, "1f1b", s) for s in range(4)] == [0, 0, 0, 0]
    assert [at(Op.FORWARD, "2bw", s) for s in range(4)] == [4, 3, 2, 1]  # the forward/backward phase's peak
    assert [at(Op.BACKWARD, "2bw", s) for s in range(4)] == [4, 3, 2, 1]  # its activations are live until it ends


@pytest.mark.parametrize("lam", [0.0, 1.0])
def test_error_feedback_scratch_is_what_its_apply_allocates(lam):
    """The plan's update-phase EF item against the live storages a StepTracer counts while ErrorFeedback.apply
    runs on CPU tensors (the largest parameter last, first and in the middle: the bound is the largest's)."""
    for sizes in ([300, 5000, 700], [5000, 300, 700], [300, 700, 5000]):
        params = [torch.randn(n) for n in sizes]
        ef = ErrorFeedback(params, lam)
        ef.prev_update = [torch.randn(n) for n in sizes]  # a step after the first: u_{t-1} is nonzero
        before = [p.clone() for p in params]
        for p in params:
            p.sub_(0.01)
        tracer = StepTracer("cpu", sweep_fraction=0.0)  # swept at every op: exact, not an upper bound
        held = tracer.start()
        with tracer:
            tracer.begin("U")
            ef.apply(before, [True] * len(params))
            tracer.end()
        assert tracer.actions[0].peak_bytes - held == error_feedback_scratch_bytes(params, lam), sizes


def test_error_feedback_off_holds_no_buffer_and_the_plan_agrees():
    """λ = 0: ErrorFeedback keeps no u_{t-1}, its apply leaves the parameters and allocates nothing, the checkpoint
    part has no "ef" key, and the simulator's report counts every tensor it keeps with an EF row of 0."""
    params = [torch.randn(7), torch.randn(3, 5)]
    ef = ErrorFeedback(params, 0.0)
    assert ef.prev_update == []
    after = [p.clone() for p in params]
    before = [p + 1 for p in params]
    ef.apply(before, [True, True])
    assert all(torch.equal(p, a) for p, a in zip(params, after)) and ef.prev_update == []
    assert error_feedback_scratch_bytes(params, 0.0) == 0 < error_feedback_scratch_bytes(params, 1.0)
    on = sim_config("bf16")
    cfg = dataclasses.replace(on, staleness=dataclasses.replace(on.staleness, ef_lambda=0.0))
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny_hybrid"))
    sim = build_simulator(cfg, model, build_from_config(model, cfg.optimizer))
    tokens = torch.randint(0, 8192, (2, 17))
    for t in range(2):
        sim.step(t, [tokens, tokens])
    assert "ef" not in sim.rule.state_dict()
    report = simulator_report(sim, activation_bytes_per_mb=0, title="")
    assert report.get("error feedback") == 0
    kept = list(sim.params) + [x for v in sim.history for x in v] + list(sim.masters) + \
        [v for o in sim.optimizer.optimizers.values() for s in o.state.values() for v in s.values()]
    assert sum(i.nbytes for i in report.items if i.how == ALLOCATED) == storage_bytes(kept)
