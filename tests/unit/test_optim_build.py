"""The Muon/AdamW split and OptimizerSet on a small hand-made model."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from asyncpp.optim import Muon, OptimizerSet, build_optimizer, split_params

V, D, E, H = 32, 16, 4, 24


class RMSNormLike(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MoE(nn.Module):
    """Stacked SwiGLU experts as w_gate/w_up/w_down [E, ., .] (dense mixing keeps the test simple)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w_gate = nn.Parameter(torch.randn(E, D, H) * 0.1)
        self.w_up = nn.Parameter(torch.randn(E, D, H) * 0.1)
        self.w_down = nn.Parameter(torch.randn(E, H, D) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)  # [B, T, E]
        h = torch.einsum("btd,edh->bteh", x, self.w_gate).sigmoid() * torch.einsum(
            "btd,edh->bteh", x, self.w_up
        )
        return torch.einsum("bteh,ehd,bte->btd", h, self.w_down, probs)


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, D, D) * 0.1)
        self.bias = nn.Parameter(torch.zeros(E, D))  # stacked per-expert bias: vectors, not a matrix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("btd,edf->btf", x, self.w1) + self.bias.sum(0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNormLike(D)
        self.proj = nn.Linear(D, D, bias=True)
        self.conv = nn.Conv1d(D, D, kernel_size=3, groups=D, padding=2)  # depthwise: weight [D, 1, 3]
        self.moe = MoE()
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(x))
        h = h + self.conv(h.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return x + self.moe(h) + self.experts(h)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.final_norm = RMSNormLike(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.final_norm(x))


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (2, 6), generator=g)
    logits = model(tokens)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))


def _train(model: nn.Module, opt: OptimizerSet, seeds: range) -> None:
    for s in seeds:
        opt.zero_grad()
        _loss(model, s).backward()
        opt.step()


def test_split_rule() -> None:
    torch.manual_seed(0)
    model = Tiny()
    muon, adamw = split_params(model)
    muon_names = {n for n, _ in muon}
    adamw_names = {n for n, _ in adamw}
    per_layer_muon = {
        "proj.weight",
        "moe.router.weight",
        "moe.w_gate",
        "moe.w_up",
        "moe.w_down",
        "experts.w1",
    }
    assert muon_names == {f"layers.{i}.{n}" for i in range(2) for n in per_layer_muon}
    per_layer_adamw = {"norm.weight", "proj.bias", "conv.weight", "conv.bias", "experts.bias"}
    assert adamw_names == {"embed.weight", "final_norm.weight"} | {
        f"layers.{i}.{n}" for i in range(2) for n in per_layer_adamw
    }
    # The tied head is the embedding Parameter: listed once, and every parameter is somewhere.
    ids = [id(p) for _, p in muon + adamw]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))


def test_w_gate_outside_moe_is_not_an_expert_stack() -> None:
    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_gate = nn.Parameter(torch.zeros(3, 4, 5))

    muon, adamw = split_params(nn.ModuleDict({"mixer": Mixer()}))
    assert not muon and [n for n, _ in adamw] == ["mixer.w_gate"]


def test_build_muon_groups_and_adamw_weight_decay() -> None:
    model = Tiny()
    opt = build_optimizer(model, name="muon", lr=0.02, weight_decay=0.1, adamw_lr=3e-3)
    assert set(opt.optimizers) == {"muon", "adamw"} and isinstance(opt.optimizers["muon"], Muon)
    assert opt.optimizers["muon"].defaults["adjust_lr"] == "match_rms_adamw"
    for group in opt.optimizers["adamw"].param_groups:
        assert group["lr"] == 3e-3
        assert all(p.ndim >= 2 for p in group["params"]) == (group["weight_decay"] == 0.1)
        # CPU has a fused AdamW kernel in this torch; the choice comes from the params' device type.
        assert group["fused"] is True
    assert len(opt.params()) == len(list(model.parameters()))


def test_build_adamw_only_and_foreach_fallback() -> None:
    opt = build_optimizer(Tiny(), name="adamw", lr=1e-3, weight_decay=0.1, adamw_lr=5.0)
    assert set(opt.optimizers) == {"adamw"}
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)
    meta = build_optimizer(Tiny().to("meta"), name="adamw", lr=1e-3, weight_decay=0.1)
    assert all(g["foreach"] and not g["fused"] for g in meta.param_groups)


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"optimizer\.name='sgd'.*adamw.*muon"):
        build_optimizer(Tiny(), name="sgd", lr=1e-3, weight_decay=0.0)


def test_step_updates_both_and_lr_multiplier() -> None:
    torch.manual_seed(0)
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, name="muon", lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
    _train(model, opt, range(1))
    for name in ("layers.0.proj.weight", "layers.1.moe.w_down", "embed.weight", "final_norm.weight"):
        assert not torch.equal(before[name], dict(model.named_parameters())[name]), name
    opt.set_lr_multiplier(0.5)
    for group in opt.param_groups:
        assert group["lr"] == group["base_lr"] * 0.5
    assert {g["base_lr"] for g in opt.param_groups} == {0.02, 1e-3}
    opt.set_lr_multiplier(0.0)
    frozen = [p.detach().clone() for p in opt.params()]
    _train(model, opt, range(1, 2))
    muon_ids = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    for p, old in zip(opt.params(), frozen):
        if id(p) not in muon_ids:  # AdamW with lr 0 leaves weights unchanged (decay is lr-scaled too)
            assert torch.equal(p, old)
    with pytest.raises(ValueError, match="multiplier"):
        opt.set_lr_multiplier(-1.0)


def test_state_dict_round_trip_continues_identically() -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, name="muon", lr=0.02, weight_decay=0.1)
    _train(model, opt, range(3))
    opt.set_lr_multiplier(0.7)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    _train(model, opt, range(3, 6))

    resumed = Tiny()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    opt2 = build_optimizer(resumed, name="muon", lr=0.02, weight_decay=0.1)
    opt2.load_state_dict(ckpt["optim"])
    assert [g["lr"] for g in opt2.param_groups] == [g["base_lr"] * 0.7 for g in opt2.param_groups]
    _train(resumed, opt2, range(3, 6))
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n

    with pytest.raises(ValueError, match="optimizer.name"):
        opt2.load_state_dict({"adamw": copy.deepcopy(ckpt["optim"]["adamw"])})
