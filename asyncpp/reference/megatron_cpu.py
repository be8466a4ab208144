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
  (megatron/core/transformer/moe/router.py:90, 92, 169, 178, 192, 198). Those two modules get `CpuCurrentDevice`
  as their `torch`: the real torch module whose `torch.cuda.current_device()` is the CPU (nothing else changes,
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
- Not shimmed: the MoE alltoall dispatcher creates a CUDA stream in its constructor
  (megatron/core/transformer/moe/token_dispatcher.py:445) and syncs on the current CUDA stream in its
  permutation (token_dispatcher.py:871); use moe_token_dispatcher_type="allgather".

`enable(device)` installs the after `parallel_state.initialize_model_parallel`. It refuses any device but the
CPU: on CUDA megatron-core's own buffer and tracker are the right ones, and this module must never replace them.
"""

from __future__ import annotations

import contextlib
import operator
import types
from functools import reduce

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import param_and_grad_buffer
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.moe import moe_utils, router
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
    if in_group and (self.share_embeddings_and_output_weights or getattr(self, "mtp_process", False)):
        torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)


class CpuCurrentDevice(types.ModuleType):
    """torch, as a megatron-core module sees it in the CPU mode: every attribute is torch's, except that
    `torch.cuda.current_device()` names the CPU (megatron allocates its buffers on that device)."""

    cuda = types.SimpleNamespace(current_device=lambda: "cpu")

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)


_CPU_TORCH = CpuCurrentDevice()
_ALLOCATE_ON_CURRENT_DEVICE = (mappings, router, param_and_grad_buffer)  # the modules that get it (docstring)


def enable(device: torch.device, seed: int = 1234) -> None:
    """Install the CPU buffer and RNG tracker (after initialize_model_parallel); refuses every other device.

    The tracker gets megatron's three named states (model-parallel, data-parallel, expert-parallel), seeded as
    `model_parallel_cuda_manual_seed(seed)` seeds them (per TP/EP rank offsets included)."""
    if device.type != "cpu" or torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(f"asyncpp.reference.megatron_cpu is megatron-core's CPU mode for tests and examples; "
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
            and all(module.torch is _CPU_TORCH for module in _ALLOCATE_ON_CURRENT_DEVICE))


def causal_mask(seq_length: int) -> torch.Tensor:
    """The [1, 1, s, s] attention mask (True = masked) that pretrain_gpt's get_batch passes. Pass one: without
    it megatron's softmax builds its default causal mask with device="cuda" (megatron/core/transformer/utils.py:35,
    get_default_causal_mask)."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)[None, None]
