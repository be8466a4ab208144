"""HF datasets -> tokenizer -> Megatron's indexed format (.bin/.idx), in parallel, resumable.

    # FineWeb-Edu 10BT with the SmolLM2 tokenizer (the paper's recipe; needs the hub)
    python -m data.preprocess --input HuggingFaceFW/fineweb-edu --subset sample-10BT --split train \\
        --tokenizer HuggingFaceTB/SmolLM2-135M --output-prefix prepared/fineweb_edu_10bt/smollm2_text_document
    # local files (json/jsonl/parquet/csv/txt, optionally .gz/.xz/.bz2/.zst; globs are sorted)
    python -m data.preprocess --input 'corpus/*.jsonl.xz' --tokenizer path/to/tokenizer.json --output-prefix out/corpus
    # train a byte-level BPE on the corpus first (saved as <output-prefix>.tokenizer.json)
    python -m data.preprocess --input corpus.jsonl --train-tokenizer 8192 --output-prefix out/corpus

Every document becomes one sequence: its tokens, then the EOD token (uint16 below 65500 token ids, int32
above). Files are written through megatron-core's IndexedDatasetBuilder, so they are interchangeable with
Megatron-LM's preprocess_data.py output. Empty records are skipped. A `<prefix>.json` beside them records
the tokenizer, the counts and the source (docs/data.md).

Workers tokenize batches in order, so the output is bit-identical for any --workers. Resume: records are
written in chunks of --chunk-docs under `<prefix>.parts/`, each complete chunk renamed into place; rerun
the same command after an interruption and it resumes after the last complete chunk (a rerun with other
arguments discards the partial work and restarts). The final .bin/.idx appear only when complete, the
.idx last, so a prefix whose .idx exists is never half-written. Existing output is never overwritten
without --overwrite.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, fields
from itertools import islice
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from asyncpp.host.files import refuse_overwriting_inputs
from data.indexed import bin_path, idx_path, publish, temp_path, token_dtype
from data.inputs import SourceSpec, fingerprint, iter_texts, known_length, local_files, open_dataset
from data.tokenizer import EOD_TOKEN, LoadedTokenizer, load_tokenizer, resolve_tokenizer_file, train_bpe

FORMAT = 1


@dataclass
class Stats:
    records: int = 0
    """Input records consumed (empty ones included)."""
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    empty: int = 0
    literal_eod: int = 0
    """Documents' text that tokenized to the EOD id (a literal EOD string in the text)."""
    resumed_records: int = 0
    seconds: float = 0.0

    def add(self, other: Stats) -> None:
        for f in fields(self):
            if f.name not in ("resumed_records", "seconds"):
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


# ---- workers: one tokenizer per process, batches in, flat token arrays out -------------------------------
_WORKER: dict = {}


def _init_worker(tokenizer_json: str, eod_id: int, append_eod: bool, dtype: str, single_thread: bool) -> None:
    if single_thread:  # one core per worker; set before the tokenizer's thread pool ever starts
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _WORKER.update(tok=Tokenizer.from_str(tokenizer_json), eod=eod_id, append_eod=append_eod, dtype=np.dtype(dtype))


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray, Stats]:
    """(tokens of all documents back to back, length per input text (0 = empty, skipped), stats)."""
    w = _WORKER
    encodings = w["tok"].encode_batch(texts, add_special_tokens=False)
    raw = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))
    lengths = raw + (raw > 0) * int(w["append_eod"])
    ids = np.empty(int(lengths.sum()), w["dtype"])
    pos = 0
    for e, n, k in zip(encodings, lengths.tolist(), raw.tolist()):
        if n:
            ids[pos: pos + k] = e.ids
            if w["append_eod"]:
                ids[pos + n - 1] = w["eod"]
            pos += n
    nonempty = int(np.count_nonzero(raw))
    literal = int(np.count_nonzero(ids == w["eod"])) - (nonempty if w["append_eod"] else 0)
    stats = Stats(records=len(texts), documents=nonempty, tokens=int(ids.size), empty=len(texts) - nonempty,
                  input_bytes=sum(len(t.encode("utf-8")) for t in texts), literal_eod=literal)
    return ids, lengths, stats


