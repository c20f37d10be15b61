"""Tokenizers: byte-level BPE trained here (on the training split only), files a user has, one
interface with bytes, bits per byte, and the recipe's --data.tokenizer."""

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eqgpt.data import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    bytes_per_token,
    load_corpus,
    load_tokenizer,
    stdlib_root,
    train_bpe,
)
from eqgpt.data import corpus as corpus_mod

TEXTS = ["def main():\n    return 42\n", "class Foo:\n    pass  # héllo, wörld ✓\n", "<|endoftext|> is text here\n"]


@pytest.fixture(scope="module")
def small_bpe():
    return train_bpe(TEXTS * 20, 300)


def test_one_interface(small_bpe):
    for tok in (ByteTokenizer(), small_bpe):
        assert isinstance(tok, Tokenizer)
        for text in TEXTS:
            ids = tok.encode(text)
            assert ids.dtype == np.uint16 and tok.decode(ids) == text
            assert [list(x) for x in tok.encode_batch([text])] == [list(ids)]
            assert int(tok.token_bytes()[ids.astype(int)].sum()) == len(text.encode())
    assert small_bpe.vocab_size == 300 and small_bpe.special_tokens == {"<|endoftext|>": small_bpe.eos_id}
    assert small_bpe.eos_id not in small_bpe.encode(TEXTS[2])  # text that spells it stays text
    assert ByteTokenizer().special_tokens == {} and ByteTokenizer().eos_id is None
    with pytest.raises(ValueError, match="257..65536"):
        train_bpe(TEXTS, 100)


def test_tokenizer_files(small_bpe, tmp_path):
    small_bpe.save(tmp_path / "run")
    same = load_tokenizer(tmp_path / "run" / "tokenizer.json")
    assert load_tokenizer(tmp_path / "run").fingerprint == same.fingerprint == small_bpe.fingerprint
    # GPT-2's vocab.json + merges.txt pair, three ways of naming it
    small_bpe.hf.model.save(str(tmp_path))
    for spec in (tmp_path / "vocab.json", f"{tmp_path / 'vocab.json'},{tmp_path / 'merges.txt'}", tmp_path):
        pair = load_tokenizer(spec)
        assert isinstance(pair, BPETokenizer)
        for text in TEXTS:
            assert list(pair.encode(text)) == list(small_bpe.encode(text))
    # the byte tokenizer's file is a byte-level BPE without merges: bytes again, and any tokenizers user agrees
    path = ByteTokenizer().save(tmp_path / "bytes")
    assert isinstance(load_tokenizer(path), ByteTokenizer)
    hf = BPETokenizer.from_file(path)
    assert list(hf.encode(TEXTS[1])) == list(TEXTS[1].encode())
    with pytest.raises(ValueError, match="unknown tokenizer"):
        load_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="trained on a corpus"):
        load_tokenizer("bpe:512")


def test_bpe_is_trained_on_the_training_split_only(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"f{i:02d}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 30)
    seen = []
    real = corpus_mod.train_bpe

    def spy(texts, size, **kw):
        texts = list(texts)
        seen.extend(texts)
        return real(texts, size, **kw)

    monkeypatch.setattr(corpus_mod, "train_bpe", spy)
    c = load_corpus(docs, cache_dir=tmp_path / "cache", val_percent=20, tokenizer="bpe:300")
    assert c.val_files and len(seen) == len(c.train_files)
    assert set(seen) == {(docs / f).read_text() for f in c.train_files}
    assert (next((tmp_path / "cache").iterdir()) / "tokenizer.json").is_file()  # next to the token cache
    seen.clear()
    again = load_corpus(docs, cache_dir=tmp_path / "cache", val_percent=20, tokenizer="bpe:300")
    assert not seen and again.tokenizer.fingerprint == c.tokenizer.fingerprint  # cached, not retrained
    np.testing.assert_array_equal(np.asarray(again.val), np.asarray(c.val))
    assert c.tokenizer.decode(c.val) == "".join((docs / f).read_text() for f in c.val_files)
    bpt = bytes_per_token(c.tokenizer, np.asarray(c.val))
    assert bpt == pytest.approx(sum(len((docs / f).read_bytes()) for f in c.val_files) / len(c.val))
    assert bytes_per_token(ByteTokenizer(), np.asarray([1, 2, 3])) == 1.0
    assert bytes_per_token(ByteTokenizer(), np.asarray([1, 300])) is None
    with pytest.raises(ValueError, match="already tokenized"):
        np.save(tmp_path / "t.npy", np.zeros(10, np.uint16))
        load_corpus(tmp_path / "t.npy", tokenizer="bpe:300")


@pytest.mark.slow
def test_bpe_4096_on_the_stdlib_trains_and_round_trips_every_validation_file(tmp_path, capsys):
    t0 = time.perf_counter()
    c = load_corpus("stdlib", cache_dir=tmp_path, tokenizer="bpe:4096")
    seconds = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nbpe:4096 on the stdlib: trained and tokenized in {seconds:.1f} s "
              f"({len(c.train) / 1e6:.2f}M train tokens)")
    assert c.vocab_size == 4096 and c.tokenizer.name == "bpe:4096"
    root = stdlib_root()
    for f in c.val_files:
        text = (root / f).read_text(encoding="utf-8")
        assert c.tokenizer.decode(c.tokenizer.encode(text)) == text, f
    assert bytes_per_token(c.tokenizer, np.asarray(c.val)) > 3  # code compresses ~3.5 bytes per token


def test_recipe_trains_with_bpe_and_records_it(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import sample as sample_recipe
    import train_gpt

    cfg = train_gpt.TrainConfig(steps=2, batch_size=8, eval_every=0, eval_windows=8, log_every=1,
                                out_dir=tmp_path / "run", sample_tokens=0,
                                progress=False, peak_flops=1e9)
    cfg.model.seq_len, cfg.model.num_layers = 32, 1
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {i + j}\n" for j in range(60)))
    cfg.data.corpus, cfg.data.tokenizer, cfg.data.cache_dir = str(docs), "bpe:320", tmp_path / "cache"
    summary = train_gpt.main(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if "val_loss" in r]
    assert vals and all(r["val_bpb"] < r["val_loss"] for r in vals)  # several bytes per token
    assert json.loads((tmp_path / "run" / "model_config.json").read_text())["vocab_size"] == 320
    tok = load_tokenizer(tmp_path / "run")
    assert tok.vocab_size == 320 and summary["steps"] == 2
    texts = sample_recipe.main(sample_recipe.SampleConfig(run_dir=tmp_path / "run", prompt="def f", max_new_tokens=3,
                                                          num_samples=1))
    assert texts[0].startswith("def f")
