"""checkpoint.init_from: continued pretraining from Hugging Face weights (issue 47).

The path a user takes: an HF directory (here one that tools.hf export wrote from a seeded model), `python -m
tools.hf import <dir> --out <file>.pt`, then `checkpoint.init_from=<file>.pt`. The run's model is then the
file's weights bit for bit (fp32 in and out), not its seed's; a training step moves them. A directory, a missing
file and another model's weights are refused naming the option, the value and the fix. Every layout loads the same
weights: tests/dist/test_layout_independent_init.py (pp=2 x tp=2, equal to the simulator)."""

from __future__ import annotations

import pytest
import torch

from asyncpp.config import ConfigError
from asyncpp.pipeline.build import build_whole_model
from asyncpp.train.preflight import check_init_from
from model_zoo import build_model, get_model_config
from tests.dist.workers import make_config, reference_run
from tools import hf


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the seeded source model's state dict, the .pt that tools.hf import wrote from its HF export)."""
    tmp = tmp_path_factory.mktemp("init_from")
    model_cfg = get_model_config("tiny_dense")
    source = build_model(model_cfg, seed=99).state_dict()
    hf.export_state_dict(source, model_cfg, tmp / "hf")
    assert hf.main(["import", str(tmp / "hf"), "--out", str(tmp / "model.pt")]) == 0
    return source, tmp / "model.pt"


def test_a_run_starts_from_the_imported_weights_and_a_step_moves_them(imported):
    source, path = imported
    cfg = make_config(train={"steps": 1}, checkpoint={"enabled": False, "init_from": str(path)}, seed=1234)
    model_cfg = get_model_config("tiny_dense")
    check_init_from(cfg, model_cfg)  # the preflight accepts the file
    built = build_whole_model(cfg, model_cfg, "cpu").model.state_dict()
    seeded = build_model(model_cfg, seed=cfg.seed).state_dict()
    for name, tensor in built.items():
        assert torch.equal(tensor, source[name]), name
    assert not torch.equal(built["layers.0.mixer.q_proj.weight"], seeded["layers.0.mixer.q_proj.weight"])
    trained = reference_run(cfg)["params"]  # one step of the simulator from the same file
    moved = [n for n in trained if not torch.equal(trained[n], source[n])]
    assert "layers.0.mixer.q_proj.weight" in moved


def test_what_init_from_cannot_load_is_refused_with_the_fix(imported, tmp_path):
    _, path = imported
    with pytest.raises(ConfigError, match=r"checkpoint.init_from=.* is a directory.*tools.hf import"):
        make_config(checkpoint={"init_from": str(path.parent / "hf")}).validate(get_model_config("tiny_dense"))
    with pytest.raises(ConfigError, match=r"checkpoint.init_from=.*no such file"):
        make_config(checkpoint={"init_from": str(tmp_path / "none.pt")}).validate(get_model_config("tiny_dense"))
    other = get_model_config("tiny_moe")
    cfg = make_config(model={"name": "tiny_moe"}, checkpoint={"init_from": str(path)})
    with pytest.raises(ConfigError, match=r"differs from model=tiny_moe in .*moe"):
        check_init_from(cfg, other)
    torch.save({"not": torch.zeros(1)}, tmp_path / "plain.pt")
    cfg = make_config(checkpoint={"init_from": str(tmp_path / "plain.pt")})
    with pytest.raises(ConfigError, match=r"lacks .* of model=tiny_dense's tensors"):
        check_init_from(cfg, get_model_config("tiny_dense"))
