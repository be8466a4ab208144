"""megatron-core's GPTDataset and BlendedMegatronDatasetBuilder, used from any single process.

Two things stand between megatron-core's dataset code and asyncpp's pipeline:

- Its builders are collective: when torch.distributed is initialized, rank 0 builds the index caches,
  then *every* rank meets at a WORLD barrier, then the others load. asyncpp builds datasets lazily and
  only on the pipeline stages that read tokens (first and last), so a middle stage would never reach
  the barrier. `process_local()` makes the three dataset modules see a one-process world for the
  duration of a build; asyncpp's own cache (data.source) makes concurrent builds safe instead (each
  process builds into a private directory, the first rename wins, and all builds are identical).
- Its index helpers are C++ (`helpers_cpp`). The PyPI wheel ships them prebuilt (CPython 3.11 / x86-64
  here); where a platform's wheel lacks them, `ensure_helpers()` compiles megatron's own helpers.cpp
  once into the asyncpp cache, with a message, and fails with the fix if no compiler or pybind11.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_HELPERS = "megatron.core.datasets.helpers_cpp"
_COLLECTIVE_MODULES = ("blended_megatron_dataset_builder", "gpt_dataset", "blended_dataset")
_lock = threading.Lock()


@dataclass(frozen=True)
class TokenizerIdentity:
    """What GPTDatasetConfig needs from a tokenizer (no online tokenization happens)."""

    vocab_size: int
    eod: int
    sha256: str

    @property
    def unique_identifiers(self) -> dict:  # megatron hashes this into its cache names
        return {"class": "asyncpp.TokenizerIdentity", "vocab_size": self.vocab_size, "eod": self.eod,
                "sha256": self.sha256}


@contextlib.contextmanager
def _quiet_import():
    # megatron.core's package import warns about every optional GPU library it does not find.
    with warnings.catch_warnings(), _quiet_logs():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit and megatron's own, at import time
        yield


def megatron_core_version() -> str:
    with _quiet_import():
        import megatron.core
    return megatron.core.__version__


def import_megatron_datasets():
    """(BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig). megatron.core takes ~5 s to import."""
    with _quiet_import():
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    return BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


def open_indexed(prefix: str | Path):
    """megatron-core's IndexedDataset (the low-level reader: dataset[i] = document i's tokens). Its arrays
    are views of a memory map it closes when collected: copy what must outlive it."""
    with _quiet_import():
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    with _quiet_logs():
        return IndexedDataset(str(prefix))


def indexed_dataset_builder(bin_file: Path, dtype):
    """megatron-core's IndexedDatasetBuilder writing `bin_file` with tokens of numpy dtype `dtype`."""
    with _quiet_import():
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    return IndexedDatasetBuilder(str(bin_file), dtype=np.dtype(dtype).type)


def ensure_helpers(build_dir: Path) -> None:
    """Make `megatron.core.datasets.helpers_cpp` importable, compiling it once if the wheel lacks it."""
    import_megatron_datasets()
    if _HELPERS in sys.modules:
        return
    try:
        importlib.import_module(_HELPERS)
        return
    except ImportError:
        pass
    import megatron.core

    src = Path(megatron.core.__file__).parent / "datasets" / "helpers.cpp"
    out_dir = build_dir / f"megatron-core-{megatron.core.__version__}-helpers"
    so = out_dir / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not so.is_file():
        print(f"[data] compiling megatron-core's dataset helpers into {so.parent} (once)", flush=True)
        _compile_helpers(src, so)
    spec = importlib.util.spec_from_file_location(_HELPERS, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_HELPERS] = module


def _compile_helpers(src: Path, so: Path) -> None:
    try:
        import pybind11
    except ImportError:
        raise RuntimeError(
            f"megatron-core's C++ dataset helpers (helpers_cpp) are not in this installation and building them "
            f"from {src} needs pybind11: `pip install pybind11` (and a C++ compiler), then rerun") from None
    so.parent.mkdir(parents=True, exist_ok=True)
    tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
    cmd = [os.environ.get("CXX", "c++"), "-O3", "-shared", "-std=c++17", "-fPIC",
           f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", str(src), "-o", str(tmp)]
    print(f"[data] compiling megatron-core's dataset helpers once: {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise RuntimeError(f"no C++ compiler '{cmd[0]}' to build megatron-core's dataset helpers; install g++ "
                           "(or set CXX) and rerun") from None
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {src} failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp, so)


class _OneProcessDistributed:
    def is_initialized(self) -> bool:
        return False

    def get_rank(self) -> int:
        return 0

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


class _OneProcessTorch:
    distributed = _OneProcessDistributed()

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def process_local():
    """While inside, megatron's dataset builders neither wait at barriers nor defer to rank 0."""
    modules = [importlib.import_module(f"megatron.core.datasets.{m}") for m in _COLLECTIVE_MODULES]
    with _lock:
        saved = [m.torch for m in modules]
        for m in modules:
            m.torch = _OneProcessTorch()
        try:
            yield
        finally:
            for m, t in zip(modules, saved):
                m.torch = t


def build_gpt_datasets(prefixes: list[str], weights: list[float] | None, *, split: str, seq_len: int, seed: int,
                       sizes: list[int], tokenizer: TokenizerIdentity, path_to_cache: Path,
                       helpers_dir: Path) -> list:
    """[train, valid, test] (each a GPTDataset, a BlendedDataset or None), megatron-core's own build.
    Samples are seq_len + 1 tokens (add_extra_token_to_sequence), so inputs and labels are both seq_len."""
    Builder, GPTDataset, GPTDatasetConfig = import_megatron_datasets()
    ensure_helpers(helpers_dir)
    with process_local(), _quiet_logs():
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_len, blend=(list(prefixes), None if weights is None else list(weights)),
            split=split, path_to_cache=str(path_to_cache), tokenizer=tokenizer, reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False, mmap_bin_files=True)
        return Builder(GPTDataset, sizes, lambda: True, config).build()


@contextlib.contextmanager
def _quiet_logs():
    """megatron logs every index it builds or loads, and its import, at INFO (hydra's job logging prints it)."""
    logger = logging.getLogger("megatron.core")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)
