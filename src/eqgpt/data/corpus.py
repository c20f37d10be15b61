"""Corpora: the Python standard library (the embedded default), text files, token files.

A corpus is two token arrays, `train` and `val`, read from a cache of `np.memmap`
files so that a large corpus is tokenized once and never held in memory twice.
Text corpora are split **by file**: a file's relative path decides (by a stable
hash) whether it is held out, so the split does not change when files are added
elsewhere and no validation text leaks into training through a shared file.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import pickle
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jaxtyping import Integer

from eqgpt.data.tokenizer import (
    MAX_VOCAB,
    TOKENIZER_FILE,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
    parse_bpe_spec,
    train_bpe,
)
from eqgpt.files import written_whole

# Directories of the stdlib that are not ordinary library code (tests, vendored
# third-party packages, IDLE's tests): left out of the default corpus.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
TOKEN_SUFFIXES = (".bin", ".npy")


@dataclass(frozen=True)
class Corpus:
    """Train and validation tokens of one source.

    **Fields:** `name` (where it came from), `train` and `val` (1-D integer arrays,
    usually read-only memmaps), `vocab_size`, and the files of each split.
    """

    name: str
    train: Integer[np.ndarray, " n"]
    val: Integer[np.ndarray, " m"]
    vocab_size: int
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    train_docs: np.ndarray | None = None  # document boundaries [0, end_0, end_1, ...] into train (packing)
    val_docs: np.ndarray | None = None
    tokenizer: Tokenizer = ByteTokenizer()  # what made (and decodes) the tokens
    pretokenized: bool = False  # ids read from a token file or a nanoGPT folder, not tokenized here
    notes: tuple[str, ...] = ()  # what loading skipped, for the user to read
    fingerprint: str = ""  # of the token arrays (`token_fingerprint`): what a resume checks it trains on


def default_cache_dir() -> Path:
    """`$EQGPT_CACHE`, else `$XDG_CACHE_HOME/eqgpt`, else `~/.cache/eqgpt`."""
    if os.environ.get("EQGPT_CACHE"):
        return Path(os.environ["EQGPT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eqgpt"


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The stdlib's `.py` files in sorted order, without tests and site-packages."""
    root = stdlib_root()
    return [
        p for p in sorted(root.rglob("*.py"))
        if not _STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1])
    ]


def text_files(source: str | Path) -> tuple[Path, list[Path]]:
    """The text files of a directory (recursively, sorted; hidden and binary files and hidden
    directories left out) or a glob pattern (binary files left out).

    **Returns:** `(root, files)`; `root` is what split hashes are relative to.
    """
    root, files, _ = scan_text_files(source)
    return root, files


def scan_text_files(source: str | Path) -> tuple[Path, list[Path], tuple[str, ...]]:
    """`text_files`, and a note saying what it skipped (empty when nothing)."""
    s = str(source)
    if any(ch in s for ch in "*?["):
        found = sorted(Path(p) for p in glob.glob(s, recursive=True) if Path(p).is_file())
        if not found:
            raise ValueError(f"glob {s!r} matched no files; check the pattern (use ** for subdirectories).")
        hidden_dirs, hidden_files = [], []
    else:
        path = Path(s).expanduser()
        if not path.exists():
            raise ValueError(
                f"corpus path {s!r} does not exist; pass a directory of text files, a glob such as "
                "'data/**/*.txt', a .bin/.npy token file, a nanoGPT data folder, or 'stdlib'."
            )
        if path.is_file():
            if is_binary(path):  # the rule directories apply to their files
                raise ValueError(f"corpus file {s!r} is binary (a NUL byte in its first 8 KiB), not text: pass a "
                                 "text file, a .bin (uint16) or .npy token file, or a nanoGPT data folder.")
            return path.parent, [path], ()
        found, hidden_dirs, hidden_files = _walk(path)
        if not found and not hidden_dirs and not hidden_files:
            raise ValueError(f"corpus directory {s!r} holds no files; put text files in it.")
    files = [f for f in found if not is_binary(f)]
    binary = [f for f in found if f not in set(files)]
    note = _skipped_note(s, binary, hidden_dirs, hidden_files)
    if not files:
        raise ValueError(f"corpus {s!r} holds no text files" + (f" ({note})" if note else "")
                         + "; put text files in it.")
    root = path if not any(ch in s for ch in "*?[") else Path(os.path.commonpath([str(f.parent) for f in files]))
    return root, files, (note,) if note else ()