def _ordered_map(items: Iterable, workers: int, initargs: tuple) -> Iterator:
    """(meta, _encode(texts)) for (meta, texts) in items, in input order, at most 2 batches per worker in
    flight (reading never runs ahead of tokenizing by more). workers=0 tokenizes in this process."""
    if workers == 0:
        _init_worker(*initargs[:-1], single_thread=False)
        for meta, texts in items:
            yield meta, _encode(texts)
        return
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=initargs) as pool:
        pending: deque = deque()
        try:
            for meta, texts in items:
                pending.append((meta, pool.submit(_encode, texts)))
                if len(pending) >= 2 * workers:
                    meta0, fut = pending.popleft()
                    yield meta0, fut.result()
            while pending:
                meta0, fut = pending.popleft()
                yield meta0, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()


def _batches(texts: Iterator[str], first_chunk: int, chunk_docs: int, batch_docs: int) -> Iterator:
    """((chunk number, batch), texts) with chunk boundaries every chunk_docs records."""
    chunk = first_chunk
    while True:
        left = chunk_docs
        while left:
            batch = list(islice(texts, min(batch_docs, left)))
            if not batch:
                return
            yield chunk, batch
            left -= len(batch)
        chunk += 1


# ---- chunks: the unit of resume ---------------------------------------------------------------------------
def _chunk_prefix(parts: Path, n: int) -> Path:
    return parts / f"chunk-{n:06d}"


class _ChunkWriter:
    """One chunk through megatron-core's IndexedDatasetBuilder, published only when finished."""

    def __init__(self, parts: Path, number: int, dtype: np.dtype):
        from data.mcore import indexed_dataset_builder  # megatron: not in the workers, which only tokenize

        self.prefix = _chunk_prefix(parts, number)
        self.number = number
        self.tmp_bin = temp_path(bin_path(self.prefix))
        self.builder = indexed_dataset_builder(self.tmp_bin, dtype)
        self.stats = Stats()

    def add(self, ids: np.ndarray, lengths: np.ndarray, stats: Stats) -> None:
        pos = 0
        for n in lengths[lengths > 0].tolist():
            self.builder.add_document(ids[pos: pos + n], [n])
            pos += n
        self.stats.add(stats)

    def finish(self) -> None:
        tmp_idx, tmp_json = temp_path(idx_path(self.prefix)), temp_path(Path(f"{self.prefix}.json"))
        self.builder.finalize(str(tmp_idx))
        tmp_json.write_text(json.dumps(asdict(self.stats)))
        publish({bin_path(self.prefix): self.tmp_bin, Path(f"{self.prefix}.json"): tmp_json,
                 idx_path(self.prefix): tmp_idx})


def _resume_point(parts: Path, manifest: dict) -> tuple[int, Stats]:
    """Complete chunks to keep (0 if the partial run had other arguments) and their summed stats."""
    path = parts / "manifest.json"
    same = path.is_file() and json.loads(path.read_text()) == manifest
    done, stats = 0, Stats()
    if same:
        while idx_path(_chunk_prefix(parts, done)).is_file():
            stats.add(Stats(**json.loads(Path(f"{_chunk_prefix(parts, done)}.json").read_text())))
            done += 1
    elif any(p.name != "lock" for p in parts.iterdir()):
        print(f"[preprocess] {parts} holds a partial run made with other arguments: restarting", file=sys.stderr)
    keep = {"lock", "manifest.json"} if same else {"lock"}
    keep |= {f"{_chunk_prefix(parts, i).name}{s}" for i in range(done) for s in (".bin", ".idx", ".json")}
    for p in parts.iterdir():
        if p.name not in keep:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    if not same:
        tmp = temp_path(path)
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, path)
    return done, stats


