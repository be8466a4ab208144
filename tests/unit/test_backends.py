"""model_zoo.backends on the CPU: refusals, fallbacks and their messages; the swap machinery (names kept,
weights adopted, same function) with a stand-in for transformer_engine.pytorch; torch.compile.

The comparison with the real transformer-engine, megatron-core and FLA kernels is tests/gpu/."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncpp.config import ConfigError, RunConfig
from model_zoo import build_model, get_model_config
from model_zoo.backends import BackendError, apply_backend, compile_blocks, prepare_model, probe_backend
from model_zoo.backends.kernels import APEX_HINT, apex_fused_rms_norm, fla_status, try_import
from model_zoo.backends.mcore import McoreSwiGLU, swap_to_mcore
from model_zoo.backends.te import TEAttention, swap_to_te


def tiny(name: str = "tiny_hybrid", **overrides) -> nn.Module:
    torch.manual_seed(0)
    return build_model(get_model_config(name, **overrides))


def test_gpu_backends_are_refused_on_the_cpu_by_config_and_by_apply():
    for backend in ("te", "mcore"):
        with pytest.raises(ConfigError, match=f"train.backend={backend} runs only on CUDA.*train.device=cpu"):
            RunConfig.from_dict({"train": {"backend": backend}}).validate(get_model_config("tiny_dense"))
        with pytest.raises(BackendError, match="train.backend=local on the CPU"):
            apply_backend(tiny("tiny_dense"), backend, "cpu")
        assert not probe_backend(backend, "cpu").available
    RunConfig.from_dict({"train": {"backend": "te", "device": "cuda"}}).validate(get_model_config("tiny_dense"))
    with pytest.raises(ConfigError, match="backend"):
        RunConfig.from_dict({"train": {"backend": "tensorrt"}})


def test_a_missing_package_falls_back_to_local_with_the_install_hint(monkeypatch):
    if try_import("transformer_engine.pytorch")[0] is not None:
        pytest.skip("transformer_engine is installed here; the fallback needs it absent")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine without TE
    model = tiny("tiny_dense")
    names = [n for n, _ in model.named_parameters()]
    messages: list[str] = []
    assert apply_backend(model, "te", "cuda", log=messages.append) == "local"
    (message,) = messages
    assert "transformer_engine" in message and "pip install -e .[gpu]" in message and "train.backend=local" in message
    assert [n for n, _ in model.named_parameters()] == names
    assert not any(isinstance(m, TEAttention) for m in model.modules())


def test_no_cuda_at_run_time_falls_back_with_a_message(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    messages: list[str] = []
    assert apply_backend(tiny("tiny_dense"), "mcore", "cuda", log=messages.append) == "local"
    assert "torch.cuda.is_available() is False" in messages[0]


class StandInTE:
    """transformer_engine.pytorch's constructor signatures and semantics, in PyTorch (CPU)."""

    class Linear(nn.Linear):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)
            self.from_te = True

    class RMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-5, params_dtype=None, device=None):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))

        def forward(self, x):
            return (F.rms_norm(x.float(), self.weight.shape, eps=self.eps) * self.weight.float()).type_as(x)

    class DotProductAttention(nn.Module):
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                     qkv_format="sbhd", attn_mask_type="padding"):
            super().__init__()
            assert qkv_format == "bshd" and attn_mask_type == "causal" and attention_dropout == 0.0
            self.heads, self.groups = num_attention_heads, num_gqa_groups

        def forward(self, q, k, v):  # [B, T, H, D] -> [B, T, H * D]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=self.groups != self.heads)
            return out.transpose(1, 2).flatten(2)


@pytest.mark.parametrize("name, overrides", [("tiny_hybrid", {}), ("tiny_dense", {"tie_embeddings": False})])
def test_te_swap_keeps_names_adopts_weights_and_computes_the_same(name, overrides):
    local = tiny(name, **overrides)
    swapped = tiny(name, **overrides)
    counts = swap_to_te(swapped, StandInTE)
    assert counts["attention"] == sum(t == "attn" for t in local.config.layer_types)
    assert counts["rmsnorm"] == 2 * local.config.num_layers + 1
    assert counts["linear"] > 0
    local_state, swapped_state = local.state_dict(), swapped.state_dict()
    assert list(local_state) == list(swapped_state)  # checkpoints, Muon's split and TP plans see the same names
    for key, value in local_state.items():
        assert torch.equal(swapped_state[key], value), key
    tokens = torch.randint(0, local.config.vocab_size, (2, 24))
    torch.testing.assert_close(swapped(tokens), local(tokens), rtol=1e-5, atol=1e-5)
    head_is_te = getattr(swapped.lm_head, "from_te", False)
    assert head_is_te == (not local.config.tie_embeddings)  # a tied head stays the embedding's Parameter
    if local.config.tie_embeddings:
        assert swapped.lm_head.weight is swapped.embed.weight


