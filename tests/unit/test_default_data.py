"""The embedded default corpus, its tokenizer, and its first-use build into Megatron's indexed format.

The build tokenizes all 497 documents (a few seconds) once per cache: the tests share the checkout's
cache (tests/conftest.py), which test_pretrain.py uses too.
"""

from __future__ import annotations

import json
import lzma

import numpy as np
import pytest
from tokenizers import Tokenizer

from data import default as dd
from data.default import DEFAULT_CORPUS, DEFAULT_TOKENIZER, default_prefix, read_corpus, unit_hash
from data.indexed import check_prefix, idx_path
from data.mcore import open_indexed

SHIPPED_DOCS = 497  # python3.11-doc 3.11.2-6+deb12u9, all non-empty .rst.txt sources
SHIPPED_VOCAB = 8192
SHIPPED_TOKENS = 2_822_169  # without the 497 EOD tokens (data/default_corpus/README.md)


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


def test_default_prefix_holds_every_document_in_hash_order():
    prefix = default_prefix()
    info = check_prefix(prefix)
    assert (info.documents, info.tokens, info.dtype) == (SHIPPED_DOCS, SHIPPED_TOKENS + SHIPPED_DOCS, np.uint16)
    meta = json.loads(prefix.with_name(prefix.name + ".json").read_text())
    assert (meta["vocab_size"], meta["eod_id"], meta["documents"]) == (SHIPPED_VOCAB, 0, SHIPPED_DOCS)
    # Megatron's split is contiguous; hash order makes the held-out tail a random sample of documents.
    ds = open_indexed(prefix)
    docs = sorted(read_corpus(DEFAULT_CORPUS), key=lambda d: unit_hash(d["id"]))
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    for i in (0, 1, 250, SHIPPED_DOCS - 1):
        ids = ds[i].tolist()
        assert ids[-1] == 0 and 0 not in ids[:-1]
        assert tok.decode(ids[:-1]) == docs[i]["text"]
    assert default_prefix() == prefix, "a second call is a cache hit"


def _tiny_corpus(tmp_path):
    path = tmp_path / "tiny.jsonl.xz"
    with lzma.open(path, "wt", encoding="utf-8") as f:
        for i in range(12):
            f.write(json.dumps({"id": f"d{i}", "text": f"Document {i}: naïve λ-calculus " * (i + 1)}) + "\n")
    return path


def test_first_use_build_is_atomic_and_cached(tmp_path, capsys):
    corpus = _tiny_corpus(tmp_path)
    prefix = default_prefix(tmp_path / "cache", corpus=corpus, workers=0)
    out = capsys.readouterr().out
    assert "tokenized tiny.jsonl.xz: 12 documents" in out
    # The wait is announced before it starts (tens of seconds for the real corpus), not only reported after.
    assert out.index("[data] first use of tiny.jsonl.xz: tokenizing") < out.index("tokenized tiny.jsonl.xz")
    assert sorted(p.name for p in prefix.parent.iterdir()) == [prefix.name + s for s in (".bin", ".idx", ".json")]
    assert default_prefix(tmp_path / "cache", corpus=corpus, workers=0) == prefix
    assert capsys.readouterr().out == "", "a cache hit does not tokenize again"
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "x", "text": "a different corpus"}) + "\n")
    assert default_prefix(tmp_path / "cache", corpus=other, workers=0) != prefix, "the key is the content"


def test_interrupted_first_use_leaves_nothing(tmp_path, monkeypatch):
    import data.preprocess as pp

    def killed(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(pp._ChunkWriter, "finish", killed)
    with pytest.raises(KeyboardInterrupt):
        default_prefix(tmp_path / "cache", corpus=_tiny_corpus(tmp_path), workers=0)
    assert list((tmp_path / "cache" / "default").iterdir()) == [], "no staging files, no .idx"


def test_missing_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus=.*nope.jsonl.xz does not exist"):
        default_prefix(tmp_path, corpus=tmp_path / "nope.jsonl.xz")
    assert not idx_path(tmp_path / "x").exists() and dd.EOD_TOKEN == "<|endoftext|>"
