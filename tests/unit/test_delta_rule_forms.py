"""The batched delta-rule form (model_zoo/delta_rule.py) equals the token-by-token recurrence, forward and every
gradient, and the layer runs the form its kernel switch names (the CUDA default without a checked FLA kernel)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from model_zoo.backends.fla_check import FlaChecks, FlaDecision
from model_zoo.delta_rule import (
    affine_scan,
    batched_chunk_gated_delta_rule,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from model_zoo.gated_deltanet import GatedDeltaNet, delta_rule_form, form_name

B, H, DK, DV = 2, 3, 8, 16

pytestmark = pytest.mark.usefixtures("one_thread")  # many tiny ops: see tests/unit/test_gated_deltanet.py


def _inputs(t: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """q, k (unit norm, as the layer makes them), v, g <= 0, beta in (0, 1), and an initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, t, H, DK, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, t, H, DK, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, t, H, DV, generator=gen, dtype=dtype)
    g = -torch.rand(B, t, H, generator=gen, dtype=dtype) * 2.0
    beta = torch.rand(B, t, H, generator=gen, dtype=dtype).clamp(1e-3, 1 - 1e-3)
    s0 = torch.randn(B, H, DK, DV, generator=gen, dtype=dtype)
    return [q, k, v, g, beta, s0]


def _graph_names(t: torch.Tensor) -> set[str]:
    """The names of every autograd node `t` was made by."""
    seen, names, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(n for n, _ in node.next_functions)
    return names


def _outputs_and_grads(fn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """[o, final state, d q, d k, d v, d g, d beta, d s0] with random cotangents on both outputs."""
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    o, s = fn(*leaves[:5], initial_state=leaves[5])
    gen = torch.Generator().manual_seed(3)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (
        s * torch.randn(s.shape, generator=gen, dtype=s.dtype)).sum()
    return [o.detach(), s.detach(), *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("t,chunk_size", [(1, 64), (37, 16), (64, 16), (130, 64)])
def test_batched_form_equals_the_recurrence_forward_and_gradients(t: int, chunk_size: int) -> None:
    # fp64: both forms are exact algebra apart from rounding, ~1e-16 per op over at most a few hundred ops in
    # sequence, with the transitions contractions (unit keys, beta < 1, decays <= 1): 1e-10 leaves 1e4 of room
    # and is still far below any algebraic error (which would be O(1)).
    inputs = _inputs(t, torch.float64)
    truth = _outputs_and_grads(recurrent_gated_delta_rule, inputs)
    got = _outputs_and_grads(lambda *a, **kw: batched_chunk_gated_delta_rule(*a, chunk_size=chunk_size, **kw),
                             inputs)
    for name, g, r in zip(["o", "state", "q", "k", "v", "g", "beta", "s0"], got, truth):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9, 64, 65])
def test_affine_scan_equals_the_sequential_recurrence(n: int) -> None:
    """The two-level scan (groups of round(sqrt(N/2)) steps; N < 4 sequential; 9 and 65 pad the last group) at
    fp64 rounding: reassociated products of <= 2M + N/M maps, 1e-12."""
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, 3, 4, 4, generator=gen, dtype=torch.float64) * 0.5
    b = torch.randn(n, 3, 4, 5, generator=gen, dtype=torch.float64)
    s0 = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    expected = [s0]
    for i in range(n):
        expected.append(a[i] @ expected[-1] + b[i])
    torch.testing.assert_close(affine_scan(a, b, s0), torch.stack(expected), rtol=1e-12, atol=1e-12)


def test_batched_form_equals_the_chunk_loop_at_64_chunks() -> None:
    """64 chunks (hybrid_moe_10b's count at 4096 tokens: 11 groups of 6, the last padded) in fp64, forward
    and every gradient, against the chunk loop (itself equal to the recurrence above) at 1e-10."""
    inputs = _inputs(64 * 8, torch.float64, seed=5)
    loop = _outputs_and_grads(lambda *a, **kw: chunk_gated_delta_rule(*a, chunk_size=8, **kw), inputs)
    got = _outputs_and_grads(lambda *a, **kw: batched_chunk_gated_delta_rule(*a, chunk_size=8, **kw), inputs)
    for name, g, r in zip(["o", "state", "q", "k", "v", "g", "beta", "s0"], got, loop):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_batched_form_runs_its_chunk_recurrence() -> None:
    """The state recurrence is ChunkStates (one baddbmm per chunk each way), not autograd through a loop."""
    q, k, v, g, beta, s0 = (x.requires_grad_(True) for x in _inputs(100, torch.float32))
    o, s = batched_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, initial_state=s0)
    assert "ChunkStatesBackward" in _graph_names(o) and "ChunkStatesBackward" in _graph_names(s)
    o_loop, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, initial_state=s0)
    assert "ChunkStatesBackward" not in _graph_names(o_loop)


