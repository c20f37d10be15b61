"""The recipes run end to end on a tiny corpus and write their outputs."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def load(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_train_then_sample(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        (corpus / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x + {j}\n" for j in rng.integers(0, 9, 40)))
    train = load("train_gpt")
    cfg = train.TrainConfig(
        model=train.ModelConfig(seq_len=32, num_layers=1, embed_dim=32, num_heads=2),
        data=train.DataConfig(corpus=str(corpus), cache_dir=tmp_path / "cache", val_percent=20),
        steps=6, batch_size=4, accum_steps=2, log_every=2, eval_every=3, eval_windows=4,
        out_dir=tmp_path / "run", peak_flops=1e9, sample_prompts=("def ",), sample_tokens=8, progress=False,
    )
    summary = train.main(cfg)
    out = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "loss.png", "samples.txt", "model.eqx", "model_config.json"):
        assert (out / name).is_file(), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 3, 6]
    assert any("mfu" in r and "tokens_per_s" in r for r in rows)
    assert summary["steps"] == 6 and summary["val_loss"] < summary["first_val_loss"]
    assert summary["samples"][0].startswith("def ")
    texts = load("sample").main(load("sample").SampleConfig(run_dir=out, prompt="def ", max_new_tokens=5,
                                                            num_samples=1))
    assert len(texts) == 1 and texts[0].startswith("def ")
    assert "(1 x 5 tokens in " in capsys.readouterr().out  # the sampler reports its speed


def test_help_documents_options():
    out = subprocess.run([sys.executable, str(RECIPES / "train_gpt.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--steps", "--batch-size", "--data.corpus", "--optim.lr", "--model.preset", "--out-dir"):
        assert flag in out.stdout
    assert "Peak learning rate" in out.stdout
    head = "\n".join(out.stdout.splitlines()[:12])  # the common flags and an example come first
    for flag in ("--steps", "--batch-size", "--optim.lr", "--data.corpus", "--model.preset", "--out-dir",
                 "Example: eqgpt-train"):
        assert flag in head, flag
    assert out.stdout.index("╭─ parallel options") > out.stdout.index("╭─ optim options")


def test_token_files_set_the_vocab_and_each_default_run_gets_its_own_directory(tmp_path, monkeypatch, capsys):
    """A nanoGPT-style uint16 .bin of GPT-2 ids trains with no vocabulary flag; two default runs
    leave two directories, and sample.py loads the newest and names it."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    gpt2_ids = rng.integers(0, 50257, 4000).astype(np.uint16)
    gpt2_ids[7] = 50256  # <|endoftext|>: the top GPT-2 id
    gpt2_ids.tofile("gpt2.bin")
    rng.integers(0, 256, 4000).astype(np.uint16).tofile("bytes.bin")
    train, sample = load("train_gpt"), load("sample")
    small = dict(model=train.ModelConfig(seq_len=16, num_layers=1, embed_dim=32, num_heads=2), steps=2,
                 batch_size=4, log_every=1, eval_every=2, eval_windows=2, peak_flops=1e9, progress=False)
    train.main(train.TrainConfig(data=train.DataConfig(corpus="gpt2.bin", threads=0), sample_tokens=4, **small))
    first = Path("runs/latest").resolve()
    cfg = json.loads((first / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == 50304  # 50256 + 1, rounded up to a multiple of 64
    assert "no samples" in capsys.readouterr().out  # no tokenizer for GPT-2 ids: said, not crashed
    train.main(train.TrainConfig(data=train.DataConfig(corpus="bytes.bin", threads=0), sample_tokens=4, **small))
    second = Path("runs/latest").resolve()
    assert first != second and first.parent == second.parent == Path("runs").resolve()
    assert sorted(p.name for p in Path("runs").iterdir()) == sorted([first.name, second.name, "latest"])
    assert json.loads((second / "config.json").read_text())["model"]["vocab_size"] == 256
    for run in (first, second):
        assert (run / "model.eqx").is_file() and (run / "metrics.jsonl").is_file()
    capsys.readouterr()
    sample.main(sample.SampleConfig(prompt="a", max_new_tokens=2, num_samples=1))
    assert f"loading run {second}" in capsys.readouterr().out
    # A stated vocabulary below the file's ids: an error naming the file and its max id, and no new directory.
    try:
        train.main(train.TrainConfig(model=train.ModelConfig(vocab_size=1000, **vars_of(small["model"])),
                                     data=train.DataConfig(corpus="gpt2.bin", threads=0),
                                     **{k: v for k, v in small.items() if k != "model"}))
    except ValueError as e:
        assert "gpt2.bin" in str(e) and "max token id 50256" in str(e) and "--model.vocab-size" in str(e)
    else:
        raise AssertionError("vocab_size 1000 below id 50256 was accepted")
    assert len(list(Path("runs").iterdir())) == 3


def vars_of(model_config):
    return {k: v for k, v in vars(model_config).items() if k in ("seq_len", "num_layers", "embed_dim", "num_heads")}


def test_bad_inputs_leave_no_debris(tmp_path, monkeypatch):
    """Each bad flag, corpus or missing package stops the run before runs/ changes: runs/latest still
    points at the last good run. From the command line: one line naming the flag, exit 1."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "good").mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to("good", target_is_directory=True)
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "tiny.txt").write_text("x = 1\n" * 10)
    for name in [n for n in sys.modules if n == "tensorboard" or n.startswith("tensorboard.")] + ["tensorboard"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    train = load("train_gpt")
    small = ["--model.num-layers", "1", "--model.embed-dim", "32", "--model.seq-len", "32", "--no-progress"]
    bad = {("--steps", "0"): "--steps must be at least 1", ("--batch-size", "0"): "--batch-size must be at least 1",
           ("--checkpoint-dir", "a-file"): "--checkpoint-dir a-file is a file",
           ("--log", "tensorboard"): "--log tensorboard needs the tensorboard package",
           ("--data.corpus", "tiny.txt"): "corpus file tiny.txt is too small: 60 bytes",
           ("--data.corpus", "missing"): "corpus path 'missing' does not exist"}
    for flags, message in bad.items():
        with pytest.raises(ValueError, match=message):
            train.main(train.parse_flags([*small, *flags]))
        assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["good", "latest"], flags
        assert (tmp_path / "runs" / "latest").resolve().name == "good"
    out = subprocess.run([sys.executable, str(RECIPES / "train_gpt.py"), "--steps", "0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip() == "error: --steps must be at least 1, got 0.", out.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["good", "latest"]


def test_nanogpt_folder_trains_with_its_vocabulary_and_samples_characters(tmp_path, capsys):
    """A shakespeare_char-style folder: vocabulary from meta.pkl, validation on val.bin, samples and
    sample.py decode its characters; a prompt outside them is refused by name before training."""
    from test_data import nanogpt_folder

    folder, vocab, _, n_val = nanogpt_folder(tmp_path / "shakespeare_char")
    train, sample = load("train_gpt"), load("sample")
    flags = ["--data.corpus", str(folder), "--model.num-layers", "1", "--model.embed-dim", "32",
             "--model.seq-len", "32", "--steps", "3", "--batch-size", "4", "--eval-windows", "2", "--no-progress",
             "--peak-flops", "1e9", "--sample-tokens", "8", "--sample-prompts", "Before ", "--out-dir"]
    with pytest.raises(ValueError, match=r"--sample-prompts 'Zq': 'Z', 'q' are not in the \d+-character"):
        train.main(train.parse_flags([*flags, str(tmp_path / "bad"), "--sample-prompts", "Zq"]))
    assert not (tmp_path / "bad").exists()
    summary = train.main(train.parse_flags([*flags, str(tmp_path / "run")]))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"]["vocab_size"] == vocab
    assert "0.00M val tokens" in capsys.readouterr().out and n_val < 10_000  # val.bin's
    chars = set("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    assert summary["samples"][0].startswith("Before ") and set(summary["samples"][0]) <= chars
    texts = sample.main(sample.SampleConfig(run_dir=tmp_path / "run", prompt="hear ", max_new_tokens=10, num_samples=1))
    assert texts[0].startswith("hear ") and set(texts[0]) <= chars and len(texts[0]) == 15
    with pytest.raises(ValueError, match=r"'Z' is not in the \d+-character vocabulary"):
        sample.main(sample.SampleConfig(run_dir=tmp_path / "run", prompt="Zounds", max_new_tokens=4, num_samples=1))
