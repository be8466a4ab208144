"""Typed run configuration, validated once, before any process group or model exists.

The hydra tree under configs/ composes into a plain dict; `RunConfig.from_dict` turns it into these
dataclasses (unknown keys and wrong types are rejected there) and `validate` checks the cross-field
rules. Every error names the field, the value and the fix. Library code never sees a DictConfig.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from asyncpp.host.allocator import MMAP_THRESHOLD_MAX, TRIM_THRESHOLD_MAX
from asyncpp.schedules.build import check_head_split
from asyncpp.schedules.registry import SYNC_KINDS, ScheduleKindError, kind_of
from asyncpp.typed import ConfigError, from_dict, to_dict

ScheduleName = Literal["sync", "gpipe", "1f1b", "2bw", "pipedream"]
#: Schedules whose mathematics is synchronous training (they differ only in how a pipeline orders work).
SYNC_SCHEDULES = SYNC_KINDS


class ModelLimits(Protocol):
    """What validation needs to know about the model (model_zoo.ModelConfig satisfies it)."""

    name: str
    num_layers: int
    max_seq_len: int
    vocab_size: int


@dataclass(kw_only=True)
class ModelSection:
    name: str = "tiny_hybrid"
    """A name from model_zoo.MODEL_NAMES."""
    overrides: dict | None = None
    """Fields of the registered ModelConfig to change, e.g. {num_layers: 8, moe: {bias_update_rate: 1e-3}}
    (`+model.overrides.moe.bias_update_rate=1e-3` on the command line). Checked by the model's validate()."""


@dataclass(kw_only=True)
class ParallelConfig:
    pp: int = 1
    """Pipeline stages. In a single process this is the number of stages the simulator models."""
    tp: int = 1
    ep: int = 1
    dp: int | None = None
    """Data-parallel replicas; None = world_size / (pp * tp) under torchrun, 1 in one process.
    In one process, dp > 1 simulates the replicas (m * dp microbatches per step)."""
    sequence_parallel: bool = False
    """With tp > 1: norms and residuals work on sequence shards (activation memory / tp); the TP
    regions all-gather their input and reduce-scatter their output instead of all-reducing it."""
    stage_layers: tuple[int, ...] | Literal["auto"] | None = None
    """Layers per pipeline stage, e.g. [3, 1] or [4, 0] (an explicit split may give a stage 0 layers: only the
    embedding, or only the norm, head and loss); `auto` (configs/parallel/default.yaml) picks the split whose
    slowest stage is cheapest under the cost model of asyncpp.core.layer_costs (the last stage also runs the
    LM head and the loss, the first the embedding; at least 1 layer per stage); None (a config built in
    Python without a split) = the near-even asyncpp.core.partition.default_split. Resolved by
    asyncpp.core.partition.stage_split, the same on every rank and in the simulator."""
    distributed_optimizer: bool = False
    """Megatron's --use-distributed-optimizer (ZeRO-1) over DP: each replica owns whole parameters, keeps
    their optimizer state and Error-Feedback buffer, receives their reduced gradient and broadcasts their
    new weights (asyncpp/optim/distributed.py, pipeline/sharded.py). Pipeline runs only; with dp=1 it is a
    no-op, as in Megatron. Not with the gradient corrections (staleness.dc_lambda, grad_ef_lambda)."""
    head_split: Literal["none", "tokens"] = "none"
    """tokens: stage 0 runs the LM head and loss of a share of every microbatch's tokens for the last stage
    (a replica of the head weight, reduced like a tied embedding), so a head that costs several blocks no
    longer caps the pipeline's balance (asyncpp/core/head_split.py, docs/parallelism.md). Pipeline runs with
    schedule sync, 1f1b or 2bw, tp=1; the mathematics is the unsplit model's (the simulator ignores it)."""
    head_split_tokens: int | None = None
    """With head_split=tokens: how many of the micro_batch_size x seq_len tokens the helper takes; None = the
    cost model's balance (chosen with stage_layers=auto's split)."""
    head: Literal["last", "vocab"] = "last"
    """Where the LM head and its loss run. last: on the last stage. vocab: its vocabulary spread over every
    stage, each holding rows sized with its layers by the cost model (asyncpp/core/vocab_split.py,
    pipeline/vocab_head.py), so a 128k-wide head no longer makes the last stage the pipeline's slowest."""
    vocab_shards: tuple[int, ...] | None = None
    """With head=vocab: every stage's rows of the head, in stage order, summing to the vocabulary; None = the
    cost model's (sized together with stage_layers)."""


#: train.num_microbatches when neither it nor train.global_batch_size is given.
DEFAULT_MICROBATCHES = 4


