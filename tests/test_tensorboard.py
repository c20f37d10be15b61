"""`--log tensorboard`: a short run's event file, read back with TensorBoard's own reader."""

import math

import pytest

from recipe_runs import TINY, load_recipe, run_recipe, write_documents

pytest.importorskip("tensorboard")


def test_tensorboard_scalars_at_every_logged_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from eqgpt.train.logging import read_scalars

    corpus = write_documents(tmp_path / "docs")
    out = tmp_path / "run"
    rows = run_recipe(load_recipe(), [*TINY, "--steps", "6", "--data.corpus", str(corpus), "--data.cache-dir",
                                      str(tmp_path / "cache"), "--data.val-percent", "20", "--out-dir", str(out),
                                      "--log", "tensorboard", "--sample-tokens", "8", "--data.mode", "packed"])
    got = read_scalars(out / "tb")
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for key, tag in [("loss", "train/loss"), ("lr", "train/learning_rate"), ("grad_norm", "train/grad_norm"),
                     ("tokens_per_s", "perf/tokens_per_s"), ("mfu", "perf/mfu")]:
        logged = {r["step"]: r[key] for r in train if key in r}
        assert logged, key
        assert set(got[tag]) == set(logged), tag  # each scalar at each logged step
        for step, value in logged.items():
            assert got[tag][step] == pytest.approx(value, rel=1e-6), (tag, step)
    vals = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert set(got["val/loss_nats"]) == set(vals) == {0, 5, 6}
    for step, v in vals.items():
        assert got["val/bits_per_byte"][step] == pytest.approx(v / math.log(2), rel=1e-6)
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert {"samples/0", "samples/1", "samples/2"} <= set(acc.Tags()["tensors"])  # the samples as text
    # metrics.jsonl is still written; only process 0 writes events (one process here).
    assert (out / "metrics.jsonl").is_file() and len(list((out / "tb").glob("events.out.tfevents.*"))) == 1
