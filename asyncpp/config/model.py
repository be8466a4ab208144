"""model.*: which registered model to build and the fields to override (checked by the model's own validate())."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ModelSection:
    name: str = "tiny_hybrid"
    """A name from model_zoo.MODEL_NAMES."""
    overrides: dict | None = None
    """Fields of the registered ModelConfig to change, e.g. {num_layers: 8, moe: {bias_update_rate: 1e-3}}
    (`+model.overrides.moe.bias_update_rate=1e-3` on the command line). Checked by the model's validate()."""
