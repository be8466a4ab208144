"""Megatron's indexed dataset format (.bin/.idx): checks that fail with a clear message, and atomic files.

A *prefix* names a pair of files, `<prefix>.bin` (the tokens of every document, back to back) and
`<prefix>.idx`:

    b"MMIDIDX\\x00\\x00"  <Q version = 1>  <B dtype code>  <Q S = sequences>  <Q D = documents + 1>
    int32[S] sequence lengths  int64[S] byte offsets into .bin  int64[D] document boundaries (0 ... S)

megatron-core reads these with bare asserts (or reads garbage from a wrong dtype); `check_prefix` reads
the header, the lengths (4 bytes a document) and two offsets, and says what is wrong and how to fix it.
The writer (data.preprocess) renames the .idx into place last: a prefix whose .idx exists is complete.
"""

from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
# megatron.core.datasets.indexed_dataset.DType, mirrored so that checks need no megatron import (5 s);
# tests/unit/test_data_pipeline.py asserts the two tables agree.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.int32))


class IndexedDataError(ValueError):
    """A .bin/.idx pair is missing, corrupt, empty or does not fit the tokenizer."""


@dataclass(frozen=True)
class IndexedInfo:
    prefix: str
    dtype: np.dtype
    sequences: int
    """What megatron's train/valid/test split divides (one per document when written by data.preprocess)."""
    documents: int
    tokens: int


def token_dtype(vocab_size: int) -> np.dtype:
    """As Megatron-LM's preprocess_data.py (DType.optimal_dtype): uint16 below 65500 tokens, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def is_complete(prefix: str | Path) -> bool:
    return idx_path(prefix).is_file() and bin_path(prefix).is_file()


def missing_files_message(prefix: str) -> str | None:
    """None if both files exist, else what is missing and how to make it."""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return (f"'{prefix}' names a file, but a prefix is the path without .bin/.idx; "
                    f"use '{prefix[: -len(suffix)]}'")
    missing = [p.name for p in (idx_path(prefix), bin_path(prefix)) if not p.is_file()]
    if not missing:
        return None
    return (f"{' and '.join(missing)} not found for prefix '{prefix}'; make them with "
            f"`python -m data.preprocess --input ... --tokenizer ... --output-prefix {prefix}`")


def check_prefix(prefix: str | Path) -> IndexedInfo:
    """Header, sizes and .idx/.bin agreement of one prefix. Raises IndexedDataError (FileNotFoundError
    for missing files) naming the file, what is wrong and the fix."""
    prefix = str(prefix)
    message = missing_files_message(prefix)
    if message is not None:
        raise FileNotFoundError(message)
    idx, binf = idx_path(prefix), bin_path(prefix)
    idx_size, bin_size = idx.stat().st_size, binf.stat().st_size
    remake = f"re-create it with `python -m data.preprocess ... --output-prefix {prefix} --overwrite`"
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
        if not MAGIC.startswith(head[:9]):
            raise IndexedDataError(f"{idx} is not a Megatron indexed-dataset index: it starts with {head[:9]!r}, "
                                   f"expected {MAGIC!r} (wrong magic); {remake}")
        if len(head) < HEADER_BYTES:
            raise IndexedDataError(f"{idx} is truncated ({idx_size} bytes, less than the {HEADER_BYTES}-byte "
                                   f"header); {remake}")
        version, code, sequences, docs_plus_one = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            raise IndexedDataError(f"{idx} has format version {version}; only version 1 exists; {remake}")
        if code not in DTYPE_CODES:
            raise IndexedDataError(f"{idx} has token dtype code {code}, which is none of Megatron's "
                                   f"{sorted(DTYPE_CODES)}; {remake}")
        dtype = DTYPE_CODES[code]
        expected = HEADER_BYTES + 12 * sequences + 8 * docs_plus_one
        if idx_size < expected:
            raise IndexedDataError(f"{idx} is truncated: {idx_size} bytes, but its header announces {sequences} "
                                   f"sequences and {docs_plus_one - 1} documents ({expected} bytes); {remake}")
        if idx_size > expected:
            raise IndexedDataError(f"{idx} has {idx_size - expected} bytes past the end of its index (a multimodal "
                                   f"or foreign file?); only GPT-style token datasets are supported; {remake}")
        if sequences == 0 or docs_plus_one <= 1:
            raise IndexedDataError(f"prefix '{prefix}' is an empty dataset (0 documents); preprocess an input "
                                   "that has non-empty documents")
        f.seek(HEADER_BYTES + 12 * sequences - 8)
        (last_ptr,) = struct.unpack("<q", f.read(8))
        f.seek(HEADER_BYTES + 12 * sequences)
        (first_doc,) = struct.unpack("<q", f.read(8))
        f.seek(expected - 8)
        (last_doc,) = struct.unpack("<q", f.read(8))
    lengths = np.fromfile(idx, dtype="<i4", count=sequences, offset=HEADER_BYTES)  # O(S), 4 bytes each
    if first_doc != 0 or last_doc != sequences or lengths.min() < 0:
        raise IndexedDataError(f"{idx} is corrupt (its document boundaries or lengths are inconsistent); {remake}")
    tokens = int(lengths.sum(dtype=np.int64))
    before_last = tokens - int(lengths[-1])
    if last_ptr != before_last * dtype.itemsize:
        sizes = [d for d in TOKEN_DTYPES if d != dtype and last_ptr == before_last * d.itemsize]
        hint = (f"its offsets were written for {sizes[0].name} tokens but its dtype code says {dtype.name} "
                "(a dtype mismatch)") if sizes else "its offsets do not match its lengths"
        raise IndexedDataError(f"{idx} is corrupt: {hint}; {remake}")
    want = tokens * dtype.itemsize
    if bin_size != want:
        why = "truncated" if bin_size < want else "longer than its index says"
        for other in TOKEN_DTYPES:
            if other != dtype and bin_size == tokens * other.itemsize:
                why = (f"exactly the size of those tokens as {other.name}: a dtype mismatch between the .idx "
                       f"({dtype.name}) and the .bin")
        raise IndexedDataError(f"{binf} has {bin_size} bytes, but {idx} describes {tokens} tokens of {dtype.name} "
                               f"({want} bytes): it is {why}; the two files do not belong together; {remake}")
    return IndexedInfo(prefix=prefix, dtype=dtype, sequences=sequences, documents=docs_plus_one - 1, tokens=tokens)


def check_fits_vocab(info: IndexedInfo, vocab_size: int, tokenizer: str) -> None:
    """Token ids of a `vocab_size` tokenizer must be representable in the prefix's dtype."""
    limit = int(np.iinfo(info.dtype).max) + 1 if info.dtype.kind in "iu" else 0
    if vocab_size > limit:
        raise IndexedDataError(
            f"prefix '{info.prefix}' stores tokens as {info.dtype.name} (ids < {limit}), but tokenizer {tokenizer} "
            f"has {vocab_size} tokens: the prefix was made with another tokenizer; preprocess again with this one")


