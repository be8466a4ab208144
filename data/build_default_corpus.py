"""Build the embedded default corpus and its tokenizer from Debian's python3.11-doc.

The default training run must need no network, so the corpus and the tokenizer are
built once here and committed under data/default_corpus/. Rebuild (Debian/Ubuntu):

    apt-get install -y python3.11-doc
    python data/build_default_corpus.py

Outputs, all deterministic for a given package version:
    cpython_docs.jsonl.xz   one {"id": <path relative to _sources>, "text": ...} per line, sorted by id
    tokenizer.json          byte-level BPE, vocab 8192, "<|endoftext|>" = id 0 (end of document)
    LICENSE                 the package's copyright file verbatim + the docs' Zero-Clause BSD terms
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DEFAULT_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
DEFAULT_COPYRIGHT = Path("/usr/share/doc/python3.11-doc/copyright")
DEFAULT_OUT = Path(__file__).resolve().parent / "default_corpus"
CORPUS_NAME = "cpython_docs.jsonl.xz"
TOKENIZER_NAME = "tokenizer.json"
EOD_TOKEN = "<|endoftext|>"
# The shipped file must stay small enough to commit; above this, a subset is taken.
MAX_COMPRESSED_BYTES = 4 * 1024 * 1024


def clean(text: str) -> str:
    """Light cleanup only: the text should stay the upstream reST, minus noise whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def read_documents(sources: Path) -> list[dict[str, str]]:
    """All non-empty .rst.txt documents under `sources`, in sorted relative-path order."""
    if not sources.is_dir():
        raise FileNotFoundError(
            f"sources={sources} is not a directory; install the docs with "
            "`apt-get install -y python3.11-doc` or pass --sources"
        )
    paths = sorted(sources.rglob("*.rst.txt"), key=lambda p: p.relative_to(sources).as_posix())
    docs = []
    for path in paths:
        text = clean(path.read_text(encoding="utf-8"))
        if not text:
            continue
        doc_id = path.relative_to(sources).as_posix()
        # id 0 must only ever mean "end of document"; the tokenizer would map a literal
        # occurrence in the text to it as well, so refuse such input instead of hiding it.
        if EOD_TOKEN in text:
            raise ValueError(f"document {doc_id} contains the EOD marker {EOD_TOKEN!r}; remove it first")
        docs.append({"id": doc_id, "text": text})
    if not docs:
        raise ValueError(f"sources={sources} holds no non-empty *.rst.txt files")
    return docs


def to_jsonl(docs: list[dict[str, str]]) -> bytes:
    # ensure_ascii=False keeps the file readable and smaller; sort_keys fixes the field order.
    lines = (json.dumps(d, ensure_ascii=False, sort_keys=True) for d in docs)
    return ("\n".join(lines) + "\n").encode("utf-8")


def compress(raw: bytes) -> bytes:
    # Single-threaded preset 9e: the output bytes depend only on the input and the preset.
    return lzma.compress(raw, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME)


def fit_under_limit(docs: list[dict[str, str]], limit: int) -> tuple[list[dict[str, str]], bytes, int]:
    """Return (docs kept, compressed bytes, raw size). Drops the tail of the sorted order until
    the compressed file fits: deterministic, and it keeps whole top-level sections together."""
    kept = docs
    while True:
        raw = to_jsonl(kept)
        packed = compress(raw)
        if len(packed) <= limit:
            return kept, packed, len(raw)
        keep = max(1, int(len(kept) * limit / len(packed) * 0.98))
        if keep >= len(kept):
            keep = len(kept) - 1
        print(f"[build] {len(packed) / 2**20:.2f} MiB compressed > limit; keeping the first {keep} docs")
        kept = kept[:keep]


def iter_texts(docs: list[dict[str, str]]) -> Iterator[str]:
    for d in docs:
        yield d["text"]


def train_tokenizer(docs: list[dict[str, str]], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): every byte string round-trips through encode/decode."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: decode(encode(text)) must equal text exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(docs), trainer=trainer, length=len(docs))
    if tok.token_to_id(EOD_TOKEN) != 0:
        raise RuntimeError(f"{EOD_TOKEN!r} got id {tok.token_to_id(EOD_TOKEN)}, expected 0")
    return tok