def test_mcore_swap_uses_the_same_parameters():
    model = tiny("tiny_hybrid")
    before = {n: p for n, p in model.named_parameters()}
    calls = []

    def fused(y, bias):  # megatron-core's bias_swiglu_impl(input, bias) semantics
        calls.append(y.shape)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up

    x = torch.randint(0, 8192, (2, 16))
    expected = model(x)
    counts = swap_to_mcore(model, swiglu=fused, rms_norm=None, log=lambda m: None)
    assert counts["fused swiglu"] == 4  # tiny_hybrid: one shared expert per layer
    assert {n: p for n, p in model.named_parameters()} == before  # the very same Parameter objects
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert calls and all(isinstance(m.mlp.shared_expert, McoreSwiGLU) for m in model.layers)


def test_mcore_swap_says_what_it_cannot_use():
    messages: list[str] = []
    swap_to_mcore(tiny("tiny_dense"), log=messages.append, swiglu=lambda y, b: y, rms_norm=None)
    if apex_fused_rms_norm() is None:
        assert any("apex" in m and "never `pip install apex`" in m for m in messages)
    assert "github.com/NVIDIA/apex" in APEX_HINT


@pytest.mark.slow
def test_mcore_fused_swiglu_matches_local_on_cpu():
    """megatron-core's real fused SwiGLU (torch.compile'd: ~30 s to compile on a CPU, hence slow)."""
    from model_zoo.backends.mcore import fused_swiglu

    fused = fused_swiglu()
    assert fused is not None
    local, swapped = tiny("tiny_dense"), tiny("tiny_dense")
    swap_to_mcore(swapped, swiglu=fused, rms_norm=None, log=lambda m: None)
    x = torch.randint(0, 8192, (2, 16))
    torch.testing.assert_close(swapped(x), local(x), rtol=1e-5, atol=1e-5)


def test_gated_deltanet_stays_on_pytorch_off_cuda(monkeypatch):
    import model_zoo.gated_deltanet as gdn

    used = []
    monkeypatch.setattr(gdn.FLA_CHECKS, "find_kernel", lambda: used.append(1) or None)
    layer = gdn.GatedDeltaNet(32, 2, 8, 8, chunk_size=8).to(torch.bfloat16)
    layer(torch.randn(1, 16, 32, dtype=torch.bfloat16))
    assert used == []  # not even looked up for CPU tensors
    assert layer.kernel == "auto"
    if "unavailable" in fla_status():
        assert "pip install -e .[gpu]" in fla_status()


def test_fla_kernel_is_only_imported_here(monkeypatch):
    """Importing is all kernels.py does: whether the kernel is correct is decided per shape where a layer would use
    it (model_zoo/backends/fla_check.py; tests/unit/test_fla_check.py), not by one probe that refused FLA 0.6 with
    Triton < 3.7.1 on Hopper at Dk=64 whatever the model's Dk."""
    import types

    from model_zoo.backends import kernels

    def kernel(*args, **kwargs):
        raise AssertionError("not run at import")

    monkeypatch.setattr(kernels, "try_import", lambda module: (types.SimpleNamespace(chunk_gated_delta_rule=kernel), ""))
    kernels._fla.cache_clear()
    try:
        assert kernels.fla_chunk_gated_delta_rule() is kernel
        assert "importable" in kernels.fla_status()
        monkeypatch.setattr(kernels, "try_import", lambda module: (None, "ModuleNotFoundError: No module named 'fla'"))
        kernels._fla.cache_clear()
        assert kernels.fla_chunk_gated_delta_rule() is None
        assert "No module named 'fla'" in kernels.fla_status() and "pip install -e .[gpu]" in kernels.fla_status()
    finally:
        kernels._fla.cache_clear()


