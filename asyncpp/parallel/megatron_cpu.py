"""megatron-core on the CPU, for tests and examples only: the places where its GPTModel assumes CUDA.

megatron-core 0.16's dense GPTModel (local layer spec, `use_cpu_initialization=True`, gloo) builds on a CPU,
and stops in these places:

- `parallel_state.get_global_memory_buffer().get_tensor` allocates on `torch.cuda.current_device()`
  (megatron/core/utils.py, GlobalMemoryBuffer.get_tensor); the attention's baddbmm input and the TP all-gathers
  take their buffers there. `CpuGlobalMemoryBuffer` allocates them on the CPU.
- The attention's dropout runs inside `tensor_parallel.get_cuda_rng_tracker().fork()`, which swaps the CUDA
  generator's state. `CpuRNGStatesTracker` keeps one named CPU generator state per seed and swaps the CPU
  generator's instead (the same contract: a fork starts where the previous fork of that name stopped, and the
  default generator is left as found).

- With a tied embedding over pipeline stages, GPTModel's constructor copies the shared weight with
  `weight.data.cuda()` before its first all-reduce over the embedding group
  (megatron/core/models/common/language_module/language_module.py:243, LanguageModule.setup_embeddings_and_output_layer).
  `_setup_embeddings_on_cpu` runs megatron's method with that copy skipped and does the same all-reduce on the CPU.

- megatron/core/tensor_parallel/mappings.py allocates the outputs of its gathers, reduce-scatters and all-to-alls on
  `torch.cuda.current_device()` (mappings.py:91, 141, 148, 181, 442: MoE's allgather dispatcher with EP or TP > 1,
  sequence parallelism), and the MoE router moves its CPU weights there and allocates its load counters there
  (megatron/core/transformer/moe/router.py:90, 92, 169, 178, 192, 198); under sequence parallelism the TP
  linears' backward allocates its all-gather buffer there too (megatron/core/tensor_parallel/layers.py:552, 597,
  607). Those three modules get `CpuCurrentDevice` as their `torch`: the real torch module whose `torch.cuda.current_device()` is the CPU (nothing else changes,
  and no other module sees it).
- megatron-core's DistributedDataParallel allocates its gradient (and, with its distributed optimizer, parameter)
  buffers on `torch.cuda.current_device()` (megatron/core/distributed/param_and_grad_buffer.py:800, 806):
  param_and_grad_buffer gets `CpuCurrentDevice` too. With it, DistributedDataParallel and finalize_model_grads run
  a flushed step on the CPU (tests/dist/test_megatron_core.py); asyncpp's 2BW refuses them for reasons of its own
  (asyncpp/pipeline/megatron.py, _refuse_megatron_grad_machinery). megatron's optimizers are not
  shimmed: they allocate with device='cuda' in their constructors (megatron/core/optimizer/optimizer.py:481,
  MixedPrecisionOptimizer and so DistributedOptimizer; :907, FP32Optimizer), and the DistributedOptimizer raises
  for a CPU parameter after that (distrib_optimizer.py:430).
- Without Transformer Engine, megatron/core/transformer/moe/moe_utils.py:1192 (the router's gating linear) reads
  `te_general_gemm`, which only its TE import defines (a NameError); it is set to None, megatron's "no TE" value.
- The MoE alltoall dispatcher (MoEAlltoAllTokenDispatcher) creates a side CUDA stream in its constructor
  (megatron/core/transformer/moe/token_dispatcher.py:444-445) and, at its `cuda_dtoh_point`, copies the split sizes
  to the host on that stream, records an event and synchronizes on it at its `cuda_sync_point`
  (token_dispatcher.py:869-898). token_dispatcher gets `CpuCurrentDevice` as its `torch`, whose `cuda.Stream`,
  `cuda.current_stream` and `cuda.stream` are the CPU's streams (`CpuStream`: torch.cpu.Stream, whose record_event
  returns a `CpuEvent`). The ordering contract holds trivially: on the CPU every op has completed when it returns,
  in program order, so an event is reached when it is recorded and synchronize() has nothing to wait for. The split
  sizes are CPU tensors already, but megatron's maybe_move_tensor_to_cpu (moe_utils.py:1093) converts to numpy only
  what it copied from CUDA, and all_to_all_single takes a sequence of ints, not a tensor: token_dispatcher's
  `maybe_move_tensor_to_cpu` is `_host_copy`, which converts a CPU tensor to numpy as megatron converts its host
  copy.
- Sequence parallelism needs a norm whose parameters carry `sequence_parallel` (megatron's FusedLayerNorm sets it,
  fused_layer_norm.py, and TE's norms; both need apex or Transformer Engine, i.e. CUDA), while the local spec's
  WrappedTorchNorm asserts `not config.sequence_parallel` (megatron/core/transformer/torch_norm.py:32).
  `SequenceParallelLayerNorm` is torch's LayerNorm with FusedLayerNorm's attributes, and `local_block_spec` builds
  a block spec with it (every layer's norms and the final norm): the CPU stand-in of apex's fused kernel, the same
  mathematics.

`enable(device)` installs the after `parallel_state.initialize_model_parallel`. It refuses any device but the
CPU: on CUDA megatron-core's own buffer and tracker are the right ones, and this module must never replace them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import types
from functools import reduce

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import param_and_grad_buffer
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel import layers, mappings
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils, router, token_dispatcher
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.utils import GlobalMemoryBuffer


class CpuGlobalMemoryBuffer(GlobalMemoryBuffer):
    """megatron-core's GlobalMemoryBuffer with its storage on the CPU."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required_len = reduce(operator.mul, tensor_shape, 1)
        held = self.buffer.get((name, dtype))
        if held is None or held.numel() < required_len:
            self.buffer[(name, dtype)] = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        return self.buffer[(name, dtype)][0:required_len].view(*tensor_shape)


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron-core's RNG tracker over the CPU generator: add() seeds a named state, fork() swaps it in."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


