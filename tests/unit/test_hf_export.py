"""Export to / import from Hugging Face Llama format: transformers computes the same logits (fp32, 1e-5)."""

from __future__ import annotations

import json

import pytest
import torch

from model_zoo import build_model, get_model_config
from tools import hf

transformers = pytest.importorskip("transformers")  # a [dev] dependency; skipped only on a broken setup

ATOL = 1e-5


def _random_model(name: str, seed: int = 0, **overrides):
    """A model with every tensor random, norms included (ones would hide a swapped norm)."""
    torch.manual_seed(seed)
    cfg = get_model_config(name, **overrides)
    model = build_model(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.eval(), cfg


def _tokens(vocab: int, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))


def _hf_logits(hf_dir, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("name, overrides", [("tiny_dense", {}), ("smollm2_135m", {"num_layers": 2})])
def test_exported_model_gives_the_same_logits_in_transformers(tmp_path, name, overrides):
    model, cfg = _random_model(name, **overrides)
    hf.export_state_dict(model.state_dict(), cfg, tmp_path)
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        ours = model(tokens)
    theirs = _hf_logits(tmp_path, tokens)
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)


def test_tied_head_is_not_written_and_untied_head_is(tmp_path):
    from safetensors.torch import load_file

    model, cfg = _random_model("tiny_dense")
    hf.export_state_dict(model.state_dict(), cfg, tmp_path / "tied")
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / hf.WEIGHTS_FILE))
    model, cfg = _random_model("tiny_dense", tie_embeddings=False)
    hf.export_state_dict(model.state_dict(), cfg, tmp_path / "untied")
    assert "lm_head.weight" in load_file(str(tmp_path / "untied" / hf.WEIGHTS_FILE))
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(tmp_path / "untied", tokens), model(tokens), atol=ATOL, rtol=0)


def test_import_round_trip_is_exact(tmp_path):
    model, cfg = _random_model("tiny_dense")
    hf.export_state_dict(model.state_dict(), cfg, tmp_path)
    state, cfg_back = hf.import_state_dict(tmp_path)
    assert cfg_back == cfg
    original = model.state_dict()
    assert state.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(state[key], value), key
    assert state["lm_head.weight"] is state["embed.weight"]  # tied: one tensor, as in the model


def test_import_of_a_transformers_saved_model(tmp_path):
    """HF -> asyncpp: weights written by transformers itself load into our model with the same logits."""
    cfg = get_model_config("smollm2_135m", num_layers=2)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **{
                k: v
                for k, v in hf.hf_config(cfg).items()
                if k not in ("architectures", "asyncpp_model_config")
            }
        )
    ).eval()
    theirs.save_pretrained(str(tmp_path))
    assert "asyncpp_model_config" not in json.loads((tmp_path / "config.json").read_text())
    state, cfg_back = hf.import_state_dict(tmp_path)
    # Not a registered shape (2 layers) and no asyncpp metadata: a generic name, the same architecture.
    assert cfg_back.name == "hf_llama"
    assert all(getattr(cfg_back, k) == getattr(cfg, k) for k in hf._ARCH_FIELDS)
    ours = hf.build_from_state_dict(state, cfg_back)
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=ATOL, rtol=0)


def test_smollm2_135m_maps_to_the_published_hf_config():
    c = hf.hf_config(get_model_config("smollm2_135m"))
    published = {  # HuggingFaceTB/SmolLM2-135M config.json
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
        "head_dim": 64,
        "rope_scaling": None,
    }
    assert {k: c[k] for k in published} == published
    # And back: the published fields alone are recognised as the registered model.
    assert hf.model_config_from_hf(published) == get_model_config("smollm2_135m")


def test_moe_and_hybrid_models_are_refused_by_name():
    for name in ("tiny_moe", "tiny_hybrid"):
        with pytest.raises(hf.HFFormatError, match=f"'{name}' is not a dense"):
            hf.hf_config(get_model_config(name))


def test_wrong_state_dict_is_refused_naming_the_keys(tmp_path):
    model, cfg = _random_model("tiny_dense")
    state = dict(model.state_dict())
    del state["layers.1.mixer.q_proj.weight"]
    with pytest.raises(hf.HFFormatError, match=r"missing \['layers.1.mixer.q_proj.weight'\]"):
        hf.export_state_dict(state, cfg, tmp_path)


def test_rope_scaling_is_refused():
    c = hf.hf_config(get_model_config("tiny_dense"))
    c["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(hf.HFFormatError, match="rope scaling"):
        hf.model_config_from_hf(c)


def test_cli_export_then_import(tmp_path, capsys):
    model, _ = _random_model("tiny_dense")
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    rc = hf.main(
        [
            "export",
            "--model",
            "tiny_dense",
            "--state-dict",
            str(tmp_path / "weights.pt"),
            "--out",
            str(tmp_path / "hf"),
            "--verify",
        ]
    )
    assert rc == 0 and "ok" in capsys.readouterr().out
    assert hf.main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["model_config"]["name"] == "tiny_dense"
    for key, value in back["state_dict"].items():
        assert torch.equal(value, model.state_dict()[key]), key
    assert hf.main(["export", "--model", "tiny_moe", "--out", str(tmp_path / "moe")]) == 2
    assert "not a dense" in capsys.readouterr().err


@pytest.mark.slow
def test_full_smollm2_135m_gives_the_same_logits_in_transformers(tmp_path):
    model, cfg = _random_model("smollm2_135m")
    hf.export_state_dict(model.state_dict(), cfg, tmp_path)
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(_hf_logits(tmp_path, tokens), ours, atol=ATOL, rtol=0)