def _walk(path: Path) -> tuple[list[Path], list[str], list[str]]:
    """Files under `path` (sorted), without descending into hidden directories; **returns** them,
    the hidden directories and the hidden files left out."""
    files, hidden_dirs, hidden_files = [], [], []
    for top, dirs, names in os.walk(path):
        hidden_dirs += [os.path.relpath(os.path.join(top, d), path) for d in dirs if d.startswith(".")]
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        hidden_files += [n for n in names if n.startswith(".")]
        files += [Path(top, n) for n in names if not n.startswith(".") and Path(top, n).is_file()]
    return sorted(files), sorted(hidden_dirs), hidden_files


def is_binary(path: Path) -> bool:
    """Whether `path` looks binary: a NUL byte in its first 8 KiB (as git decides)."""
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def _skipped_note(source: str, binary: list[Path], hidden_dirs: list[str], hidden_files: list[str]) -> str:
    parts = []
    if binary:
        parts.append(f"{len(binary)} binary file{'s' * (len(binary) != 1)} ({', '.join(f.name for f in binary[:3])}"
                     + (", ..." if len(binary) > 3 else "") + ")")
    if hidden_dirs:
        parts.append(f"{len(hidden_dirs)} hidden director{'ies' if len(hidden_dirs) != 1 else 'y'} "
                     f"({', '.join(hidden_dirs[:3])}" + (", ..." if len(hidden_dirs) > 3 else "") + ")")
    if hidden_files:
        parts.append(f"{len(hidden_files)} hidden file{'s' * (len(hidden_files) != 1)}")
    return f"corpus {source}: skipped {', '.join(parts)}" if parts else ""


def is_validation_file(relative_path: str, val_percent: float) -> bool:
    """The fixed split: a stable hash of the relative path, in percent, below `val_percent`."""
    return (zlib.crc32(relative_path.encode("utf-8")) % 10000) < val_percent * 100


def _split(root: Path, files: list[Path], val_percent: float) -> tuple[list[Path], list[Path]]:
    rel = lambda f: f.relative_to(root).as_posix()  # noqa: E731
    val = [f for f in files if is_validation_file(rel(f), val_percent)]
    train = [f for f in files if not is_validation_file(rel(f), val_percent)]
    if not val and len(files) > 1:  # tiny corpora: hold out the last file, still by file
        train, val = files[:-1], files[-1:]
    return train, val