def check_token_ids(info: IndexedInfo, vocab_size: int, *, documents: int = 64, max_tokens: int = 1 << 20) -> None:
    """Token ids must lie in [0, vocab_size). A .bin overwritten with garbage keeps its size and passes
    check_prefix, then fails at the first forward with a bare IndexError; this reads a strided sample of
    `documents` sequences (the first and the last among them), at most `max_tokens` tokens in all, and
    names the file, the id and where it is. Cheap (memory-mapped), not exhaustive: a few bad ids in an
    unsampled document still pass."""
    if info.tokens == 0:
        return
    idx, binf = idx_path(info.prefix), bin_path(info.prefix)
    s = info.sequences
    lengths = np.memmap(idx, dtype="<i4", mode="r", offset=HEADER_BYTES, shape=(s,))
    pointers = np.memmap(idx, dtype="<i8", mode="r", offset=HEADER_BYTES + 4 * s, shape=(s,))
    tokens = np.memmap(binf, dtype=info.dtype, mode="r")
    picks = np.unique(np.linspace(0, s - 1, num=min(documents, s)).round().astype(np.int64))
    budget = max(1, max_tokens // len(picks))
    for seq in picks:
        start = int(pointers[seq]) // info.dtype.itemsize
        chunk = np.asarray(tokens[start: start + min(int(lengths[seq]), budget)])
        if chunk.size == 0:
            continue
        bad = np.flatnonzero((chunk >= vocab_size) | (chunk < 0))
        if bad.size:
            at = int(bad[0])
            raise IndexedDataError(
                f"{binf} holds token id {int(chunk[at])} at token {start + at} (sequence {int(seq)}), outside the "
                f"vocabulary [0, {vocab_size}): the .bin is corrupt or was made with another tokenizer; re-create it "
                f"with `python -m data.preprocess ... --output-prefix {info.prefix} --overwrite`")


def replace_atomic(tmp: Path, final: Path) -> None:
    """fsync `tmp` and rename it over `final` (readers see the old file or the new one, never half)."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache should be readable by all
    os.replace(tmp, final)


def temp_path(final: Path) -> Path:
    """A unique name beside `final` that never ends in .bin/.idx, so it can never pass as complete."""
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=final.name + ".", suffix=".tmp")
    os.close(fd)
    return Path(name)


def publish(files: dict[Path, Path]) -> None:
    """Move finished temp files into place, the .idx last (its presence is what means 'complete').
    An existing .idx is removed first, so an old .idx never describes a new .bin."""
    finals = sorted(files, key=lambda p: p.suffix == ".idx")
    for final in finals:
        if final.suffix == ".idx":
            final.unlink(missing_ok=True)
    for final in finals:
        replace_atomic(files[final], final)
