"""Export to / import from Hugging Face format for every family (Llama, Qwen3, Qwen2-MoE, Qwen3-MoE,
Qwen3-Next): transformers' own classes compute the same fp32 logits (tools/hf_roundtrip.logit_tolerance says how close),
the tokenizer loads with AutoTokenizer offline, and the files have the normal modes."""

from __future__ import annotations

import json

import pytest
import torch

from model_zoo import build_model, get_model_config
from tools import hf, hf_roundtrip
from tools.hf_families import family_of

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
    assert hf.architecture(cfg_back) == hf.architecture(cfg)
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


@pytest.mark.parametrize("family", list(hf_roundtrip.TINY))
def test_every_family_exports_to_transformers_own_class(tmp_path, family):
    cfg = hf_roundtrip.tiny_config(family)
    assert family_of(cfg) == family
    diff, tolerance = hf_roundtrip.export_difference(family, tmp_path)
    assert diff <= tolerance, (diff, tolerance)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [hf.hf_class_name(family)]


# No asyncpp metadata in transformers' own save: a registered shape keeps its name (with the options set),
# tiny_moe without its shared expert is not one.
IMPORTED_NAME = {"llama": "tiny_dense", "qwen3": "tiny_dense", "qwen2_moe": "tiny_moe", "qwen3_moe": "hf_qwen3_moe",
                 "qwen3_next": "tiny_hybrid"}


@pytest.mark.parametrize("family", list(hf_roundtrip.TINY))
def test_every_family_imports_from_transformers_save_pretrained(tmp_path, family):
    diff, tolerance = hf_roundtrip.import_difference(family, tmp_path)
    assert diff <= tolerance, (diff, tolerance)
    _, cfg = hf.import_state_dict(tmp_path)
    assert (cfg.name, family_of(cfg)) == (IMPORTED_NAME[family], family)
    assert hf.architecture(cfg) == hf.architecture(hf_roundtrip.tiny_config(family))


@pytest.mark.parametrize("family", list(hf_roundtrip.TINY))
def test_every_family_round_trips_to_the_same_tensors(tmp_path, family):
    """Ours -> HF -> ours gives back every tensor bit for bit, except Qwen3-Next's zero-centred norms:
    w - 1 + 1 is exact for w in [0.5, 2] and otherwise rounds once (at most half an ulp of |w - 1|)."""
    cfg = hf_roundtrip.tiny_config(family)
    model = hf_roundtrip.random_model(cfg)
    hf.export_state_dict(model.state_dict(), cfg, tmp_path, tokenizer=None)
    state, cfg_back = hf.import_state_dict(tmp_path)
    assert cfg_back == cfg
    original = model.state_dict()
    assert state.keys() == original.keys()
    for key, value in original.items():
        if family == "qwen3_next" and "norm" in key and "o_norm" not in key:
            torch.testing.assert_close(state[key], value, atol=6e-8, rtol=0)
        else:
            assert torch.equal(state[key], value), key


