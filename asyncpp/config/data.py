"""data.*: the corpus (the built-in one or indexed prefixes), the blend and the split, with their parsers and checks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from asyncpp.config.base import ModelLimits
from asyncpp.typed import ConfigError

if TYPE_CHECKING:  # annotations only: run.py imports this module
    from asyncpp.config.run import RunConfig


@dataclass(kw_only=True)
class DataConfig:
    name: Literal["default", "indexed"] = "default"
    """'default': the embedded CPython-docs corpus, built into Megatron's indexed format on first use (no
    network). 'indexed': the .bin/.idx prefixes of `blend` (from `python -m data.preprocess` or Megatron-LM)."""
    blend: tuple[str, ...] = ()
    """name=indexed: entries "WEIGHT PREFIX" (e.g. "0.7 /data/fineweb_text_document"), or bare "PREFIX"es,
    then weighted by their token counts. A prefix is the path without .bin/.idx. docs/data.md has more."""
    split: str = "98,2,0"
    """Shares of each prefix's documents for train,valid,test (Megatron's split: contiguous ranges)."""
    tokenizer: str | None = None
    """name=indexed: the tokenizer the prefixes were made with (tokenizer.json or hub name); None = the one
    recorded in <prefix>.json by data.preprocess. Its vocabulary is checked against the model's."""
    cache_dir: str | None = None
    """Dataset index caches and the default corpus' .bin/.idx; None = $ASYNCPP_CACHE or ~/.cache/asyncpp."""


def check_data(cfg: RunConfig, model: ModelLimits) -> None:
    d = cfg.data
    shares = parse_split(d.split)
    if cfg.train.eval_every and shares[1] == 0:
        raise ConfigError(f"data.split={d.split!r} holds out no validation data but train.eval_every="
                          f"{cfg.train.eval_every}; give validation a share, e.g. data.split='98,2,0', or set "
                          "train.eval_every=0")
    if d.name == "default":
        if d.blend:
            raise ConfigError(f"data.blend={list(d.blend)} applies to data.name=indexed (the default corpus is "
                              "built in); set data.name=indexed or drop data.blend")
        if d.tokenizer is not None:
            raise ConfigError(f"data.tokenizer={d.tokenizer!r} applies to data.name=indexed (the default corpus "
                              "ships its own tokenizer); set data.name=indexed or drop data.tokenizer")
        return
    prefixes, _ = parse_blend(d.blend)
    seen: dict[str, int] = {}
    for i, prefix in enumerate(prefixes):
        first = seen.setdefault(str(Path(prefix).resolve()), i)
        if first != i:
            raise ConfigError(f"data.blend[{i}]={d.blend[i]!r} names the prefix of data.blend[{first}]="
                              f"{d.blend[first]!r} again, so its documents would be read twice; list each prefix once "
                              "(give it a larger weight to read it more often)")
    for i, prefix in enumerate(prefixes):
        for suffix in (".bin", ".idx"):
            if prefix.endswith(suffix):
                raise ConfigError(f"data.blend[{i}]={d.blend[i]!r} names a file; a prefix is the path without "
                                  f"{suffix}: {prefix[: -len(suffix)]}")
        missing = [s for s in (".idx", ".bin") if not Path(prefix + s).is_file()]
        if missing:
            raise ConfigError(f"data.blend[{i}]={d.blend[i]!r}: {prefix}{' and '.join(missing)} not found; make "
                              f"the prefix with `python -m data.preprocess ... --output-prefix {prefix}` "
                              "(docs/data.md), or fix the path")


_SPLIT = re.compile(r"\s*\d+(\.\d*)?(\s*,\s*\d+(\.\d*)?){0,2}\s*")


def parse_split(split: str) -> tuple[float, float, float]:
    """'98,2,0' -> normalized (train, valid, test) shares, as megatron-core reads it (missing parts = 0)."""
    if not _SPLIT.fullmatch(split):
        raise ConfigError(f"data.split={split!r} must be up to three comma-separated non-negative shares "
                          "train,valid,test; e.g. data.split='98,2,0'")
    parts = [float(x) for x in split.split(",")] + [0.0, 0.0]
    total = sum(parts[:3])
    if parts[0] <= 0:
        raise ConfigError(f"data.split={split!r} gives training no documents; e.g. data.split='98,2,0'")
    return parts[0] / total, parts[1] / total, parts[2] / total


def parse_blend(blend: tuple[str, ...] | list[str]) -> tuple[list[str], list[float] | None]:
    """["0.7 /a", "0.3 /b"] -> (["/a", "/b"], [0.7, 0.3]); ["/a", "/b"] -> (["/a", "/b"], None)."""
    if not blend:
        raise ConfigError("data.blend is empty, but data.name=indexed reads its prefixes; e.g. "
                          "data.blend=[/data/fineweb_edu/smollm2_text_document] (docs/data.md)")
    prefixes, weights = [], []
    example = "e.g. data.blend=['0.7 /data/a_text_document','0.3 /data/b_text_document']"
    for i, entry in enumerate(blend):
        fields = entry.split()
        if len(fields) == 1 and is_number(fields[0]):
            raise ConfigError(f"data.blend[{i}]={entry!r} is a weight without a prefix; put both in one entry "
                              f"('WEIGHT PREFIX', not Megatron's flat list), {example}")
        if len(fields) not in (1, 2):
            raise ConfigError(f"data.blend[{i}]={entry!r} must be 'WEIGHT PREFIX' or 'PREFIX' (prefixes with spaces "
                              f"are not supported), {example}")
        if len(fields) == 2:
            if not is_number(fields[0]):
                raise ConfigError(f"data.blend[{i}]={entry!r}: the weight {fields[0]!r} does not parse as a number; "
                                  f"write 'WEIGHT PREFIX', {example}")
            w = float(fields[0])
            if not (math.isfinite(w) and w > 0):
                raise ConfigError(f"data.blend[{i}]={entry!r}: the weight {fields[0]} must be a finite number > 0")
            weights.append(w)
        prefixes.append(fields[-1])
    if weights and len(weights) != len(prefixes):
        raise ConfigError(f"data.blend={list(blend)} mixes weighted and bare entries; give every entry a weight, "
                          f"or none (then prefixes are weighted by their tokens), {example}")
    return prefixes, weights or None


def is_number(text: str) -> bool:
    """Whether a blend entry's field reads as a weight (data.blend here, --data-path in examples/megatron_2bw.py)."""
    try:
        float(text)
    except ValueError:
        return False
    return True