def _merge(parts: Path, chunks: int, prefix: Path, dtype: np.dtype, meta: dict) -> None:
    tmp_json = temp_path(Path(f"{prefix}.json"))
    tmp_json.write_text(json.dumps(meta, indent=2))
    if chunks == 1:  # nothing to concatenate: move the chunk itself
        files = {bin_path(prefix): bin_path(_chunk_prefix(parts, 0)), idx_path(prefix): idx_path(_chunk_prefix(parts, 0))}
    else:
        from data.mcore import indexed_dataset_builder

        tmp_bin, tmp_idx = temp_path(bin_path(prefix)), temp_path(idx_path(prefix))
        builder = indexed_dataset_builder(tmp_bin, dtype)
        for i in range(chunks):
            builder.add_index(str(_chunk_prefix(parts, i)))
        builder.finalize(str(tmp_idx))
        files = {bin_path(prefix): tmp_bin, idx_path(prefix): tmp_idx}
    publish({**files, Path(f"{prefix}.json"): tmp_json})


class _Lock:
    """An exclusive flock on <parts>/lock: two runs writing one prefix would interleave their chunks."""

    def __init__(self, parts: Path):
        parts.mkdir(parents=True, exist_ok=True)
        self.file = open(parts / "lock", "w")  # noqa: SIM115  (held until release(): the flock lives with it)
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise FileExistsError(f"another data.preprocess is writing {parts} (it holds {parts / 'lock'})") from None

    def release(self) -> None:
        self.file.close()


def _write_chunks(results: Iterator, parts: Path, dtype: np.dtype, stats: Stats, bar) -> int:
    """Write the tokenized batches into chunk files; returns the number of chunks (0 if none was new)."""
    writer, chunks, new_bytes, t0 = None, 0, 0, time.perf_counter()
    for chunk_no, (ids, lengths, batch_stats) in results:
        if writer is None or chunk_no != writer.number:
            if writer is not None:
                writer.finish()
            writer, chunks = _ChunkWriter(parts, chunk_no, dtype), chunk_no + 1
        writer.add(ids, lengths, batch_stats)
        stats.add(batch_stats)
        new_bytes += batch_stats.input_bytes
        bar.update(batch_stats.records)
        rate = new_bytes / 2**20 / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix_str(f"{stats.tokens / 1e6:,.1f}M tokens, {rate:.1f} MB/s", refresh=False)
    if writer is not None:
        writer.finish()
    return chunks


