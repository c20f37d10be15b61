"""Tokenizers: bytes (the default, no files) and byte-level BPE (the `tokenizers` package).

Both have one interface, `Tokenizer`: `encode`, `encode_bytes`, `encode_batch`,
`decode`, `vocab_size`, `special_tokens`, `eos_id`, `name`, `fingerprint`,
`token_bytes()` (the UTF-8 byte length of each id, for bits per byte) and
`save(dir)`. `load_tokenizer(spec)` turns a flag into one:

- `"bytes"`: every UTF-8 byte is a token (vocabulary 256); nothing to train or read.
- `"bpe:4096"`: a byte-level BPE trained here (`train_bpe`); the corpus trains it on
  its *training* split and caches it next to the token cache.
- `path/to/tokenizer.json`: a Hugging Face `tokenizers` file (or a directory holding one).
- a GPT-2 `vocab.json` + `merges.txt` pair: the path of `vocab.json` (with
  `merges.txt` beside it), `"vocab.json,merges.txt"`, or their directory.

A run directory records its tokenizer as `tokenizer.json` (`save`; the byte
tokenizer is written as a byte-level BPE without merges, which maps each byte to
its own id, so any `tokenizers` user reads it too); `load_tokenizer(run_dir)`
reads it back and a directory without one means bytes. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from jaxtyping import Integer

TOKENIZER_FILE = "tokenizer.json"
EOS = "<|endoftext|>"
MAX_VOCAB = 1 << 16  # token caches hold uint16


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer offers (see the module docs)."""

    name: str
    vocab_size: int

    @property
    def special_tokens(self) -> dict[str, int]: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def fingerprint(self) -> str: ...

    def encode(self, text: str) -> np.ndarray: ...

    def encode_bytes(self, data: bytes) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids) -> str: ...

    def token_bytes(self) -> np.ndarray: ...

    def save(self, directory: str | Path) -> Path: ...


def _write_json(text: str, directory: str | Path) -> Path:
    """`text` as `directory/tokenizer.json`; **returns** its path."""
    path = Path(directory) / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _ids_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= MAX_VOCAB else np.uint32