@pytest.mark.parametrize("t", [5, 130])
def test_batched_form_fp32_equals_the_recurrence(t: int) -> None:
    # fp32: eps 6e-8 over the same few hundred sequential ops, as tests/unit/test_gated_deltanet.py's 1e-5
    # for the loop form (the batched form adds one product, A_i = d_i I - K_i^T W_k, per chunk).
    inputs = _inputs(t, torch.float32, seed=4)
    o_ref, s_ref = recurrent_gated_delta_rule(*inputs[:5], initial_state=inputs[5])
    o, s = batched_chunk_gated_delta_rule(*inputs[:5], chunk_size=64, initial_state=inputs[5])
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def test_bf16_layer_batched_equals_the_chunk_loop_within_bf16s_own_error() -> None:
    """A bf16 layer with the batched form against the same layer with the loop form: the output, the input's
    gradient and every parameter's gradient within 3 e, e = the loop form's own distance from the same layer in
    fp64 (tests/gpu's bound: two bf16 implementations each ~e from the truth are <= 2e apart; 3e leaves room for
    the other's error being the larger). Both forms compute the delta rule in fp32, so they differ by fp32 rounding
    inside a bf16 layer: far inside the bound, and an algebra error would be O(1) outside it."""
    torch.manual_seed(0)
    loop = GatedDeltaNet(64, 4, 16, 32, chunk_size=16).to(torch.bfloat16)
    loop.reset_parameters(std=0.1)
    loop.kernel = "torch"
    batched, truth = copy.deepcopy(loop), copy.deepcopy(loop).double()
    batched.kernel = "batched"
    x = torch.randn(2, 50, 64)
    cotangent = torch.randn(2, 50, 64)
    results = []
    for layer in (loop, batched, truth):
        dtype = next(layer.parameters()).dtype
        xi = x.to(dtype).requires_grad_(True)
        out = layer(xi)
        assert ("ChunkStatesBackward" in _graph_names(out)) == (layer is batched)  # the form really ran
        grads = torch.autograd.grad(out, [xi, *layer.parameters()], cotangent.to(dtype))
        results.append([out, *grads])
    names = ["out", "x", *(n for n, _ in loop.named_parameters())]
    for name, a, b, tr in zip(names, *results):
        bound = 3 * _rel(a, tr)
        assert bound > 0, name  # bf16 is really lossy here: the bound is not a vacuous 0 < 0
        assert _rel(b, a) < bound, (name, _rel(b, a), bound)


def test_the_kernel_switch_picks_the_form() -> None:
    cuda, cpu, shape = torch.device("cuda", 0), torch.device("cpu"), (4096, 8, 128, 256)
    no_fla = FlaChecks(find_kernel=lambda: None, log=lambda m: None)
    assert delta_rule_form("auto", cpu, torch.bfloat16, shape, no_fla) is chunk_gated_delta_rule  # CPU unchanged
    assert delta_rule_form("auto", cuda, torch.bfloat16, shape, no_fla) is batched_chunk_gated_delta_rule
    assert delta_rule_form("auto", cuda, torch.float32, shape, no_fla) is batched_chunk_gated_delta_rule
    assert delta_rule_form("torch", cuda, torch.bfloat16, shape, no_fla) is chunk_gated_delta_rule
    assert delta_rule_form("batched", cpu, torch.float32, shape, no_fla) is batched_chunk_gated_delta_rule
    with pytest.raises(ValueError, match="GatedDeltaNet.kernel='fla'"):
        delta_rule_form("fla", cpu, torch.float32, shape, no_fla)


def test_a_layer_names_the_form_it_runs() -> None:
    """GatedDeltaNet.form_at is what a bench row records (bench/gpu.py) and the step-time model traces."""
    layer = GatedDeltaNet(64, 4, 16, 16)
    cpu = torch.device("cpu")
    assert layer.form_at(128, torch.float32, cpu) == "torch"  # the CPU default: the chunk loop
    layer.kernel = "batched"
    assert layer.form_at(128, torch.float32, cpu) == "batched"
    assert form_name(lambda *a, **k: None) == "fla"  # anything else is the fused kernel FLA handed out


def test_the_switch_uses_fla_only_where_it_passed_its_check() -> None:
    def passed(*args, **kwargs):
        raise AssertionError("not called: only returned")

    class Decided(FlaChecks):
        def _decide(self, t, h, dk, dv, dtype, device):
            return FlaDecision(dk == 128, "stand-in")

    checks = Decided(find_kernel=lambda: passed, log=lambda m: None)
    cuda = torch.device("cuda", 0)
    assert delta_rule_form("auto", cuda, torch.bfloat16, (4096, 8, 128, 256), checks) is passed
    assert delta_rule_form("auto", cuda, torch.bfloat16, (4096, 8, 64, 256), checks) is batched_chunk_gated_delta_rule
    assert delta_rule_form("auto", cuda, torch.float32, (4096, 8, 128, 256), checks) is batched_chunk_gated_delta_rule
    assert delta_rule_form("batched", cuda, torch.bfloat16, (4096, 8, 128, 256), checks) is \
        batched_chunk_gated_delta_rule


@pytest.mark.slow  # Inductor on the CPU: ~1 min alone, 10+ min on a loaded 2-core box
def test_compiled_batched_layer_equals_eager_in_one_graph() -> None:
    """A GDN layer with the batched form under torch.compile (what train.compile does per block on CUDA): one
    graph, no break (ChunkStates and its out= kernels trace), output and every gradient equal to eager within fp32
    rounding reordered by Inductor's fusions (rtol 1e-4, as test_backends' compiled tiny_dense)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    eager = GatedDeltaNet(64, 2, 16, 16, chunk_size=16)  # 100 tokens: 7 chunks, the two-level scan
    eager.kernel = "batched"
    compiled = copy.deepcopy(eager)
    compiled.compile()
    x = torch.randn(2, 100, 64)
    results = []
    for layer in (compiled, eager):
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        results.append([out, *torch.autograd.grad(out.square().sum(), [xi, *layer.parameters()])])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    for c, e in zip(*results):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5)
