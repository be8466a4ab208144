"""data.preprocess -> Megatron .bin/.idx -> megatron-core GPTDataset/blending -> the trainer's DataSource.

Every input is a small local file written here; the same code reads hub datasets (docs/data.md).
"""

from __future__ import annotations

import json
import lzma
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import data.preprocess as pp
from data.default import DEFAULT_TOKENIZER
from data.indexed import DTYPE_CODES, IndexedDataError, bin_path, check_prefix, idx_path
from data.mcore import open_indexed, process_local
from data.source import IndexedDataSource
from data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["pipeline", "stage", "Muon", "gradient", "naïve", "λ-calculus", "def f(x):", "\n", "  ", "é", "2BW"]


def make_texts(n: int, seed: int = 0, words: list[str] = WORDS) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(words, k=rng.randint(5, 80))) for _ in range(n)]
    for i in range(0, n, 37):
        texts[i] = ""  # empty records are skipped
    return texts


def write_jsonl_xz(path: Path, texts: list[str]) -> Path:
    with lzma.open(path, "wt", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n")
    return path


def documents(prefix) -> list[list[int]]:
    """Every document's tokens, copied: megatron's IndexedDataset unmaps its file when collected, so
    views into it must not outlive it."""
    ds = open_indexed(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def cli(*args: str) -> int:
    return pp.main([*args, "--no-progress"])


def preprocess(out: Path, texts: list[str], **kw) -> Path:
    """In-process (workers=0) write of `texts`: the fast path for building test prefixes."""
    tok = load_tokenizer(DEFAULT_TOKENIZER)
    pp.write_indexed(lambda skip: iter(texts[skip:]), tok, out, source={"test": str(out)}, workers=0,
                     progress=False, **kw)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    texts = make_texts(300)
    return write_jsonl_xz(tmp_path_factory.mktemp("in") / "docs.jsonl.xz", texts), texts


@pytest.fixture(scope="module")
def one_worker(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("w1") / "docs_text_document"
    assert cli("--input", str(corpus[0]), "--tokenizer", str(DEFAULT_TOKENIZER), "--output-prefix", str(out),
               "--workers", "1", "--chunk-docs", "64", "--batch-docs", "16") == 0
    return out


# ---- preprocessing --------------------------------------------------------------------------------------
def test_round_trip_yields_exactly_the_tokenized_documents(corpus, one_worker):
    _, texts = corpus
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    expected = [tok.encode(t, add_special_tokens=False).ids + [0] for t in texts if t]
    ds = open_indexed(one_worker)  # megatron-core's own reader
    assert len(ds) == len(expected) == 300 - len(range(0, 300, 37))
    for i, ids in enumerate(expected):
        assert ds[i].tolist() == ids
    info = check_prefix(one_worker)
    assert (info.documents, info.tokens, info.dtype) == (len(expected), sum(map(len, expected)), np.uint16)
    meta = json.loads(Path(f"{one_worker}.json").read_text())
    assert meta["documents"] == len(expected) and meta["empty_skipped"] == len(range(0, 300, 37))
    assert not Path(f"{one_worker}.parts").exists(), "the chunks are merged and removed"


def test_output_is_bit_identical_for_any_worker_count(corpus, one_worker, tmp_path):
    two = tmp_path / "w2"
    assert cli("--input", str(corpus[0]), "--tokenizer", str(DEFAULT_TOKENIZER), "--output-prefix", str(two),
               "--workers", "2", "--chunk-docs", "1000", "--batch-docs", "7") == 0
    inproc = preprocess(tmp_path / "w0", corpus[1], chunk_docs=50)
    for other in (two, inproc):
        assert bin_path(other).read_bytes() == bin_path(one_worker).read_bytes()
        assert idx_path(other).read_bytes() == idx_path(one_worker).read_bytes()


def test_parquet_and_text_inputs(corpus, one_worker, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": corpus[1]}), tmp_path / "docs.parquet")
    assert cli("--input", str(tmp_path / "docs.parquet"), "--text-key", "body", "--tokenizer",
               str(DEFAULT_TOKENIZER), "--output-prefix", str(tmp_path / "pq"), "--workers", "0") == 0
    assert bin_path(tmp_path / "pq").read_bytes() == bin_path(one_worker).read_bytes()
    for i, t in enumerate(["first file\nwith two lines", "second"]):
        (tmp_path / f"{i}.txt").write_text(t)
    assert cli("--input", str(tmp_path / "*.txt"), "--tokenizer", str(DEFAULT_TOKENIZER), "--output-prefix",
               str(tmp_path / "txt"), "--workers", "0") == 0
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    assert [tok.decode(d[:-1]) for d in documents(tmp_path / "txt")] == ["first file\nwith two lines",
                                                                                      "second"]


def test_train_tokenizer_mode(corpus, tmp_path):
    out = tmp_path / "trained"
    assert cli("--input", str(corpus[0]), "--train-tokenizer", "300", "--output-prefix", str(out),
               "--workers", "0") == 0
    tok = Tokenizer.from_file(f"{out}.tokenizer.json")
    assert tok.get_vocab_size() <= 300 and tok.token_to_id("<|endoftext|>") == 0
    docs = documents(out)
    assert [tok.decode(d[:-1]) for d in docs] == [t for t in corpus[1] if t]


def test_interrupted_run_leaves_no_complete_looking_idx_and_resumes(corpus, one_worker, tmp_path, monkeypatch,
                                                                    capsys):
    out, args = tmp_path / "resumed", ["--input", str(corpus[0]), "--tokenizer", str(DEFAULT_TOKENIZER),
                                       "--output-prefix", str(tmp_path / "resumed"), "--workers", "0",
                                       "--chunk-docs", "64", "--batch-docs", "16"]
    add = pp._ChunkWriter.add

    def killed_in_chunk_2(self, *a):
        if self.number == 2:
            raise KeyboardInterrupt  # Ctrl-C / preemption halfway through the third chunk
        add(self, *a)

    monkeypatch.setattr(pp._ChunkWriter, "add", killed_in_chunk_2)
    assert cli(*args) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err
    assert not idx_path(out).exists() and not bin_path(out).exists()
    with pytest.raises(FileNotFoundError):
        check_prefix(out)
    parts = Path(f"{out}.parts")
    assert sorted(p.name for p in parts.glob("*.idx")) == ["chunk-000000.idx", "chunk-000001.idx"]
    monkeypatch.setattr(pp._ChunkWriter, "add", add)
    stats = pp.run(pp.parse_args([*args, "--no-progress"]))
    assert stats.resumed_records == 128 and "resuming after 2 complete chunk(s)" in capsys.readouterr().err
    assert bin_path(out).read_bytes() == bin_path(one_worker).read_bytes()
    assert idx_path(out).read_bytes() == idx_path(one_worker).read_bytes()
    assert not parts.exists()


def test_rerun_with_other_arguments_restarts_cleanly(corpus, one_worker, tmp_path, monkeypatch, capsys):
    out = tmp_path / "restarted"
    base = ["--input", str(corpus[0]), "--tokenizer", str(DEFAULT_TOKENIZER), "--output-prefix", str(out),
            "--workers", "0"]
    add = pp._ChunkWriter.add

    def killed_in_chunk_1(self, *a):
        if self.number == 1:
            raise KeyboardInterrupt
        add(self, *a)

    monkeypatch.setattr(pp._ChunkWriter, "add", killed_in_chunk_1)
    assert cli(*base, "--chunk-docs", "64") == 130
    assert Path(f"{out}.parts/chunk-000000.idx").is_file()
    monkeypatch.undo()
    assert cli(*base, "--chunk-docs", "100") == 0
    assert "other arguments: restarting" in capsys.readouterr().err
    assert bin_path(out).read_bytes() == bin_path(one_worker).read_bytes()


def test_existing_output_is_never_overwritten(corpus, one_worker, capsys):
    before = {p: p.read_bytes() for p in (bin_path(one_worker), idx_path(one_worker))}
    assert cli("--input", str(corpus[0]), "--tokenizer", str(DEFAULT_TOKENIZER), "--output-prefix",
               str(one_worker), "--workers", "0") == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in before} == before


@pytest.mark.parametrize("records, message", [
    ([""], "no non-empty documents (1 records read)"),
    ([], "has no records"),
])
def test_empty_input_is_an_error_and_writes_nothing(tmp_path, records, message, capsys):
    src = write_jsonl_xz(tmp_path / "empty.jsonl.xz", records)
    assert cli("--input", str(src), "--tokenizer", str(DEFAULT_TOKENIZER), "--output-prefix",
               str(tmp_path / "out"), "--workers", "0") == 2
    assert message in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["empty.jsonl.xz"]


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"content": "x"}) + "\n")
    base = ["--tokenizer", str(DEFAULT_TOKENIZER), "--workers", "0"]
    assert cli("--input", str(src), *base, "--output-prefix", str(tmp_path / "o")) == 2
    assert "record 0 has no string field 'text' (its fields: ['content']); pick the text field with --text-key" \
        in capsys.readouterr().err
    assert cli("--input", str(tmp_path / "missing.jsonl"), *base, "--output-prefix", str(tmp_path / "o")) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    assert cli("--input", str(src), "--tokenizer", str(tmp_path / "tok.json"), "--output-prefix", str(tmp_path / "o")) == 2
    assert "tok.json does not exist" in capsys.readouterr().err
    assert cli("--input", str(src), *base, "--eod-token", "</s>", "--output-prefix", str(tmp_path / "o")) == 2
    assert "no end-of-document token '</s>'" in capsys.readouterr().err
    assert not list(tmp_path.glob("o*"))


