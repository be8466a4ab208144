"""FLA's kernel checked per shape against the PyTorch form (model_zoo/backends/fla_check.py), on the CPU with
stand-in kernels: a correct one is used, one with a wrong key gradient and one that raises are refused, each with
its reason, and a shape is checked once per process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from model_zoo.backends.fla_check import FlaChecks, check_kernel
from model_zoo.delta_rule import chunk_gated_delta_rule

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = (130, 2, 32, 64)  # T (not a multiple of 64: FLA pads too), H, Dk, Dv
CPU = torch.device("cpu")


def correct(q, k, v, g, beta, output_final_state=False):
    """FLA's contract in PyTorch: bf16 q, k, v in, bf16 o out (the chunk-loop form: not the check's reference)."""
    return chunk_gated_delta_rule(q, k, v, g, beta)[0], None


class WrongKeyGradient(torch.autograd.Function):
    """o as `correct`, but the key gradient's second half of the features wrong, as #640's 64-wide K tiles."""

    @staticmethod
    def forward(ctx, k):  # type: ignore[override]
        return k.view_as(k)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        wrong = grad.clone()
        wrong[..., wrong.shape[-1] // 2:] *= -1
        return wrong


def wrong_dk(q, k, v, g, beta, output_final_state=False):
    return correct(q, WrongKeyGradient.apply(k), v, g, beta)


def raises(*args, **kwargs):
    raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_correct_kernel_is_used(dtype):
    decision = check_kernel(correct, *SHAPE, dtype, CPU)
    assert decision.use, decision.reason
    assert "within" in decision.reason and "of its bound" in decision.reason


def test_a_wrong_key_gradient_is_refused_with_its_reason():
    decision = check_kernel(wrong_dk, *SHAPE, torch.bfloat16, CPU)
    assert not decision.use
    assert decision.reason.startswith("dk is ") and "above its bound" in decision.reason


def test_a_kernel_that_raises_is_refused_with_its_reason():
    decision = check_kernel(raises, *SHAPE, torch.bfloat16, CPU)
    assert not decision.use
    assert "RuntimeError: Triton >= 3.4.0" in decision.reason


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_check_runs_its_backward_whatever_the_callers_autograd_mode(mode):
    """The first GDN forward may be an evaluation's (no_grad) or a test's (inference mode): the check's backward
    must run there too (seen on the H200: a kernel reported broken for that reason)."""
    with mode():
        assert check_kernel(correct, *SHAPE, torch.bfloat16, CPU).use


def test_each_shape_is_checked_once_logged_and_kept():
    calls, logged = [], []

    def counting(*args, **kwargs):
        calls.append(1)
        return correct(*args, **kwargs)

    checks = FlaChecks(find_kernel=lambda: counting, log=logged.append)
    for _ in range(3):
        assert checks.kernel_for(*SHAPE, torch.bfloat16, CPU) is counting
    assert len(calls) == 1 and len(logged) == 1
    assert "uses flash-linear-attention's kernel at T=130 H=2 Dk=32 Dv=64" in logged[0]
    refusing = FlaChecks(find_kernel=lambda: raises, log=logged.append)
    assert refusing.kernel_for(*SHAPE, torch.bfloat16, CPU) is None
    assert "does not use" in logged[-1] and "RuntimeError" in logged[-1]
    assert next(iter(refusing.decisions.values())).reason.startswith("it raised RuntimeError")


def test_no_kernel_or_no_device_is_refused_without_running_anything(monkeypatch):
    missing = FlaChecks(find_kernel=lambda: None, log=lambda m: None)
    decision = missing.decide(*SHAPE, torch.bfloat16, CPU)
    assert not decision.use and "flash-linear-attention" in decision.reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    traced = FlaChecks(find_kernel=lambda: raises, log=lambda m: None)  # raises if it were run
    decision = traced.decide(*SHAPE, torch.bfloat16, torch.device("cuda", 0))
    assert not decision.use and decision.reason == "no CUDA device to check it on"


def test_a_shape_first_met_inside_a_compiled_graph_is_checked_once_outside_it():
    """`decide` keeps Python state and runs real kernels, so torch.compile must leave it out of the graph: the first
    call of a shape inside a compiled function runs the check eagerly (the kernel looked up and the decision logged
    once), the second call reads the decision. (The disable is applied at the first call, not at import, so that
    importing the model imports no torch._dynamo: the next test.)"""
    looked_up, logged = [], []
    checks = FlaChecks(find_kernel=lambda: looked_up.append(1), log=logged.append)

    @torch.compile(backend="eager")
    def layer(x):
        kernel = checks.kernel_for(*SHAPE, torch.bfloat16, CPU)
        return x * 2 if kernel is None else x

    for _ in range(2):
        torch.testing.assert_close(layer(torch.ones(3)), torch.full((3,), 2.0))
    assert len(looked_up) == 1 and len(logged) == 1 and len(checks.decisions) == 1


def test_the_entry_imports_no_compiler():
    """`python pretrain.py <a typo>` answers in ~5 s here, not ~9.5: importing torch._dynamo (what a decorator
    `torch.compiler.disable` at import costs) is ~3 s of every process's start, every rank's and every refusal's."""
    probe = "import sys, asyncpp.job, model_zoo, data; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