RecomputeMode = Literal["none", "selective", "full"]


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 300
    micro_batch_size: int = 8
    num_microbatches: int | None = None
    """Microbatches per step per DP replica (m). None: derived from global_batch_size, else
    DEFAULT_MICROBATCHES. Read it from a validated config (RunConfig.validate fills it in)."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all DP replicas (Megatron's --global-batch-size); m is derived as
    global_batch_size / (micro_batch_size x dp), which must divide it. None = micro_batch_size x m x dp."""
    batch_rampup: tuple[int, int, int] | None = None
    """[start, increment, samples]: Megatron's --rampup-batch-size. The global batch starts at `start` sequences
    and grows by `increment` every samples / ((global_batch_size - start) / increment) consumed samples until it
    reaches global_batch_size (the m of a step follows, asyncpp/core/batches.py). start and increment must be
    multiples of micro_batch_size x dp. None = off. The LR schedule stays step-based."""
    seq_len: int = 128
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (the norm is still logged)."""
    eval_every: int = 50
    eval_batches: int = 8
    max_consecutive_skips: int = 5
    """Abort after this many consecutive steps with a non-finite gradient."""
    device: str = "cpu"
    """torch device type ("cpu", "cuda"); under torchrun each rank takes cuda:LOCAL_RANK."""
    timeout_s: float = 300.0
    """How long a pipeline rank waits for a neighbour or a collective before failing with an error
    that names its stage and what it was waiting for (a dead rank must not hang the others)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: forward/backward and every weight version in bfloat16; fp32 master weights, fp32 optimizer
    state, and each microbatch's bf16 gradient summed into an fp32 accumulator (reduced in fp32).
    fp32: everything in float32 (bit-identical to runs before this option existed). docs/gpu.md."""
    backend: Literal["local", "te", "mcore"] = "local"
    """Layer implementations: local (PyTorch + SDPA), te (transformer-engine), mcore (megatron-core).
    te/mcore need a CUDA device; without their package the run falls back to local with a message
    (`pip install -e .[gpu]`). model_zoo/backends, docs/gpu.md."""
    compile: bool = False
    """torch.compile each transformer block (one graph per block, reused by every pipeline stage)."""
    recompute: RecomputeMode | tuple[RecomputeMode, ...] = "none"
    """Activation recomputation: none; selective (each block's token mixer is replayed in the backward);
    full (each block keeps only its input). One mode, or one per pipeline stage (a list of parallel.pp
    modes). Bit-identical gradients, less activation memory (asyncpp/core/recompute.py)."""
    peak_tflops: float | None = None
    """Per-device peak TFLOP/s for the log's MFU; None = the device table (asyncpp/train/throughput.py:
    H100/H200/A100), and no MFU on a CPU."""
    host_mmap_threshold: int | None = None
    """Host memory (glibc): every allocation of this many bytes or more gets an mmap of its own, returned to
    the kernel when freed, and glibc no longer raises this threshold as it goes (131072, glibc's own starting
    value, is the usual choice). RSS then tracks live bytes (what a memory plan counts; bench/memory_plan.py
    sets it), but every activation-sized block costs page faults, which halved tiny_dense's CPU throughput
    (bench/peers.py --memory), so it is off by default: null keeps glibc's dynamic threshold. No effect on
    other C libraries or on device memory (asyncpp/host/allocator.py)."""
    allow_oversubscribe: bool = False
    """Start a run whose memory plan exceeds the device's (or, on a CPU, the node's) memory; off: such a run is
    refused before anything is built (asyncpp/train/preflight.py check_memory)."""
    host_trim_threshold: int | None = None
    """Host memory (glibc): free bytes the heap keeps at its top instead of returning them to the kernel; setting
    it also stops glibc's dynamic thresholds. With host_mmap_threshold=33554432 and 2147483647 here, a CPU run
    reuses its heap instead of faulting pages in every microbatch (about 10% of a CPU step's time at M=8) and
    RSS stays at its high-water mark. null keeps glibc's default (asyncpp/host/allocator.py)."""

    def __post_init__(self) -> None:
        # Without a global batch size the microbatch count needs no dp: fill it in at once, so a config built
        # in Python without validate() still reads a number. With one, validate() derives it from dp.
        if self.num_microbatches is None and self.global_batch_size is None:
            self.num_microbatches = DEFAULT_MICROBATCHES


@dataclass(kw_only=True)
class LRScheduleConfig:
    kind: Literal["constant", "cosine", "wsd"] = "cosine"
    warmup_steps: int | None = None
    """Linear warmup steps; None = round(warmup_fraction x train.steps), so any train.steps fits."""
    warmup_fraction: float = 0.1
    """The warmup's share of the run when warmup_steps is None (the paper's recipe: 10%)."""
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    """WSD only: the final fraction of steps over which the LR decays."""

    def warmup_for(self, total_steps: int) -> int:
        """The warmup in steps for a run of `total_steps` (the one place the fraction is turned into steps)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return round(self.warmup_fraction * total_steps)


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adamw", "muon", "normuon", "soap", "lion", "ademamix", "mars", "signum", "adan"] = "muon"
    """muon/normuon/soap take the hidden matrices (AdamW the rest); the others take every parameter."""
    lr: float = 0.01
    adamw_lr: float | None = None
    """LR of the AdamW part of Muon runs (embeddings, head, norms); None = same as lr."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    muon_compute_dtype: Literal["float32", "bfloat16"] | None = None
    """Muon/NorMuon Newton-Schulz dtype; null = the parameters' (fp32). bfloat16 is torch.optim.Muon's choice
    and ~5x faster on GPUs and AVX512-BF16 CPUs; momentum, weights and the update stay fp32."""
    tp_mode: Literal["gather", "block"] = "gather"
    """Muon on TP-sharded matrices: 'gather' all-gathers each shard's momentum and orthogonalizes the full
    matrix (exact, one all-gather per step); 'block' orthogonalizes each shard on its own (no communication,
    a different update). NorMuon/SOAP only do 'block'. docs/muon.md has the trade-off."""
    precondition_frequency: int = 10
    """SOAP: refresh the eigenbasis of the Shampoo statistics every this many steps (the paper's f)."""
    beta3: float = 0.9999
    """AdEMAMix: coefficient of the slow gradient EMA. Adan: coefficient of the second moment (its third beta)."""
    alpha: float = 5.0
    """AdEMAMix: weight of the slow EMA in the update's numerator."""
    ademamix_warmup_steps: int = 0
    """AdEMAMix: steps over which alpha and beta3 warm up (the paper: the whole run); 0 = no warmup."""
    gamma: float = 0.025
    """MARS: scale of the variance-reduction term gamma * beta1 / (1 - beta1) * (g_t - g_{t-1})."""
    schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)


