"""The Hugging Face round trip of a tiny model of every family, against transformers' own classes.

    python -m tools.hf roundtrip [--json out.json]

For each family (tools/hf_families.py): our tiny model with random weights (norms too, so a swapped or
mis-centred norm shows) -> export -> transformers' class loads it -> max |logit difference|; and the other
way, transformers' model with random weights -> save_pretrained -> import -> our model -> the same. fp32,
2 sequences of 96 tokens (more than one 64-token Gated DeltaNet chunk). Prints a table, exits 1 if any
difference is above its family's tolerance.

logit_tolerance(cfg, max_abs_logit), the tolerance, from where the two implementations run different
floating-point work:
  * llama, qwen3: the same matmuls and SDPA in the same order; measured 0.
  * qwen2_moe, qwen3_moe: transformers sums each token's top-k expert outputs (and the shared expert) in
    another order than our grouped computation: ~1 ulp of the MoE output per layer; measured ~4e-7.
  * qwen3_next: both chunk the gated delta rule by 64 but solve the intra-chunk triangular system
    differently (their row loop, our solve_triangular): ~C * eps relative per Gated DeltaNet layer output
    (C = 64, eps = 6e-8: ~4e-6 of an O(0.1) output); measured ~1e-6 on logits of max 2.7 (~3 ulps of it).
  A rounding difference reaches a logit through its last reductions, each a dot product over hidden_size terms
  whose rounding errors add like a random walk: sqrt(hidden_size) ulps of the logits' scale. So every family is
  allowed ULPS = 4 such units, TOLERANCE_ULPS x 2^-23 x sqrt(hidden_size) x max|logit| (tiny models: 5.4e-6 x
  max|logit|; 1.5e-5 at max|logit| 2.7, 15x the worst measured). Relative, because a trained model's logits
  are larger than a random init's (make train's tiny_hybrid: a 7e-6 difference on larger logits), and still
  orders below what a wrong map gives (a swapped or mis-centred tensor moves logits by 1e-2 and more).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

FP32_ULP = 2.0 ** -23
"""The spacing of float32 numbers at 1.0 (torch.finfo(torch.float32).eps)."""
TOLERANCE_ULPS = 4
"""'A few ulps' of the logits' scale per sqrt(reduction length) (the module docstring derives it)."""


def logit_tolerance(cfg: Any, max_abs_logit: float) -> float:
    """The largest |logit difference| two fp32 implementations that differ only in reduction order may show:
    TOLERANCE_ULPS ulps x sqrt(hidden_size) (the length of the dot products that make each logit) x max|logit|."""
    return TOLERANCE_ULPS * FP32_ULP * math.sqrt(cfg.hidden_size) * max_abs_logit

QWEN3_NEXT_OPTIONS = {"qk_norm": True, "attn_output_gate": True, "partial_rotary_factor": 0.25,
                      "gdn": {"fla_l2norm": True}}
# family -> (registered tiny model, the overrides that give it that family's architecture)
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("tiny_dense", {}),
    "qwen3": ("tiny_dense", {"qk_norm": True}),
    "qwen2_moe": ("tiny_moe", {}),
    "qwen3_moe": ("tiny_moe", {"qk_norm": True, "moe": {"shared_expert_ffn_hidden_size": 0}}),
    "qwen3_next": ("tiny_hybrid", QWEN3_NEXT_OPTIONS),
}
SEQ_LEN = 96


def tiny_config(family: str):
    from model_zoo import get_model_config

    name, overrides = TINY[family]
    return get_model_config(name, **overrides)


def random_model(cfg: Any, seed: int = 0):
    """Our model with every tensor random, norms included (ones would hide a swapped norm)."""
    from model_zoo import build_model

    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.eval()


def random_transformers_model(cfg: Any, seed: int = 0):
    """transformers' own model of cfg's family, its own random init, norms perturbed the same way."""
    import transformers

    from tools.hf_families import family_of, hf_class_name, hf_config

    c = {k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "asyncpp_model_config")}
    torch.manual_seed(seed)
    model = getattr(transformers, hf_class_name(family_of(cfg)))(transformers.AutoConfig.for_model(**c))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.float().eval()


def tokens(vocab_size: int, seq_len: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def export_difference(family: str, out_dir: Path) -> tuple[float, float]:
    """asyncpp -> HF: max |logits(ours) - logits(transformers loading our export)| and its tolerance."""
    from tools import hf

    cfg = tiny_config(family)
    model = random_model(cfg)
    hf.export_state_dict(model.state_dict(), cfg, out_dir, tokenizer=hf.default_tokenizer(cfg))
    x = tokens(cfg.vocab_size)
    ours = model(x)
    diff = (ours - hf.load_transformers_model(out_dir)(x).logits).abs().max().item()
    return diff, logit_tolerance(cfg, ours.abs().max().item())


@torch.no_grad()
def import_difference(family: str, out_dir: Path) -> tuple[float, float]:
    """HF -> asyncpp: max |logits(transformers) - logits(ours after importing its save_pretrained)| and its
    tolerance."""
    from tools import hf

    theirs = random_transformers_model(tiny_config(family))
    theirs.save_pretrained(str(out_dir))
    state, cfg = hf.import_state_dict(out_dir)
    x = tokens(cfg.vocab_size)
    reference = theirs(x).logits
    diff = (hf.build_from_state_dict(state, cfg)(x) - reference).abs().max().item()
    return diff, logit_tolerance(cfg, reference.abs().max().item())


def _flat(overrides: dict, prefix: str = "") -> list[str]:
    """{"moe": {"top_k": 4}} -> ["moe.top_k=4"] (as --set and +model.overrides spell them)."""
    out = []
    for k, v in overrides.items():
        out += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={v}"]
    return out


def main(json_path: str | None = None) -> int:
    from tools.hf_families import hf_class_name

    rows = []
    print(f"{'family':<11} {'transformers class':<22} {'export':>9} {'import':>9} {'tolerance':>9}  model (overrides)")
    for family, (name, overrides) in TINY.items():
        with tempfile.TemporaryDirectory() as tmp:
            exported, export_tol = export_difference(family, Path(tmp) / "export")
            imported, import_tol = import_difference(family, Path(tmp) / "import")
        ok = exported <= export_tol and imported <= import_tol
        label = " ".join([name, *_flat(overrides)])
        rows.append({"family": family, "class": hf_class_name(family), "model": name, "overrides": overrides,
                     "export_max_abs_logit_diff": exported, "import_max_abs_logit_diff": imported,
                     "export_tolerance": export_tol, "import_tolerance": import_tol, "ok": ok})
        print(f"{family:<11} {hf_class_name(family):<22} {exported:>9.2e} {imported:>9.2e} "
              f"{min(export_tol, import_tol):>9.1e}  {label}{'' if ok else '  MISMATCH'}")
    print(f"fp32 logits, 2 x {SEQ_LEN} random tokens; torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}")
    if json_path:
        Path(json_path).write_text(json.dumps({"seq_len": SEQ_LEN, "rows": rows}, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