_MEGATRON_SETUP_EMBEDDINGS = LanguageModule.setup_embeddings_and_output_layer


def _setup_embeddings_on_cpu(self: LanguageModule) -> None:
    """megatron's setup_embeddings_and_output_layer minus its `.cuda()` copy: the method runs as if this rank
    were outside the embedding group (it then only sets the parameter attributes and zeroes the last stage's
    copy), and the initial all-reduce that makes both copies equal follows here, on the CPU tensor."""
    in_group = torch.distributed.is_initialized() and self._is_in_embd_group()
    self._is_in_embd_group = lambda: False  # an instance attribute shadows the method for this call only
    try:
        _MEGATRON_SETUP_EMBEDDINGS(self)
    finally:
        del self._is_in_embd_group
    # megatron returns before its all-reduce without a shared weight and at pipeline size 1 (one copy, nothing
    # to make equal: language_module.py:192-202); so must this, or a model built unsplit in a pipelined job would
    # post a collective its peers never join.
    shared = self.share_embeddings_and_output_weights or getattr(self.config, "mtp_num_layers", 0)
    if in_group and shared and self.config.pipeline_model_parallel_size > 1:
        torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)


class CpuEvent:
    """An event on a CPU stream: reached when recorded (every CPU op has completed when it returns)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass


class CpuStream(torch.cpu.Stream):
    """torch.cpu.Stream whose record_event returns an event (torch's returns None): what the alltoall dispatcher
    synchronizes on (token_dispatcher.py:895-898)."""

    def record_event(self, event=None) -> CpuEvent:
        return event if event is not None else CpuEvent()


class CpuCurrentDevice(types.ModuleType):
    """torch, as a megatron-core module sees it in the CPU mode: every attribute is torch's, except that
    `torch.cuda.current_device()` names the CPU (megatron allocates its buffers on that device) and torch.cuda's
    streams are the CPU's (the alltoall dispatcher's side stream, see the module docstring)."""

    cuda = types.SimpleNamespace(current_device=lambda: "cpu", Stream=CpuStream,
                                 current_stream=torch.cpu.current_stream, stream=torch.cpu.stream)

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)


_CPU_TORCH = CpuCurrentDevice()
_MEGATRON_HOST_COPY = moe_utils.maybe_move_tensor_to_cpu


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """moe_utils.maybe_move_tensor_to_cpu in the CPU mode: a CPU tensor asked for as numpy is converted, as megatron
    converts the host copy of a CUDA tensor (the alltoall dispatcher's split sizes, see the module docstring)."""
    if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
        return tensor.numpy()
    return _MEGATRON_HOST_COPY(tensor, as_numpy=as_numpy, record_stream=record_stream)
_ALLOCATE_ON_CURRENT_DEVICE = (mappings, layers, router, param_and_grad_buffer, token_dispatcher)  # the modules that get it (docstring)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm with the interface and parameter attributes of megatron's FusedLayerNorm: under
    sequence parallelism each TP rank normalizes its own tokens, so its weight and bias gradients are partial sums,
    which `sequence_parallel=True` tells the gradient reduction to all-reduce over TP (finalize_model_grads.py:354)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "LayerNorm"):
        if config.normalization != "LayerNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"normalization={config.normalization!r}, layernorm_zero_centered_gamma="
                             f"{config.layernorm_zero_centered_gamma}: SequenceParallelLayerNorm is a plain LayerNorm")
        super().__init__(hidden_size, eps=eps)
        for p in (self.weight, self.bias):
            p.sequence_parallel = config.sequence_parallel