@dataclass(kw_only=True)
class ScheduleConfig:
    name: ScheduleName = "2bw"


@dataclass(kw_only=True)
class StalenessConfig:
    ef_lambda: float = 0.0
    """Update-level Error Feedback coefficient; 0 turns it off (bit-identical to plain delay)."""
    sync_start_steps: int = 0
    sync_cooldown_steps: int = 0
    grad_ef_lambda: float = 0.0
    """Gradient-level Error Feedback (the ablation that diverges): the base optimizer sees
    g_t + lambda * (g_t - g_{t-1}); 0 turns it off."""
    dc_lambda: float = 0.0
    """DC-ASGD Taylor compensation: the base optimizer sees g + dc_lambda * g * g * (x_t - x_{t-d});
    0 turns it off (simulator only with schedule=pipedream)."""
    weight_prediction: bool = False
    """SAPipe-style weight prediction: forward/backward on x_{t-d} + d * (x_{t-d} - x_{t-d-1}) instead
    of x_{t-d}."""
    diagnostics_every: int = 0
    """Every K steps also compute the fresh (non-delayed) update and log update_cosine and
    update_rel_error; 0 turns it off. Simulator only: it needs a second forward/backward per step."""


#: StalenessConfig fields the single-process simulator implements and the pipeline runtime does not: the
#: fresh-vs-delayed diagnostics need a second forward/backward of every step on the fresh weights x_t.
SIMULATOR_ONLY_STALENESS = ("diagnostics_every",)


def simulator_only_options(staleness: StalenessConfig) -> list[str]:
    """'field=value' for each simulator-only staleness option that is on (a pipeline run must refuse them)."""
    return [f"staleness.{n}={getattr(staleness, n)}" for n in SIMULATOR_ONLY_STALENESS if getattr(staleness, n)]


def check_pipeline_options(cfg: RunConfig, model: ModelLimits) -> None:
    """What a multi-process pipeline cannot run (the simulator can), refused before any process group exists."""
    only = simulator_only_options(cfg.staleness)
    if only:
        raise ConfigError(
            f"{', '.join(only)}: the fresh-vs-delayed diagnostics need a second forward/backward of every step "
            "on the fresh weights, which only the single-process simulator runs; run `python pretrain.py ...` "
            "without torchrun, or set staleness.diagnostics_every=0"
        )
    p = cfg.parallel
    if cfg.train.backend != "local" and (p.tp > 1 or p.ep > 1):
        raise ConfigError(f"train.backend={cfg.train.backend} is not combined with tensor/expert parallelism yet "
                          f"(parallel.tp={p.tp}, parallel.ep={p.ep}); use train.backend=local")
    tied = getattr(model, "tie_embeddings", True)
    if cfg.staleness.dc_lambda and cfg.schedule.name == "pipedream" and cfg.parallel.pp > 1 and tied:
        # The tied embedding's copies are read at different delays under PipeDream; DC-ASGD corrects their
        # summed gradient with the first stage's x_{t-d}, which the last stage (delay 0) does not hold.
        raise ConfigError(
            f"staleness.dc_lambda={cfg.staleness.dc_lambda} with schedule=pipedream and model '{model.name}' "
            "(tied embeddings) runs only in the single-process simulator: the last stage does not hold the first "
            "stage's stale version of the tied weight; use schedule=2bw, an untied model "
            "(+model.overrides.tie_embeddings=false), or `python pretrain.py ...` without torchrun"
        )


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


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    """Where step_* checkpoints go; None = <out_dir>/checkpoints."""
    every: int = 0
    """Save every N steps (and at the end of the run); 0 = only at the end."""
    every_minutes: float = 30.0
    """Also save once this much wall-clock time has passed since the last save or the start (rank 0's clock,
    agreed by every rank at a step boundary, like Megatron's --save-interval by time); 0 = off."""
    warn_loss_minutes: float = 60.0
    """Warn at start (after the first steps, from their time) when a crash could lose more than this much work."""
    keep_last: int = 3
    resume: str = "auto"
    """'auto' = the newest complete checkpoint in `dir` if there is one, 'none', or a step_* path."""
    enabled: bool = True
    """Write checkpoints (resuming is governed by `resume` alone)."""
    async_save: bool = False
    """Write shards in the background (DCP async_save); rank 0 commits the checkpoint from DCP's completion
    callback as soon as every shard is written, so a crash after that never loses it."""


@dataclass(kw_only=True)
class LoggingConfig:
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "asyncpp"
    run_name: str | None = None
    log_every: int = 10
    progress: bool = True