class ByteTokenizer:
    """Text <-> UTF-8 bytes. Token ids are `0..255`; decoding replaces broken sequences."""

    vocab_size: int = 256
    name: str = "bytes"
    fingerprint: str = "bytes"
    special_tokens: dict[str, int] = {}  # noqa: RUF012 (read-only)
    eos_id: int | None = None

    def encode(self, text: str) -> Integer[np.ndarray, " n"]:
        """**Arguments:** `text`. **Returns:** its UTF-8 bytes as a `uint16` array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_bytes(self, data: bytes) -> Integer[np.ndarray, " n"]:
        """Raw bytes (e.g. a file read in binary) as a `uint16` array."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """**Arguments:** token ids (any integer sequence). **Returns:** the text."""
        arr = np.asarray(ids).astype(np.int64).ravel()
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte tokens lie in 0..255; got ids in {arr.min()}..{arr.max()}.")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def token_bytes(self) -> Integer[np.ndarray, " vocab"]:
        """Every id stands for one byte."""
        return np.ones(256, np.int64)

    def to_hf_json(self) -> str:
        """This tokenizer as a `tokenizers` JSON: byte-level BPE, no merges, id = byte."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        table = _bytes_to_unicode()
        tok = HFTokenizer(models.BPE({table[b]: b for b in range(256)}, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok.to_str()

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json` into `directory` (see the module docs). **Returns:** its path."""
        return _write_json(self.to_hf_json(), directory)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class CharTokenizer:
    """One id per character, from a table `itos` (nanoGPT's `meta.pkl`, e.g. `shakespeare_char`).

    Encoding refuses characters outside the table (naming them); `decode` writes U+FFFD for
    ids it lacks. Saved as a `tokenizers` WordLevel JSON that splits text into characters.
    """

    special_tokens: dict[str, int] = {}  # noqa: RUF012 (read-only)
    eos_id: int | None = None

    def __init__(self, itos: dict[int, str], stoi: dict[str, int] | None = None, name: str = "chars"):
        self.itos = {int(i): str(c) for i, c in itos.items()}
        self.stoi = {c: i for i, c in self.itos.items()} if stoi is None else {str(c): int(i) for c, i in stoi.items()}
        self.vocab_size = max(self.itos, default=-1) + 1
        self.name = name
        self.fingerprint = "chars-" + hashlib.sha256(json.dumps(sorted(self.itos.items())).encode()).hexdigest()[:16]

    def encode(self, text: str) -> Integer[np.ndarray, " n"]:
        """**Returns:** the id of each character. **Raises** `ValueError` naming the characters not in the table."""
        missing = sorted(set(text) - self.stoi.keys())
        if missing:
            shown = ", ".join(repr(c) for c in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise ValueError(f"{shown} {'is' if len(missing) == 1 else 'are'} not in the {len(self.stoi)}-character "
                             "vocabulary of this corpus (its meta.pkl); use only characters it holds.")
        return np.asarray([self.stoi[c] for c in text], _ids_dtype(self.vocab_size))

    def encode_bytes(self, data: bytes) -> Integer[np.ndarray, " n"]:
        """UTF-8 `data` encoded as text."""
        return self.encode(data.decode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """**Arguments:** token ids. **Returns:** their characters joined."""
        return "".join(self.itos.get(int(i), "\ufffd") for i in np.asarray(ids).ravel())

    def token_bytes(self) -> Integer[np.ndarray, " vocab"]:
        """The UTF-8 length of each id's character (0 for ids the table lacks)."""
        return np.asarray([len(self.itos.get(i, "").encode("utf-8")) for i in range(self.vocab_size)], np.int64)

    def to_hf_json(self) -> str:
        """This tokenizer as a `tokenizers` JSON: WordLevel over single characters, joined when decoding."""
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer(models.WordLevel(self.stoi, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        return tok.to_str()

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json` into `directory`. **Returns:** its path."""
        return _write_json(self.to_hf_json(), directory)

    def __repr__(self) -> str:
        return f"CharTokenizer({self.vocab_size} characters)"


class BPETokenizer:
    """A byte-level BPE tokenizer (a `tokenizers.Tokenizer`) behind the `Tokenizer` interface.

    Text that spells a special token (`<|endoftext|>`) is encoded as ordinary text, so
    `decode(encode(text)) == text` for any text; `eos_id` is only ever inserted on purpose.

    **Arguments:** `tokenizer` (a `tokenizers.Tokenizer`), `name` (for messages and caches).
    """

    def __init__(self, tokenizer, name: str = "bpe"):
        self.hf = tokenizer
        self.hf.encode_special_tokens = True
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.name = name
        self._json = tokenizer.to_str()
        self.fingerprint = hashlib.sha256(self._json.encode()).hexdigest()[:16]
        self._dtype = _ids_dtype(self.vocab_size)
        self._token_bytes: np.ndarray | None = None

    # --- construction
    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """A `tokenizers` JSON file (`tokenizer.json`)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library's message, with the file named
            raise ValueError(f"{path} is not a readable tokenizers JSON file: {e}") from e
        return cls(tok, name=f"file:{path.name}")

    @classmethod
    def from_gpt2_files(cls, vocab: str | Path, merges: str | Path) -> BPETokenizer:
        """GPT-2's `vocab.json` + `merges.txt` pair (byte-level BPE, `<|endoftext|>` special)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        for p in (vocab, merges):
            if not Path(p).is_file():
                raise ValueError(f"{p} not found; a GPT-2 tokenizer is a vocab.json and a merges.txt file.")
        tok = HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if tok.token_to_id(EOS) is not None:
            tok.add_special_tokens([EOS])
        return cls(tok, name=f"gpt2-files:{Path(vocab).parent.name or 'vocab'}")

    # --- the interface
    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token -> id (e.g. `{"<|endoftext|>": 0}`)."""
        return {t.content: i for i, t in self.hf.get_added_tokens_decoder().items() if t.special}

    @property
    def eos_id(self) -> int | None:
        """The id of `<|endoftext|>` (or of the only special token), or `None`."""
        special = self.special_tokens
        if EOS in special:
            return special[EOS]
        return next(iter(special.values())) if len(special) == 1 else None

    def encode(self, text: str) -> Integer[np.ndarray, " n"]:
        """**Arguments:** `text`. **Returns:** its ids (`uint16` when the vocabulary fits)."""
        return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, self._dtype)

    def encode_bytes(self, data: bytes) -> Integer[np.ndarray, " n"]:
        """UTF-8 bytes (a file read in binary); invalid UTF-8 raises `ValueError`."""
        return self.encode(_utf8(data))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text, in parallel (the library's threads)."""
        fast = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [np.asarray(e.ids, self._dtype) for e in fast(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        """**Arguments:** token ids. **Returns:** the text (special tokens kept)."""
        arr = np.asarray(ids).astype(np.int64).ravel()
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids lie in 0..{self.vocab_size - 1}; got ids in {arr.min()}..{arr.max()}.")
        return self.hf.decode(arr.tolist(), skip_special_tokens=False)

    def token_bytes(self) -> Integer[np.ndarray, " vocab"]:
        """UTF-8 bytes each id stands for (special tokens: 0, they are not text)."""
        if self._token_bytes is None:
            table = {c: b for b, c in _bytes_to_unicode().items()}
            special = set(self.special_tokens.values())
            out = np.zeros(self.vocab_size, np.int64)
            for token, i in self.hf.get_vocab(with_added_tokens=True).items():
                if i not in special:
                    out[i] = sum(1 if ch in table else len(ch.encode("utf-8")) for ch in token)
            self._token_bytes = out
        return self._token_bytes

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json` into `directory`. **Returns:** its path."""
        return _write_json(self._json, directory)

    def __repr__(self) -> str:
        return f"BPETokenizer({self.name!r}, vocab_size={self.vocab_size})"


def _utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"text is not UTF-8 ({e}); the BPE tokenizer reads UTF-8 text "
                         "(the byte tokenizer reads any bytes).") from e


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE works on)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def train_bpe(texts: Iterable[str], vocab_size: int, *, length: int | None = None,
              show_progress: bool = False) -> BPETokenizer:
    """Train a byte-level BPE on `texts` (GPT-2's pre-tokenizer; `<|endoftext|>` special).

    **Arguments:** `texts` (an iterable of documents), `vocab_size` (256 bytes +
    merges + 1 special; at least 257, at most 65536), `length` (number of texts, for
    the progress bar), `show_progress`.

    **Returns:** a `BPETokenizer` named `bpe:<vocab_size>`. Deterministic for the same texts.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not 257 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"a byte-level BPE vocabulary holds 256 bytes + merges + {EOS}: use 257..{MAX_VOCAB} "
                         f"(e.g. bpe:4096), got {vocab_size}.")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=length)
    return BPETokenizer(tok, name=f"bpe:{vocab_size}")


def parse_bpe_spec(spec: str) -> int | None:
    """`"bpe:4096"` -> 4096; anything else -> `None`."""
    if not spec.startswith("bpe:"):
        return None
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"tokenizer {spec!r}: write bpe:N with a vocabulary size N, e.g. bpe:4096.") from None


def load_tokenizer(spec: str | os.PathLike | Tokenizer = "bytes") -> Tokenizer:
    """A tokenizer from a flag value or a path (see the module docs).

    `"bpe:N"` needs training text: the corpus trains it (`load_corpus(..., tokenizer="bpe:N")`),
    or call `train_bpe`. A directory is a run directory (its `tokenizer.json`, else bytes)
    or a GPT-2 `vocab.json` + `merges.txt` directory.
    """
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    s = str(spec)
    if s == "bytes":
        return ByteTokenizer()
    if parse_bpe_spec(s) is not None:
        raise ValueError(f"tokenizer {s!r} is trained on a corpus: pass it to load_corpus(..., tokenizer={s!r}) "
                         "(the recipe's --data.tokenizer), or use eqgpt.data.train_bpe.")
    if "," in s:
        vocab, merges = (p.strip() for p in s.split(",", 1))
        return BPETokenizer.from_gpt2_files(vocab, merges)
    path = Path(s).expanduser()
    if path.is_dir():
        if (path / TOKENIZER_FILE).is_file():
            return _from_json_file(path / TOKENIZER_FILE)
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return BPETokenizer.from_gpt2_files(path / "vocab.json", path / "merges.txt")
        if (path / "model_config.json").is_file() or (path / "config.json").is_file():
            return ByteTokenizer()  # a run (or export) that recorded no tokenizer: bytes
        raise ValueError(f"{path} holds no {TOKENIZER_FILE} and no vocab.json + merges.txt pair.")
    if path.name == "vocab.json":
        return BPETokenizer.from_gpt2_files(path, path.with_name("merges.txt"))
    if path.suffix == ".json":
        if not path.is_file():
            raise ValueError(f"tokenizer file {path} not found.")
        return _from_json_file(path)
    raise ValueError(f"unknown tokenizer {s!r}: use 'bytes', 'bpe:N' (e.g. bpe:4096), a tokenizer.json file, "
                     "or a GPT-2 vocab.json (merges.txt beside it).")


def _from_json_file(path: Path) -> Tokenizer:
    """A `tokenizer.json`; the byte tokenizer's own file (no merges, id = byte) comes back as bytes."""
    try:
        spec = json.loads(path.read_text())
        model = spec.get("model", {})
        vocab, table = model.get("vocab") or {}, _bytes_to_unicode()
        if (model.get("type") == "BPE" and not model.get("merges") and not spec.get("added_tokens")
                and vocab == {table[b]: b for b in range(256)}):
            return ByteTokenizer()
        if model.get("type") == "WordLevel" and (spec.get("decoder") or {}).get("type") == "Fuse":
            return CharTokenizer({i: c for c, i in vocab.items()}, vocab)
    except (json.JSONDecodeError, AttributeError):
        pass
    return BPETokenizer.from_file(path)


def bytes_per_token(tokenizer: Tokenizer, tokens: np.ndarray) -> float | None:
    """Mean UTF-8 bytes per token of `tokens` (e.g. the validation targets), or `None`
    when an id lies outside the tokenizer (token files made with another tokenizer).

    Bits per byte = (nats per token) / ln 2 / `bytes_per_token`: the same text costs
    the same bits whatever the tokenizer, so runs with different ones compare.
    """
    ids = np.asarray(tokens).astype(np.int64).ravel()
    if ids.size == 0 or ids.min() < 0 or ids.max() >= tokenizer.vocab_size:
        return None
    n = int(tokenizer.token_bytes()[ids].sum())
    return n / ids.size if n else None


__all__ = ["Tokenizer", "ByteTokenizer", "CharTokenizer", "BPETokenizer", "train_bpe", "load_tokenizer",
           "parse_bpe_spec", "bytes_per_token", "TOKENIZER_FILE", "EOS"]
