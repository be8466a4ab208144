"""The embedded default corpus, its tokenizer and the deterministic window loader.

Most tests tokenize a tiny corpus written to tmp_path with the shipped tokenizer; one test
checks the shipped files themselves without tokenizing all of them (that takes ~9 s).
"""

from __future__ import annotations

import json
import lzma
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from data import default as dd
from data.default import (
    DEFAULT_CORPUS,
    DEFAULT_TOKENIZER,
    TokenWindows,
    cache_key,
    cache_paths,
    load_token_splits,
    read_corpus,
    split_ids,
    validation_batches,
)

SHIPPED_DOCS = 497  # python3.11-doc 3.11.2-6+deb12u9, all non-empty .rst.txt sources
SHIPPED_VOCAB = 8192


def _texts(n: int) -> list[dict[str, str]]:
    rng = random.Random(0)
    words = ["pipeline", "stage", "Muon", "gradient", "naïve", "λ-calculus", "def f(x):", "\n", "  ", "é"]
    return [
        {"id": f"doc/{i:03d}.rst.txt", "text": f"Document {i}. " + " ".join(rng.choices(words, k=20 + i))}
        for i in range(n)
    ]


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> tuple[Path, list[dict[str, str]]]:
    docs = _texts(40)
    path = tmp_path / "tiny.jsonl.xz"
    with lzma.open(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    return path, docs


def _split_docs(stream: np.ndarray, eod: int) -> list[list[int]]:
    assert stream.size and stream[-1] == eod, "every document, the last included, ends with EOD"
    ends = np.flatnonzero(stream == eod)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [stream[s:e].tolist() for s, e in zip(starts, ends)]


def test_round_trip_and_eod_placement(tiny_corpus, tmp_path):
    corpus, docs = tiny_corpus
    s = load_token_splits(corpus, val_fraction=0.2, cache_dir=tmp_path / "cache")
    assert s.eod_id == 0 and s.vocab_size == SHIPPED_VOCAB
    assert s.train.dtype == np.uint16 and s.train.ndim == 1
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    train_idx, val_idx = split_ids([d["id"] for d in docs], 0.2)
    for stream, idx in ((s.train, train_idx), (s.val, val_idx)):
        pieces = _split_docs(stream, s.eod_id)
        assert len(pieces) == len(idx)
        for ids, i in zip(pieces, idx):
            assert tok.decode(ids, skip_special_tokens=False) == docs[i]["text"]


def test_split_is_deterministic_disjoint_and_order_free(tiny_corpus, tmp_path):
    corpus, docs = tiny_corpus
    ids = [d["id"] for d in docs]
    train, val = split_ids(ids, 0.2)
    assert (train, val) == split_ids(ids, 0.2)
    assert set(train).isdisjoint(val) and sorted(train + val) == list(range(len(ids)))
    assert 0 < len(val) < len(ids)
    shuffled = ids[::-1]
    _, v2 = split_ids(shuffled, 0.2)
    assert {shuffled[i] for i in v2} == {ids[i] for i in val}, "membership depends on the id only"
    a = load_token_splits(corpus, val_fraction=0.2, cache_dir=tmp_path / "a")
    b = load_token_splits(corpus, val_fraction=0.2, cache_dir=tmp_path / "b")
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)


def test_split_edge_cases():
    ids = [f"d{i}" for i in range(5)]
    assert split_ids(ids, 0.0) == (list(range(5)), [])
    train, val = split_ids(ids, 1e-9)  # no hash that low: the lowest one is taken
    assert len(val) == 1 and len(train) == 4
    train, val = split_ids(ids, 0.999999)  # training always keeps a document
    assert len(train) == 1
    with pytest.raises(ValueError, match="val_fraction=1.5"):
        split_ids(ids, 1.5)
    with pytest.raises(ValueError, match="unique"):
        split_ids(["a", "a"], 0.5)


def test_cache_hit_returns_identical_arrays(tiny_corpus, tmp_path, capsys):
    corpus, _ = tiny_corpus
    cache = tmp_path / "cache"
    first = load_token_splits(corpus, val_fraction=0.2, cache_dir=cache)
    assert "tokenized" in capsys.readouterr().out
    second = load_token_splits(corpus, val_fraction=0.2, cache_dir=cache)
    assert capsys.readouterr().out == "", "a cache hit does not tokenize again"
    np.testing.assert_array_equal(first.train, second.train)
    np.testing.assert_array_equal(first.val, second.val)
    assert second.train.dtype == first.train.dtype
    assert not list(cache.glob("*.tmp")), "no temp files left after a clean write"
    # A different val_fraction is a different key, never the old arrays.
    assert cache_key(corpus, DEFAULT_TOKENIZER, 0.2) != cache_key(corpus, DEFAULT_TOKENIZER, 0.3)


