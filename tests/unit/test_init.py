"""model_zoo/init.py: initialization is a pure function of (seed, name, global shape, slice held)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncpp.parallel.sharding import ParamSharding
from asyncpp.pipeline.build import ShardCoords, build_stage, build_whole_model, param_slice
from asyncpp.pipeline.stage import StageSpec
from model_zoo import build_model, get_model_config
from model_zoo import init as init_mod
from model_zoo.init import KeyedInit, ParamSlice, draw_slice
from tests.dist.workers import make_config


def _normal(t, g):
    t.normal_(0.0, 1.0, generator=g)


@pytest.mark.parametrize("shape, offsets, local", [
    ((10, 6), (0, 3), (10, 3)),            # a column (dim 1) shard
    ((10, 6), (5, 0), (5, 6)),             # a row (dim 0) shard
    ((4, 6, 8), (2, 0, 4), (2, 6, 4)),     # an expert slice of a TP shard
])
def test_a_slice_draws_the_values_of_the_whole_tensor_there(shape, offsets, local, monkeypatch):
    monkeypatch.setattr(init_mod, "BLOCK_ELEMENTS", 12)  # several row blocks, boundaries inside the slices
    whole = draw_slice(7, ParamSlice.whole("w", shape), shape, _normal)
    piece = draw_slice(7, ParamSlice("w", shape, offsets), local, _normal)
    expect = whole
    for dim, (o, n) in enumerate(zip(offsets, local)):
        expect = expect.narrow(dim, o, n)
    assert torch.equal(piece, expect)


def test_values_depend_on_seed_and_name():
    shape = (8, 8)
    a = draw_slice(1, ParamSlice.whole("a", shape), shape, _normal)
    assert not torch.equal(a, draw_slice(2, ParamSlice.whole("a", shape), shape, _normal))
    assert not torch.equal(a, draw_slice(1, ParamSlice.whole("b", shape), shape, _normal))
    assert torch.equal(a, draw_slice(1, ParamSlice.whole("a", shape), shape, _normal))


def test_param_slice_from_layouts():
    at = ShardCoords(tp_rank=1, tp=2, ep_rank=1, ep=2)
    w = param_slice("w_gate", torch.Size([4, 64, 128]), ParamSharding(tp_dim=1, expert=True), at)
    assert w.global_shape == (8, 128, 128) and w.offsets == (4, 64, 0)
    r = param_slice("norm.weight", torch.Size([128]), ParamSharding(), at)
    assert r.global_shape == (128,) and r.offsets == (0,)


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_hybrid"])
def test_a_stage_holds_the_whole_models_weights(model):
    """Built alone (meta, pruned, materialized), each stage equals the whole model's part of it."""
    cfg = get_model_config(model)
    full = build_model(cfg, seed=5).state_dict()
    for s in range(2):
        stage = build_stage(cfg, StageSpec(s, 2, cfg.num_layers), "cpu", seed=5).model
        for name, t in stage.state_dict().items():
            ref = "embed.weight" if name == "lm_head.weight" and cfg.tie_embeddings else name
            assert torch.equal(t, full[ref]), name


def test_the_seed_changes_every_weight_and_build_model_defaults_to_torch_seed():
    cfg = get_model_config("tiny_hybrid")
    a, b = build_model(cfg, seed=1).state_dict(), build_model(cfg, seed=2).state_dict()
    for name in a:
        if not name.endswith("norm.weight"):  # norms start at ones
            assert not torch.equal(a[name], b[name]), name
    torch.manual_seed(1)
    assert all(torch.equal(t, a[n]) for n, t in build_model(cfg).state_dict().items())


def test_tied_embedding_is_initialized_once():
    model = build_model(get_model_config("tiny_dense"), seed=3)
    assert model.lm_head.weight is model.embed.weight


def test_a_parameter_initialized_around_the_initializer_is_refused():
    model = build_model(get_model_config("tiny_dense"), device="meta")
    model.to_empty(device="cpu")
    model.tie_weights()
    init = KeyedInit.for_model(model, 0)
    model.init_weights(init)
    model.layers[0].extra = nn.Linear(2, 2)  # a module whose init_weights would call torch.nn.init
    with pytest.raises(RuntimeError, match=r"layers\.0\.extra\.weight"):
        init.check_complete(model.named_parameters())


def test_the_single_process_model_is_the_stage_builders_whole_model():
    """job.run's model (build.build_whole_model, one stage of one) is build_model's, weight for weight, and each
    layer recomputes as its simulated stage says (train.recompute per stage of parallel.pp, the run's split)."""
    cfg = make_config(model={"name": "tiny_hybrid"}, parallel={"pp": 2, "stage_layers": [3, 1]},
                      train={"recompute": ["selective", "full"]})
    model_cfg = get_model_config("tiny_hybrid")
    built = build_whole_model(cfg, model_cfg, "cpu")
    assert built.spec.is_first and built.spec.is_last and list(built.spec.layers) == list(range(model_cfg.num_layers))
    full = build_model(model_cfg, seed=cfg.seed).state_dict()
    assert sorted(built.model.state_dict()) == sorted(full)
    for name, t in built.model.state_dict().items():
        assert torch.equal(t, full[name]), name
    wrapped = [(getattr(layer, "_asyncpp_recompute", False), getattr(layer.mixer, "_asyncpp_recompute", False))
               for layer in built.model.layers]
    assert wrapped == [(False, True)] * 3 + [(True, False)]