def test_exported_tokenizer_loads_offline_and_encodes_like_ours(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    from data.default import DEFAULT_TOKENIZER

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, cfg = _random_model("tiny_dense")
    hf.export_state_dict(model.state_dict(), cfg, tmp_path, tokenizer=hf.default_tokenizer(cfg))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "def f(x):\n    return x + 1  # the CPython docs' tokenizer"
    assert tok(text)["input_ids"] == Tokenizer.from_file(str(DEFAULT_TOKENIZER)).encode(text).ids
    assert tok.eos_token == hf.EOD_TOKEN
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == tok.eos_token_id == 0
    # a class name transformers 4.x knows too (5.x maps it to its TokenizersBackend)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    from data.default import DEFAULT_TOKENIZER

    model, cfg = _random_model("tiny_dense", vocab_size=1024)
    with pytest.raises(hf.HFFormatError, match="8192 tokens but model 'tiny_dense' only 1024"):
        hf.export_state_dict(model.state_dict(), cfg, tmp_path, tokenizer=DEFAULT_TOKENIZER)
    assert hf.default_tokenizer(cfg) is None


def test_files_have_the_normal_modes(tmp_path):
    import os
    import stat

    model, cfg = _random_model("tiny_dense")
    old = os.umask(0o022)
    try:
        out = hf.export_state_dict(model.state_dict(), cfg, tmp_path / "hf", tokenizer=hf.default_tokenizer(cfg))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= modes.keys()
    assert modes == dict.fromkeys(modes, 0o644)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_models_without_an_hf_class_are_refused_naming_the_options():
    with pytest.raises(hf.HFFormatError, match="'tiny_hybrid'.*lacks qk_norm=true, attn_output_gate=true, "
                                               "gdn.fla_l2norm=true.*overrides.qk_norm=true"):
        hf.hf_config(get_model_config("tiny_hybrid", qk_norm=False, attn_output_gate=False, partial_rotary_factor=1.0,
                                      gdn={"fla_l2norm": False}))
    with pytest.raises(hf.HFFormatError, match="'tiny_moe'.*shared expert=True.*overrides.qk_norm=false"):
        hf.hf_config(get_model_config("tiny_moe", qk_norm=True))
    with pytest.raises(hf.HFFormatError, match="'tiny_moe'.*shared expert=False.*overrides.qk_norm=true"):
        hf.hf_config(get_model_config("tiny_moe", moe={"shared_expert_ffn_hidden_size": 0}))


def test_aux_loss_free_router_bias_exports_only_while_zero(tmp_path):
    cfg = get_model_config("tiny_moe", moe={"bias_update_rate": 1e-3})
    model = hf_roundtrip.random_model(cfg)
    hf.export_state_dict(model.state_dict(), cfg, tmp_path / "zero")  # as initialised: dropped
    model.layers[1].mlp.update_bias(torch.arange(8.0))
    with pytest.raises(hf.HFFormatError, match="layers.1.mlp.expert_bias is non-zero"):
        hf.export_state_dict(model.state_dict(), cfg, tmp_path / "trained")


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
    off = ["--set", "qk_norm=false", "--set", "attn_output_gate=false", "--set", "partial_rotary_factor=1.0",
           "--set", "gdn.fla_l2norm=false"]
    assert hf.main(["export", "--model", "tiny_hybrid", *off, "--out", str(tmp_path / "hybrid")]) == 2
    assert "lacks qk_norm=true" in capsys.readouterr().err
    # As registered (make train's model), tiny_hybrid has Qwen3-Next's options: it exports as it is.
    assert hf.main(["export", "--model", "tiny_hybrid", "--out", str(tmp_path / "next"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "as Qwen3NextForCausalLM" in out and "tokenizer.json" in out
    assert "(ok, tolerance " in out and "= fp32 reduction order on max |logit|" in out


@pytest.mark.slow
def test_full_smollm2_135m_gives_the_same_logits_in_transformers(tmp_path):
    model, cfg = _random_model("smollm2_135m")
    hf.export_state_dict(model.state_dict(), cfg, tmp_path)
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(_hf_logits(tmp_path, tokens), ours, atol=ATOL, rtol=0)


def test_paper_sized_models_take_the_qwen_options():
    """moe_2b + qk_norm is Qwen3-MoE's architecture, hybrid_moe_10b + the Qwen3-Next options Qwen3-Next's."""
    assert family_of(get_model_config("moe_2b", qk_norm=True)) == "qwen3_moe"
    assert family_of(get_model_config("hybrid_moe_10b", **hf_roundtrip.QWEN3_NEXT_OPTIONS)) == "qwen3_next"
    assert get_model_config("hybrid_moe_10b", **hf_roundtrip.QWEN3_NEXT_OPTIONS).rotary_dim == 32


@pytest.mark.slow
def test_cli_export_of_a_checkpoint_trained_with_overrides(tmp_path, capsys):
    """A run's model.overrides (here qk_norm) come from its checkpoint's manifest: the export is that model,
    Qwen3, with the run's tokenizer."""
    from asyncpp import job

    run = tmp_path / "run"
    cfg, model_cfg = job.resolve(job.compose([
        f"out_dir={run}", "model=tiny_dense", "+model.overrides.qk_norm=true", "logging=disabled",
        "logging.progress=false", "train.steps=1", "train.eval_every=0", "train.micro_batch_size=1",
        "train.num_microbatches=1", "train.seq_len=16", "optimizer.schedule.warmup_steps=1"]))
    job.run(cfg, model_cfg)
    step = next((run / "checkpoints").glob("step_*"))
    assert hf.main(["export", "--checkpoint", str(step), "--out", str(tmp_path / "hf"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "exported 'tiny_dense' as Qwen3ForCausalLM" in out and "tokenizer.json" in out and "(ok," in out


def test_the_logit_tolerance_is_relative_to_the_logits_size():
    """4 ulps x sqrt(hidden_size) x max|logit| (tools/hf_roundtrip.py derives it): a trained tiny_hybrid with
    logits up to 11.1 differs by 7.15e-6 from transformers (above the old absolute 1e-5's margin at that size,
    well inside this), while a wrong tensor map (>= 1e-2) stays refused."""
    cfg = hf_roundtrip.tiny_config("qwen3_next")
    unit = 4 * torch.finfo(torch.float32).eps * cfg.hidden_size ** 0.5
    assert hf_roundtrip.logit_tolerance(cfg, 1.0) == pytest.approx(unit, rel=1e-12)
    assert hf_roundtrip.logit_tolerance(cfg, 11.1) == pytest.approx(11.1 * unit, rel=1e-12)
    assert 7.15e-6 < hf_roundtrip.logit_tolerance(cfg, 11.1) < 1e-3
    assert hf_roundtrip.logit_tolerance(cfg, 100.0) < 1e-2  # a wrong map is refused even on large logits
