"""A run's layout over its pipeline stages, resolved once from the config and the model: where the LM head runs
(parallel.head=auto decided by the cost model), every stage's layers, a vocabulary-parallel head's rows per stage,
whether the input embedding is sharded by them, and where the head's S and T actions are placed.

Everything downstream (the stage spec, the mesh's groups, the stage plan, the memory plan, the checkpoint's row
map, the preflight) reads these from a `Layout`; `Layout.of` is the one caller of the cost model's vocabulary split
(core/vocab_split.run_vocab_split). Deterministic: every rank and the simulator resolve the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from asyncpp.config import RunConfig
from asyncpp.core.layer_costs import layer_costs
from asyncpp.core.layer_split import balanced_split, stage_sizes
from asyncpp.core.vocab_split import VocabSplit, run_vocab_placement, run_vocab_split
from asyncpp.schedules.build import VOCAB_PARALLEL_KINDS
from asyncpp.schedules.costmodel import VocabPlacement

AUTO_HEAD_GAIN = 0.05
"""parallel.head=auto takes the vocabulary-parallel head when its slowest stage is at least this much cheaper than
the head-on-last split's (cost model): below that the head's collectives, which the compute cost leaves out, can
eat the gain."""


@dataclass(frozen=True)
class Layout:
    """One run's resolved layout (see the module docstring). Build it with `Layout.of`."""

    cfg: RunConfig
    head: str
    """"last" or "vocab" (spread over every stage); never "auto"."""
    sizes: tuple[int, ...]
    """Every stage's layer count (parallel.stage_layers resolved: with a vocabulary-parallel head and `auto`, the
    split sized together with the shards)."""
    vocab: VocabSplit | None
    """The vocabulary-parallel head's split (layers, rows and costs per stage) when the head is spread over pp >= 2
    stages; else None."""
    embedding: bool
    """parallel.embedding=vocab in effect: the input embedding sharded by the head's rows (only with `vocab`)."""

    @classmethod
    def of(cls, cfg: RunConfig, model) -> Layout:
        """`cfg`'s layout for `model` (a model_zoo.ModelConfig)."""
        p = cfg.parallel
        split = run_vocab_split(cfg, model) if p.head == "vocab" or (p.head == "auto" and may_spread(cfg, model)) \
            else None
        head = p.head if p.head != "auto" else "last" if split is None else _auto_head(cfg, model, split)
        vocab = split if head == "vocab" and p.pp > 1 else None
        if p.stage_layers == "auto" and head == "vocab":
            sizes = tuple(split.sizes)
        elif p.stage_layers == "auto":
            t = cfg.train
            sizes = tuple(balanced_split(layer_costs(model, t.seq_len, t.micro_batch_size, _device_type(cfg)), p.pp))
        else:
            sizes = tuple(stage_sizes(model.num_layers, p.pp, p.stage_layers))
        return cls(cfg, head, sizes, vocab, getattr(p, "embedding", "first") == "vocab" and vocab is not None)

    @property
    def shards(self) -> tuple[int, ...] | None:
        """Every stage's rows of a vocabulary-parallel head (None: the head is whole on the last stage)."""
        return self.vocab.shards if self.vocab is not None else None

    @cached_property
    def placement(self) -> VocabPlacement | None:
        """The warm-up and slack the head's S and T are placed with (explicit, or the cost model's: asked once, on
        first use, as it costs seconds at P=16)."""
        return run_vocab_placement(self.cfg, self.vocab) if self.vocab is not None else None


def _device_type(cfg: RunConfig) -> str:
    return str(cfg.train.device).split(":")[0]


def may_spread(cfg: RunConfig, model) -> bool:
    """Whether parallel.head=auto may choose the vocabulary-parallel head here."""
    p = cfg.parallel
    return bool(p.pp > 1 and cfg.schedule.name in VOCAB_PARALLEL_KINDS and getattr(model, "hidden_size", None)
                and not (p.tp > 1 and getattr(model, "tie_embeddings", False)))


def _auto_head(cfg: RunConfig, model, split: VocabSplit) -> str:
    """parallel.head=auto: "vocab" when its slowest stage beats the head-on-last split's by AUTO_HEAD_GAIN."""
    p, t = cfg.parallel, cfg.train
    costs = layer_costs(model, t.seq_len, t.micro_batch_size, _device_type(cfg))
    sizes = None if p.stage_layers == "auto" else stage_sizes(model.num_layers, p.pp, p.stage_layers)
    last = max(costs.stage_costs(sizes or balanced_split(costs, p.pp)))
    return "vocab" if max(split.compute) <= (1 - AUTO_HEAD_GAIN) * last else "last"
