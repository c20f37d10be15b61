"""Data: tokenizer, corpora and their split, the deterministic loader, bad input."""

import numpy as np
import pytest

from eqgpt.data import (
    BatchLoader,
    ByteTokenizer,
    eval_windows,
    load_corpus,
    process_rows,
    stdlib_files,
)
from eqgpt.train import SingleDevice


def write_corpus(root, n_files=12, size=400, alphabet="abcdefgh \n"):
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n_files):
        text = "".join(rng.choice(list(alphabet), size))
        (root / f"f{i:02d}.txt").write_text(text)
    return root


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é' * x\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.max() < 256
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="0..255"):
        tok.decode([300])


def test_stdlib_files_sorted_without_tests():
    files = stdlib_files()
    assert len(files) > 300 and files == sorted(files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)


def test_corpus_split_by_file_and_cached(tmp_path):
    root = write_corpus(tmp_path / "c")
    a = load_corpus(root, cache_dir=tmp_path / "cache", val_percent=25)
    assert set(a.train_files).isdisjoint(a.val_files) and len(a.val_files) >= 1
    assert len(a.train) + len(a.val) == 12 * 400
    assert isinstance(a.train, np.memmap)
    b = load_corpus(root, cache_dir=tmp_path / "cache", val_percent=25)  # reads the cache
    assert a.val_files == b.val_files and np.array_equal(a.train, b.train)
    g = load_corpus(str(root / "f0*.txt"), cache_dir=tmp_path / "cache", val_percent=25)
    assert len(g.train_files) + len(g.val_files) == 10


def test_token_files(tmp_path):
    toks = np.arange(1000, dtype=np.uint16) % 200
    toks.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", toks.astype(np.int32))
    for name in ("t.bin", "t.npy"):
        c = load_corpus(tmp_path / name, val_percent=10)
        assert len(c.train) == 900 and np.array_equal(c.val, toks[900:])
    with pytest.raises(ValueError, match="vocab_size"):
        load_corpus(tmp_path / "t.bin", vocab_size=100)


def test_loader_is_a_function_of_seed_and_step(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16) % 256
    a = BatchLoader(tokens, batch_size=8, seq_len=16, seed=3)
    b = BatchLoader(tokens, batch_size=8, seq_len=16, seed=3)
    assert np.array_equal(a.local_windows(7), b.local_windows(7))  # same (seed, step)
    assert np.array_equal(a.local_windows(7), a.local_windows(7))  # no hidden state
    assert not np.array_equal(a.local_windows(7), a.local_windows(8))
    assert not np.array_equal(a.local_windows(7), BatchLoader(tokens, batch_size=8, seq_len=16, seed=4).local_windows(7))
    assert a.local_windows(0).shape == (8, 17)
    # Two processes each load half the rows; together they are the one-process batch.
    halves = [BatchLoader(tokens, batch_size=8, seq_len=16, seed=3, process_index=i, process_count=2).local_windows(7)
              for i in range(2)]
    assert np.array_equal(np.concatenate(halves), a.local_windows(7))
    g = SingleDevice().batch(a.local_batch(7))  # the Batch: inputs and targets shifted by one
    assert g.shape == (8, 16) and np.array_equal(np.asarray(g.targets), a.local_windows(7)[:, 1:])


def test_training_never_reads_validation(tmp_path):
    root = tmp_path / "c"
    write_corpus(root, n_files=10, alphabet="abcdef \n")
    c0 = load_corpus(root, cache_dir=tmp_path / "cache0", val_percent=20)
    # Rewrite the held-out files with digits only: no training batch may contain one.
    for name in c0.val_files:
        (root / name).write_text("0123456789" * 40)
    c = load_corpus(root, cache_dir=tmp_path / "cache", val_percent=20)
    assert c.val_files == c0.val_files
    digits = np.frombuffer(b"0123456789", np.uint8)
    loader = BatchLoader(c.train, batch_size=16, seq_len=32, seed=0)
    seen = np.concatenate([loader.local_windows(s).ravel() for s in range(200)])
    assert not np.isin(seen, digits).any()
    assert np.isin(eval_windows(c.val, seq_len=32, num_windows=4), digits).all()


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "blank", cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="matched no files"):
        load_corpus(str(tmp_path / "*.nothing"))
    write_corpus(tmp_path / "short", n_files=3, size=20)
    with pytest.raises(ValueError, match="fewer than one"):
        load_corpus(tmp_path / "short", cache_dir=tmp_path / "cache", min_tokens=65)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        BatchLoader(np.zeros(10, np.uint16), batch_size=2, seq_len=16)
    with pytest.raises(ValueError, match="divisible"):
        process_rows(6, 0, 4)
