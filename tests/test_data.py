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
from helpers import unchecked


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


def test_a_crash_mid_write_leaves_no_half_written_cache(tmp_path, monkeypatch):
    """Every rank of a job loads the corpus from one cache: a reader must never find half a file.
    A write that dies part-way (here, after the first byte of the document bounds) leaves the
    cache as if never written, and the next load builds it whole."""
    root = write_corpus(tmp_path / "c")
    real_save = np.save

    def dies_mid_write(file, array, *args, **kwargs):
        file.write(b"\x93")  # the first byte of the .npy header
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        load_corpus(root, cache_dir=tmp_path / "cache", val_percent=25)
    assert not list((tmp_path / "cache").rglob("*.tmp*"))  # the temporary files removed, not left as debris
    monkeypatch.setattr(np, "save", real_save)
    c = load_corpus(root, cache_dir=tmp_path / "cache", val_percent=25)
    assert len(c.train) + len(c.val) == 12 * 400 and c.train_docs[-1] == len(c.train)


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
    assert not np.array_equal(a.local_windows(7),
                              BatchLoader(tokens, batch_size=8, seq_len=16, seed=4).local_windows(7))
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


def test_loader_state_restores_its_step_and_refuses_another_pipeline():
    """A checkpoint's data state names the seed and the batch shape; a loader that differs in any of
    them refuses it with every difference listed (a batch is a function of all of them)."""
    tokens = np.arange(100, dtype=np.uint16)
    loader = BatchLoader(tokens, batch_size=4, seq_len=8, seed=3)
    state = loader.state(7)
    assert state == {"seed": 3, "step": 7, "mode": "windows", "batch_size": 4, "seq_len": 8}
    assert loader.restore(state) == 7 and loader.restore({"seed": 3, "step": 5}) == 5  # an older checkpoint's
    fix = "; resume with the same --data settings (or start a new run) to see the same batches."
    for other, diff in [({"seed": 4}, "seed was 3, now 4"), ({"batch_size": 2}, "batch_size was 4, now 2"),
                        ({"seq_len": 16}, "seq_len was 8, now 16"),
                        ({"seed": 0, "seq_len": 4}, "seed was 3, now 0, seq_len was 8, now 4")]:
        changed = BatchLoader(tokens, **{"batch_size": 4, "seq_len": 8, "seed": 3, **other})
        message = f"the checkpoint's data pipeline differs from this run's: {diff}{fix}"
        with pytest.raises(ValueError) as refused:
            changed.restore(state)
        assert str(refused.value) == message
    with pytest.raises(ValueError, match="mode was 'packed', now 'windows'"):
        loader.restore({**state, "mode": "packed"})


def test_loader_defaults_and_bad_shapes():
    tokens = np.arange(100, dtype=np.uint16)
    assert BatchLoader(tokens, batch_size=2, seq_len=4).seed == 0
    for batch_size, seq_len in [(0, 4), (2, 0)]:
        with pytest.raises(ValueError) as refused:
            BatchLoader(tokens, batch_size=batch_size, seq_len=seq_len)
        assert str(refused.value) == f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}."
    with pytest.raises(ValueError) as refused:
        BatchLoader(np.zeros(10, np.uint16), batch_size=2, seq_len=16)
    assert str(refused.value) == ("10 training tokens are fewer than one sequence (seq_len + 1 = 17); "
                                  "use a larger corpus or a shorter seq_len.")
    with pytest.raises(ValueError) as refused:
        eval_windows(np.zeros(10, np.uint16), seq_len=16, num_windows=2)
    assert str(refused.value) == ("10 validation tokens are fewer than one sequence (17); "
                                  "hold out more files or shorten seq_len.")


# --------------------------------------------------------------------------- the Grain pipeline

