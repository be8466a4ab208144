"""train.*: the step loop's sizes (batch, microbatches, the batch ramp), device, precision, backend, recompute
and host memory, with their checks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from asyncpp.config.base import ModelLimits, positive
from asyncpp.host.allocator import MMAP_THRESHOLD_MAX, TRIM_THRESHOLD_MAX
from asyncpp.schedules.registry import kind_of
from asyncpp.typed import ConfigError

if TYPE_CHECKING:  # annotations only: run.py imports this module
    from asyncpp.config.run import RunConfig


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
    global_batch_size / (micro_batch_size x dp), which must divide it. None: see batch_scaling."""
    batch_scaling: Literal["fixed", "per_replica"] = "per_replica"
    """The batch when neither num_microbatches nor global_batch_size is given: "fixed" (Megatron; configs/
    pretrain.yaml's default, so every command line's) fixes global_batch_size = micro_batch_size x
    DEFAULT_MICROBATCHES, whatever dp is (each replica runs its share; at dp x pp > DEFAULT_MICROBATCHES under 2BW
    give train.global_batch_size, as with Megatron); "per_replica" runs DEFAULT_MICROBATCHES on every replica, so
    the global batch grows with dp (the behaviour before issue 47). A given num_microbatches is always per replica
    (m), a given global_batch_size always global. The Python default stays per_replica: configs built in code
    (the DP equivalence tests' "two replicas = one with twice the microbatches", tools) keep their meaning."""
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
            if self.batch_scaling == "fixed":  # Megatron: one global batch for every dp (validate() derives m)
                self.global_batch_size = self.micro_batch_size * DEFAULT_MICROBATCHES
            else:
                self.num_microbatches = DEFAULT_MICROBATCHES


def derive_num_microbatches(t: TrainConfig, dp: int) -> int:
    """train.num_microbatches of a config: given, derived from global_batch_size (which must split into
    whole microbatches on every DP replica, and agree with an explicit m), or DEFAULT_MICROBATCHES."""
    positive("train.micro_batch_size", t.micro_batch_size)
    positive("parallel.dp", dp)  # before it divides the global batch (checked here: validate() asks this first)
    if t.global_batch_size is None:
        return DEFAULT_MICROBATCHES if t.num_microbatches is None else t.num_microbatches
    positive("train.global_batch_size", t.global_batch_size)
    per_step = t.micro_batch_size * dp
    m, rest = divmod(t.global_batch_size, per_step)
    if rest or m < 1:
        lower, upper = max(per_step, t.global_batch_size - rest), (m + 1) * per_step
        use = f"{lower}" if lower == upper else f"{lower} or {upper}"
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
            f"{t.micro_batch_size} x dp={dp} = {per_step} (every replica runs whole microbatches); use "
            f"train.global_batch_size={use}, or change train.micro_batch_size"
        )
    if t.num_microbatches is not None and t.num_microbatches != m:
        raise ConfigError(
            f"train.num_microbatches={t.num_microbatches} disagrees with train.global_batch_size="
            f"{t.global_batch_size} / (train.micro_batch_size={t.micro_batch_size} x dp={dp}) = {m}; set only one "
            "of them (train.num_microbatches=null derives it)"
        )
    return m


def check_train(cfg: RunConfig, model: ModelLimits) -> None:
    t = cfg.train
    positive("train.steps", t.steps)
    positive("train.micro_batch_size", t.micro_batch_size)
    positive("train.num_microbatches", t.num_microbatches, "it is the number of microbatches per step (m)")
    positive("train.seq_len", t.seq_len)
    positive("train.eval_batches", t.eval_batches)
    positive("train.max_consecutive_skips", t.max_consecutive_skips)
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


def check_batch_rampup(cfg: RunConfig, model: ModelLimits) -> None:
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