# ---- the whole run ----------------------------------------------------------------------------------------
def write_indexed(texts_from: Callable[[int], Iterator[str]], tok: LoadedTokenizer, prefix: str | Path, *,
                  source: dict, workers: int = 1, batch_docs: int = 256, chunk_docs: int = 100_000,
                  append_eod: bool = True, overwrite: bool = False, progress: bool = True,
                  total: int | None = None) -> Stats:
    """Tokenize `texts_from(skip)` (the records from `skip` on) into `<prefix>.bin/.idx`. `source`
    identifies the input for resume; a rerun with the same arguments continues after the last chunk."""
    from tqdm import tqdm

    from data.mcore import indexed_dataset_builder  # noqa: F401  (megatron's 5 s import, before the clock starts)

    prefix = Path(prefix)
    if workers < 0 or batch_docs < 1 or chunk_docs < 1:
        raise ValueError(f"workers={workers} must be >= 0, batch_docs={batch_docs} and chunk_docs={chunk_docs} >= 1")
    existing = [p for p in (idx_path(prefix), bin_path(prefix)) if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists; pass --overwrite to replace it (the old files stay until "
                              "the new ones are complete)")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    manifest = {"format": FORMAT, "source": source, "tokenizer_sha256": tok.sha256, "eod_id": tok.eod_id,
                "append_eod": append_eod, "chunk_docs": chunk_docs, "dtype": dtype.name}
    manifest = json.loads(json.dumps(manifest))  # as it reads back (tuples become lists)
    parts = Path(f"{prefix}.parts")
    lock = _Lock(parts)
    try:
        t0 = time.perf_counter()
        done, stats = _resume_point(parts, manifest)
        stats.resumed_records = done * chunk_docs
        if done:
            print(f"[preprocess] resuming after {done} complete chunk(s) ({stats.records:,} records) in {parts}",
                  file=sys.stderr)
        initargs = (tok.tokenizer.to_str(), tok.eod_id, append_eod, dtype.name, True)
        items = _batches(texts_from(done * chunk_docs), done, chunk_docs, batch_docs)
        with tqdm(total=total, initial=stats.records, unit="doc", disable=not progress, dynamic_ncols=True) as bar:
            chunks = _write_chunks(_ordered_map(items, workers, initargs), parts, dtype, stats, bar) or done
        if stats.documents == 0:
            shutil.rmtree(parts)
            raise ValueError(f"the input has no non-empty documents ({stats.records} records read); nothing written")
        meta = {"format": "megatron-indexed", "written_by": "asyncpp data.preprocess", "tokenizer": tok.name,
                "tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
                "eod_token": tok.eod_token, "append_eod": append_eod, "dtype": dtype.name,
                "documents": stats.documents, "tokens": stats.tokens, "empty_skipped": stats.empty,
                "literal_eod": stats.literal_eod, "source": source}
        _merge(parts, chunks, prefix, dtype, meta)
        shutil.rmtree(parts)
        stats.seconds = time.perf_counter() - t0
        return stats
    except BaseException:
        if parts.is_dir() and not any(parts.glob("chunk-*.idx")):  # nothing to resume from: leave nothing
            shutil.rmtree(parts)
        raise
    finally:
        lock.release()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m data.preprocess", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("input")
    src.add_argument("--input", nargs="+", required=True, help="local files/globs, or one hub dataset name")
    src.add_argument("--subset", help="hub dataset configuration, e.g. sample-10BT")
    src.add_argument("--split", default="train", help="hub dataset split (%(default)s)")
    src.add_argument("--revision", help="hub dataset revision (a commit pins the data)")
    src.add_argument("--text-key", default="text", help="the field holding the text (%(default)s)")
    src.add_argument("--text-sample-by", default="document", choices=["document", "paragraph", "line"],
                     help="for .txt inputs: what one record is (%(default)s)")
    src.add_argument("--max-docs", type=int, help="read at most this many records")
    tk = p.add_argument_group("tokenizer").add_mutually_exclusive_group(required=True)
    tk.add_argument("--tokenizer", help="tokenizer.json, a directory with one, or a hub name (local cache first)")
    tk.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE",
                    help="train a byte-level BPE of this size on the input first")
    p.add_argument("--tokenizer-out", type=Path, help="where --train-tokenizer saves (<output-prefix>.tokenizer.json)")
    p.add_argument("--eod-token", default=EOD_TOKEN, help="end-of-document token (%(default)s)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false", help="do not append EOD")
    out = p.add_argument_group("output")
    out.add_argument("--output-prefix", required=True, type=Path, help="writes <prefix>.bin, .idx and .json")
    out.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                     help="tokenizer processes; 0 = in this process (%(default)s)")
    out.add_argument("--batch-docs", type=int, default=256, help="records per worker task (%(default)s)")
    out.add_argument("--chunk-docs", type=int, default=100_000, help="records per resumable chunk (%(default)s)")
    out.add_argument("--overwrite", action="store_true", help="replace an existing output prefix")
    out.add_argument("--no-progress", dest="progress", action="store_false")
    return p.parse_args(argv)


def _tokenizer(args: argparse.Namespace, spec: SourceSpec) -> LoadedTokenizer:
    if args.tokenizer:
        return load_tokenizer(args.tokenizer, args.eod_token)
    out = args.tokenizer_out or Path(f"{args.output_prefix}.tokenizer.json")
    if out.is_file():  # from an interrupted run (or a previous one): reuse, so a resume keeps its token ids
        print(f"[preprocess] reusing the tokenizer {out} (delete it to train a new one)", file=sys.stderr)
    else:
        t0 = time.perf_counter()
        tok = train_bpe(iter_texts(spec), args.train_tokenizer, args.eod_token)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(out)
        tok.save(str(tmp), pretty=True)
        os.replace(tmp, out)
        print(f"[preprocess] trained a {tok.get_vocab_size()}-token byte-level BPE in "
              f"{time.perf_counter() - t0:.1f}s -> {out}", file=sys.stderr)
    return load_tokenizer(out, args.eod_token)


