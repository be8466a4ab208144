"""The trainer's DataSource over Megatron indexed datasets: megatron-core's GPTDataset and blending.

Microbatch `index` holds samples [index*B, (index+1)*B) of megatron-core's train dataset (a GPTDataset,
or a BlendedDataset for several prefixes). With the global index (t * dp + dp_rank) * m + j, DP ranks
read disjoint samples, and the samples of step t depend only on (prefixes, weights, split, seq_len,
seed, the run's total train samples) and t: a resumed run, any pipeline stage and any DP rank read
exactly what the uninterrupted run reads, with no iterator state. The data position of a checkpoint is
therefore its step (consumed samples = step * m * dp * B).

Nothing is read until the first microbatch or validation batch is asked for, so pipeline stages that
never ask (the middle ones) never open the .bin files. The index caches (megatron's .npy files) live
in `<cache_dir>/indices/<key>/`, key = a hash of everything they depend on (file sizes and mtimes
included); each process builds a missing one in a private directory and renames it into place, so
concurrent first uses are safe and a killed build never leaves a half-written cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from asyncpp.config import parse_split
from data.indexed import IndexedDataError, IndexedInfo, check_fits_vocab, check_prefix, check_token_ids
from data.mcore import TokenizerIdentity, build_gpt_datasets, megatron_core_version

_CACHE_FORMAT = 1


SIDECAR_KEYS = ("tokenizer", "tokenizer_sha256", "vocab_size", "eod_id")
"""What resolve_tokenizer reads from a <prefix>.json (data.preprocess writes them all)."""


def read_sidecar(prefix: str) -> dict:
    """<prefix>.json, the record data.preprocess writes beside the .bin/.idx; IndexedDataError naming the file if it
    is not a JSON object with the tokenizer's identity (truncated, edited, another program's file)."""
    path = Path(f"{prefix}.json")
    fix = ("rewrite it with data.preprocess (or move it away and set data.tokenizer to the tokenizer the prefix "
           "was made with)")
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise IndexedDataError(f"{path} (the record of prefix '{prefix}') is not valid JSON ({e}); {fix}") from None
    missing = [k for k in SIDECAR_KEYS if k not in meta] if isinstance(meta, dict) else list(SIDECAR_KEYS)
    if missing:
        raise IndexedDataError(f"{path} (the record of prefix '{prefix}') lacks {', '.join(missing)}"
                               f"{'' if isinstance(meta, dict) else ' (it is not a JSON object)'}; {fix}")
    return meta


def resolve_tokenizer(prefixes: Sequence[str], tokenizer: str | None) -> tuple[TokenizerIdentity, str]:
    """(identity, name) of the tokenizer the prefixes were made with: `tokenizer` if given (checked against
    the <prefix>.json data.preprocess writes), else the one those files record."""
    metas = {p: read_sidecar(p) for p in prefixes if Path(f"{p}.json").is_file()}
    if tokenizer is not None:
        from data.tokenizer import load_tokenizer

        eod = next((m["eod_token"] for m in metas.values() if "eod_token" in m), None)
        tok = load_tokenizer(tokenizer) if eod is None else load_tokenizer(tokenizer, eod)
        for p, m in metas.items():
            if m.get("tokenizer_sha256") not in (None, tok.sha256):
                raise IndexedDataError(
                    f"prefix '{p}' was made with tokenizer {m.get('tokenizer')} ({p}.json), which differs from "
                    f"data.tokenizer={tokenizer}; set data.tokenizer={m.get('tokenizer')} or preprocess again")
        return TokenizerIdentity(tok.vocab_size, tok.eod_id, tok.sha256), tokenizer
    missing = [p for p in prefixes if p not in metas]
    if missing:
        raise IndexedDataError(
            f"data.tokenizer is not set and {missing[0]}.json (written by data.preprocess) does not exist; set "
            "data.tokenizer to the tokenizer the prefix was made with, e.g. data.tokenizer=HuggingFaceTB/SmolLM2-135M")
    shas = {m["tokenizer_sha256"]: p for p, m in metas.items()}
    if len(shas) > 1:
        raise IndexedDataError(f"the blend's prefixes were made with different tokenizers ({sorted(shas.values())}); "
                               "preprocess them with one tokenizer")
    m = next(iter(metas.values()))
    return TokenizerIdentity(m["vocab_size"], m["eod_id"], m["tokenizer_sha256"]), str(m["tokenizer"])


def _check_split_sizes(infos: list[IndexedInfo], split: str) -> None:
    """megatron's split gives each part the sequences [round(lo * S), round(hi * S)). A part with a share
    but no sequences would make GPTDataset loop forever looking for tokens, so refuse it here."""
    shares = parse_split(split)
    bounds = [0.0, shares[0], shares[0] + shares[1], 1.0]
    for info in infos:
        for part, name in enumerate(("train", "valid", "test")):
            lo, hi = (round(b * info.sequences) for b in bounds[part: part + 2])
            if shares[part] > 0 and hi <= lo:
                raise IndexedDataError(
                    f"prefix '{info.prefix}' has {info.sequences} documents; data.split='{split}' leaves its {name} "
                    f"part none; use more data, give {name} a larger share, or none (0)")


class IndexedDataSource:
    """DataSource over .bin/.idx prefixes; see the module docstring for the sampling contract."""

    def __init__(self, prefixes: Sequence[str | Path], weights: Sequence[float] | None = None, *,
                 tokenizer: str | None, split: str, seq_len: int, micro_batch_size: int, seed: int,
                 train_samples: int, eval_samples: int, cache_dir: Path):
        if micro_batch_size < 1 or seq_len < 1 or train_samples < 1 or eval_samples < 0:
            raise ValueError(f"micro_batch_size={micro_batch_size}, seq_len={seq_len} and train_samples="
                             f"{train_samples} must be >= 1, eval_samples={eval_samples} >= 0")
        self.prefixes = [os.path.abspath(p) for p in prefixes]
        self.infos = [check_prefix(p) for p in self.prefixes]
        self.tokenizer, self.tokenizer_name = resolve_tokenizer(self.prefixes, tokenizer)
        for info in self.infos:
            check_fits_vocab(info, self.tokenizer.vocab_size, self.tokenizer_name)
            check_token_ids(info, self.tokenizer.vocab_size)  # a garbage .bin: refused here, naming the file
        _check_split_sizes(self.infos, split)
        if weights is not None and len(weights) != len(self.prefixes):
            raise ValueError(f"{len(weights)} weights for {len(self.prefixes)} prefixes")
        if len(self.prefixes) == 1:
            weights = None  # one prefix: a plain GPTDataset, no blending layer
        elif weights is None:  # megatron would weight by one epoch's samples and cap the size at one epoch
            weights = [float(info.tokens) for info in self.infos]
        self.weights = None if weights is None else [float(w) for w in weights]
        self.split, self.seq_len, self.micro_batch_size, self.seed = split, seq_len, micro_batch_size, seed
        self.sizes = [train_samples, eval_samples, 0]
        self.cache_dir = Path(cache_dir)
        self._datasets: list | None = None
        self._val: list[Tensor] | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eod_id(self) -> int:
        return self.tokenizer.eod

    def identity(self) -> dict:
        """Everything the sample stream depends on (besides megatron-core's version): a checkpoint can store
        it; a resume under a different identity reads different samples for the same step."""
        files = [[os.stat(f"{p}{s}").st_size for s in (".idx", ".bin")] +
                 [os.stat(f"{p}{s}").st_mtime_ns for s in (".idx", ".bin")] for p in self.prefixes]
        return {"format": _CACHE_FORMAT, "prefixes": self.prefixes, "files": files, "weights": self.weights,
                "split": self.split, "seq_len": self.seq_len, "seed": self.seed, "sizes": self.sizes,
                "micro_batch_size": self.micro_batch_size, "tokenizer": self.tokenizer.unique_identifiers}

    def cache_key(self) -> str:
        desc = {**self.identity(), "megatron_core": megatron_core_version()}
        desc.pop("micro_batch_size")  # how samples are grouped, not which exist
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]

    def datasets(self) -> list:
        """[train, valid, test], built (or loaded from the cache) on first use."""
        if self._datasets is None:
            self._datasets = self._build()
        return self._datasets

    def _build(self) -> list:
        root = self.cache_dir / "indices"
        root.mkdir(parents=True, exist_ok=True)
        key = self.cache_key()  # imports megatron.core (~5 s), needed from here on anyway
        final = root / key
        kwargs = {"split": self.split, "seq_len": self.seq_len, "seed": self.seed, "sizes": self.sizes,
                  "tokenizer": self.tokenizer, "helpers_dir": self.cache_dir}
        if final.is_dir():
            return build_gpt_datasets(self.prefixes, self.weights, path_to_cache=final, **kwargs)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f"{key}.", suffix=".tmp"))
        print(f"[data] building megatron-core's dataset indices for {len(self.prefixes)} prefix(es) (once for this "
              f"data, seq_len, seed and sample count; cached in {final})", flush=True)
        try:
            built = build_gpt_datasets(self.prefixes, self.weights, path_to_cache=tmp, **kwargs)
            try:
                os.rename(tmp, final)
            except OSError:  # another process published the same (identical) indices first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return built

    def _rows(self, dataset, start: int) -> Tensor:
        """LongTensor [B, seq_len + 1] of samples start .. start+B-1 (inputs [:, :-1], labels [:, 1:])."""
        rows = []
        for i in range(start, start + self.micro_batch_size):
            sample = dataset[i]
            rows.append(torch.cat([sample["tokens"], sample["labels"][-1:]]))
        return torch.stack(rows)

    def train_microbatch(self, index: int) -> Tensor:
        train = self.datasets()[0]
        start = index * self.micro_batch_size
        if index < 0 or start + self.micro_batch_size > len(train):
            raise IndexError(
                f"microbatch {index} needs train samples [{start}, {start + self.micro_batch_size}), but the "
                f"dataset was built for {len(train)} (train.steps x train.num_microbatches x dp x "
                "train.micro_batch_size); a longer run needs a larger train.steps")
        return self._rows(train, start)

    def sample_ids(self, index: int) -> np.ndarray:
        """[B, 2] (dataset in the blend, sample within it) of microbatch `index`: what it is made of."""
        train = self.datasets()[0]
        lo, hi = index * self.micro_batch_size, (index + 1) * self.micro_batch_size
        if hasattr(train, "dataset_index"):
            return np.stack([train.dataset_index[lo:hi], train.dataset_sample_index[lo:hi]], axis=1).astype(np.int64)
        return np.stack([np.zeros(hi - lo, np.int64), train.shuffle_index[lo:hi]], axis=1).astype(np.int64)

    def order_digest(self, samples: int) -> str:
        """sha256 of what the train samples [0, samples) are made of (for a blend: which dataset and sample; for each
        GPTDataset: its document, sample and shuffle indices). Equal digests: the same first `samples` samples.
        megatron-core shuffles over every epoch a dataset is built for, so a longer run whose sample count needs
        more epochs reads even its first samples in another order; within the same epochs the order is the same."""
        train = self.datasets()[0]
        digest = hashlib.sha256()
        parts = [train]
        if hasattr(train, "dataset_index"):  # a blend: its own index is a prefix-stable greedy by weight
            digest.update(np.ascontiguousarray(train.dataset_index[:samples]).tobytes())
            digest.update(np.ascontiguousarray(train.dataset_sample_index[:samples]).tobytes())
            parts = list(train.datasets)
        for dataset in parts:
            if dataset.shuffle_index is None:  # megatron maps its .npy indices lazily, on the first read
                dataset[0]
            for index in (dataset.document_index, dataset.sample_index, dataset.shuffle_index):
                digest.update(np.ascontiguousarray(index).tobytes())
        return digest.hexdigest()[:24]

    def epochs(self) -> int:
        """How many times the run reads its training documents over: megatron-core's epoch count (its document index
        repeats the split's documents once per epoch), the largest over a blend's datasets."""
        train = self.datasets()[0]
        parts = list(train.datasets) if hasattr(train, "dataset_index") else [train]
        for dataset in parts:
            if dataset.shuffle_index is None:  # megatron maps its .npy indices lazily, on the first read
                dataset[0]
        return max(len(d.document_index) // max(1, len(d.indices)) for d in parts)

    def val_batches(self) -> list[Tensor]:
        """The first eval_samples validation samples as full microbatches; the same every evaluation."""
        if self._val is None:
            valid = self.datasets()[1]
            n = 0 if valid is None else min(len(valid), self.sizes[1]) // self.micro_batch_size
            self._val = [self._rows(valid, k * self.micro_batch_size) for k in range(n)]
        return self._val
