"""HF `tokenizers` tokenizers for data.preprocess: load one by path or hub name, or train a byte-level BPE."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class LoadedTokenizer:
    tokenizer: Tokenizer
    name: str
    """What the user passed (a path or a hub name), for messages and metadata."""
    path: Path
    """The tokenizer.json it was read from."""
    sha256: str
    vocab_size: int
    eod_id: int
    eod_token: str


def resolve_tokenizer_file(spec: str) -> Path:
    """A tokenizer.json path, a directory holding one, or a hub repo id (e.g. HuggingFaceTB/SmolLM2-135M):
    the local HF cache first, then the hub (which needs network unless HF_HUB_OFFLINE is set)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
        raise FileNotFoundError(f"tokenizer={spec} is a directory without tokenizer.json; pass the file itself")
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")) or spec.endswith(".json"):
        raise FileNotFoundError(f"tokenizer={spec} does not exist (not a file, a directory or a hub repo id)")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(spec, "tokenizer.json", local_files_only=True))
    except LocalEntryNotFoundError:  # not cached: try the hub
        pass
    try:
        return Path(hf_hub_download(spec, "tokenizer.json"))
    except (OSError, ValueError, HfHubHTTPError) as e:
        raise FileNotFoundError(
            f"tokenizer={spec} is not a local file, not in the local Hugging Face cache, and the hub could not "
            f"provide it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); run once where the hub "
            f"is reachable (`huggingface-cli download {spec} tokenizer.json`) or pass a tokenizer.json path"
        ) from None


def load_tokenizer(spec: str | Path, eod_token: str = EOD_TOKEN) -> LoadedTokenizer:
    path = resolve_tokenizer_file(str(spec))
    tok = Tokenizer.from_file(str(path))
    eod_id = tok.token_to_id(eod_token)
    if eod_id is None:
        specials = sorted(t.content for t in tok.get_added_tokens_decoder().values() if t.special)[:10]
        raise ValueError(f"tokenizer={spec} has no end-of-document token {eod_token!r}; pass one it has with "
                         f"--eod-token (its special tokens: {specials})")
    return LoadedTokenizer(tokenizer=tok, name=str(spec), path=path,
                           sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                           vocab_size=tok.get_vocab_size(with_added_tokens=True), eod_id=eod_id,
                           eod_token=eod_token)


def train_bpe(texts: Iterable[str], vocab_size: int, eod_token: str = EOD_TOKEN) -> Tokenizer:
    """Byte-level BPE (GPT-2 style, the settings of the shipped default tokenizer): every string round-trips
    through encode/decode, and `eod_token` is the only special token, id 0. One pass over `texts`."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} is below 257 (256 bytes + the EOD token); use e.g. 8192")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[eod_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
