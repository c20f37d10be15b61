"""Byte-level tokenizer: every UTF-8 byte is a token (vocabulary 256).

It needs no training and no files, so the default corpus works on a fresh machine.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int


class ByteTokenizer:
    """Text <-> UTF-8 bytes. Token ids are `0..255`; decoding replaces broken sequences."""

    vocab_size: int = 256
    name: str = "bytes"

    def encode(self, text: str) -> Int[np.ndarray, " n"]:
        """**Arguments:** `text`. **Returns:** its UTF-8 bytes as a `uint16` array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_bytes(self, data: bytes) -> Int[np.ndarray, " n"]:
        """Raw bytes (e.g. a file read in binary) as a `uint16` array."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        """**Arguments:** token ids (any integer sequence). **Returns:** the text."""
        arr = np.asarray(ids).astype(np.int64).ravel()
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte tokens lie in 0..255; got ids in {arr.min()}..{arr.max()}.")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
