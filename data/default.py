"""The embedded default corpus (CPython 3.11 docs, 8192-token byte-level BPE), as a Megatron indexed dataset.

The default run needs no network: on first use, `default_prefix()` tokenizes data/default_corpus/ with
the shipped tokenizer through data.preprocess into `<cache>/default/cpython_docs-<hash>.bin/.idx` (a
private staging directory, renamed into place when complete), and training reads it with megatron-core's
GPTDataset like any other prefix (data.source). Documents are written in the order of a hash of their
id, so Megatron's contiguous train/valid split (data.split) holds out a random sample of documents
rather than the last files alphabetically.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

from data.indexed import bin_path, idx_path, is_complete, publish

DEFAULT_DIR = Path(__file__).resolve().parent / "default_corpus"
DEFAULT_CORPUS = DEFAULT_DIR / "cpython_docs.jsonl.xz"
DEFAULT_TOKENIZER = DEFAULT_DIR / "tokenizer.json"
EOD_TOKEN = "<|endoftext|>"
# Bump when the written layout changes, so a stale cache is never read.
_CACHE_FORMAT = 2


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


def unit_hash(doc_id: str) -> float:
    """The first 8 bytes of sha256(id) as a fraction of 2**64: independent of process and hash seed."""
    return int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big") / 2**64


def content_key(corpus: Path, tokenizer: Path) -> str:
    """A changed corpus or tokenizer can never hit an old cache."""
    h = hashlib.sha256(f"asyncpp-default-v{_CACHE_FORMAT}|".encode())
    for path in (corpus, tokenizer):
        h.update(hashlib.sha256(Path(path).read_bytes()).digest())
    return h.hexdigest()[:16]


def default_prefix(cache_dir: Path | None = None, *, corpus: Path = DEFAULT_CORPUS,
                   tokenizer: Path = DEFAULT_TOKENIZER, workers: int | None = None) -> Path:
    """The indexed-dataset prefix of `corpus` tokenized with `tokenizer`, built on first use."""
    from data.preprocess import write_indexed
    from data.tokenizer import load_tokenizer

    for name, path in (("corpus", corpus), ("tokenizer", tokenizer)):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{name}={path} does not exist; the default lives in {DEFAULT_DIR} "
                                    "(rebuild it with `python data/build_default_corpus.py`)")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = content_key(corpus, tokenizer)
    prefix = cache_dir / "default" / f"{Path(corpus).name.split('.')[0]}-{key}"
    if is_complete(prefix):
        return prefix
    prefix.parent.mkdir(parents=True, exist_ok=True)
    # Tens of seconds on a small machine, once per cache: say so before the wait, not only after it.
    print(f"[data] first use of {Path(corpus).name}: tokenizing it into {prefix}.bin/.idx (once; later runs "
          "read the cache)", flush=True)
    stage = Path(tempfile.mkdtemp(dir=prefix.parent, prefix=f"{prefix.name}.", suffix=".tmp"))
    try:
        docs = sorted(read_corpus(Path(corpus)), key=lambda d: unit_hash(d["id"]))
        texts = [d["text"] for d in docs]
        tok = load_tokenizer(tokenizer, EOD_TOKEN)
        staged = stage / "corpus"
        stats = write_indexed(lambda skip: iter(texts[skip:]), tok, staged, source={"default_corpus": key},
                              workers=min(4, os.cpu_count() or 1) if workers is None else workers,
                              chunk_docs=len(texts), progress=False)
        if not is_complete(prefix):  # else another process finished first; its files are identical
            publish({bin_path(prefix): bin_path(staged), Path(f"{prefix}.json"): Path(f"{staged}.json"),
                     idx_path(prefix): idx_path(staged)})
        print(f"[data] tokenized {Path(corpus).name}: {stats.documents} documents, {stats.tokens:,} tokens "
              f"(vocab {tok.vocab_size}) in {stats.seconds:.1f}s -> {prefix}.bin/.idx", flush=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return prefix
