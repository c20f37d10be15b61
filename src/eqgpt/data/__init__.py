"""Data: tokenizers (bytes, byte-level BPE), corpora (the Python stdlib by default), deterministic loaders."""

from eqgpt.data.batch import Batch
from eqgpt.data.corpus import (
    Corpus,
    default_cache_dir,
    is_validation_file,
    load_corpus,
    stdlib_files,
    stdlib_root,
    text_files,
)
from eqgpt.data.grain_source import GrainLoader, LoaderConfig, make_loader
from eqgpt.data.loader import BatchLoader, eval_windows, process_rows
from eqgpt.data.packing import PackedLoader, pack_documents, packing_efficiency
from eqgpt.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    bytes_per_token,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "Batch", "ByteTokenizer", "CharTokenizer", "BPETokenizer", "Tokenizer", "load_tokenizer", "train_bpe",
    "bytes_per_token", "Corpus", "load_corpus", "stdlib_files", "stdlib_root", "text_files",
    "default_cache_dir", "is_validation_file", "BatchLoader", "eval_windows", "process_rows",
    "GrainLoader", "LoaderConfig", "make_loader", "PackedLoader", "pack_documents", "packing_efficiency",
]
