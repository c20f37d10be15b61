"""The recipes run end to end on a tiny corpus and write their outputs."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def load(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_train_then_sample(tmp_path):
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
    texts = load("sample").main(load("sample").SampleConfig(run_dir=out, prompt="def ", max_new_tokens=5, num_samples=1))
    assert len(texts) == 1 and texts[0].startswith("def ")


def test_help_documents_options():
    out = subprocess.run([sys.executable, str(RECIPES / "train_gpt.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--steps", "--batch-size", "--data.corpus", "--optim.lr", "--model.preset", "--out-dir"):
        assert flag in out.stdout
    assert "Peak learning rate" in out.stdout
