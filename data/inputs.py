"""Where data.preprocess reads documents: an HF `datasets` source, streamed, in a fixed order.

Either a hub dataset (`HuggingFaceFW/fineweb-edu`, subset `sample-10BT`, split `train`) or local files
(json/jsonl/parquet/csv/text, optionally .gz/.xz/.bz2/.zst compressed; globs allowed). Always streamed, so
nothing is copied into the HF cache and memory stays flat. The order is the files' order as given (each
glob sorted), so a rerun reads the same records in the same order, which is what resume relies on.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

COMPRESSIONS = (".gz", ".xz", ".bz2", ".zst")
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".text": "text"}


@dataclass(frozen=True)
class SourceSpec:
    inputs: tuple[str, ...]
    """Local files / globs, or exactly one hub dataset name."""
    subset: str | None = None
    """Hub dataset configuration ("subset"), e.g. sample-10BT."""
    split: str = "train"
    revision: str | None = None
    text_key: str = "text"
    text_sample_by: str = "document"
    """For .txt inputs: one record per 'document' (file), 'paragraph' or 'line'."""
    max_docs: int | None = None


def _format_of(path: str) -> str:
    name = path.lower()
    for c in COMPRESSIONS:
        name = name.removesuffix(c)
    for ext, fmt in FORMATS.items():
        if name.endswith(ext):
            return fmt
    raise ValueError(f"--input {path}: unknown format; name files *.jsonl, *.json, *.parquet, *.csv or *.txt "
                     f"(optionally compressed: {', '.join(COMPRESSIONS)})")


def local_files(spec: SourceSpec) -> list[Path] | None:
    """The local files of `spec` in reading order, or None if it names a hub dataset."""
    files: list[Path] = []
    for item in spec.inputs:
        matches = sorted(glob.glob(item)) if glob.has_magic(item) else ([item] if Path(item).exists() else [])
        if Path(item).is_dir():
            raise ValueError(f"--input {item} is a directory; pass its files, e.g. '{item}/*.jsonl.gz'")
        if not matches:
            looks_local = glob.has_magic(item) or item.startswith((".", "/", "~")) or item.count("/") != 1 or \
                any(item.lower().endswith(e) for e in (*FORMATS, *COMPRESSIONS))
            if looks_local or len(spec.inputs) > 1:
                raise FileNotFoundError(f"--input {item}: no such file")
            return None  # "owner/name": a hub dataset
        files.extend(Path(m) for m in matches)
    return files


def fingerprint(spec: SourceSpec) -> dict:
    """What identifies the records read (and their order): resume only continues a run with the same one."""
    files = local_files(spec)
    common = {"split": spec.split, "text_key": spec.text_key, "max_docs": spec.max_docs}
    if files is None:
        return {"hub": spec.inputs[0], "subset": spec.subset, "revision": spec.revision, **common}
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return {"files": stats, "text_sample_by": spec.text_sample_by, **common}


def open_dataset(spec: SourceSpec):
    """The streaming `datasets.IterableDataset` of `spec`."""
    import datasets

    files = local_files(spec)
    if files is None:
        return datasets.load_dataset(spec.inputs[0], spec.subset, split=spec.split, revision=spec.revision,
                                     streaming=True)
    formats = {_format_of(str(p)) for p in files}
    if len(formats) != 1:
        raise ValueError(f"--input mixes formats {sorted(formats)}; preprocess each format separately")
    fmt = formats.pop()
    kwargs = {"sample_by": spec.text_sample_by} if fmt == "text" else {}
    try:
        return datasets.load_dataset(fmt, data_files=[str(p) for p in files], split="train", streaming=True,
                                     **kwargs)
    except StopIteration:  # datasets' json reader, when it finds no record to infer the features from
        raise ValueError(f"--input {' '.join(spec.inputs)} has no records") from None


def known_length(spec: SourceSpec, dataset) -> int | None:
    """The number of records, where the hub's metadata says it (for the progress bar only)."""
    try:
        n = dataset.info.splits[spec.split].num_examples
    except (AttributeError, KeyError, TypeError):
        n = None
    n = n or None
    if spec.max_docs is not None:
        n = min(n, spec.max_docs) if n else spec.max_docs
    return n


def iter_texts(spec: SourceSpec, dataset=None, skip: int = 0) -> Iterator[str]:
    """The text of every record from record `skip` on, in order, up to `max_docs` records in all."""
    ds = dataset if dataset is not None else open_dataset(spec)
    if spec.max_docs is not None:
        ds = ds.take(spec.max_docs)
    if skip:
        ds = ds.skip(skip)
    for i, record in enumerate(ds, start=skip):
        text = record.get(spec.text_key)
        if isinstance(text, str):
            yield text
            continue
        raise ValueError(f"record {i} has no string field {spec.text_key!r} (its fields: {sorted(record)}); "
                         f"pick the text field with --text-key")