def test_grain_windows_are_the_batchloader_batches_bit_for_bit():
    """Windows mode through Grain (prefetch threads) yields exactly `BatchLoader`'s batches."""
    from eqgpt.data.grain_source import LoaderConfig, make_loader

    tokens = (np.arange(20000) * 7 % 251).astype(np.uint16)
    plain = BatchLoader(tokens, batch_size=8, seq_len=16, seed=3)
    grain_loader = make_loader(tokens, batch_size=8, seq_len=16, seed=3, config=LoaderConfig(threads=2, prefetch=4))
    for step in [0, 1, 2, 3, 7, 8, 2]:  # in order (prefetched), then jumps (the iterator moves)
        a, b = plain.local_batch(step), grain_loader.local_batch(step)
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.targets, b.targets)
        assert b.segment_ids is None and b.positions is None and b.loss_mask is None
    assert grain_loader.batches == 7 and grain_loader.wait_s >= 0
    grain_loader.close()


def test_grain_state_resumes_at_the_same_batch():
    from eqgpt.data.grain_source import LoaderConfig, make_loader

    rng = np.random.default_rng(0)
    bounds = np.concatenate([[0], np.cumsum(rng.integers(2, 40, 500))])
    tokens = rng.integers(0, 256, bounds[-1]).astype(np.uint16)
    cfg = LoaderConfig(mode="packed", threads=2, prefetch=2)
    make = lambda **kw: make_loader(tokens, batch_size=4, seq_len=32, seed=5, config=cfg, docs=bounds, **kw)  # noqa: E731
    straight = make()
    want = [straight.local_batch(s) for s in range(12)]
    first = make()
    for s in range(6):
        first.local_batch(s)
    state = first.state(6)
    assert state["grain"] == {"next_index": 6} and state["mode"] == "packed"
    resumed = make()
    assert resumed.restore(state) == 6
    for s in range(6, 12):
        got = resumed.local_batch(s)
        for field in ("tokens", "targets", "loss_mask", "segment_ids", "positions"):
            assert np.array_equal(getattr(got, field), getattr(want[s], field)), field
    # Two processes each read half the rows of the same global batch.
    halves = [make(process_index=i, process_count=2).local_batch(9) for i in range(2)]
    assert np.array_equal(np.concatenate([h.tokens for h in halves]), want[9].tokens)
    # A checkpoint of another data pipeline is refused, not silently mixed.
    with pytest.raises(ValueError, match="mode was 'windows'"):
        resumed.restore({**state, "mode": "windows"})
    with pytest.raises(ValueError, match="seed was 4"):
        BatchLoader(tokens, batch_size=4, seq_len=32, seed=5).restore({"seed": 4, "step": 3})
    for loader in (straight, first, resumed):
        loader.close()


def test_document_boundaries_of_text_and_token_corpora(tmp_path):
    root = write_corpus(tmp_path / "c", n_files=6, size=50)
    c = load_corpus(root, cache_dir=tmp_path / "cache", val_percent=20)
    assert c.train_docs.tolist() == [50 * i for i in range(len(c.train_files) + 1)]
    assert c.val_docs[-1] == len(c.val)
    toks = np.arange(100, dtype=np.uint16)
    toks.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.docs.npy", np.array([0, 30, 95, 100]))
    t = load_corpus(tmp_path / "t.bin", val_percent=10)  # 90 train tokens, 10 validation
    assert t.train_docs.tolist() == [0, 30, 90] and t.val_docs.tolist() == [0, 5, 10]
    np.save(tmp_path / "t.docs.npy", np.array([0, 30, 99]))
    with pytest.raises(ValueError, match="document boundaries"):
        load_corpus(tmp_path / "t.bin", val_percent=10)


def test_packed_mode_errors_and_decisions(tmp_path, caplog):
    from eqgpt.data.grain_source import LoaderConfig, make_loader

    tokens = np.arange(1000, dtype=np.uint16) % 256
    with pytest.raises(ValueError, match="needs document boundaries"):
        make_loader(tokens, batch_size=2, seq_len=16, config=LoaderConfig(mode="packed"))
    with pytest.raises(ValueError, match="'windows' or 'packed'"), unchecked():
        make_loader(tokens, batch_size=2, seq_len=16, config=LoaderConfig(mode="zigzag"))
    # A document longer than the sequence is split (and the decision logged), never refused.
    with caplog.at_level("INFO", logger="eqgpt.data.packing"):
        loader = make_loader(tokens, batch_size=2, seq_len=16, docs=np.array([0, 10, 1000]),
                             config=LoaderConfig(mode="packed", threads=0))
    assert "longer than seq_len + 1 = 17 tokens; they are split" in caplog.text
    assert loader.local_batch(0).shape == (2, 16)