def test_a_second_writer_of_one_prefix_is_refused(tmp_path):
    lock = pp._Lock(tmp_path / "x.parts")
    try:
        with pytest.raises(FileExistsError, match="another data.preprocess is writing"):
            pp._Lock(tmp_path / "x.parts")
    finally:
        lock.release()


def test_cli_help_is_fast_and_documents_resume():
    out = subprocess.run([sys.executable, "-m", "data.preprocess", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0 and "resumes after the last complete chunk" in out.stdout


# ---- corrupt, foreign and mismatched files --------------------------------------------------------------
def _corrupt(src: Path, dst: Path, idx: bytes | None, binary: bytes | None) -> Path:
    for path, data, orig in ((idx_path(dst), idx, idx_path(src)), (bin_path(dst), binary, bin_path(src))):
        path.write_bytes(orig.read_bytes() if data is None else data)
    return dst


def _flip_dtype(idx: bytes, code: int) -> bytes:
    return idx[:17] + bytes([code]) + idx[18:]


@pytest.mark.parametrize("case, message", [
    ("no-idx", "docs_text_document.idx not found for prefix"),
    ("no-bin", "docs_text_document.bin not found for prefix"),
    ("truncated-idx", "is truncated"),
    ("header-only", "is truncated (20 bytes"),
    ("wrong-magic", "wrong magic"),
    ("truncated-bin", "it is truncated"),
    ("idx-dtype-flipped", "offsets were written for uint16 tokens but its dtype code says int32 (a dtype mismatch)"),
    ("bin-as-int32", "exactly the size of those tokens as int32: a dtype mismatch"),
    ("named-with-suffix", "a prefix is the path without .bin/.idx"),
])
def test_corrupt_prefixes_fail_clearly_and_nothing_is_written(one_worker, tmp_path, case, message):
    idx, binary = idx_path(one_worker).read_bytes(), bin_path(one_worker).read_bytes()
    dst = tmp_path / "docs_text_document"
    variants = {
        "no-idx": (None, None), "no-bin": (None, None), "truncated-idx": (idx[:-5], None),
        "header-only": (idx[:20], None), "wrong-magic": (b"NOTANIDX\x00" + idx[9:], None),
        "truncated-bin": (None, binary[:-2]), "idx-dtype-flipped": (_flip_dtype(idx, 4), None),
        "bin-as-int32": (None, np.frombuffer(binary, np.uint16).astype(np.int32).tobytes()),
        "named-with-suffix": (None, None),
    }
    _corrupt(one_worker, dst, *variants[case])
    Path(f"{dst}.json").write_text(Path(f"{one_worker}.json").read_text())
    if case == "no-idx":
        idx_path(dst).unlink()
    if case == "no-bin":
        bin_path(dst).unlink()
    prefix = f"{dst}.idx" if case == "named-with-suffix" else str(dst)
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises((IndexedDataError, FileNotFoundError), match=".") as err:
        source(prefix, cache_dir=tmp_path / "cache")
    assert message in str(err.value)
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before, "nothing written, nothing changed"


def test_empty_prefix_is_a_clear_error(tmp_path):
    from data.mcore import indexed_dataset_builder

    builder = indexed_dataset_builder(bin_path(tmp_path / "e"), np.uint16)
    builder.finalize(str(idx_path(tmp_path / "e")))
    with pytest.raises(IndexedDataError, match="is an empty dataset"):
        check_prefix(tmp_path / "e")


def test_tokenizer_must_fit_the_files_and_match_them(one_worker, tmp_path):
    meta = json.loads(Path(f"{one_worker}.json").read_text())
    dst = _corrupt(one_worker, tmp_path / "big", None, None)
    Path(f"{dst}.json").write_text(json.dumps({**meta, "vocab_size": 128_256}))
    with pytest.raises(IndexedDataError, match=r"stores tokens as uint16 \(ids < 65536\), but tokenizer .* has 128256"):
        source(dst, cache_dir=tmp_path / "cache")
    Path(f"{dst}.json").write_text(json.dumps({**meta, "tokenizer_sha256": "0" * 64, "tokenizer": "other.json"}))
    with pytest.raises(IndexedDataError, match="was made with tokenizer other.json"):
        source(dst, cache_dir=tmp_path / "cache", tokenizer=str(DEFAULT_TOKENIZER))
    Path(f"{dst}.json").unlink()
    with pytest.raises(IndexedDataError, match="data.tokenizer is not set and .*big.json"):
        source(dst, cache_dir=tmp_path / "cache")
    assert source(dst, cache_dir=tmp_path / "cache", tokenizer=str(DEFAULT_TOKENIZER)).vocab_size == 8192


def test_megatron_dtype_table_and_process_local_restore():
    from megatron.core.datasets import gpt_dataset
    from megatron.core.datasets.indexed_dataset import DType

    assert {d.value: np.dtype(DType.dtype_from_code(d.value)) for d in DType} == DTYPE_CODES
    with process_local():
        assert not gpt_dataset.torch.distributed.is_initialized()
    assert gpt_dataset.torch is torch


# ---- the training side ----------------------------------------------------------------------------------
def source(prefix, *, cache_dir, weights=None, tokenizer=None, **kw) -> IndexedDataSource:
    prefixes = prefix if isinstance(prefix, list) else [prefix]
    args = {"split": "90,10,0", "seq_len": 16, "micro_batch_size": 4, "seed": 7, "train_samples": 400,
            "eval_samples": 8}
    return IndexedDataSource(prefixes, weights, tokenizer=tokenizer, cache_dir=cache_dir, **{**args, **kw})


def test_three_way_blend_respects_weights(tmp_path):
    topics = (["alpha"], ["beta"], ["gamma"])
    prefixes = [preprocess(tmp_path / f"p{i}", make_texts(40, seed=i, words=w)) for i, w in enumerate(topics)]
    weights = [0.5, 0.3, 0.2]
    src = source(prefixes, cache_dir=tmp_path / "cache", weights=weights, train_samples=10_000)
    ids = np.concatenate([src.sample_ids(i) for i in range(10_000 // 4)])
    shares = np.bincount(ids[:, 0], minlength=3) / len(ids)
    assert np.abs(shares - weights).max() < 0.01, shares
    vocab = [{t for d in documents(p) for t in d} for p in prefixes]
    assert all(len(vocab[i] - vocab[j]) > 0 for i in range(3) for j in range(3) if i != j)
    for index in (0, 3, 2000):
        for row, d in zip(src.train_microbatch(index).tolist(), src.sample_ids(index)[:, 0].tolist()):
            assert set(row) <= vocab[d], "each row's tokens come from the prefix its id names"


def test_resumed_source_sees_exactly_the_same_samples(tmp_path):
    prefixes = [preprocess(tmp_path / f"p{i}", make_texts(60, seed=i)) for i in range(2)]
    m, dp, steps, k = 2, 2, 25, 11
    kw = {"weights": [0.7, 0.3], "train_samples": steps * m * dp * 4}
    full = source(prefixes, cache_dir=tmp_path / "cache", **kw)
    seen = {i: (full.sample_ids(i), full.train_microbatch(i)) for i in range(steps * m * dp)}
    for cache in ("cache", "fresh-cache"):  # a restart that loads the cached indices, and one that rebuilds them
        restarted = source(prefixes, cache_dir=tmp_path / cache, **kw)
        for i in range(k * m * dp, steps * m * dp):
            assert np.array_equal(restarted.sample_ids(i), seen[i][0])
            assert torch.equal(restarted.train_microbatch(i), seen[i][1])
    # DP ranks of a step read disjoint samples: index (t * dp + r) * m + j.
    step_ids = [tuple(map(tuple, seen[(k * dp + r) * m + j][0])) for r in range(dp) for j in range(m)]
    assert len({s for ids in step_ids for s in ids}) == m * dp * 4
    assert all(torch.equal(b, full.val_batches()[i]) for i, b in enumerate(restarted.val_batches()))
    with pytest.raises(IndexError, match="a longer run needs a larger train.steps"):
        full.train_microbatch(steps * m * dp)


def test_source_is_lazy_and_rows_are_contiguous_windows(one_worker, tmp_path):
    src = source(one_worker, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists(), "constructing reads no samples and builds no index"
    x = src.train_microbatch(0)
    assert x.dtype == torch.long and x.shape == (4, 17)
    assert len(list((tmp_path / "cache" / "indices").iterdir())) == 1
    assert not list((tmp_path / "cache" / "indices").glob("*.tmp")), "the build directory was renamed"
    docs = documents(one_worker)
    for row in x.tolist():  # documents (in shuffled order) cut into windows: every EOD-delimited piece is
        pieces = " ".join(map(str, row)).split(" 0")  # part of one document, whole ones in the middle
        assert any(_contains(d, [int(t) for t in pieces[0].split()]) for d in docs)
        for middle in pieces[1:-1]:
            assert [int(t) for t in middle.split()] + [0] in docs
    assert len(src.val_batches()) == 2 and src.val_batches()[0].shape == (4, 17)


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i: i + len(part)] == part for i in range(len(seq) - len(part) + 1))


# ---- configuration and job.build_data --------------------------------------------------------------
def resolve(*overrides: str):
    from asyncpp import job

    return job.resolve(job.compose(["logging=disabled", "logging.progress=false", *overrides]))


@pytest.mark.parametrize("overrides, message", [
    (["data.name=indexed", "data.blend=['abc /data/x']"],
     "data.blend[0]='abc /data/x': the weight 'abc' does not parse as a number; write 'WEIGHT PREFIX'"),
    (["data.name=indexed", "data.blend=['30','/data/x']"], "data.blend[0]='30' is a weight without a prefix"),
    (["data.name=indexed", "data.blend=['-1 /data/x']"], "the weight -1 must be a finite number > 0"),
    (["data.name=indexed", "data.blend=['1 /data/x','/data/y']"], "mixes weighted and bare entries"),
    (["data.name=indexed"], "data.blend is empty"),
    (["data.name=indexed", "data.blend=[/nonexistent/x_text_document]"],
     ("data.blend[0]='/nonexistent/x_text_document': /nonexistent/x_text_document.idx and .bin not found; "
      "make the prefix with `python -m data.preprocess")),
    (["data.split='98;2'"], "data.split='98;2' must be up to three comma-separated"),
    (["data.split='0,1'"], "gives training no documents"),
    (["data.split='100,0,0'"], "holds out no validation data but train.eval_every=50"),
    (["data.blend=[/data/x]"], "data.blend=['/data/x'] applies to data.name=indexed"),
])
def test_bad_data_config_names_field_value_and_fix(overrides, message):
    from asyncpp.config import ConfigError

    with pytest.raises(ConfigError) as err:
        resolve(*overrides)
    assert message in str(err.value)


def test_build_data_refuses_a_larger_vocabulary_and_corrupt_files(one_worker, tmp_path):
    from asyncpp import job
    from asyncpp.config import ConfigError
    from asyncpp.train import preflight

    dst = _corrupt(one_worker, tmp_path / "big", None, None)
    meta = json.loads(Path(f"{one_worker}.json").read_text())
    Path(f"{dst}.json").write_text(json.dumps({**meta, "vocab_size": 49152}))
    cfg, model_cfg = resolve("data.name=indexed", f"data.blend=[{dst}]", "model=tiny_dense",
                             f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(ConfigError, match="has 49152 tokens but model 'tiny_dense' has vocab_size=8192"):
        job.build_data(cfg, model_cfg)
    with pytest.raises(ConfigError, match="has 49152 tokens but model 'tiny_dense' has vocab_size=8192"):
        preflight.check_data(cfg, model_cfg)  # the same refusal before any process group exists
    idx_path(dst).write_bytes(b"garbage!!" + idx_path(one_worker).read_bytes()[9:])
    with pytest.raises(ConfigError, match=r"data.name=indexed: .*big.idx is not a Megatron .*wrong magic"):
        job.build_data(cfg, model_cfg)
    assert not (tmp_path / "cache").exists()


def test_pretrain_trains_on_an_indexed_prefix(one_worker, tmp_path):
    from asyncpp import job

    cfg, model_cfg = resolve("data.name=indexed", f"data.blend=['1 {one_worker}']", "model=tiny_dense",
                             f"out_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=3",
                             "train.eval_every=3", "train.eval_batches=1", "train.micro_batch_size=2",
                             "train.num_microbatches=2", "train.seq_len=16", "optimizer.schedule.warmup_steps=1",
                             "data.split='80,20,0'", "checkpoint.enabled=false")
    summary = job.run(cfg, model_cfg)
    assert summary["steps"] == 3 and np.isfinite(summary["final_val_loss"])


def test_tokenizer_by_hub_name_resolves_from_the_local_hf_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "tokenizer.json").write_bytes(DEFAULT_TOKENIZER.read_bytes())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    tok = load_tokenizer("HuggingFaceTB/SmolLM2-135M")  # as configs/data/fineweb_edu.yaml names it
    assert tok.path.parent.name == commit and (tok.vocab_size, tok.eod_id) == (8192, 0)


# ---- megatron-core's C++ helpers --------------------------------------------------------------------------
def test_missing_cpp_helpers_without_pybind11_say_how_to_fix(tmp_path, monkeypatch):
    import importlib

    import data.mcore as mc

    mc.import_megatron_datasets()
    real = importlib.import_module

    def no_helpers(name, *args, **kwargs):
        if name == mc._HELPERS:
            raise ImportError(name)  # as on a platform whose wheel ships no helpers_cpp
        return real(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, mc._HELPERS, raising=False)
    monkeypatch.setattr(importlib, "import_module", no_helpers)
    monkeypatch.setitem(sys.modules, "pybind11", None)
    with pytest.raises(RuntimeError, match=r"building them from .*helpers.cpp needs pybind11: `pip install pybind11`"):
        mc.ensure_helpers(tmp_path)
    assert not list(tmp_path.rglob("*.so"))


COMPILE_SCRIPT = """
import importlib.abc, sys
class NoHelpers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "megatron.core.datasets.helpers_cpp":
            raise ImportError(name)
sys.meta_path.insert(0, NoHelpers())
from pathlib import Path
import numpy as np
from data.mcore import ensure_helpers
ensure_helpers(Path(sys.argv[1]))
sys.meta_path.pop(0)
from megatron.core.datasets import helpers
idx = helpers.build_sample_idx(np.array([5, 7, 3], np.int32), np.array([0, 1, 2], np.int32), 4, 1, 15, True, True)
assert idx.tolist() == [[0, 0], [0, 4], [1, 3], [2, 0]], idx.tolist()
"""


@pytest.mark.slow
def test_missing_cpp_helpers_are_compiled_once(tmp_path):
    pytest.importorskip("pybind11")
    for _ in range(2):  # the second run loads the .so the first compiled
        out = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True,
                             text=True, timeout=600, check=False)
        assert out.returncode == 0, out.stderr[-2000:]
    assert len(list(tmp_path.rglob("helpers_cpp*.so"))) == 1


def test_a_split_part_without_documents_is_refused(tmp_path):
    small = preprocess(tmp_path / "small", ["one document", "another one", "a third"])
    for split, part in (("90,10,0", "valid"), ("50,40,10", "test")):
        with pytest.raises(IndexedDataError, match=f"has 3 documents; data.split='{split}' leaves its {part} part none"):
            source(small, cache_dir=tmp_path / "cache", split=split)
    assert source(small, cache_dir=tmp_path / "cache", split="2,1,0").train_microbatch(0).shape == (4, 17)