def _fingerprint(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


_WHOLE = 1 << 25  # token arrays up to this many ids are hashed whole; longer ones by 1024 evenly spaced blocks
_BLOCK = 1 << 14


def token_fingerprint(*arrays: np.ndarray) -> str:
    """A short hash of token arrays: their lengths, dtypes and ids (every id up to 32M ids per array; beyond,
    1024 evenly spaced blocks of 16K ids, 32 MiB read at most). The same ids give the same fingerprint
    wherever the files lie; another corpus, tokenizer or validation share gives another."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(f"{len(a)}:{a.dtype.str};".encode())
        if len(a) <= _WHOLE:
            h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
            continue
        for start in np.linspace(0, len(a) - _BLOCK, 1024).astype(np.int64):
            h.update(memoryview(np.ascontiguousarray(a[start : start + _BLOCK])).cast("B"))
    return h.hexdigest()


def _write_tokens(path: Path, files: list[Path | _Slice], tokenizer: Tokenizer, *, progress: str | None = None) -> None:
    bounds = [0]  # one document per file: its token boundaries, for packing
    with written_whole(path) as out, _progress(progress, len(files)) as advance:
        if isinstance(tokenizer, ByteTokenizer):
            chunks = ([f] for f in files)
        else:  # encode_batch runs the library's threads over a chunk of files at a time
            chunks = (files[i : i + 64] for i in range(0, len(files), 64))
        for chunk in chunks:
            if isinstance(tokenizer, ByteTokenizer):
                encoded = [tokenizer.encode_bytes(chunk[0].read_bytes())]
            else:
                encoded = tokenizer.encode_batch([_read_text(f) for f in chunk])
            for ids in encoded:
                out.write(np.asarray(ids, np.uint16).tobytes())
                bounds.append(bounds[-1] + len(ids))
            advance(len(chunk))
        with written_whole(docs_path(path)) as docs:  # in place before the tokens are: readers need both
            np.save(docs, np.asarray(bounds, np.int64))


def _read_text(f: Path) -> str:
    try:
        return f.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{f} is not UTF-8 text ({e}); a BPE tokenizer reads UTF-8 text. Remove or convert "
                         "the file, or use --data.tokenizer bytes.") from e


class _progress:
    """A rich progress bar over files (`label=None`: none); `advance(n)` moves it."""

    def __init__(self, label: str | None, total: int):
        self.label, self.total, self.bar = label, total, None

    def __enter__(self):
        if self.label is None or self.total < 2:
            return lambda n: None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(TextColumn(f"[bold]{self.label}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("files"), TimeElapsedColumn(), transient=True)
        task = self.bar.add_task(self.label, total=self.total)
        self.bar.start()
        return lambda n: self.bar.update(task, advance=n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def docs_path(tokens_path: Path) -> Path:
    """The document boundaries file beside a token file: `name.bin` -> `name.docs.npy`."""
    return Path(tokens_path).with_suffix(".docs.npy")


def _split_docs(bounds: np.ndarray | None, n_train: int, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    if bounds is None:
        return None, None
    inner = lambda lo, hi: bounds[(bounds > lo) & (bounds < hi)]  # noqa: E731
    return (np.concatenate([[0], inner(0, n_train), [n_train]]),
            np.concatenate([[0], inner(n_train, n) - n_train, [n - n_train]]))


def _memmap(path: Path) -> np.ndarray:
    size = path.stat().st_size
    if size == 0:
        return np.zeros((0,), np.uint16)
    if size % 2:
        raise ValueError(f"{path} holds {size:,} bytes, an odd number: a .bin token file is uint16 ids (2 bytes "
                         "each); write it with np.asarray(ids, np.uint16).tofile(path), or save a .npy.")
    return np.memmap(path, dtype=np.uint16, mode="r")


@dataclass(frozen=True)
class _Slice:
    """Bytes `start:stop` of a file: the head (training) or tail (validation) of a one-file corpus."""

    path: Path
    start: int
    stop: int

    def read_bytes(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read(self.stop - self.start)

    def relative_to(self, root: Path) -> Path:
        return Path(f"{self.path.relative_to(root).as_posix()}[{self.start}:{self.stop}]")

    def __str__(self) -> str:
        return f"{self.path} (bytes {self.start}:{self.stop})"


def tail_split(path: Path, val_percent: float) -> tuple[_Slice, _Slice]:
    """A one-file corpus split by bytes: the last `val_percent` for validation, its start moved back
    to a line start (within 64 KiB; else to a UTF-8 character start)."""
    size = path.stat().st_size
    cut = size - math.ceil(size * val_percent / 100)
    with open(path, "rb") as f:
        lo = max(0, cut - (1 << 16))
        f.seek(lo)
        window = f.read(cut - lo + 1)
    newline = window.rfind(b"\n", 0, cut - lo)
    if newline >= 0:
        cut = lo + newline + 1
    else:
        while 0 < cut < size and (window[cut - lo] & 0xC0) == 0x80:  # a UTF-8 continuation byte
            cut -= 1
    return _Slice(path, 0, cut), _Slice(path, cut, size)


def _text_corpus(name, root, files, *, cache_dir, val_percent, tokenizer, progress=False) -> Corpus:
    if len(files) == 1:  # one file: its head trains, its tail validates
        head, tail = tail_split(files[0], val_percent)
        train_files, val_files = [head], [tail]
    else:
        train_files, val_files = _split(root, files, val_percent)
    stats = [(f.relative_to(root).as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    spec = tokenizer if isinstance(tokenizer, str) else tokenizer.name if isinstance(tokenizer, ByteTokenizer) \
        else tokenizer.fingerprint
    key = _fingerprint([str(root), stats, val_percent, spec] + (["tail"] if len(files) == 1 else []))
    cache = Path(cache_dir).expanduser() / f"{Path(name).name or 'corpus'}-{key}"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot write the token cache in {cache_dir} ({e.strerror or e}); set --data.cache-dir "
                         "(or EQGPT_CACHE) to a directory you can write to.") from None
    tokenizer = _corpus_tokenizer(tokenizer, cache, train_files, progress)
    arrays, docs = {}, {}
    for split, split_files in (("train", train_files), ("val", val_files)):
        path = cache / f"{split}.bin"
        if not path.exists() or not docs_path(path).exists():
            _write_tokens(path, split_files, tokenizer, progress=f"tokenize {split}" if progress else None)
        arrays[split] = _memmap(path)
        docs[split] = np.load(docs_path(path))
    rel = lambda fs: tuple(f.relative_to(root).as_posix() for f in fs)  # noqa: E731
    return Corpus(name, arrays["train"], arrays["val"], tokenizer.vocab_size, rel(train_files), rel(val_files),
                  docs["train"], docs["val"], tokenizer)


def _corpus_tokenizer(tokenizer: str | Tokenizer, cache: Path, train_files: list[Path | _Slice],
                      progress: bool) -> Tokenizer:
    """`bpe:N`: the tokenizer cached in `cache`, else trained on the training files (never on
    validation) and cached there; anything else: `load_tokenizer`."""
    size = parse_bpe_spec(tokenizer) if isinstance(tokenizer, str) else None
    if size is None:
        tok = load_tokenizer(tokenizer)
    elif (cache / TOKENIZER_FILE).is_file():
        tok = load_tokenizer(cache / TOKENIZER_FILE)
        tok.name = tokenizer
    else:
        if progress:
            print(f"training a {tokenizer} tokenizer on {len(train_files)} training files ...", flush=True)
        tok = train_bpe((_read_text(f) for f in train_files), size, length=len(train_files))
        tmp = cache / f"tok.tmp{os.getpid()}"
        tok.save(tmp).replace(cache / TOKENIZER_FILE)  # atomic
        tmp.rmdir()
    if tok.vocab_size > MAX_VOCAB:
        raise ValueError(f"tokenizer {tok.name!r} has {tok.vocab_size} tokens; token caches hold uint16 ids "
                         f"(at most {MAX_VOCAB}).")
    return tok


def is_token_file(source: str | Path) -> bool:
    """Whether `load_corpus(source)` reads pre-tokenized ids (an existing `.bin`/`.npy`) rather than text."""
    return Path(str(source)).suffix in TOKEN_SUFFIXES and Path(str(source)).is_file()


def vocab_sidecar(tokens_path: Path) -> Path:
    """The optional vocabulary file beside a token file: `name.bin` -> `name.meta.json`,
    holding `{"vocab_size": N}` (what the tokenizer that made the file has)."""
    return Path(tokens_path).with_suffix(".meta.json")


def inferred_vocab_size(max_id: int) -> int:
    """The vocabulary a token file implies when nothing states it: its largest id + 1,
    rounded up to a multiple of 64 (wider, better-shaped matmuls; the extra rows are never
    targets), and at least 256 so that byte files keep the byte vocabulary."""
    return max(256, -(-(max_id + 1) // 64) * 64)


def _token_file_vocab(path: Path, tokens: np.ndarray, vocab_size: int | None) -> int:
    """`vocab_size` if given, else the sidecar's, else inferred from the ids; checked against them."""
    if tokens.size and np.issubdtype(tokens.dtype, np.signedinteger) and int(tokens.min()) < 0:
        raise ValueError(f"{path} holds negative token ids (the first at offset {int(np.argmax(tokens < 0))}); "
                         "token ids must lie in 0..vocab_size-1.")
    max_id = int(tokens.max()) if tokens.size else 0
    source, fix = ("given as vocab_size, --model.vocab-size in train_gpt.py",
                   f"give one above {max_id}, or leave it out to infer it from the file")
    if vocab_size is None and vocab_sidecar(path).exists():
        try:
            vocab_size = int(json.loads(vocab_sidecar(path).read_text())["vocab_size"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{vocab_sidecar(path)} must hold {{\"vocab_size\": N}}: {e!r}") from None
        source, fix = (f"from {vocab_sidecar(path)}",
                       f"write one above {max_id} there, or delete {vocab_sidecar(path).name} to infer it from "
                       "the file")
    if vocab_size is None:
        return inferred_vocab_size(max_id)
    if max_id >= vocab_size:
        first = int(np.argmax(tokens >= vocab_size))
        raise ValueError(
            f"{path} has max token id {max_id} (the first id >= {vocab_size} at offset {first}), but vocab_size is "
            f"{vocab_size} ({source}); {fix}."
        )
    return vocab_size


def _token_file_corpus(path: Path, *, val_percent: float, vocab_size: int | None) -> Corpus:
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{path} holds {tokens.dtype} of shape {tokens.shape}; save a 1-D integer token array.")
    else:
        tokens = _memmap(path)
    vocab_size = _token_file_vocab(path, tokens, vocab_size)
    n_val = int(len(tokens) * val_percent / 100)
    bounds = None
    if docs_path(path).exists():  # optional document boundaries: [0, end_0, ..., len(tokens)]
        bounds = np.load(docs_path(path)).astype(np.int64)
        if bounds.ndim != 1 or bounds[0] != 0 or bounds[-1] != len(tokens) or (np.diff(bounds) < 0).any():
            raise ValueError(f"{docs_path(path)} must hold increasing document boundaries from 0 to "
                             f"{len(tokens)} (the token count); got {bounds[:3]}...{bounds[-3:]}.")
    n_train = len(tokens) - n_val
    return Corpus(str(path), tokens[:n_train], tokens[n_train:], vocab_size, (), (),
                  *_split_docs(bounds, n_train, len(tokens)))


META_KEYS = {"vocab_size", "itos", "stoi"}


class _NoGlobals(pickle.Unpickler):
    """An unpickler that builds plain containers only: any class or function is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and only plain data is read")


def read_meta(path: Path) -> dict:
    """nanoGPT's `meta.pkl`: a plain dict `{"vocab_size": int, "itos": {int: str}, "stoi": {str: int}}`.

    Nothing is imported or called while reading it; any other pickle is refused with a `ValueError`.
    """
    what = f"{path} is not a nanoGPT vocabulary (a plain dict of vocab_size, itos and stoi)"
    try:
        with open(path, "rb") as f:
            meta = _NoGlobals(f).load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure means: not such a dict
        raise ValueError(f"{what}; refused: {e}") from None
    if not isinstance(meta, dict) or not set(meta) <= META_KEYS or not isinstance(meta.get("vocab_size"), int):
        raise ValueError(f"{what}; it holds {type(meta).__name__}"
                         + (f" with keys {sorted(map(str, meta))}" if isinstance(meta, dict) else ""))
    itos, stoi = meta.get("itos"), meta.get("stoi")
    if (itos is None) != (stoi is None) or not (itos is None or (
            isinstance(itos, dict) and isinstance(stoi, dict)
            and all(isinstance(i, int) and 0 <= i < meta["vocab_size"] and isinstance(c, str) for i, c in itos.items())
            and all(isinstance(c, str) and isinstance(i, int) for c, i in stoi.items()))):
        raise ValueError(f"{what}; its itos/stoi are not tables of ids below vocab_size and strings.")
    return meta


def nanogpt_folder(source: str | Path) -> Path | None:
    """The nanoGPT data folder `source` names: a directory holding `train.bin`, or a `train.bin`
    with `val.bin` or `meta.pkl` beside it; else `None`."""
    path = Path(str(source)).expanduser()
    if path.is_dir() and (path / "train.bin").is_file():
        return path
    if (path.name == "train.bin" and path.is_file()
            and any((path.parent / n).is_file() for n in ("val.bin", "meta.pkl"))):
        return path.parent
    return None


def _nanogpt_corpus(folder: Path, *, val_percent: float, vocab_size: int | None, tokenizer) -> Corpus:
    """`train.bin` trains, `val.bin` validates (else the tail of `train.bin`), `meta.pkl` gives the
    vocabulary and the characters that decode it."""
    meta = read_meta(folder / "meta.pkl") if (folder / "meta.pkl").is_file() else {}
    if not (folder / "val.bin").is_file():
        corpus = _token_file_corpus(folder / "train.bin", val_percent=val_percent,
                                    vocab_size=vocab_size or meta.get("vocab_size"))
    else:
        train, val = _memmap(folder / "train.bin"), _memmap(folder / "val.bin")
        vocab = _token_file_vocab(folder / "train.bin", train, vocab_size or meta.get("vocab_size"))
        _token_file_vocab(folder / "val.bin", val, vocab)
        corpus = Corpus(str(folder), train, val, vocab)
    if "itos" in meta and tokenizer == "bytes":
        tok = CharTokenizer(meta["itos"], meta["stoi"], name=f"{len(meta['itos'])} characters of meta.pkl")
    else:
        tok = load_tokenizer(tokenizer)
    return dataclasses.replace(corpus, name=str(folder), tokenizer=tok, pretokenized=True)


def _too_small(corpus: Corpus, source, split: str, n: int, min_tokens: int, val_percent: float) -> ValueError:
    """The error for a split shorter than one sequence; a one-file corpus names its size."""
    path = Path(str(source)).expanduser()
    total = len(corpus.train) + len(corpus.val)
    if path.is_file() and not corpus.pretokenized:
        need = math.ceil(min_tokens * 100 / min(val_percent, 100 - val_percent))
        return ValueError(
            f"corpus file {source} is too small: {path.stat().st_size:,} bytes, {total:,} tokens, of which the "
            f"{split} share ({'the last ' if split == 'val' else 'the first '}"
            f"{val_percent if split == 'val' else 100 - val_percent:g}%) "
            f"holds {n}, fewer than one sequence ({min_tokens} = seq_len + 1); it needs about {need:,} tokens "
            "at this --data.val-percent: give a longer file or lower --model.seq-len.")
    return ValueError(f"the {split} split of corpus {corpus.name!r} has {n} tokens, fewer than one "
                      f"sequence ({min_tokens} = seq_len + 1); add text, lower seq_len, or change val_percent.")


def load_corpus(
    source: str | Path = "stdlib",
    *,
    cache_dir: str | Path | None = None,
    val_percent: float = 5.0,
    min_tokens: int = 1,
    vocab_size: int | None = None,
    tokenizer: str | Tokenizer = "bytes",
    progress: bool = False,
) -> Corpus:
    """Load (and cache) a corpus.

    **Arguments:**

    - `source`: `"stdlib"` (the Python standard library's `.py` files), a directory,
      a glob of text files, one text file (its last `val_percent` of bytes validates), a
      nanoGPT data folder (`train.bin`, `val.bin`, `meta.pkl`; or its `train.bin`), or a
      pre-tokenized `.bin` (`uint16`) / `.npy` file. Directories skip hidden directories
      and files and binary files, and say so in `Corpus.notes`.
    - `cache_dir`: where token caches go (default `default_cache_dir()`).
    - `val_percent`: share held out for validation: of files for text corpora,
      of the token tail for token files.
    - `min_tokens`: each split must hold at least this many tokens (one training
      sequence plus its target, `seq_len + 1`); a clear error otherwise.
    - `vocab_size`: for token files, the vocabulary (every id must lie below it). None
      (default): the sidecar `name.meta.json`'s `{"vocab_size": N}` if there is one, else
      `inferred_vocab_size(max id)`. Text corpora take the tokenizer's.
    - `tokenizer`: `"bytes"` (default), `"bpe:N"` (a byte-level BPE of N tokens trained
      on the training split, cached as `tokenizer.json` next to the token cache), a
      `tokenizer.json`, a GPT-2 `vocab.json` (see `eqgpt.data.load_tokenizer`), or a
      `Tokenizer`. For token files it only names the tokenizer that made them.
    - `progress`: progress bars while tokenizing (and a line while training BPE).

    **Returns:** a `Corpus` (its `tokenizer` decodes it).
    """
    if not 0 < val_percent < 100:
        raise ValueError(f"val_percent must lie in (0, 100), got {val_percent}.")
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    if str(source) == "stdlib":
        corpus = _text_corpus("stdlib", stdlib_root(), stdlib_files(), cache_dir=cache_dir,
                              val_percent=val_percent, tokenizer=tokenizer, progress=progress)
    elif (folder := nanogpt_folder(source)) is not None:
        if isinstance(tokenizer, str) and parse_bpe_spec(tokenizer) is not None:
            raise ValueError(f"{source} is already tokenized, so there is no text to train {tokenizer!r} on.")
        corpus = _nanogpt_corpus(folder, val_percent=val_percent, vocab_size=vocab_size, tokenizer=tokenizer)
    elif is_token_file(source):
        if isinstance(tokenizer, str) and parse_bpe_spec(tokenizer) is not None:
            raise ValueError(f"{source} is already tokenized, so there is no text to train {tokenizer!r} on; "
                             "pass the tokenizer.json that made it (or 'bytes').")
        corpus = _token_file_corpus(Path(source), val_percent=val_percent, vocab_size=vocab_size)
        corpus = dataclasses.replace(corpus, tokenizer=load_tokenizer(tokenizer), pretokenized=True)
    else:
        root, files, notes = scan_text_files(source)
        corpus = _text_corpus(str(source), root, files, cache_dir=cache_dir,
                              val_percent=val_percent, tokenizer=tokenizer, progress=progress)
        corpus = dataclasses.replace(corpus, notes=notes)
    if len(corpus.train) == 0 and len(corpus.val) == 0:
        raise ValueError(f"corpus {corpus.name!r} is empty (0 tokens); give it some text.")
    for split in ("train", "val"):
        n = len(getattr(corpus, split))
        if n < min_tokens:
            raise _too_small(corpus, source, split, n, min_tokens, val_percent)
    return dataclasses.replace(corpus, fingerprint=token_fingerprint(corpus.train, corpus.val))