def packed_corpus():
    """Synthetic documents shared with the 2-process worker `mp/data_worker.py`."""
    rng = np.random.default_rng(11)
    bounds = np.concatenate([[0], np.cumsum(rng.integers(2, 45, 400))])
    return rng.integers(0, 256, bounds[-1]).astype(np.uint16), bounds


@pytest.mark.multiprocess
def test_two_processes_load_the_one_process_batches():
    """2 processes x 4 devices, each reading only its rows, assemble exactly the 1-process global batch."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from eqgpt.data.grain_source import LoaderConfig, make_loader

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "eqgpt.launch", "--nproc", "2", "--devices-per-proc", "4", "--timeout", "200",
           "--", str(root / "tests" / "mp" / "data_worker.py")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=280)
    lines = [line for line in proc.stdout.splitlines() if "RESULT " in line]
    assert proc.returncode == 0 and len(lines) == 1, (proc.stdout + proc.stderr)[-3000:]
    got = json.loads(lines[0].split("RESULT ", 1)[1])
    tokens, bounds = packed_corpus()
    for mode in ("windows", "packed"):
        one = make_loader(tokens, batch_size=8, seq_len=32, seed=7, docs=bounds, process_index=0, process_count=1,
                          config=LoaderConfig(mode=mode, threads=0))
        for step, fields in enumerate(got[mode]):
            want = one.local_batch(step)
            for k, v in fields.items():
                np.testing.assert_array_equal(np.asarray(v), np.asarray(getattr(want, k)), err_msg=f"{mode} {k}")
        assert set(got[mode][0]) == ({"tokens", "targets"} if mode == "windows" else
                                     {"tokens", "targets", "segment_ids", "positions", "loss_mask"})


def test_token_file_vocabulary_from_flag_sidecar_or_ids(tmp_path):
    from eqgpt.data.corpus import inferred_vocab_size

    assert [inferred_vocab_size(m) for m in (10, 255, 256, 50256)] == [256, 256, 320, 50304]
    toks = (np.arange(3000) % 1500).astype(np.uint16)
    toks.tofile(tmp_path / "t.bin")
    assert load_corpus(tmp_path / "t.bin").vocab_size == 1536  # max id 1499 + 1, to a multiple of 64
    assert load_corpus(tmp_path / "t.bin", vocab_size=1500).vocab_size == 1500
    (tmp_path / "t.meta.json").write_text('{"vocab_size": 2000}')
    assert load_corpus(tmp_path / "t.bin").vocab_size == 2000
    assert load_corpus(tmp_path / "t.bin", vocab_size=1600).vocab_size == 1600  # the flag wins
    (tmp_path / "t.meta.json").write_text('{"vocab_size": 1000}')
    with pytest.raises(ValueError, match=r"max token id 1499 \(the first id >= 1000 at offset 1000\).*t\.meta\.json"):
        load_corpus(tmp_path / "t.bin")
    (tmp_path / "t.meta.json").write_text('{"size": 1000}')
    with pytest.raises(ValueError, match="vocab_size"):
        load_corpus(tmp_path / "t.bin")
    np.save(tmp_path / "n.npy", np.array([3, 1, -2, 5] * 50))
    with pytest.raises(ValueError, match="negative token ids.*offset 2"):
        load_corpus(tmp_path / "n.npy")


def nanogpt_folder(root, text="First Citizen:\nBefore we proceed any further, hear me speak.\n" * 200):
    """A shakespeare_char-style folder: uint16 character ids, 90/10 split, meta.pkl of the characters."""
    import pickle

    root.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(text))
    stoi, itos = {c: i for i, c in enumerate(chars)}, dict(enumerate(chars))
    ids = np.array([stoi[c] for c in text], np.uint16)
    cut = int(len(ids) * 0.9)
    ids[:cut].tofile(root / "train.bin")
    ids[cut:].tofile(root / "val.bin")
    (root / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": len(chars), "itos": itos, "stoi": stoi}))
    (root / "prepare.py").write_text("# the script that made it\n")
    return root, len(chars), cut, len(ids) - cut


def test_one_text_file_is_a_corpus_with_its_tail_validating(tmp_path):
    text = "".join(f"line {i}: {'ab' * (i % 7)}\n" for i in range(400))
    (tmp_path / "input.txt").write_text(text)
    c = load_corpus(tmp_path / "input.txt", cache_dir=tmp_path / "cache", val_percent=10, min_tokens=33)
    train, val = bytes(np.asarray(c.train, np.uint8)), bytes(np.asarray(c.val, np.uint8))
    assert train + val == text.encode() and val.startswith(b"line ") and train.endswith(b"\n")
    assert 0.1 <= len(val) / len(text) < 0.12  # the last 10%, from the start of a line
    (tmp_path / "short.txt").write_text("x = 1\n" * 50)
    with pytest.raises(ValueError, match=r"corpus file .*short.txt is too small: 300 bytes, 300 tokens"):
        load_corpus(tmp_path / "short.txt", cache_dir=tmp_path / "cache", min_tokens=33)


def test_nanogpt_folder_vocab_validation_and_characters(tmp_path):
    folder, vocab, n_train, n_val = nanogpt_folder(tmp_path / "shakespeare_char")
    for source in (folder, folder / "train.bin"):
        c = load_corpus(source, cache_dir=tmp_path / "cache", min_tokens=33)
        assert (c.vocab_size, len(c.train), len(c.val)) == (vocab, n_train, n_val) and c.pretokenized
        assert c.tokenizer.decode(c.train[:15]) == "First Citizen:\n"
        at = "First Citizen:\nBefore we proceed any further, ".__len__()
        assert list(c.tokenizer.encode("hear me")) == list(c.train[at : at + 7])
    with pytest.raises(ValueError, match=r"'Z', 'é' are not in the \d+-character vocabulary"):
        c.tokenizer.encode("Zé")
    saved = c.tokenizer.save(tmp_path / "run")
    from eqgpt.data import CharTokenizer, load_tokenizer

    again = load_tokenizer(tmp_path / "run")
    assert isinstance(again, CharTokenizer) and again.decode(c.train[:15]) == "First Citizen:\n"
    from tokenizers import Tokenizer as HF

    assert HF.from_file(str(saved)).decode([int(i) for i in c.train[:15]]) == "First Citizen:\n"


class Shell:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > pwned.txt",))


@pytest.mark.parametrize("meta", [Shell(), ["vocab_size", 65], {"vocab_size": 65, "itos": {}, "cmd": "x"},
                                  {"vocab_size": 3, "itos": {0: "a", 7: "b"}, "stoi": {"a": 0, "b": 7}}])
def test_other_pickles_are_refused(tmp_path, monkeypatch, meta):
    import pickle

    monkeypatch.chdir(tmp_path)
    folder = nanogpt_folder(tmp_path / "data")[0]
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    with pytest.raises(ValueError, match="is not a nanoGPT vocabulary"):
        load_corpus(folder, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "pwned.txt").exists()


def test_directories_skip_binary_files_and_hidden_directories(tmp_path):
    root = write_corpus(tmp_path / "repo", n_files=6)
    (root / ".git" / "objects").mkdir(parents=True)
    (root / ".git" / "objects" / "pack").write_text("a" * 5000)
    (root / ".env").write_text("SECRET=1")
    np.arange(300, dtype=np.uint16).tofile(root / "tokens.bin")
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    c = load_corpus(root, cache_dir=tmp_path / "cache", val_percent=20)
    assert sorted(c.train_files + c.val_files) == [f"f{i:02d}.txt" for i in range(6)]
    assert c.notes == ("corpus " + str(root) + ": skipped 2 binary files (logo.png, tokens.bin), "
                       "1 hidden directory (.git), 1 hidden file",)