def local_block_spec(config: TransformerConfig, layer_spec: ModuleSpec, pp_rank: int | None = None
                     ) -> TransformerBlockSubmodules:
    """GPTModel's transformer_layer_spec for this pipeline rank's layers: `layer_spec` (get_gpt_layer_local_spec's)
    with every norm, and the block's final norm, a SequenceParallelLayerNorm (what the spec's WrappedTorchNorm
    refuses under sequence parallelism, see the module docstring)."""
    layer = dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        layer_spec.submodules, input_layernorm=SequenceParallelLayerNorm, pre_mlp_layernorm=SequenceParallelLayerNorm))
    num_layers = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=SequenceParallelLayerNorm)


def enable(device: torch.device, seed: int = 1234) -> None:
    """Install the CPU buffer and RNG tracker (after initialize_model_parallel); refuses every other device.

    The tracker gets megatron's three named states (model-parallel, data-parallel, expert-parallel), seeded as
    `model_parallel_cuda_manual_seed(seed)` seeds them (per TP/EP rank offsets included)."""
    if device.type != "cpu" or torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(f"asyncpp.parallel.megatron_cpu is megatron-core's CPU mode for tests and examples; "
                           f"device={device} (CUDA initialized: {torch.cuda.is_available() and torch.cuda.is_initialized()}) "
                           "must use megatron-core's own buffer and RNG tracker")
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call parallel_state.initialize_model_parallel(...) before megatron_cpu.enable()")
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuGlobalMemoryBuffer()
    tracker = CpuRNGStatesTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    # The offsets of megatron/core/tensor_parallel/random.py:model_parallel_cuda_manual_seed.
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    LanguageModule.setup_embeddings_and_output_layer = _setup_embeddings_on_cpu
    for module in _ALLOCATE_ON_CURRENT_DEVICE:
        module.torch = _CPU_TORCH
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    if not moe_utils.HAVE_TE:
        moe_utils.te_general_gemm = None
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    assert tensor_parallel.get_cuda_rng_tracker() is tracker


def is_enabled() -> bool:
    """Whether this process runs megatron-core in the CPU mode (both shims installed)."""
    return (isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, CpuGlobalMemoryBuffer)
            and isinstance(mcore_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker)
            and LanguageModule.setup_embeddings_and_output_layer is _setup_embeddings_on_cpu
            and all(module.torch is _CPU_TORCH for module in _ALLOCATE_ON_CURRENT_DEVICE)
            and token_dispatcher.maybe_move_tensor_to_cpu is _host_copy)


def causal_mask(seq_length: int) -> torch.Tensor:
    """The [1, 1, s, s] attention mask (True = masked) that pretrain_gpt's get_batch passes. Pass one: without
    it megatron's softmax builds its default causal mask with device="cuda" (megatron/core/transformer/utils.py:35,
    get_default_causal_mask)."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)[None, None]