def test_local_backend_changes_nothing():
    model = tiny("tiny_dense")
    modules = [type(m) for m in model.modules()]
    assert prepare_model(model, backend="local", compile=False, device="cpu", log=pytest.fail) == "local"
    assert [type(m) for m in model.modules()] == modules


def test_compile_blocks_runs_on_cpu_with_the_same_results_and_names():
    """train.compile on tiny_dense (CPU inductor): equal to eager, the parameter names kept, gradients reach every
    block. Its cost (~25 s here, mostly inductor's first compile) is why it is the only compile test in the default tier."""
    eager, compiled = tiny("tiny_dense"), tiny("tiny_dense")
    names = [n for n, _ in compiled.named_parameters()]
    assert compile_blocks(compiled) == 4
    tokens = torch.randint(0, 8192, (2, 32))
    out = compiled(tokens)
    out.float().logsumexp(-1).mean().backward()
    assert [n for n, _ in compiled.named_parameters()] == names  # nn.Module.compile keeps names
    torch.testing.assert_close(out, eager(tokens), rtol=1e-4, atol=1e-4)
    assert all(p.grad is not None for p in compiled.layers.parameters())


@pytest.mark.slow  # ~20 s of Inductor on CI's 2 cores; the bmm kernel's compile stays default (test_moe.py)
def test_compiled_moe_blocks_match_eager_in_bf16_with_the_same_routing():
    """train.compile on an MoE model in bf16 (the bmm expert kernel under Inductor; tests/gpu runs the same
    comparison on CUDA): forward, loss and every gradient within bf16 tolerance once the expert choice is
    pinned (tests/routing.py). Unpinned, 1-4 of 256 tokens per MoE call flip here and 14 of 58 gradients
    differ by 5-15%: the routing's discontinuity, which is what the pinning takes out of the comparison."""
    from asyncpp.core.loss import lm_loss
    from tests.routing import same_routing

    eager = tiny("tiny_moe").to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == 4
    tokens = torch.randint(0, 8192, (2, 129), generator=torch.Generator().manual_seed(1))
    grads, losses = [], []
    with same_routing(eager, compiled) as flipped:
        for model in (eager, compiled):
            loss = lm_loss(model, tokens)
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    assert len(flipped) == 4  # each of the compiled model's four MoE calls took the eager model's choice
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    assert grads[1].keys() == grads[0].keys()
    for name, g in grads[0].items():
        assert (grads[1][name] - g).norm() <= 5e-2 * g.norm(), name


def test_compile_skips_layers_of_other_stages():
    model = tiny("tiny_dense")
    model.layers[0] = nn.Identity()
    assert compile_blocks(model) == 3


@pytest.mark.parametrize("name", ["smollm2_135m", "tiny_hybrid", "hybrid_moe_10b"])
def test_bench_flop_count_uses_the_active_matmul_parameters(name):
    """The FLOP count's N (6N rule; model_zoo/counting.py, used by bench/gpu.py and the training log) against
    the independent parameter count: the active parameters without 1-D ones (norms, gates' scalars) and
    without an untied embedding (a lookup, not a matmul)."""
    from model_zoo import count_parameters, flops_per_token
    from model_zoo.counting import matmul_params_per_token

    cfg = get_model_config(name)
    skeleton = build_model(cfg, device="meta")
    one_d = sum(p.numel() for p in skeleton.parameters() if p.ndim == 1)
    embed = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    n = matmul_params_per_token(cfg, range(cfg.num_layers), head=True)
    assert n == count_parameters(cfg).active - one_d - embed
    attn = sum(t == "attn" for t in cfg.layer_types)
    assert flops_per_token(cfg, 4096) >= 6 * n + attn * 6 * 4096 * cfg.num_heads * cfg.head_dim


def test_bench_gpu_smoke_runs_on_cpu_and_refuses_without_smoke(tmp_path, monkeypatch):
    from bench import gpu

    result = gpu.main(["--smoke", "--out", str(tmp_path / "gpu.json")])
    local = [r for r in result["stages"] if r["backend"] == "local"]
    assert len(local) == 2 and all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in local)
    if not torch.cuda.is_available():
        assert all("CUDA" in r["skipped"] for r in result["stages"] if r["backend"] != "local")
    assert {r["optimizer"] for r in result["muon"]} == {"asyncpp", "torch.optim.Muon"}
    assert (tmp_path / "gpu.json").is_file()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device.*--smoke"):
        gpu.main(["--out", str(tmp_path / "x.json")])
