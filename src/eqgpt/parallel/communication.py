"""`CommunicationPart`: the strategy options that reshape collectives, and their checks.

- `Strategy(..., collective_matmul=True)` (`--collective-matmul`): on the manual
  path with sequence parallelism, each tensor-parallel region's all-gather and
  reduce-scatter become rings of `n-1` permutes interleaved with the matmuls
  (`eqgpt.parallel.collective_matmul`).
- `Strategy(..., bucket_mb=M)` (`--bucket-mb M`): the gradient all-reduces eqgpt
  writes itself (the manual path's data-parallel reduction, the pipeline's
  end-of-step reductions) are packed into fp32 buckets of at most `M` MiB
  (`eqgpt.parallel.buckets`).

The manual and pipeline parts read the two fields; this part only refuses what
they cannot run, with a `ValueError` naming the option, before anything compiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxtyping import PyTree

from eqgpt.parallel.buckets import bucket_bytes_of
from eqgpt.parallel.manual import manual_grad_fn
from eqgpt.parallel.part import Part


def bucket_report(strategy: Any, model_like: PyTree) -> str | None:
    """One line for a run's log: the manual path's gradient all-reduces per step, without and
    with `bucket_mb`'s buckets; `None` where the strategy has no buckets or no manual path
    (a pipeline's count is in its compiled program: `eqgpt.profile.collectives`).

    **Arguments:** the `Strategy`, the model or its `jax.eval_shape`.
    """
    if strategy.bucket_mb is None or not strategy.manual:
        return None
    before, after = manual_grad_fn(model_like, strategy.mesh, sequence_parallel=strategy.sequence_parallel,
                                   bucket_bytes=bucket_bytes_of(strategy.bucket_mb)).all_reduce_counts
    return f"gradient all-reduces per step: {before} -> {after} (buckets of at most {strategy.bucket_mb:g} MiB)"


@dataclass(frozen=True)
class CommunicationPart(Part):
    """`collective_matmul` and `bucket_mb`: validated here, run by the manual and pipeline parts."""

    name = "communication"
    needs_mesh = False  # its own messages say what the options need

    @classmethod
    def of(cls, strategy: Any) -> CommunicationPart | None:
        return cls() if strategy.collective_matmul or strategy.bucket_mb is not None else None

    def validate(self, strategy: Any) -> None:
        if strategy.bucket_mb is not None:
            bucket_bytes_of(strategy.bucket_mb)  # > 0
            if not (strategy.manual or strategy.pipeline):
                raise ValueError(
                    "bucket_mb (--bucket-mb) buckets the gradient all-reduces eqgpt writes itself: the manual path's "
                    "(--manual) and a pipeline's (--pipeline). On the automatic path XLA places the gradient "
                    "reduction and its all-reduce combiner merges them (on GPU, "
                    "--xla_gpu_all_reduce_combine_threshold_bytes sets the size); drop --bucket-mb or add --manual.")
        if strategy.collective_matmul:
            mesh = strategy.mesh
            if mesh is None or mesh.shape.get("tensor", 1) < 2:
                raise ValueError("collective_matmul (--collective-matmul) splits the tensor axis's collectives into "
                                 "ring steps; the mesh has no tensor axis > 1: add one, e.g. --mesh data=2,tensor=4.")
            if not strategy.manual:
                raise ValueError("collective_matmul (--collective-matmul) runs on the manual path; add --manual.")
            if not strategy.sequence_parallel:
                raise ValueError("collective_matmul (--collective-matmul) needs sequence parallelism: use 'sp' in "
                                 "--strategy (e.g. dp+sp); plain tp's all-reduce, decomposed, is SP's layout.")

    def check(self, strategy: Any, model_like: PyTree, *, rows: int, seq_len: int) -> None:
        if strategy.collective_matmul:
            n = strategy.mesh.shape["tensor"]
            if seq_len % n:
                raise ValueError(f"collective_matmul (--collective-matmul) splits the sequence into tensor={n} "
                                 f"ring chunks; seq_len {seq_len} is not divisible by {n}: use a multiple of {n}.")

    def describe(self, strategy: Any) -> str:
        pieces = (["collective matmul"] if strategy.collective_matmul else []) + (
            [f"buckets {strategy.bucket_mb:g} MiB"] if strategy.bucket_mb is not None else [])
        return ", ".join(pieces)


__all__ = ["CommunicationPart", "bucket_report"]
