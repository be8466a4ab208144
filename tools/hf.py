"""Hugging Face format <-> model_zoo's CausalLM, for every model family (tools/hf_families.py).

    python -m tools.hf export --model tiny_dense --state-dict weights.pt --out hf/tiny --verify
    python -m tools.hf export --checkpoint outputs/run/checkpoints/step_00000300 --out hf/run --verify
    python -m tools.hf export --model moe_2b --set qk_norm=true --out hf/moe_2b      # Qwen3-MoE
    python -m tools.hf import hf/SmolLM2-135M --out smollm2.pt --verify
    python -m tools.hf roundtrip            # every family: export, transformers, import; max logit difference

An export is a directory transformers loads offline: config.json (the family's, plus our own config so an
import gives back exactly the exported model), model.safetensors, and the tokenizer (tokenizer.json,
tokenizer_config.json) so AutoTokenizer.from_pretrained(dir) works; files are written with the normal modes
(0644 under the usual umask 022). Dense models are Llama (or Qwen3 with qk_norm), MoE models Qwen2-MoE or
Qwen3-MoE, hybrids Qwen3-Next; docs/hf.md has the mapping and the options each needs.

`export_state_dict` / `import_state_dict` take and return a plain CausalLM state_dict, so a checkpoint
tool only has to produce or consume one. The model configs come from model_zoo, which the engine
otherwise never imports: this module is a format edge, imported by tools, never by the training path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from asyncpp.host.files import refuse_overwriting_inputs
from tools.hf_families import (
    HFFormatError,
    architecture,
    family_of,
    family_of_model_type,
    hf_class_name,
    hf_config,
    model_fields_from_hf,
    rules,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
EOD_TOKEN = "<|endoftext|>"


def _full(t: Tensor) -> Tensor:
    """A plain, contiguous CPU tensor (a DTensor shard is gathered first)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


def _expected_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry of `cfg`'s CausalLM and its shape, from the model built on meta (no memory)."""
    from model_zoo import build_model

    return {k: tuple(v.shape) for k, v in build_model(cfg, device="meta").state_dict().items()}


def _drop_expert_bias(state: dict[str, Tensor], cfg: Any) -> None:
    """Aux-loss-free balancing's router bias steers which experts a token visits; no HF MoE class has one,
    so it can only be dropped while it is still zero (as initialised)."""
    for key in [k for k in state if k.endswith(".expert_bias")]:
        bias = _full(state.pop(key))
        if bias.any():
            raise HFFormatError(
                f"{key} is non-zero (max |b| = {bias.abs().max().item():.3g}): model '{cfg.name}' was trained with "
                "aux-loss-free balancing (model.moe.bias_update_rate > 0), whose router bias changes which experts "
                "a token visits, and no Hugging Face MoE class has one; export a model trained without it"
            )


# ---- configs ------------------------------------------------------------------------------------------


def model_config_from_hf(hf: Mapping[str, Any]):
    """A config.json (as a dict) -> model_zoo.ModelConfig.

    A directory we exported carries our full config (`asyncpp_model_config`), used when its architecture
    still matches; otherwise a registered model with the same architecture keeps its name and init
    settings (an imported SmolLM2 is `smollm2_135m`; a Qwen3-MoE of moe_2b's shape is `moe_2b` with
    qk_norm); anything else becomes 'hf_<family>'."""
    from model_zoo import ModelConfig

    fields = model_fields_from_hf(hf)
    max_seq_len = hf.get("max_position_embeddings", 2048)
    candidate = ModelConfig(
        name=f"hf_{family_of_model_type(hf.get('model_type'))}", **fields, max_seq_len=max_seq_len,
        init_std=hf.get("initializer_range", 0.02),
        scale_residual_init=False,  # HF initialises every projection with initializer_range
    ).validate()
    saved = hf.get("asyncpp_model_config")
    if saved:
        ours = model_config_from_dict(saved)
        if architecture(ours) == architecture(candidate):
            return dataclasses.replace(ours, max_seq_len=max_seq_len).validate()
    registered = _registered_match(candidate)
    if registered is not None:
        options = {k: getattr(candidate, k) for k in ("qk_norm", "attn_output_gate", "partial_rotary_factor")}
        if registered.gdn is not None:
            options["gdn"] = dataclasses.replace(registered.gdn, fla_l2norm=candidate.gdn.fla_l2norm)
        return dataclasses.replace(registered, max_seq_len=max_seq_len, **options).validate()
    return candidate