def test_interrupted_cache_write_is_not_read(tiny_corpus, tmp_path, capsys):
    corpus, _ = tiny_corpus
    cache = tmp_path / "cache"
    good = load_token_splits(corpus, val_fraction=0.2, cache_dir=cache)
    _, val_path = cache_paths(cache, cache_key(corpus, DEFAULT_TOKENIZER, 0.2))
    # A process killed while writing val: train is final, val only a half-written temp file.
    val_path.unlink()
    (cache / (val_path.name + ".abc123.tmp")).write_bytes(b"\x93NUMPY half a header")
    capsys.readouterr()
    again = load_token_splits(corpus, val_fraction=0.2, cache_dir=cache)
    assert "tokenized" in capsys.readouterr().out, "an incomplete cache is a miss"
    np.testing.assert_array_equal(again.train, good.train)
    np.testing.assert_array_equal(again.val, good.val)
    assert val_path.is_file()


def test_failed_save_leaves_no_final_file(tiny_corpus, tmp_path, monkeypatch):
    corpus, _ = tiny_corpus
    cache = tmp_path / "cache"

    def killed(f, *args, **kwargs):
        f.write(b"\x93NUMPY partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(dd.np, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        load_token_splits(corpus, val_fraction=0.2, cache_dir=cache)
    assert list(cache.iterdir()) == []


def _counting_stream(n_windows: int, seq_len: int, extra: int = 3) -> np.ndarray:
    # Token j has value j, so a window's first token identifies it; `extra` leftover tokens.
    return np.arange(n_windows * (seq_len + 1) + extra, dtype=np.int32)


def test_token_windows_is_a_pure_function_of_seed_and_index():
    tokens = _counting_stream(50, seq_len=7)
    a = TokenWindows(tokens, seq_len=7, micro_batch_size=4, seed=1)
    b = TokenWindows(tokens, seq_len=7, micro_batch_size=4, seed=1)
    assert a.num_windows == 50
    x = a.batch(3)
    assert x.dtype == torch.long and x.shape == (4, 8)
    for i in (30, 3, 12, 3):  # random access order and the permutation cache do not matter
        assert torch.equal(a.batch(i), b.batch(i))
    assert torch.equal(b.batch(3), x)
    assert not torch.equal(a.batch(3), a.batch(4))
    assert not torch.equal(a.batch(3), TokenWindows(tokens, 7, 4, seed=2).batch(3))
    # Each row is a contiguous window: labels are the inputs shifted by one.
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)
    assert (x[:, 0] % 8 == 0).all()


def test_every_epoch_covers_every_window_once():
    n, b = 10, 3  # b does not divide n: batches straddle epoch boundaries
    w = TokenWindows(_counting_stream(n, seq_len=4), seq_len=4, micro_batch_size=b, seed=7)
    samples = torch.cat([w.batch(i)[:, 0] for i in range(4 * n // b + 1)])
    windows = (samples // 5).tolist()
    epochs = [windows[e * n : (e + 1) * n] for e in range(4)]
    for e, ids in enumerate(epochs):
        assert sorted(ids) == list(range(n)), f"epoch {e} is a permutation of all windows"
    assert epochs[0] != epochs[1], "each epoch has its own order"


def test_too_short_stream_raises():
    with pytest.raises(ValueError, match=r"5 tokens.*seq_len\+1=9"):
        TokenWindows(np.arange(5), seq_len=8, micro_batch_size=1, seed=0)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        TokenWindows(np.arange(50), seq_len=8, micro_batch_size=0, seed=0)
    with pytest.raises(ValueError, match="index=-1"):
        TokenWindows(np.arange(50), seq_len=8, micro_batch_size=1, seed=0).batch(-1)


def test_validation_batches_are_the_first_windows_in_order():
    tokens = _counting_stream(7, seq_len=4)
    batches = validation_batches(tokens, seq_len=4, micro_batch_size=2, num_batches=10)
    assert len(batches) == 3, "capped at the full batches that exist"
    firsts = torch.cat([x[:, 0] for x in batches]).tolist()
    assert firsts == [0, 5, 10, 15, 20, 25]
    assert len(validation_batches(tokens, 4, 2, num_batches=1)) == 1
    with pytest.raises(ValueError, match="micro_batch_size"):
        validation_batches(tokens, 4, micro_batch_size=8, num_batches=1)


def test_shipped_corpus_and_tokenizer():
    assert DEFAULT_CORPUS.stat().st_size < 4 * 2**20, "the committed corpus stays small"
    docs = read_corpus(DEFAULT_CORPUS)
    assert len(docs) == SHIPPED_DOCS
    ids = [d["id"] for d in docs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(d["text"] and d["text"] == d["text"].rstrip() for d in docs)
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    assert tok.get_vocab_size() == SHIPPED_VOCAB and tok.token_to_id("<|endoftext|>") == 0
    sample = [d for d in docs if d["id"] in ("glossary.rst.txt", "tutorial/index.rst.txt")]
    assert len(sample) == 2
    for d, enc in zip(sample, tok.encode_batch([d["text"] for d in sample])):
        assert 0 not in enc.ids
        assert tok.decode(enc.ids) == d["text"]