def check_round_trip(tok: Tokenizer, docs: list[dict[str, str]]) -> int:
    """Every document must decode back to itself; returns the total token count."""
    encodings = tok.encode_batch([d["text"] for d in docs])
    total = 0
    for d, enc in zip(docs, encodings):
        if tok.decode(enc.ids, skip_special_tokens=False) != d["text"]:
            raise RuntimeError(f"tokenizer does not round-trip document {d['id']}")
        total += len(enc.ids)
    return total


def _between(text: str, start: str, end: str, where: Path) -> str:
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{where}: expected a section from {start!r} to {end!r}; has the layout changed?")
    return text[i:j].strip()


def license_text(copyright_file: Path, sources: Path) -> str:
    """Debian's copyright file verbatim, then the documentation's own statement that code in
    it is also under the Zero-Clause BSD license (Debian's file does not carry that part)."""
    if not copyright_file.is_file():
        raise FileNotFoundError(f"--copyright {copyright_file} does not exist; install python3.11-doc")
    license_rst = sources / "license.rst.txt"
    rst = license_rst.read_text(encoding="utf-8")
    terms = _between(
        rst, "Python software and documentation are licensed", "Some software incorporated", license_rst
    )
    bsd0 = _between(rst, "ZERO-CLAUSE BSD LICENSE", ".. _OtherLicenses:", license_rst)
    # As the package's HTML renders it: |release| is the upstream version (3.11.2 for 3.11.2-6+deb12u9).
    release = package_version("python3.11-doc").split("-")[0]
    bsd0 = bsd0.replace("|release|", release if release != "unknown" else "3.11")
    bsd0 = re.sub(r"\n\s*\.\. parsed-literal::\s*\n", "\n\n", bsd0)
    rule = "=" * 72
    return (
        "License of data/default_corpus/cpython_docs.jsonl.xz (CPython 3.11 documentation sources)\n"
        f"{rule}\n\nPart 1: {copyright_file} (Debian package python3.11-doc), verbatim.\n{rule}\n\n"
        + copyright_file.read_text(encoding="utf-8").rstrip()
        + f"\n\n{rule}\nPart 2: from {license_rst} (the documentation's own license page).\n{rule}\n\n"
        + terms
        + "\n\n"
        + "\n".join(line.rstrip() for line in bsd0.splitlines())
        + "\n"
    )


def package_version(name: str) -> str:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=Path, default=DEFAULT_SOURCES, help="reST sources (%(default)s)")
    p.add_argument("--copyright", type=Path, default=DEFAULT_COPYRIGHT, help="license file (%(default)s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (%(default)s)")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (%(default)s)")
    p.add_argument(
        "--max-compressed-mb",
        type=float,
        default=MAX_COMPRESSED_BYTES / 2**20,
        help="keep a sorted-order prefix of the docs if the .xz would exceed this (%(default)s MiB)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.vocab_size < 257:
        raise SystemExit(f"--vocab-size={args.vocab_size} is below 257 (256 bytes + EOD); use e.g. 8192")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    all_docs = read_documents(args.sources)
    docs, packed, raw_size = fit_under_limit(all_docs, int(args.max_compressed_mb * 2**20))
    (args.out / CORPUS_NAME).write_bytes(packed)
    print(
        f"[build] {len(docs)}/{len(all_docs)} docs, {raw_size / 2**20:.2f} MiB raw jsonl, "
        f"{len(packed) / 2**20:.2f} MiB xz -> {args.out / CORPUS_NAME}"
    )

    tok = train_tokenizer(docs, args.vocab_size)
    tok.save(str(args.out / TOKENIZER_NAME), pretty=True)
    n_tokens = check_round_trip(tok, docs)
    print(
        f"[build] tokenizer vocab {tok.get_vocab_size()}, {n_tokens} tokens "
        f"(+{len(docs)} EOD) -> {args.out / TOKENIZER_NAME}"
    )

    (args.out / "LICENSE").write_text(license_text(args.copyright, args.sources), encoding="utf-8")
    print(
        f"[build] python3.11-doc {package_version('python3.11-doc')}, done in {time.perf_counter() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