@dataclass(kw_only=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 1234
    out_dir: str = "outputs/run"
    dry_run: int = 0
    """> 0: lay the job out for this many ranks on a fake process group (no GPU, no memory: meta tensors)
    and print each stage's shard shapes and per-rank memory instead of training."""

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        return from_dict(cls, data)

    def to_dict(self) -> dict:
        return to_dict(self)

    def replace(self, **sections) -> RunConfig:
        return dataclasses.replace(self, **sections)

    def validate(self, model: ModelLimits) -> RunConfig:
        """Cross-field checks, on the config with its derived values filled in (the microbatch count of
        train.global_batch_size, the warmup of warmup_fraction). Returns that resolved config; raises
        ConfigError naming the field, the value and the fix. Under torchrun, set parallel.dp from the
        world size first (asyncpp.job.resolve does), so the microbatch count is derived from the real dp."""
        _check_finite(self, model)
        cfg = _resolve_derived(self)
        for check in (_check_run, _check_train, _check_batch_rampup, _check_parallel, _check_tp_ep, _check_optimizer,
                      _check_staleness, _check_data, _check_logging, _check_checkpoint):
            check(cfg, model)
        return cfg


def derive_num_microbatches(t: TrainConfig, dp: int) -> int:
    """train.num_microbatches of a config: given, derived from global_batch_size (which must split into
    whole microbatches on every DP replica, and agree with an explicit m), or DEFAULT_MICROBATCHES."""
    _positive("train.micro_batch_size", t.micro_batch_size)
    if t.global_batch_size is None:
        return DEFAULT_MICROBATCHES if t.num_microbatches is None else t.num_microbatches
    _positive("train.global_batch_size", t.global_batch_size)
    per_step = t.micro_batch_size * dp
    m, rest = divmod(t.global_batch_size, per_step)
    if rest or m < 1:
        lower, upper = max(per_step, t.global_batch_size - rest), (m + 1) * per_step
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
            f"{t.micro_batch_size} x dp={dp} = {per_step} (every replica runs whole microbatches); use "
            f"train.global_batch_size={lower} or {upper}, or change train.micro_batch_size"
        )
    if t.num_microbatches is not None and t.num_microbatches != m:
        raise ConfigError(
            f"train.num_microbatches={t.num_microbatches} disagrees with train.global_batch_size="
            f"{t.global_batch_size} / (train.micro_batch_size={t.micro_batch_size} x dp={dp}) = {m}; set only one "
            "of them (train.num_microbatches=null derives it)"
        )
    return m


def _resolve_derived(cfg: RunConfig) -> RunConfig:
    """The config with its derived fields filled in; the checks below then see plain numbers."""
    t, s = cfg.train, cfg.optimizer.schedule
    if not 0.0 <= s.warmup_fraction <= 1.0:
        raise ConfigError(f"optimizer.schedule.warmup_fraction={s.warmup_fraction} must be in [0, 1] (the share of "
                          "train.steps spent warming up); e.g. optimizer.schedule.warmup_fraction=0.1")
    _positive("train.steps", t.steps)
    m = derive_num_microbatches(t, cfg.parallel.dp or 1)
    warmup = s.warmup_for(t.steps)
    train = dataclasses.replace(t, num_microbatches=m, global_batch_size=m * t.micro_batch_size * (cfg.parallel.dp or 1))
    schedule = dataclasses.replace(s, warmup_steps=warmup)
    return cfg.replace(train=train, optimizer=dataclasses.replace(cfg.optimizer, schedule=schedule))


def _check_finite(cfg: RunConfig, model: ModelLimits) -> None:
    """nan passes every range check below (nan < 0 is False) and inf most of them, so refuse both first."""
    for path, value, default in _float_fields(cfg):
        if not math.isfinite(value):
            raise ConfigError(f"{path}={value} must be a finite number; e.g. the default {path}={default}")


def _float_fields(obj: object, prefix: str = "") -> Iterator[tuple[str, float, object]]:
    """(dotted path, value, default) of every float in a config dataclass, tuple entries included."""
    for f in dataclasses.fields(obj):
        value, path = getattr(obj, f.name), prefix + f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(value):
            yield from _float_fields(value, path + ".")
        elif isinstance(value, float):
            yield path, value, default
        elif isinstance(value, tuple):
            defaults = default if isinstance(default, tuple) and len(default) == len(value) else [None] * len(value)
            for i, (v, d) in enumerate(zip(value, defaults)):
                if isinstance(v, float):
                    yield f"{path}[{i}]", v, d


SEED_MAX = 2**32 - 1
"""megatron-core seeds its dataset shuffles with numpy.random.RandomState, which takes 32-bit seeds."""


def _check_run(cfg: RunConfig, model: ModelLimits) -> None:
    if not 0 <= cfg.seed <= SEED_MAX:
        raise ConfigError(f"seed={cfg.seed} must be in [0, {SEED_MAX}] (the data order is seeded by numpy, which "
                          "takes 32-bit seeds); e.g. seed=1234")

    if not cfg.out_dir.strip():
        raise ConfigError(f"out_dir={cfg.out_dir!r} is empty; give a directory, or leave the default "
                          "(hydra's run directory)")


def _positive(path: str, value: float, fix: str = "") -> None:
    if value < 1:
        raise ConfigError(f"{path}={value} must be >= 1{'; ' + fix if fix else ''}")