def check_outputs(args: argparse.Namespace, spec: SourceSpec) -> None:
    """Nothing this run writes (the .bin/.idx, the <prefix>.json sidecar, the <prefix>.parts/ directory it removes,
    a trained tokenizer) may be one of its inputs (an --input file, the --tokenizer), however spelt; and a
    <prefix>.json that another program wrote is not replaced without --overwrite. Raises FileExistsError."""
    prefix = args.output_prefix
    sidecar = Path(f"{prefix}.json")
    outputs = [("--output-prefix", p) for p in (bin_path(prefix), idx_path(prefix), sidecar, Path(f"{prefix}.parts"))]
    if args.train_tokenizer:
        outputs.append(("--tokenizer-out" if args.tokenizer_out else "--train-tokenizer (<output-prefix>.tokenizer"
                        ".json)", args.tokenizer_out or Path(f"{prefix}.tokenizer.json")))
    inputs = [("--input", p) for p in local_files(spec) or ()]
    if args.tokenizer and Path(args.tokenizer).expanduser().exists():
        inputs.append(("--tokenizer", resolve_tokenizer_file(args.tokenizer)))
    refuse_overwriting_inputs(outputs, inputs, "choose another --output-prefix (or --tokenizer-out)")
    if sidecar.is_file() and not args.overwrite and not _ours(sidecar):
        raise FileExistsError(f"--output-prefix {prefix}: {sidecar} exists and was not written by data.preprocess, "
                              "but the run writes its record there; choose another --output-prefix, or pass "
                              "--overwrite to replace it")


def _ours(sidecar: Path) -> bool:
    try:
        return json.loads(sidecar.read_text()).get("written_by") == "asyncpp data.preprocess"
    except (ValueError, AttributeError, OSError, UnicodeDecodeError):
        return False


def run(args: argparse.Namespace) -> Stats:
    spec = SourceSpec(inputs=tuple(args.input), subset=args.subset, split=args.split, revision=args.revision,
                      text_key=args.text_key, text_sample_by=args.text_sample_by, max_docs=args.max_docs)
    if args.output_prefix.suffix in (".bin", ".idx"):
        raise ValueError(f"--output-prefix {args.output_prefix}: give the prefix without .bin/.idx")
    check_outputs(args, spec)
    source = fingerprint(spec)
    tok = _tokenizer(args, spec)
    dataset = open_dataset(spec)
    stats = write_indexed(lambda skip: iter_texts(spec, dataset, skip), tok, args.output_prefix, source=source,
                          workers=args.workers, batch_docs=args.batch_docs, chunk_docs=args.chunk_docs,
                          append_eod=args.append_eod, overwrite=args.overwrite, progress=args.progress,
                          total=known_length(spec, dataset))
    new_tokens_note = f" ({stats.resumed_records:,} records resumed)" if stats.resumed_records else ""
    print(f"[preprocess] {stats.documents:,} documents, {stats.tokens:,} tokens (vocab {tok.vocab_size}) -> "
          f"{args.output_prefix}.bin/.idx in {stats.seconds:.1f}s{new_tokens_note}; "
          f"{stats.empty} empty records skipped", file=sys.stderr)
    if stats.literal_eod:
        print(f"[preprocess] warning: {stats.literal_eod} tokens inside documents are the EOD id (their text "
              f"contains {args.eod_token!r})", file=sys.stderr)
    return stats


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:
        print(f"[preprocess] interrupted: no {args.output_prefix}.idx was written; rerun the same command to "
              f"resume after the last complete chunk", file=sys.stderr)
        return 130
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
