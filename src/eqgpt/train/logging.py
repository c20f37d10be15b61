"""Metric sinks beside the always-on `metrics.jsonl`: TensorBoard event files.

`TensorBoardWriter` writes scalars and text with TensorBoard's own event-file
writer and protocol buffers (`pip install 'eqgpt[tensorboard]'`); TensorFlow is
not needed, and `tensorboard --logdir OUT/tb` reads the files. Only process 0
writes: on other processes `make_writer` returns `None`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

LogKind = Literal["jsonl", "tensorboard"]

# metrics.jsonl keys -> TensorBoard tags (anything else numeric goes under "train/").
TAGS = {
    "loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "val_loss": "val/loss_nats",
    "time": "perf/seconds", "skipped_total": "train/skipped_steps",
}


class TensorBoardWriter:
    """Scalars and text as TensorBoard events in `logdir`."""

    def __init__(self, logdir: str | Path, *, bytes_per_token: float = 1.0):
        check_tensorboard()
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.logdir = Path(logdir)
        self.bytes_per_token = bytes_per_token
        self._writer = EventFileWriter(str(logdir))

    def _event(self, step: int, summary) -> None:
        import time

        from tensorboard.compat.proto.event_pb2 import Event

        self._writer.add_event(Event(wall_time=time.time(), step=int(step), summary=summary))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event holding every value; `val_loss` also as bits per byte (`val/bits_per_byte`)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        tags = {TAGS.get(k, f"train/{k}"): float(v) for k, v in values.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        tags.pop("train/val_bpb", None)
        if "val_bpb" in values:
            tags["val/bits_per_byte"] = float(values["val_bpb"])
        elif "val_loss" in values:
            tags["val/bits_per_byte"] = float(values["val_loss"]) / math.log(2) / self.bytes_per_token
        self._event(step, Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in tags.items()]))
        self._writer.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        """Text (e.g. samples) shown in TensorBoard's text tab."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(dtype=7, string_val=[text.encode("utf-8")],  # DT_STRING
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        self._event(step, Summary(value=[Summary.Value(tag=tag, metadata=meta, tensor=tensor)]))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def check_tensorboard() -> None:
    """**Raises** `ValueError` naming the install command when the tensorboard package is missing."""
    try:
        from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: F401
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
    except ImportError as e:
        raise ValueError("--log tensorboard needs the tensorboard package: pip install 'eqgpt[tensorboard]'.") from e


def make_writer(kind: LogKind, out_dir: str | Path | None, *, is_main: bool = True) -> TensorBoardWriter | None:
    """A `TensorBoardWriter` in `out_dir/tb` for `kind="tensorboard"` on process 0; else `None`."""
    if kind not in ("jsonl", "tensorboard"):
        raise ValueError(f"--log must be 'jsonl' or 'tensorboard', got {kind!r}.")
    if kind == "jsonl" or not is_main:
        return None
    if out_dir is None:
        raise ValueError("--log tensorboard needs an output directory (out_dir).")
    return TensorBoardWriter(Path(out_dir) / "tb")


def read_scalars(logdir: str | Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files in `logdir`, `{tag: {step: value}}`, via TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


__all__ = ["LogKind", "TensorBoardWriter", "make_writer", "read_scalars", "TAGS"]
