"""MoE fast paths without process groups: the grouped expert computation against the loop reference,
aux-loss-free balancing hooks, per-layer load metrics, and parallelize_moe's shapes and errors on a
fake process group (the dry-run path)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from asyncpp.parallel.experts import ExpertDispatcher, parallelize_moe
from model_zoo import MoE, MoEConfig, build_model, get_model_config
from model_zoo.moe import LocalDispatcher, grouped_mm_available, grouped_swiglu, sort_assignments

D, E, K, F = 8, 5, 2, 12


def _moe(dtype: torch.dtype = torch.float32, seed: int = 0, **cfg) -> MoE:
    torch.manual_seed(seed)
    settings = {"num_experts": E, "top_k": K, "expert_ffn_hidden_size": F, "shared_expert_ffn_hidden_size": 6}
    moe = MoE(D, MoEConfig(**{**settings, **cfg}))
    moe.init_weights(0.5, 0.5)
    return moe.to(dtype)


def _skewed_routing(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """idx [n, K] where expert 0 is crowded, expert 3 gets no token and the rest a few; weights [n, K] fp32."""
    g = torch.Generator().manual_seed(1)
    second = torch.tensor([1, 2, 4])[torch.randint(0, 3, (n,), generator=g)]
    idx = torch.stack([torch.zeros(n, dtype=torch.long), second], dim=1)
    return torch.rand(n, K, generator=g), idx


def _grads(moe: MoE, fn, x: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    moe.zero_grad(set_to_none=True)
    out = fn(x, weight, idx)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype))
    grads = {n: moe.get_parameter(n).grad for n in ("w_gate", "w_up", "w_down")}
    return {"out": out.detach(), "x": x.grad, "weight": weight.grad, **grads}


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_grouped_experts_equal_the_loop_reference(dtype: torch.dtype, tol: float) -> None:
    moe = _moe(dtype)
    x = torch.randn(23, D, dtype=dtype, generator=torch.Generator().manual_seed(0))
    weight, idx = _skewed_routing(23)
    got = _grads(moe, moe.experts_grouped, x, weight, idx)
    want = _grads(moe, moe.experts_reference, x, weight, idx)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=name)
    # the zero-token expert's gradient is exactly zero (not None, not padding noise)
    assert got["w_gate"][3].abs().max() == 0 and got["w_down"][3].abs().max() == 0


def test_forward_runs_the_grouped_path_and_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    moe, ref = _moe(torch.float64), _moe(torch.float64)
    x = torch.randn(3, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref.experts_grouped = ref.experts_reference  # the same module with the loop swapped in
    monkeypatch.setattr(MoE, "experts_reference", lambda *a: pytest.fail("forward must not use the loop"))
    moe(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), q in zip(moe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_no_tokens_at_all() -> None:
    """An EP rank may receive no assignment: the grouped path returns [0, d] and zero expert grads."""
    moe = _moe()
    rows = torch.zeros(0, D, requires_grad=True)
    y = grouped_swiglu(rows, torch.zeros(E, dtype=torch.long), moe.w_gate, moe.w_up, moe.w_down)
    assert y.shape == (0, D)
    y.sum().backward()
    assert moe.w_gate.grad is not None and moe.w_gate.grad.abs().max() == 0


def _cpu_grouped_mm_works() -> bool:
    try:
        torch._grouped_mm(torch.ones(4, 4), torch.ones(1, 4, 4), offs=torch.tensor([4], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _cpu_grouped_mm_works(), reason="this torch has no CPU torch._grouped_mm")
def test_grouped_mm_kernel_layout_equals_bmm() -> None:
    """The aligned-offsets layout of the grouped_mm path, checked on torch's CPU kernel (fp32: 4-row groups)."""
    moe = _moe(seed=4)
    _, idx = _skewed_routing(19)
    x = torch.randn(19, D, generator=torch.Generator().manual_seed(5))
    _, token_of, counts = sort_assignments(idx, E)
    out = {}
    for kernel in ("bmm", "grouped_mm"):
        moe.zero_grad(set_to_none=True)
        rows = x.index_select(0, token_of).requires_grad_()
        y = grouped_swiglu(rows, counts, moe.w_gate, moe.w_up, moe.w_down, kernel)
        y.backward(torch.ones_like(y))
        out[kernel] = (y.detach(), rows.grad, moe.w_gate.grad.clone(), moe.w_down.grad.clone())
    for a, b in zip(out["bmm"], out["grouped_mm"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_mm_switch_falls_back_off_cuda() -> None:
    moe = _moe()
    assert not grouped_mm_available(torch.device("cpu"), torch.bfloat16)
    x = torch.randn(9, D)
    _, weight, idx = moe.route(x)
    plain = moe.experts_grouped(x, weight, idx)
    moe.use_grouped_mm = True
    torch.testing.assert_close(moe.experts_grouped(x, weight, idx), plain, rtol=0, atol=0)
    with pytest.raises(ValueError, match="kernel='loop'"):
        grouped_swiglu(x, torch.tensor([9, 0, 0, 0, 0]), moe.w_gate, moe.w_up, moe.w_down, "loop")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_mm_on_gpu_matches_reference() -> None:
    """bf16 grouped_mm (unaligned group sizes, a crowded and an empty expert) against the fp32 loop."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    moe = MoE(64, MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=128)).to(dev)
    moe.init_weights(0.05, 0.05)
    x = torch.randn(301, 64, device=dev)
    idx = torch.randint(1, 7, (301, 2), device=dev)
    idx[:, 0] = 0  # expert 0 crowded, expert 7 empty
    weight = torch.rand(301, 2, device=dev)
    upstream = torch.randn(301, 64, device=dev)

    def run(dtype: torch.dtype, fn_name: str) -> list[torch.Tensor]:
        moe.zero_grad(set_to_none=True)
        moe.to(dtype)
        xi = x.to(dtype).requires_grad_()
        out = getattr(moe, fn_name)(xi, weight, idx)
        out.backward(upstream.to(dtype))
        return [t.float() for t in (out, xi.grad, moe.w_gate.grad, moe.w_down.grad)]

    assert grouped_mm_available(dev, torch.bfloat16)
    moe.use_grouped_mm = True
    got, want = run(torch.bfloat16, "experts_grouped"), run(torch.float32, "experts_reference")
    for g, w in zip(got, want):
        assert ((g - w).norm() / w.norm()).item() < 2e-2


# ---- aux-loss-free balancing -------------------------------------------------------------------

def test_bias_changes_selection_not_the_weight_formula() -> None:
    moe = _moe(bias_update_rate=1e-3)
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(6))
    probs, _, idx0 = moe.route(x)
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0, 0.0]))  # forces expert 3 into every top-k
    probs_b, weight, idx = moe.route(x)
    torch.testing.assert_close(probs_b, probs)  # the router's probabilities ignore the bias
    assert (idx == 3).any(dim=1).all() and not (idx0 == 3).all()
    picked = probs.gather(-1, idx)
    torch.testing.assert_close(weight, picked / picked.sum(-1, keepdim=True))


def test_step_load_accumulates_in_training_and_pops() -> None:
    moe = _moe(bias_update_rate=1e-3)
    x1, x2 = torch.randn(2, 6, D), torch.randn(4, D)
    moe(x1)
    first = moe.last_expert_load.clone()
    moe(x2)
    second = moe.last_expert_load.clone()
    moe.eval()
    moe(x1)  # evaluation does not count
    load = moe.pop_step_load()
    assert load.dtype == torch.int64 and torch.equal(load, first + second) and load.sum() == (12 + 4) * K
    assert moe.pop_step_load().sum() == 0


def test_update_bias_follows_its_formula() -> None:
    moe = _moe(bias_update_rate=0.01)
    moe.expert_bias.copy_(torch.tensor([0.5, -0.2, 0.0, 0.1, 0.0]))
    load = torch.tensor([10, 2, 6, 6, 1])  # mean 5
    moe.update_bias(load)
    want = torch.tensor([0.5, -0.2, 0.0, 0.1, 0.0]) + 0.01 * torch.tensor([-1.0, 1.0, -1.0, -1.0, 1.0])
    torch.testing.assert_close(moe.expert_bias, want)
    moe.update_bias(torch.full((E,), 3))  # balanced: no change
    torch.testing.assert_close(moe.expert_bias, want)


def test_bias_is_state_fp32_and_absent_when_disabled() -> None:
    on, off = _moe(bias_update_rate=1e-3), _moe()
    assert "expert_bias" in on.state_dict() and "step_load" not in on.state_dict()
    assert "expert_bias" not in off.state_dict() and off.expert_bias is None
    on.to(torch.bfloat16)
    assert on.expert_bias.dtype == torch.float32 and on.w_gate.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="bias_update_rate"):
        off.pop_step_load()
    with pytest.raises(RuntimeError, match="bias_update_rate"):
        off.update_bias(torch.ones(E))


def test_built_model_starts_with_zero_bias() -> None:
    """build_model materialises with to_empty(), which leaves buffers uninitialised."""
    m = build_model(get_model_config("tiny_moe", moe={"bias_update_rate": 1e-3}))
    for moe in m.moe_layers():
        assert moe.expert_bias.abs().max() == 0 and moe.step_load.abs().max() == 0


def test_config_errors_name_field_and_fix() -> None:
    with pytest.raises(ValueError, match=r"model\.moe\.bias_update_rate=-0\.1.*use >= 0"):
        MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=8, bias_update_rate=-0.1).validate()
    with pytest.raises(ValueError, match=r"model\.moe\.top_k=5 must be in \[1, num_experts=4\]"):
        MoEConfig(num_experts=4, top_k=5, expert_ffn_hidden_size=8).validate()


# ---- per-layer load metrics --------------------------------------------------------------------

def test_moe_stats_per_layer() -> None:
    torch.manual_seed(0)
    m = build_model(get_model_config("tiny_moe", num_layers=3))
    with torch.no_grad():
        m(torch.randint(0, 100, (2, 16)))
    m.layers[1].mlp.last_expert_load = torch.tensor([32, 0, 0, 0, 0, 0, 0, 0])  # all on one expert
    stats = m.moe_stats(per_layer=True)
    assert set(m.moe_stats()) == {"moe/aux_loss", "moe/load_max", "moe/load_mean"}
    assert stats["moe/layer1/load_max_over_mean"] == pytest.approx(8.0)
    assert stats["moe/load_max"] == pytest.approx(8.0)
    for i in range(3):
        assert stats[f"moe/layer{i}/load_max_over_mean"] >= 1.0
        assert stats[f"moe/layer{i}/aux_loss"] == pytest.approx(m.layers[i].mlp.last_aux_loss.item())


# ---- parallelize_moe without real processes ----------------------------------------------------

def test_parallelize_on_meta_shapes_the_shards(fake_world) -> None:
    tp, ep = dist.new_group([2, 3]), dist.new_group([1, 3])
    moe = build_model(get_model_config("tiny_moe"), device="meta").layers[0].mlp
    plan = parallelize_moe(moe, tp, ep)
    assert moe.w_gate.shape == (4, 64, 128) and moe.w_down.shape == (4, 128, 64) and moe.w_gate.is_meta
    assert moe.shared_expert.gate_proj.weight.shape == (64, 128)
    assert moe.shared_expert.down_proj.weight.shape == (128, 64)
    assert plan["w_gate"].expert and plan["w_gate"].tp_dim == 1 and plan["w_down"].tp_dim == 2
    assert plan["shared_expert.down_proj.weight"].tp_dim == 1 and not plan["shared_expert.down_proj.weight"].expert
    assert "router.weight" not in plan and "shared_gate.weight" not in plan
    assert isinstance(moe.dispatcher, ExpertDispatcher)
    with pytest.raises(RuntimeError, match="already parallelized"):
        parallelize_moe(moe, tp, ep)


def test_parallelize_validation_names_field_value_and_fix(fake_world) -> None:
    three = dist.new_group([0, 1, 3])
    moe = _moe()  # E = 5, f = 12, shared 6
    with pytest.raises(ValueError, match=r"model\.moe\.num_experts=5 is not divisible by parallel\.ep=3.*\[1, 5\]"):
        parallelize_moe(moe, None, three)
    with pytest.raises(ValueError, match=r"model\.moe\.expert_ffn_hidden_size=10 is not divisible by parallel\.tp=3"):
        parallelize_moe(_moe(expert_ffn_hidden_size=10), three, None)
    with pytest.raises(ValueError, match=r"shared_expert_ffn_hidden_size=6 is not divisible by parallel\.tp=4"):
        parallelize_moe(_moe(expert_ffn_hidden_size=12), dist.group.WORLD, None)


def test_parallelize_without_groups_changes_nothing() -> None:
    moe = _moe()
    before = {n: p for n, p in moe.named_parameters()}
    assert parallelize_moe(moe, None, None) == {}
    assert isinstance(moe.dispatcher, LocalDispatcher)
    assert all(p is before[n] for n, p in moe.named_parameters())


# ---- the grouped_mm switch's decision (pure logic: runs on the CPU) ------------------------------

CUDA0 = torch.device("cuda", 0)


def test_grouped_mm_decision() -> None:
    from model_zoo.moe import grouped_mm_unsupported

    ok = grouped_mm_unsupported(CUDA0, torch.bfloat16, (1024, 256), capability=(9, 0))
    assert ok == "" and grouped_mm_unsupported(CUDA0, torch.bfloat16, (64, 128), capability=(8, 0)) == ""
    reasons = {
        "device is cpu": grouped_mm_unsupported(torch.device("cpu"), torch.bfloat16, (1024, 256), (9, 0)),
        "takes bfloat16 only": grouped_mm_unsupported(CUDA0, torch.float32, (1024, 256), (9, 0)),
        "compute capability 7.5": grouped_mm_unsupported(CUDA0, torch.bfloat16, (1024, 256), (7, 5)),
        "[100] are not": grouped_mm_unsupported(CUDA0, torch.bfloat16, (1024, 100), (9, 0)),
    }
    for expected, reason in reasons.items():
        assert expected in reason, reason


def test_moe_turns_grouped_mm_on_by_default_on_cuda_and_logs_a_fallback_once(monkeypatch, caplog) -> None:
    import model_zoo.moe as moe_module

    monkeypatch.setattr(moe_module, "cuda_capability", lambda device: (9, 0))
    moe_module._log_once.cache_clear()
    layers = [MoE(16, MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=32)) for _ in range(2)]
    assert all(m.use_grouped_mm for m in layers)  # on by default
    assert _moe().expert_kernel(CUDA0, torch.bfloat16) == "bmm"  # ffn 12: rows not 16-byte aligned
    assert layers[0].expert_kernel(CUDA0, torch.bfloat16) == "grouped_mm"
    assert layers[0].expert_kernel(torch.device("cpu"), torch.bfloat16) == "bmm"
    with caplog.at_level("WARNING", logger="model_zoo.moe"):
        kernels = [m.expert_kernel(CUDA0, torch.float32) for m in layers]  # fp32 on CUDA: falls back
    assert kernels == ["bmm", "bmm"]
    fallbacks = [r.getMessage() for r in caplog.records if "padded bmm" in r.getMessage()]
    assert "16-byte-aligned rows" in fallbacks[0]
    assert ["takes bfloat16 only" in m for m in fallbacks[1:]] == [True]  # once, not once per layer
    # Off CUDA nothing is logged: the padded bmm is the reference there, not a fallback.
    caplog.clear()
    with caplog.at_level("WARNING", logger="model_zoo.moe"):
        layers[1].expert_kernel(torch.device("cpu"), torch.float32)
    assert not caplog.records
    # The choice is made once per (device, dtype): later calls do not ask again.
    monkeypatch.setattr(moe_module, "grouped_mm_unsupported", lambda *a, **k: pytest.fail("decided twice"))
    assert layers[0].expert_kernel(CUDA0, torch.bfloat16) == "grouped_mm"


def test_moe_switch_routes_the_experts_to_the_decided_kernel(monkeypatch) -> None:
    import model_zoo.moe as moe_module

    moe = _moe()
    seen = []
    monkeypatch.setattr(moe_module, "grouped_swiglu", lambda *a: seen.append(a[-1]) or a[0])
    monkeypatch.setattr(moe, "expert_kernel", lambda device, dtype: "grouped_mm")  # as on a capable GPU
    x = torch.randn(9, D)
    _, weight, idx = moe.route(x)
    moe.experts_grouped(x, weight, idx)
    moe.use_grouped_mm = False  # the switch off: the decision is not even asked
    moe.experts_grouped(x, weight, idx)
    assert seen == ["grouped_mm", "bmm"]


def test_expert_counts_equal_bincount() -> None:
    from model_zoo.moe import expert_counts

    idx = torch.randint(0, 7, (50, 3), generator=torch.Generator().manual_seed(2))
    idx[idx == 5] = 4  # an expert with no assignment
    assert torch.equal(expert_counts(idx, 9), torch.bincount(idx.flatten(), minlength=9))
    assert expert_counts(idx, 9).dtype == torch.int64


def test_the_bmm_expert_kernel_compiles_and_matches_eager() -> None:
    """train.compile with the bmm kernel (the CPU's, and CUDA's without grouped_mm): the buffer's group starts
    were the cumsum of a tensor full of the busiest expert's count; from the second call on, torch.compile
    makes that count symbolic, and Inductor's rewrite of cumsum(full(v)) failed on a symbolic v
    (InductorError in every MoE block from the second step on)."""
    moe = _moe(seed=6)
    kernel = torch.compile(grouped_swiglu)
    for n in (17, 29, 41):  # different busiest experts: the count becomes symbolic after the first call
        _, idx = _skewed_routing(n)
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(n))
        _, token_of, counts = sort_assignments(idx, E)
        rows = x.index_select(0, token_of)
        got = kernel(rows, counts, moe.w_gate, moe.w_up, moe.w_down, "bmm")
        want = grouped_swiglu(rows, counts, moe.w_gate, moe.w_up, moe.w_down, "bmm")
        assert got.shape == (n * K, D)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
