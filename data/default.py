"""The embedded default corpus as token streams, and a deterministic window sampler.

The default run trains on data/default_corpus/ (CPython 3.11 docs, 8192-token byte-level
BPE) with no network. Every batch is a pure function of (seed, index), so a resumed run,
each pipeline stage and each data-parallel rank read exactly the same data without any
shared state. The full Megatron indexed-dataset pipeline lives elsewhere; this is the
small exact path.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

DEFAULT_DIR = Path(__file__).resolve().parent / "default_corpus"
DEFAULT_CORPUS = DEFAULT_DIR / "cpython_docs.jsonl.xz"
DEFAULT_TOKENIZER = DEFAULT_DIR / "tokenizer.json"
EOD_TOKEN = "<|endoftext|>"
# Bump when the token-stream layout changes, so stale caches are never read.
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class TokenSplits:
    """Token streams: each document's tokens followed by `eod_id`, documents in corpus order."""

    train: np.ndarray  # 1-D, uint16 if vocab_size <= 65536 else int32
    val: np.ndarray
    vocab_size: int
    eod_id: int


def default_cache_dir() -> Path:
    env = os.environ.get("ASYNCPP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "asyncpp"


def read_corpus(corpus: Path) -> list[dict[str, str]]:
    """Documents of a .jsonl.xz (or plain .jsonl) file: [{"id": ..., "text": ...}, ...]."""
    opener = lzma.open if corpus.suffix == ".xz" else open
    docs = []
    with opener(corpus, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            doc = json.loads(line)
            well_formed = isinstance(doc.get("id"), str) and isinstance(doc.get("text"), str)
            if not well_formed:
                raise ValueError(f"{corpus}:{lineno}: each line needs string fields 'id' and 'text'")
            docs.append(doc)
    if not docs:
        raise ValueError(f"corpus={corpus} holds no documents")
    return docs


def is_validation(doc_id: str, val_fraction: float) -> bool:
    """Stable per-document split: the first 8 bytes of sha256(id) as a fraction of 2**64.
    Independent of document order, process and Python's hash seed."""
    return _unit_hash(doc_id) < val_fraction


def _unit_hash(doc_id: str) -> float:
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_ids(doc_ids: list[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """(train indices, val indices), each in corpus order. With val_fraction > 0 at least one
    document goes to validation (the lowest hash) and at least one stays in training."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1); use e.g. 0.02")
    if len(set(doc_ids)) != len(doc_ids):
        raise ValueError("document ids must be unique: the split is keyed by id")
    val = [i for i, d in enumerate(doc_ids) if is_validation(d, val_fraction)]
    if val_fraction > 0 and not val:
        val = [min(range(len(doc_ids)), key=lambda i: _unit_hash(doc_ids[i]))]
    if len(val) == len(doc_ids):
        if len(doc_ids) < 2:
            raise ValueError(f"the corpus has {len(doc_ids)} document; a train/val split needs at least 2")
        val.remove(max(val, key=lambda i: _unit_hash(doc_ids[i])))
    val_set = set(val)
    return [i for i in range(len(doc_ids)) if i not in val_set], val


def cache_key(corpus: Path, tokenizer: Path, val_fraction: float) -> str:
    """Content hash: a changed corpus, tokenizer or split can never hit an old cache."""
    h = hashlib.sha256(f"asyncpp-tokens-v{_CACHE_FORMAT}|{val_fraction!r}|".encode())
    for path in (corpus, tokenizer):
        h.update(hashlib.sha256(Path(path).read_bytes()).digest())
    return h.hexdigest()[:32]


def cache_paths(cache_dir: Path, key: str) -> tuple[Path, Path]:
    return cache_dir / f"tokens-{key}.train.npy", cache_dir / f"tokens-{key}.val.npy"


def _save_atomic(path: Path, array: np.ndarray) -> None:
    """Write to a unique temp name in the same directory, then rename: readers see either no
    file or the complete one, and concurrent writers (several ranks) cannot interleave."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache should be readable by all
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenize_documents(texts: list[str], tok: Tokenizer, eod_id: int, dtype: np.dtype) -> np.ndarray:
    """One stream: doc0 tokens, EOD, doc1 tokens, EOD, ... ."""
    if not texts:
        return np.zeros(0, dtype=dtype)
    # encode_batch runs in parallel inside the Rust library (RAYON_NUM_THREADS caps it).
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    pieces = []
    eod = np.array([eod_id], dtype=dtype)
    for enc in encodings:
        pieces.append(np.asarray(enc.ids, dtype=dtype))
        pieces.append(eod)
    stream = np.concatenate(pieces)
    # The EOD id must mark document ends only; a literal "<|endoftext|>" in a text would break that.
    n_eod = int(np.count_nonzero(stream == eod_id))
    if n_eod != len(texts):
        raise ValueError(
            f"found {n_eod} EOD tokens for {len(texts)} documents: some text contains {EOD_TOKEN!r}; "
            "remove it from the corpus"
        )
    return stream


def load_token_splits(
    corpus: Path = DEFAULT_CORPUS,
    tokenizer: Path = DEFAULT_TOKENIZER,
    *,
    val_fraction: float = 0.02,
    cache_dir: Path | None = None,
) -> TokenSplits:
    """Tokenize `corpus` once (cached as .npy keyed by content) and split it by document."""
    corpus, tokenizer = Path(corpus), Path(tokenizer)
    for name, path in (("corpus", corpus), ("tokenizer", tokenizer)):
        if not path.is_file():
            raise FileNotFoundError(
                f"{name}={path} does not exist; the default lives in {DEFAULT_DIR} "
                "(rebuild it with `python data/build_default_corpus.py`)"
            )
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1); use e.g. 0.02")
    tok = Tokenizer.from_file(str(tokenizer))
    eod_id = tok.token_to_id(EOD_TOKEN)
    if eod_id is None:
        raise ValueError(f"tokenizer={tokenizer} has no {EOD_TOKEN!r} token; rebuild it")
    vocab_size = tok.get_vocab_size()
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    train_path, val_path = cache_paths(cache_dir, cache_key(corpus, tokenizer, val_fraction))
    # Only final names are read; a write killed midway leaves at most a *.tmp file (ignored)
    # or train without val (a miss: both are rewritten).
    if train_path.is_file() and val_path.is_file():
        train, val = np.load(train_path), np.load(val_path)
        if train.dtype == dtype and val.dtype == dtype:
            return TokenSplits(train=train, val=val, vocab_size=vocab_size, eod_id=eod_id)

    t0 = time.perf_counter()
    docs = read_corpus(corpus)
    train_idx, val_idx = split_ids([d["id"] for d in docs], val_fraction)
    train = tokenize_documents([docs[i]["text"] for i in train_idx], tok, eod_id, dtype)
    val = tokenize_documents([docs[i]["text"] for i in val_idx], tok, eod_id, dtype)
    print(
        f"[data] tokenized {corpus.name}: {len(train_idx)} train docs / {train.size:,} tokens, "
        f"{len(val_idx)} val docs / {val.size:,} tokens (vocab {vocab_size}) in "
        f"{time.perf_counter() - t0:.1f}s; cached in {cache_dir}",
        flush=True,
    )
    cache_dir.mkdir(parents=True, exist_ok=True)
    _save_atomic(train_path, train)
    _save_atomic(val_path, val)  # written last: its presence means train is complete too
    return TokenSplits(train=train, val=val, vocab_size=vocab_size, eod_id=eod_id)


def _num_windows(tokens: np.ndarray, seq_len: int) -> int:
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    n = tokens.size // (seq_len + 1)
    if n == 0:
        raise ValueError(
            f"the token stream has {tokens.size} tokens, fewer than one window of seq_len+1="
            f"{seq_len + 1}; lower seq_len or use a larger corpus"
        )
    return n


def _windows(tokens: np.ndarray, seq_len: int, ids: np.ndarray) -> torch.Tensor:
    w = seq_len + 1
    rows = np.stack([tokens[i * w : (i + 1) * w] for i in ids.tolist()])
    return torch.from_numpy(rows.astype(np.int64))


class TokenWindows:
    """Shuffled non-overlapping windows of seq_len+1 tokens, infinitely many epochs.

    Sample i is window perm_e[i % n] with e = i // n and perm_e a permutation drawn from
    PCG64(SeedSequence([seed, e])); batch `index` holds samples [index*B, (index+1)*B).
    Invariant: batch(index) depends only on (tokens, seq_len, B, seed, index).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, seed: int) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0 (numpy SeedSequence takes non-negative ints)")
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self._n = _num_windows(tokens, seq_len)
        # One cached permutation: consecutive batches stay in one epoch except at a boundary.
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def num_windows(self) -> int:
        return self._n

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._perm = rng.permutation(self._n)
            self._perm_epoch = epoch
        return self._perm

    def window_ids(self, index: int) -> np.ndarray:
        """Window indices of batch `index`, in sample order."""
        if index < 0:
            raise ValueError(f"index={index} must be >= 0")
        samples = np.arange(index * self.micro_batch_size, (index + 1) * self.micro_batch_size)
        ids = np.empty_like(samples)
        epochs = samples // self._n
        for e in np.unique(epochs).tolist():
            mask = epochs == e
            ids[mask] = self.permutation(e)[samples[mask] % self._n]
        return ids

    def batch(self, index: int) -> torch.Tensor:
        """LongTensor [micro_batch_size, seq_len + 1]: inputs are [:, :-1], labels [:, 1:]."""
        return _windows(self.tokens, self.seq_len, self.window_ids(index))


def validation_batches(
    tokens: np.ndarray, seq_len: int, micro_batch_size: int, num_batches: int
) -> list[torch.Tensor]:
    """The first windows in stream order, no shuffling: the same held-out set every eval.
    Only full batches are returned (fixed shapes for the pipeline), capped at what exists."""
    if micro_batch_size < 1 or num_batches < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} and num_batches={num_batches} must be >= 1")
    n = _num_windows(tokens, seq_len)
    available = n // micro_batch_size
    if available == 0:
        raise ValueError(
            f"validation has {n} windows of seq_len+1={seq_len + 1} tokens, fewer than one "
            f"micro batch of {micro_batch_size}; lower micro_batch_size or seq_len, or raise val_fraction"
        )
    b = micro_batch_size
    return [
        _windows(tokens, seq_len, np.arange(k * b, (k + 1) * b)) for k in range(min(num_batches, available))
    ]