def _check_train(cfg: RunConfig, model: ModelLimits) -> None:
    t = cfg.train
    _positive("train.steps", t.steps)
    _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("train.num_microbatches", t.num_microbatches, "it is the number of microbatches per step (m)")
    _positive("train.seq_len", t.seq_len)
    _positive("train.eval_batches", t.eval_batches)
    _positive("train.max_consecutive_skips", t.max_consecutive_skips)
    if t.seq_len > model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is above the maximum sequence length {model.max_seq_len} of "
            f"model '{model.name}'; set train.seq_len<={model.max_seq_len}"
        )
    if t.timeout_s <= 0:
        raise ConfigError(f"train.timeout_s={t.timeout_s} must be > 0 (seconds)")
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        raise ConfigError(f"train.peak_tflops={t.peak_tflops} must be > 0 (a device's peak TFLOP/s, e.g. "
                          "train.peak_tflops=989 for an H100 in bf16), or null to look the device up")
    if t.host_mmap_threshold is not None and not 0 <= t.host_mmap_threshold <= MMAP_THRESHOLD_MAX:
        raise ConfigError(f"train.host_mmap_threshold={t.host_mmap_threshold} is outside glibc's range [0, "
                          f"{MMAP_THRESHOLD_MAX}] (bytes); use e.g. 131072 (glibc's initial value), or null to "
                          "keep glibc's dynamic threshold")
    if t.host_trim_threshold is not None and not 0 <= t.host_trim_threshold <= TRIM_THRESHOLD_MAX:
        raise ConfigError(f"train.host_trim_threshold={t.host_trim_threshold} is outside mallopt's range [0, "
                          f"{TRIM_THRESHOLD_MAX}] (bytes); use {TRIM_THRESHOLD_MAX} to never give the heap's top "
                          "back, or null to keep glibc's default")
    if t.grad_clip < 0:
        raise ConfigError(f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every={t.eval_every} must be >= 0 (0 disables evaluation)")
    if not _DEVICE.fullmatch(t.device):
        raise ConfigError(
            f"train.device={t.device!r} is not a device this runtime runs on; use train.device=cpu or "
            "train.device=cuda (under torchrun each rank takes cuda:LOCAL_RANK)"
        )
    # A GPU-only backend on the CPU is a contradiction in the config itself, so it fails here, before
    # anything is built; a missing *package* on a GPU machine only falls back (model_zoo/backends).
    if not isinstance(t.recompute, str) and len(t.recompute) != cfg.parallel.pp:
        raise ConfigError(
            f"train.recompute={list(t.recompute)} gives {len(t.recompute)} modes but parallel.pp={cfg.parallel.pp}; "
            "give one mode per stage (e.g. train.recompute=[full,none]) or one for all (train.recompute=full)"
        )
    if t.recompute != "none" and t.backend != "local":  # a backend swaps the modules recompute wraps
        raise ConfigError(f"train.recompute={t.recompute} is not combined with train.backend={t.backend} yet; "
                          "use train.backend=local, or train.recompute=none")
    if t.backend != "local" and not t.device.startswith("cuda"):
        raise ConfigError(
            f"train.backend={t.backend} runs only on CUDA devices, but train.device={t.device}; use "
            "train.backend=local on the CPU, or train.device=cuda"
        )


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _check_batch_rampup(cfg: RunConfig, model: ModelLimits) -> None:
    """train.batch_rampup: Megatron's rule needs start < global batch, a whole number of increments between
    them and samples >= 1 (it divides by both); every batch on the ramp must split into whole microbatches on
    every replica, and the smallest one must still serve the schedule (2BW: m >= P)."""
    t, dp = cfg.train, cfg.parallel.dp or 1
    if t.batch_rampup is None:
        return
    start, increment, samples = t.batch_rampup
    final, per_step = t.global_batch_size, t.micro_batch_size * dp
    field = f"train.batch_rampup={list(t.batch_rampup)}"
    for name, value in (("start", start), ("increment", increment), ("samples", samples)):
        if value < 1:
            raise ConfigError(f"{field}: {name}={value} must be >= 1 ([start, increment, samples], e.g. "
                              f"train.batch_rampup=[{per_step},{per_step},{100 * final}])")
    for name, value in (("start", start), ("increment", increment)):
        if value % per_step:
            lower, upper = max(per_step, value - value % per_step), (value // per_step + 1) * per_step
            raise ConfigError(f"{field}: {name}={value} is not a multiple of train.micro_batch_size="
                              f"{t.micro_batch_size} x dp={dp} = {per_step} (every batch on the ramp must split into "
                              f"whole microbatches on every replica); use {name}={lower} or {upper}")
    if start >= final:
        raise ConfigError(f"{field}: start={start} must be below train.global_batch_size={final} (the batch the "
                          "ramp ends at); lower start, raise train.global_batch_size, or set train.batch_rampup=null")
    if (final - start) % increment:
        raise ConfigError(f"{field}: train.global_batch_size={final} - start={start} = {final - start} is not a "
                          f"multiple of increment={increment} (the ramp must land on the global batch); use an "
                          f"increment dividing {final - start}, e.g. {per_step}")
    m0 = start // per_step  # the ramp's first batch has the fewest microbatches
    if not kind_of(cfg.schedule.name).serves(cfg.parallel.pp, m0):  # the registry's rule (2bw: m >= P)
        raise ConfigError(f"{field}: its first batch of start={start} sequences runs m={m0} microbatches per "
                          f"replica, fewer than parallel.pp={cfg.parallel.pp}, which schedule={cfg.schedule.name} "
                          f"needs (two weight versions cannot cover the in-flight work); raise start to "
                          f"{cfg.parallel.pp * per_step}")


def _check_parallel(cfg: RunConfig, model: ModelLimits) -> None:
    p, m = cfg.parallel, cfg.train.num_microbatches
    if cfg.dry_run < 0:
        raise ConfigError(f"dry_run={cfg.dry_run} must be a world size (e.g. dry_run=8), or 0 to train")
    for name in ("pp", "tp", "ep"):
        _positive(f"parallel.{name}", getattr(p, name))
    if p.dp is not None:
        _positive("parallel.dp", p.dp, "or leave it null to derive it from the world size")
    s = cfg.staleness
    if p.distributed_optimizer and (s.dc_lambda or s.grad_ef_lambda):
        raise ConfigError(
            f"parallel.distributed_optimizer=true with staleness.dc_lambda={s.dc_lambda}, staleness.grad_ef_lambda="
            f"{s.grad_ef_lambda}: the gradient corrections read every parameter's gradient, which the distributed "
            "optimizer leaves on its owner only; set both to 0 or parallel.distributed_optimizer=false")
    if p.sequence_parallel and cfg.train.seq_len % p.tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true splits the sequence over parallel.tp={p.tp} ranks, which does not "
            f"divide train.seq_len={cfg.train.seq_len}; use a multiple of {p.tp} or parallel.sequence_parallel=false"
        )
    if cfg.schedule.name == "pipedream" and p.pp < 2:
        raise ConfigError(
            f"schedule=pipedream with parallel.pp={p.pp}: its per-stage delays P-1-s depend on the number of "
            "stages, so say how many it models, e.g. parallel.pp=4 (one process simulates them)"
        )
    if p.stage_layers == "auto" and getattr(model, "hidden_size", None) is None:
        raise ConfigError(f"parallel.stage_layers=auto needs the model's shape to cost its layers (model "
                          f"'{model.name}' was given by its limits only); give the split, e.g. parallel.stage_layers=[3,1]")
    explicit = p.stage_layers not in (None, "auto")
    if explicit and (
        len(p.stage_layers) != p.pp or sum(p.stage_layers) != model.num_layers or min(p.stage_layers) < 0
    ):
        raise ConfigError(
            f"parallel.stage_layers={list(p.stage_layers)} must have parallel.pp={p.pp} non-negative entries "
            f"summing to the {model.num_layers} layers of model '{model.name}', or be auto (balanced by the "
            "cost model)"
        )
    if not explicit and p.pp > model.num_layers:
        raise ConfigError(
            f"parallel.pp={p.pp} is more stages than model '{model.name}' has layers ({model.num_layers}); "
            f"set parallel.pp<={model.num_layers}"
        )
    try:  # the registry knows which (P, m) each kind serves (2bw: m >= P)
        kind_of(cfg.schedule.name).check(p.pp, m)
    except ScheduleKindError as e:
        raise ConfigError(str(e)) from None
    _check_head_split(cfg)


def _check_head_split(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.head_split not in ("none", "tokens"):
        raise ConfigError(f"parallel.head_split={p.head_split!r} is not one of none, tokens (vocabulary sharding "
                          "across stages is not implemented: docs/parallelism.md says why tokens)")
    if p.head_split == "none":
        if p.head_split_tokens is not None:
            raise ConfigError(f"parallel.head_split_tokens={p.head_split_tokens} needs parallel.head_split=tokens; "
                              "set it or leave head_split_tokens null")
        return
    try:
        check_head_split(cfg.schedule.name, p.pp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if p.tp > 1 or p.sequence_parallel:
        raise ConfigError(f"parallel.head_split=tokens with parallel.tp={p.tp}: the TP head is vocabulary-parallel "
                          "already (its shards are split over TP ranks); use parallel.head_split=none with tp > 1")
    # Tested at dp=1 with Error Feedback only (tests/dist/test_head_split.py); the combinations below have no
    # equivalence test yet, so they are refused rather than run untested.
    untested = [f"parallel.dp={p.dp}"] if (p.dp or 1) > 1 else []
    untested += ["parallel.distributed_optimizer=true"] if p.distributed_optimizer else []
    s = cfg.staleness
    untested += [f"staleness.{k}={getattr(s, k)}" for k in ("weight_prediction", "dc_lambda", "grad_ef_lambda")
                 if getattr(s, k)]
    if untested:
        raise ConfigError(f"parallel.head_split=tokens with {', '.join(untested)} is not supported yet (no "
                          "equivalence test covers it); use parallel.head_split=none with these")
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    n = p.head_split_tokens
    if n is not None and not 1 <= n < tokens:
        raise ConfigError(f"parallel.head_split_tokens={n} must be in [1, {tokens - 1}] (the helper takes a share of "
                          f"train.micro_batch_size x train.seq_len = {tokens} tokens, the last stage keeps the rest); "
                          "or null for the cost model's share")


def _check_tp_ep(cfg: RunConfig, model: ModelLimits) -> None:
    check_parallel_sizes(model, cfg.parallel.tp, cfg.parallel.ep)


def check_parallel_sizes(model: ModelLimits, tp: int, ep: int = 1) -> None:
    """Megatron's divisibility rules, the one copy of them (config validation and the TP plan both call
    it): a TP rank holds whole query heads, whole KV groups, whole GDN heads and an equal slice of the
    ffn, every expert's ffn and the vocabulary; an EP rank holds whole experts. Read with getattr:
    ModelLimits only promises what every caller can provide. Needs no process group."""
    heads = {k: getattr(model, k, None) for k in ("num_heads", "num_kv_heads")}
    common = math.gcd(*(v for v in heads.values() if v is not None))
    gdn, moe = getattr(model, "gdn", None), getattr(model, "moe", None)
    sizes = {
        **{key: (n, "whole heads", common) for key, n in heads.items()},
        "gdn.num_heads": (getattr(gdn, "num_heads", None) if "gdn" in getattr(model, "layer_types", ()) else None,
                          "whole heads", None),
        "vocab_size": (model.vocab_size, "an equal slice of the embedding and LM head rows", None),
        "ffn_hidden_size": (getattr(model, "ffn_hidden_size", None) if moe is None else None, "an equal slice", None),
    }
    if moe is not None:  # each TP rank holds a slice of every expert's (and the shared expert's) ffn
        sizes["moe.expert_ffn_hidden_size"] = (moe.expert_ffn_hidden_size, "an equal slice of every expert", None)
        sizes["moe.shared_expert_ffn_hidden_size"] = (moe.shared_expert_ffn_hidden_size, "an equal slice", None)
    for key, (n, holds, choices_of) in sizes.items():
        if n is not None and n % tp:
            raise ConfigError(
                f"model.{key}={n} is not divisible by parallel.tp={tp} (model '{model.name}': each "
                f"tensor-parallel rank holds {holds}); choose parallel.tp in {divisors(choices_of or n)}"
            )
    if ep > 1 and moe is None:
        raise ConfigError(f"parallel.ep={ep} but model '{model.name}' has no experts; set parallel.ep=1")
    if moe is not None and moe.num_experts % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide the {moe.num_experts} experts of model '{model.name}'; "
            f"choose parallel.ep in {divisors(moe.num_experts)}"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_optimizer(cfg: RunConfig, model: ModelLimits) -> None:
    o = cfg.optimizer
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr={o.lr} must be > 0")
    if o.adamw_lr is not None and o.adamw_lr <= 0:
        raise ConfigError(f"optimizer.adamw_lr={o.adamw_lr} must be > 0 (or null to reuse optimizer.lr)")
    if o.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    if o.eps <= 0:
        raise ConfigError(f"optimizer.eps={o.eps} must be > 0 (it keeps AdamW's denominator away from 0); "
                          "e.g. optimizer.eps=1e-8")
    for i, b in enumerate(o.betas):
        if not 0.0 <= b < 1.0:
            raise ConfigError(f"optimizer.betas[{i}]={b} must be in [0, 1)")
    if not 0.0 <= o.momentum < 1.0:
        raise ConfigError(f"optimizer.momentum={o.momentum} must be in [0, 1)")
    _positive("optimizer.ns_steps", o.ns_steps)
    if o.name in ("normuon", "soap") and cfg.parallel.tp > 1 and o.tp_mode != "block":
        raise ConfigError(f"optimizer.name={o.name} with parallel.tp={cfg.parallel.tp} updates each TP shard of a "
                          "matrix on its own; set optimizer.tp_mode=block to accept that, or use optimizer.name=muon")
    _check_optimizer_extras(o)
    _check_unused_options(o)
    s = o.schedule
    if not 0 <= s.warmup_steps <= cfg.train.steps:
        raise ConfigError(
            f"optimizer.schedule.warmup_steps={s.warmup_steps} must be in [0, train.steps={cfg.train.steps}]; "
            f"lower it, or set optimizer.schedule.warmup_steps=null to warm up for optimizer.schedule."
            f"warmup_fraction={s.warmup_fraction} of the run"
        )
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ConfigError(f"optimizer.schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")
    if not 0.0 < s.decay_fraction <= 1.0:
        raise ConfigError(f"optimizer.schedule.decay_fraction={s.decay_fraction} must be in (0, 1]")


#: The optimizer fields that only some optimizers read (every configs/optimizer/*.yaml lists them all at their
#: defaults, so a sweep can switch optimizer=...). Muon, NorMuon and SOAP run AdamW on the rest of the model.
OPTIMIZER_FIELD_USERS = {
    "adamw_lr": ("muon", "normuon", "soap"),
    "betas": ("adamw", "muon", "normuon", "soap", "lion", "ademamix", "mars", "adan"),
    "eps": ("adamw", "muon", "normuon", "soap", "ademamix", "mars", "adan"),
    "momentum": ("muon", "normuon", "signum"),
    "nesterov": ("muon", "normuon"),
    "ns_steps": ("muon", "normuon"),
    "adjust_lr": ("muon",),
    "muon_compute_dtype": ("muon", "normuon"),
    "tp_mode": ("muon", "normuon", "soap"),
    "precondition_frequency": ("soap",),
    "beta3": ("ademamix", "adan"),
    "alpha": ("ademamix",),
    "ademamix_warmup_steps": ("ademamix",),
    "gamma": ("mars",),
}


def _check_unused_options(o: OptimizerConfig) -> None:
    """An option changed from its default for an optimizer that never reads it is a mistake (a sweep that meant
    another optimizer, a Muon setting left on an AdamW run): refused rather than silently ignored."""
    defaults = OptimizerConfig()
    for name, users in OPTIMIZER_FIELD_USERS.items():
        value = getattr(o, name)
        if o.name not in users and value != getattr(defaults, name):
            raise ConfigError(
                f"optimizer.{name}={value!r} is not read by optimizer.name={o.name} (only by {', '.join(users)}); "
                f"drop it (its default is {getattr(defaults, name)!r}), or choose one of those optimizers")


def _check_optimizer_extras(o: OptimizerConfig) -> None:
    """The fields only some optimizers read (SOAP, AdEMAMix, MARS, Adan)."""
    _positive("optimizer.precondition_frequency", o.precondition_frequency, "SOAP refreshes its eigenbasis every "
              "this many steps; the paper uses optimizer.precondition_frequency=10")
    if not 0.0 <= o.beta3 < 1.0:
        raise ConfigError(f"optimizer.beta3={o.beta3} must be in [0, 1) (AdEMAMix's slow EMA, Adan's second "
                          "moment; e.g. optimizer.beta3=0.999)")
    if o.alpha < 0:
        raise ConfigError(f"optimizer.alpha={o.alpha} must be >= 0 (AdEMAMix's slow-EMA weight; e.g. optimizer.alpha=5)")
    if o.ademamix_warmup_steps < 0:
        raise ConfigError(
            f"optimizer.ademamix_warmup_steps={o.ademamix_warmup_steps} must be >= 0 (0 = no alpha/beta3 warmup; "
            "the paper warms up over the whole run, optimizer.ademamix_warmup_steps=${train.steps})"
        )
    if not 0.0 <= o.gamma <= 1.0:
        raise ConfigError(f"optimizer.gamma={o.gamma} must be in [0, 1] (MARS's variance-reduction scale; "
                          "the paper uses optimizer.gamma=0.025)")


def _check_staleness(cfg: RunConfig, model: ModelLimits) -> None:
    s, sched = cfg.staleness, cfg.schedule.name
    if s.ef_lambda < 0:
        raise ConfigError(
            f"staleness.ef_lambda={s.ef_lambda} must be >= 0 (0 turns Error Feedback off; the paper uses 1)"
        )
    for name in ("grad_ef_lambda", "dc_lambda", "diagnostics_every"):
        if getattr(s, name) < 0:
            raise ConfigError(f"staleness.{name}={getattr(s, name)} must be >= 0 (0 turns it off)")
    for name in ("sync_start_steps", "sync_cooldown_steps"):
        if getattr(s, name) < 0:
            raise ConfigError(f"staleness.{name}={getattr(s, name)} must be >= 0")
    if s.sync_start_steps + s.sync_cooldown_steps > cfg.train.steps:
        raise ConfigError(
            f"staleness.sync_start_steps={s.sync_start_steps} + staleness.sync_cooldown_steps="
            f"{s.sync_cooldown_steps} exceed train.steps={cfg.train.steps}; shorten them"
        )
    delayed_only = ("ef_lambda", "sync_start_steps", "sync_cooldown_steps", "grad_ef_lambda", "dc_lambda",
                    "weight_prediction")
    on = [f"staleness.{n}={getattr(s, n)}" for n in delayed_only if getattr(s, n)]
    if sched in SYNC_SCHEDULES and on:
        raise ConfigError(
            f"staleness options ({', '.join(on)}) only apply to delayed schedules, but "
            f"schedule={sched}; use schedule=2bw or schedule=pipedream, or set them to 0 (false for weight_prediction)"
        )


def _check_checkpoint(cfg: RunConfig, model: ModelLimits) -> None:
    c = cfg.checkpoint
    if c.every < 0:
        raise ConfigError(f"checkpoint.every={c.every} must be >= 0 (0 = only at the end)")
    if c.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={c.keep_last} must be >= 1")
    for name in ("every_minutes", "warn_loss_minutes"):
        if getattr(c, name) < 0:
            raise ConfigError(f"checkpoint.{name}={getattr(c, name)} must be >= 0 (0 = off)")
    if c.resume not in ("auto", "none") and not c.resume.rstrip("/").split("/")[-1].startswith("step_"):
        raise ConfigError(
            f"checkpoint.resume={c.resume!r} must be 'auto', 'none' or a path to a step_* checkpoint directory"
        )


def _check_data(cfg: RunConfig, model: ModelLimits) -> None:
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
        if len(fields) == 1 and _is_number(fields[0]):
            raise ConfigError(f"data.blend[{i}]={entry!r} is a weight without a prefix; put both in one entry "
                              f"('WEIGHT PREFIX', not Megatron's flat list), {example}")
        if len(fields) not in (1, 2):
            raise ConfigError(f"data.blend[{i}]={entry!r} must be 'WEIGHT PREFIX' or 'PREFIX' (prefixes with spaces "
                              f"are not supported), {example}")
        if len(fields) == 2:
            if not _is_number(fields[0]):
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


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_logging(cfg: RunConfig, model: ModelLimits) -> None:
    lg = cfg.logging
    _positive("logging.log_every", lg.log_every)
    if lg.wandb_mode != "disabled" and not lg.wandb_project.strip():
        raise ConfigError(f"logging.wandb_project={lg.wandb_project!r} is empty with logging.wandb_mode="
                          f"{lg.wandb_mode}; name a project, e.g. logging.wandb_project=asyncpp, "
                          "or use logging=disabled")


__all__ = [
    "DEFAULT_MICROBATCHES",
    "SIMULATOR_ONLY_STALENESS",
    "SYNC_SCHEDULES",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LRScheduleConfig",
    "LoggingConfig",
    "ModelLimits",
    "ModelSection",
    "OptimizerConfig",
    "ParallelConfig",
    "RunConfig",
    "ScheduleConfig",
    "StalenessConfig",
    "TrainConfig",
    "check_pipeline_options",
    "derive_num_microbatches",
    "simulator_only_options",
]