def model_config_from_dict(d: Mapping[str, Any]):
    """dataclasses.asdict(ModelConfig) (e.g. read back from JSON) -> ModelConfig."""
    from model_zoo import GDNConfig, ModelConfig, MoEConfig

    subs = {"moe": MoEConfig, "gdn": GDNConfig}
    fields = {k: (tuple(v) if k == "layer_types" else subs[k](**v) if k in subs and v is not None else v)
              for k, v in d.items()}
    return ModelConfig(**fields)


def _registered_match(candidate: Any):
    from model_zoo import MODEL_NAMES, get_model_config

    want = architecture(candidate, options=False)
    for name in MODEL_NAMES:
        cfg = get_model_config(name)
        if architecture(cfg, options=False) == want:
            return cfg
    return None


# ---- state dicts --------------------------------------------------------------------------------------


def to_hf_state_dict(
    state_dict: Mapping[str, Tensor], cfg: Any, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """Our CausalLM state_dict -> the HF family's tensors (CPU, contiguous, unshared; lm_head dropped when
    tied). Mapped in the state's dtype, then cast to `dtype` (None keeps it)."""
    table = rules(cfg)  # refuses a model no HF class computes, before anything else
    state = {k: _full(v) for k, v in state_dict.items()}
    _drop_expert_bias(state, cfg)
    shapes = {k: v for k, v in _expected_shapes(cfg).items() if not k.endswith(".expert_bias")}
    optional = {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing = sorted(set(shapes) - set(state) - optional)
    unknown = sorted(set(state) - set(shapes))
    if missing or unknown:
        raise HFFormatError(
            f"the state_dict does not fit model '{cfg.name}': missing {missing[:5]}, unexpected {unknown[:5]}; "
            "pass a plain CausalLM state_dict (model.state_dict()) of that model"
        )
    for key, t in state.items():
        if tuple(t.shape) != shapes[key]:
            raise HFFormatError(f"{key} has shape {tuple(t.shape)} but model '{cfg.name}' needs {shapes[key]}")
    out = {}
    for rule in table:
        for name, t in zip(rule.theirs, rule.to_hf([state[k] for k in rule.ours]), strict=True):
            out[name] = (t.to(dtype) if dtype is not None else t).contiguous().clone()
    return out


def from_hf_state_dict(tensors: Mapping[str, Tensor], cfg: Any, drop_extra: bool = False) -> dict[str, Tensor]:
    """The HF family's tensors -> our CausalLM state_dict. A tied head is the embedding tensor itself. A tensor no
    rule reads (an adapter, a value head, a bias our model has no place for) is refused, naming it, unless
    `drop_extra` (the caller then reports `extra_tensors`): an import never loses weights without a word."""
    table = rules(cfg)
    missing = sorted(name for rule in table for name in rule.theirs if name not in tensors)
    if missing:
        raise HFFormatError(f"the HF checkpoint lacks {missing[:5]} (of {len(missing)} missing tensors)")
    extra = extra_tensors(tensors, cfg)
    if extra and not drop_extra:
        raise HFFormatError(f"the HF checkpoint holds {len(extra)} tensor(s) that model '{cfg.name}' has no place for "
                            f"({', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}); an import would drop them. "
                            "Check that config.json describes these weights, or pass --drop-extra to import without "
                            "them")
    shapes = _expected_shapes(cfg)
    sd = {}
    for rule in table:
        theirs = [tensors[n] for n in rule.theirs]
        try:
            ours = rule.from_hf(theirs)
        except RuntimeError as e:  # a reshape that does not fit: the file and config.json disagree
            raise HFFormatError(f"{list(rule.theirs[:3])} do not fit config.json ({e})") from None
        for name, t in zip(rule.ours, ours, strict=True):
            if tuple(t.shape) != shapes[name]:
                raise HFFormatError(
                    f"{list(rule.theirs[:3])} give {name} the shape {tuple(t.shape)}, but config.json implies "
                    f"{shapes[name]}"
                )
            sd[name] = t
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["embed.weight"]
    for key in (k for k in shapes if k.endswith(".expert_bias")):  # (an exported bias was zero)
        sd[key] = torch.zeros(shapes[key], dtype=torch.float32)
    return sd


def extra_tensors(tensors: Mapping[str, Tensor], cfg: Any) -> list[str]:
    """The tensors of an HF checkpoint that no rule of `cfg`'s family reads. Not counted: rotary inverse
    frequencies (recomputed from config.json) and, with tied embeddings, an lm_head.weight equal to the
    embedding (some checkpoints store both)."""
    read = {name for rule in rules(cfg) for name in rule.theirs}
    embed = next((r.theirs[0] for r in rules(cfg) if r.ours == ("embed.weight",)), None)
    out = []
    for name in sorted(set(tensors) - read):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if cfg.tie_embeddings and name == "lm_head.weight" and embed in tensors and \
                torch.equal(tensors[name], tensors[embed]):
            continue
        out.append(name)
    return out


# ---- files --------------------------------------------------------------------------------------------


def _normal_modes(out: Path) -> None:
    """Files 0666 and directories 0777 minus the umask (0644 / 0755 under the usual 022), as any program
    that writes with open() leaves them: safetensors and temporary files are created 0600."""
    umask = os.umask(0o022)
    os.umask(umask)
    out.chmod(0o777 & ~umask)
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def export_state_dict(
    state_dict: Mapping[str, Tensor], model_cfg: Any, out_dir: str | Path, dtype: torch.dtype | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write `out_dir/{config.json, model.safetensors}` (and the tokenizer from `tokenizer`, a tokenizer.json
    or a directory or hub name resolved offline, when given) loadable by transformers' class of the model's
    family. dtype None keeps the state's dtype (fp32 master weights give fp32 files)."""
    from safetensors.torch import save_file

    tensors = to_hf_state_dict(state_dict, model_cfg, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    file_dtype = next(iter(tensors.values())).dtype
    config = hf_config(model_cfg, file_dtype)
    if tokenizer is not None:
        config |= write_tokenizer(tokenizer, out, model_cfg)
    # Written under a temporary name, then renamed: a crash never leaves a truncated model.safetensors.
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    _normal_modes(out)
    return out


def write_tokenizer(spec: str | Path, out: Path, cfg: Any) -> dict[str, int]:
    """Save the tokenizer `spec` into `out` as transformers' fast tokenizer files (tokenizer.json,
    tokenizer_config.json), so AutoTokenizer.from_pretrained(out) works offline; returns the special
    token ids for config.json. Its end-of-document token is eos, bos and unk (the GPT-2 convention)."""
    from transformers import PreTrainedTokenizerFast

    from data.tokenizer import load_tokenizer

    loaded = load_tokenizer(str(spec), EOD_TOKEN)
    if loaded.vocab_size > cfg.vocab_size:
        raise HFFormatError(
            f"tokenizer {spec} has {loaded.vocab_size} tokens but model '{cfg.name}' only {cfg.vocab_size} "
            "embedding rows; pass the tokenizer the model was trained with (--tokenizer PATH) or --tokenizer none"
        )
    tok = PreTrainedTokenizerFast(tokenizer_file=str(loaded.path), eos_token=EOD_TOKEN, bos_token=EOD_TOKEN,
                                  unk_token=EOD_TOKEN, model_max_length=cfg.max_seq_len)
    tok.save_pretrained(str(out))
    # transformers 5 names the class TokenizersBackend, which 4.x does not know; both load this name.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return {"eos_token_id": loaded.eod_id, "bos_token_id": loaded.eod_id}


def default_tokenizer(cfg: Any, manifest_config: Mapping[str, Any] | None = None) -> Path | str | None:
    """The tokenizer a model was trained with: a checkpoint's data section says (the embedded corpus' own,
    or data.tokenizer); without one, the embedded corpus' tokenizer when its vocabulary fits the model."""
    from data.default import DEFAULT_TOKENIZER
    from data.tokenizer import load_tokenizer

    data = (manifest_config or {}).get("data") or {}
    if data.get("tokenizer"):
        return data["tokenizer"]
    if data.get("name", "default") == "default" and load_tokenizer(DEFAULT_TOKENIZER).vocab_size <= cfg.vocab_size:
        return DEFAULT_TOKENIZER
    return None


def read_hf_tensors(hf_dir: Path) -> dict[str, Tensor]:
    """All tensors of `model.safetensors`, or of the shards listed in `model.safetensors.index.json`."""
    from safetensors.torch import load_file

    if (hf_dir / WEIGHTS_FILE).exists():
        return load_file(str(hf_dir / WEIGHTS_FILE))
    if (hf_dir / INDEX_FILE).exists():
        shards = sorted(set(json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"].values()))
        tensors: dict[str, Tensor] = {}
        for shard in shards:
            tensors.update(load_file(str(hf_dir / shard)))
        return tensors
    raise HFFormatError(
        f"{hf_dir} has neither {WEIGHTS_FILE} nor {INDEX_FILE}; point at a directory saved with "
        "safetensors (save_pretrained(..., safe_serialization=True))"
    )


def import_state_dict(hf_dir: str | Path, drop_extra: bool = False) -> tuple[dict[str, Tensor], Any]:
    """An HF directory of a supported family -> (our CausalLM state_dict, model_zoo.ModelConfig)."""
    state, cfg, _ = import_with_extras(hf_dir, drop_extra)
    return state, cfg


def import_with_extras(hf_dir: str | Path, drop_extra: bool = False) -> tuple[dict[str, Tensor], Any, list[str]]:
    """import_state_dict, and the names of the tensors it dropped (only with `drop_extra`; else it refuses)."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / CONFIG_FILE).exists():
        raise HFFormatError(f"{hf_dir / CONFIG_FILE} does not exist; point at an HF model directory")
    cfg = model_config_from_hf(json.loads((hf_dir / CONFIG_FILE).read_text()))
    tensors = read_hf_tensors(hf_dir)
    return from_hf_state_dict(tensors, cfg, drop_extra), cfg, extra_tensors(tensors, cfg)


# ---- checks -------------------------------------------------------------------------------------------


def build_from_state_dict(state_dict: Mapping[str, Tensor], cfg: Any):
    """Our CausalLM holding exactly these tensors (built on meta, then assigned: no init cost)."""
    from model_zoo import build_model

    state = dict(state_dict)
    if cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state["embed.weight"])
    model = build_model(cfg, device="meta")
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    return model.eval()


def load_transformers_model(hf_dir: str | Path):
    """transformers' own class for the directory's family, in fp32, eval mode (AutoModelForCausalLM
    dispatches on config.json's model_type, so this also checks that we wrote the family we meant)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    want = hf_class_name(family_of_model_type(json.loads((Path(hf_dir) / CONFIG_FILE).read_text())["model_type"]))
    if type(model).__name__ != want:
        raise HFFormatError(f"transformers built {type(model).__name__} for {hf_dir}, expected {want}")
    return model


@torch.no_grad()
def compare_logits(
    state_dict: Mapping[str, Tensor], cfg: Any, hf_dir: str | Path, seq_len: int = 32, seed: int = 0
) -> tuple[float, float]:
    """(max |logits(asyncpp) - logits(transformers)|, max |logits(asyncpp)|) in fp32 on random tokens: the
    difference and the scale its tolerance is relative to (tools/hf_roundtrip.logit_tolerance)."""
    ours = build_from_state_dict({k: v.float() for k, v in state_dict.items()}, cfg)
    theirs = load_transformers_model(hf_dir)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = ours(tokens)
        return (logits - theirs(tokens).logits).abs().max().item(), logits.abs().max().item()


# ---- CLI ----------------------------------------------------------------------------------------------


def _load_state_file(path: Path) -> tuple[dict[str, Tensor], Any]:
    """A torch.save'd state_dict, or {'state_dict', 'model_config'} as `import` writes it."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and "state_dict" in obj:
        cfg = obj.get("model_config")
        return obj["state_dict"], (model_config_from_dict(cfg) if cfg else None)
    return obj, None


def load_checkpoint_weights(path: str | Path) -> tuple[dict[str, Tensor], Any]:
    """The newest weights x_t of an asyncpp DCP checkpoint (any layout) as a CausalLM state_dict, and its
    model config (the registered model with the run's model.overrides)."""
    from asyncpp.train.checkpoint import newest_weights, read_manifest
    from model_zoo import get_model_config

    manifest = read_manifest(path)
    model = manifest["config"]["model"]
    cfg = get_model_config(model["name"], **(model.get("overrides") or {}))
    state = newest_weights(path)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    return state, cfg


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """["qk_norm=true", "moe.top_k=4"] -> {"qk_norm": True, "moe": {"top_k": 4}} (values parsed as JSON
    where they parse, else kept as strings), for get_model_config."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise HFFormatError(f"--set {item!r} is not KEY=VALUE; e.g. --set qk_norm=true")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *parents, leaf = key.split(".")
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return out


def _export(args: argparse.Namespace) -> int:
    from model_zoo import build_model, get_model_config

    _check_out(Path(args.out), args.force)
    _check_inputs_survive(args)
    overrides = parse_overrides(args.set)
    run_config = None
    if args.checkpoint is not None:
        from asyncpp.train.checkpoint import damage, is_complete, read_manifest

        problem = damage(args.checkpoint) if is_complete(args.checkpoint) else None
        if problem is not None:
            raise HFFormatError(f"--checkpoint={args.checkpoint} is damaged: {problem}; export an intact one")
        state, cfg = load_checkpoint_weights(args.checkpoint)
        run_config = read_manifest(args.checkpoint)["config"]
    elif args.state_dict is None:
        if args.model is None:
            raise HFFormatError("export needs --model NAME (with --init-seed), --state-dict FILE or --checkpoint DIR")
        torch.manual_seed(args.init_seed)
        cfg = get_model_config(args.model, **overrides)
        state = build_model(cfg).state_dict()
    else:
        state, cfg = _load_state_file(Path(args.state_dict))
        if args.model is not None:
            cfg = get_model_config(args.model, **overrides)
        if cfg is None:
            raise HFFormatError(
                f"{args.state_dict} holds a bare state_dict; say which model it is with --model NAME"
            )
    family_of(cfg)  # refuse a model without an HF class before reading a tokenizer
    if args.tokenizer == "auto":
        tokenizer = default_tokenizer(cfg, run_config)
        if tokenizer is None:
            print(f"note: no tokenizer known for '{cfg.name}' (vocab {cfg.vocab_size}); pass --tokenizer PATH "
                  "to include one", file=sys.stderr)
    else:
        tokenizer = None if args.tokenizer == "none" else args.tokenizer
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = export_state_dict(state, cfg, args.out, dtype=dtype, tokenizer=tokenizer)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"exported '{cfg.name}' as {hf_class_name(family_of(cfg))} to {out} ({files})")
    return _verify(state, cfg, out) if args.verify else 0


def _check_out(out: Path, force: bool) -> None:
    """An export writes config.json and the weights into --out: refuse a directory that holds anything (a run's
    directory has a config.json of its own, which the report and the study read) unless --force says so; even
    then, refuse one that holds a run or a checkpoint."""
    if out.exists() and not out.is_dir():
        raise HFFormatError(f"--out={out} is a file; give a directory for the exported model")
    if not out.is_dir() or not any(out.iterdir()):
        return
    run_files = [n for n in ("metrics.jsonl", "summary.json", "checkpoints", "manifest.json", ".metadata")
                 if (out / n).exists()]
    if run_files:
        raise HFFormatError(f"--out={out} holds a training run or checkpoint ({', '.join(run_files)}); an export "
                            "would overwrite its config.json. Export to a directory of its own, e.g. --out "
                            f"{out.parent / (out.name + '-hf')}")
    if not force:
        found = sorted(p.name for p in out.iterdir())
        raise HFFormatError(f"--out={out} is not empty ({', '.join(found[:5])}{', ...' if len(found) > 5 else ''}); "
                            "an export overwrites its config.json, weights and tokenizer files. Give an empty or new "
                            "directory, or pass --force to overwrite an earlier export")


EXPORTED = (CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_FILE + ".tmp", TOKENIZER_FILE, "tokenizer_config.json",
            "special_tokens_map.json")
"""The files an export may write into --out."""


def _check_inputs_survive(args: argparse.Namespace) -> None:
    """--state-dict and a --tokenizer path are read after --out's files are written (or while): neither may be one
    of them (--force into the directory that holds them)."""
    inputs = [(f"--{name.replace('_', '-')}", getattr(args, name)) for name in ("state_dict", "tokenizer")
              if getattr(args, name) not in (None, "auto", "none") and Path(getattr(args, name)).exists()]
    if inputs:
        refuse_overwriting_inputs([("--out", Path(args.out) / name) for name in EXPORTED], inputs,
                                  "export to another directory")


def _import(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise HFFormatError(f"--out={out} is a directory; give the .pt file to write, e.g. --out {out / 'model.pt'}")
    hf_dir = Path(args.hf_dir)
    read = sorted(hf_dir.iterdir()) if hf_dir.is_dir() else []
    refuse_overwriting_inputs([("--out", out)], [("hf_dir", p) for p in read],
                              "write the .pt file outside the HF directory")
    state, cfg, dropped = import_with_extras(hf_dir, args.drop_extra)
    out.parent.mkdir(parents=True, exist_ok=True)
    unique = {k: v for k, v in state.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    torch.save({"state_dict": unique, "model_config": dataclasses.asdict(cfg)}, out)
    print(f"imported {args.hf_dir} as model '{cfg.name}' -> {out}")
    if dropped:
        print(f"--drop-extra: left out {len(dropped)} tensor(s) the model has no place for: {', '.join(dropped)}",
              file=sys.stderr)
    return _verify(state, cfg, args.hf_dir) if args.verify else 0


def _verify(state: Mapping[str, Tensor], cfg: Any, hf_dir: str | Path) -> int:
    from tools.hf_roundtrip import logit_tolerance

    diff, scale = compare_logits(state, cfg, hf_dir)
    tol = logit_tolerance(cfg, scale)  # relative to the logits' size: a reordered fp32 sum, not a wrong map
    ok = diff <= tol
    print(f"verify: max |logits(asyncpp) - logits(transformers)| = {diff:.3g} "
          f"({'ok' if ok else 'MISMATCH'}, tolerance {tol:.3g} = fp32 reduction order on max |logit| {scale:.3g})")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.hf", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="asyncpp weights -> HF directory (config.json, safetensors, tokenizer)")
    exp.add_argument("--model", help="a registered model (python -c 'import model_zoo; print(model_zoo.MODEL_NAMES)')")
    exp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="model override with --model, as +model.overrides.KEY=VALUE in training "
                          "(e.g. --set qk_norm=true); repeatable")
    exp.add_argument("--state-dict", help="torch.save'd state_dict, or a file written by `import`")
    exp.add_argument("--checkpoint", help="an asyncpp checkpoint directory (step_*), saved by any layout")
    exp.add_argument("--init-seed", type=int, default=0, help="without --state-dict: export a fresh init")
    exp.add_argument("--out", required=True, help="output directory (new or empty; see --force)")
    exp.add_argument("--force", action="store_true",
                     help="write into a non-empty --out (an earlier export); never into a run or checkpoint directory")
    exp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: the state's dtype")
    exp.add_argument("--tokenizer", default="auto",
                     help="tokenizer.json, its directory or a cached hub name; 'auto' (default): the run's, or the "
                          "embedded corpus' when it fits the vocabulary; 'none'")
    exp.add_argument("--verify", action="store_true", help="load it with transformers and compare logits")
    imp = sub.add_parser("import", help="HF directory -> {'state_dict', 'model_config'} .pt file")
    imp.add_argument("hf_dir")
    imp.add_argument("--out", required=True, help="output .pt file")
    imp.add_argument("--verify", action="store_true", help="compare logits with transformers")
    imp.add_argument("--drop-extra", action="store_true",
                     help="import even if the checkpoint holds tensors the model has no place for (listed)")
    rt = sub.add_parser("roundtrip", help="every family's tiny model: export and import against transformers")
    rt.add_argument("--json", help="also write the table here")
    args = parser.parse_args(argv)
    try:
        if args.command == "roundtrip":
            from tools.hf_roundtrip import main as roundtrip

            return roundtrip(args.json)
        return _export(args) if args.command == "export" else _import(args)
    except (HFFormatError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
