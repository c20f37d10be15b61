"""Manual Megatron tensor parallelism (TP) by swapping leaf layers.

Everything here runs *inside* `jax.shard_map`, on the local blocks of the weights
laid out by `tensor_parallel_specs` (the automatic path's `tp` rules): each device
of the `tensor` axis holds `1/n` of the attention heads, of the MLP width and of
the vocabulary. `tensor_parallel(model, size=n)` swaps **leaf layers only**, and
only for the duration of the traced loss (the stored model never changes):

- a `Linear` whose *output* axis is a tensor-parallel name (`heads`, `kv_heads`,
  `mlp`, `vocab`) becomes a `ColumnParallelLinear`: this device's columns, no
  communication forward;
- a `Linear` whose *input* axis is one becomes a `RowParallelLinear`: a partial
  product, summed by `g` (all-reduce; under SP a reduce-scatter on `seq`), then
  the bias once;
- the vocabulary `Embedding` becomes a `VocabParallelEmbedding` (owned rows, then
  `g`; `attend` gives this device's vocabulary slice of the tied head);
- with fewer kv heads than devices (GQA), `k_proj`/`v_proj` are replicated and
  become `ReplicatedKVLinear`s that compute the one kv head the device's query
  heads read;
- an MoE layer's `Experts` become `TensorParallelExperts` (every expert's hidden
  width split, the partial outputs summed by `g`; not under SP);
- every activation hook becomes a `TensorRegionHook`, which enters the
  tensor-parallel region where a module says so, `self.shard(x, ("batch",
  "inner_seq", "embed"))`: Megatron's `f` (identity forward, all-reduce
  backward), or under SP an all-gather of the sequence shards. Every other hook
  is the identity.

The forward code of `Attention`, `MLP`, `SwiGLU`, `Block`, `GPT` and of a user's
modules built from `eqgpt.nn.Linear` runs unchanged on the local shards.

Megatron's two operators join a replicated activation to a tensor-parallel region:

- `f = copy_to_tensor`: identity forward, all-reduce of the gradient backward;
- `g = reduce_from_tensor`: all-reduce forward, identity backward.

In JAX they are not custom gradients: `f` is `pcast(x, to="varying")` and `g` is
`psum`, and each is the other's transpose under `shard_map`'s varying/invariant
types (see `docs/parallelism/manual.md`). A transformer layer has one `f`/`g`
pair around attention and one around the MLP: 2 all-reduces of `[b, T, D]`
forward and 2 backward. With `sequence_parallel=True`, `f` becomes an all-gather
on `seq` and `g` a reduce-scatter (`eqgpt.parallel.sequence`); with
`collective_matmul=True` too, each is a ring of `n-1` permutes interleaved with
the matmuls (`eqgpt.parallel.collective_matmul`).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, PyTree

from eqgpt.nn.attention import Attention
from eqgpt.nn.axes import REGION_INPUT, ActivationHook, AxisNames, map_constraints
from eqgpt.nn.embedding import Embedding
from eqgpt.nn.linear import Linear, matmul_2d
from eqgpt.nn.loss import chunked_loss_sums
from eqgpt.nn.moe import Experts, MoEStats
from eqgpt.parallel.auto import param_specs, path_str
from eqgpt.parallel.collective_matmul import (
    column_matmul,
    matmul_reduce_scatter,
    ring_all_gather,
    ring_chunks,
)
from eqgpt.parallel.collectives import AxisName, all_reduce, axis_index, axis_size, to_varying
from eqgpt.parallel.rules import TP, Rules
from eqgpt.parallel.sequence import check_sequence_length, gather_sequence, scatter_sequence

#: Logical weight names split over the tensor axis (the `tp` rules).
TENSOR_PARALLEL_NAMES = ("heads", "kv_heads", "mlp", "vocab")

# ------------------------------------------------------------------ Megatron's f and g


def copy_to_tensor(x: PyTree[Array], axis: AxisName) -> PyTree[Array]:
    """Megatron's `f`: identity forward; backward, the gradient is all-reduced over `axis`.

    **Bytes per device:** 0 forward, `2 (n-1)/n * |x|` backward.
    """
    return to_varying(x, axis)


def reduce_from_tensor(x: PyTree[Array], axis: AxisName) -> PyTree[Array]:
    """Megatron's `g`: all-reduce forward; backward, the gradient passes unchanged.

    **Bytes per device:** `2 (n-1)/n * |x|` forward, 0 backward.
    """
    return all_reduce(x, axis)


def enter_region(x: Array, axis: AxisName, sequence_parallel: bool, collective_matmul: bool = False) -> Array:
    """Into a tensor-parallel region: `f`, or under SP an all-gather of the sequence shards
    (with `collective_matmul`, a ring whose chunks the column-parallel layers multiply one by one)."""
    if sequence_parallel and collective_matmul:
        return ring_all_gather(x, axis, dim=1)
    return gather_sequence(x, axis) if sequence_parallel else copy_to_tensor(x, axis)


def exit_region(y: Array, axis: AxisName, sequence_parallel: bool, *, seq_dim: int = 1) -> Array:
    """Out of a tensor-parallel region: `g`, or under SP a reduce-scatter onto sequence shards."""
    return scatter_sequence(y, axis, dim=seq_dim) if sequence_parallel else reduce_from_tensor(y, axis)


def _check_axis(axis: AxisName, size: int, what: str) -> None:
    if axis_size(axis) != size:
        raise ValueError(
            f"{what} was swapped for {size} devices but runs on axis {axis!r} of size "
            f"{axis_size(axis)}; call tensor_parallel with size={axis_size(axis)}."
        )


class TensorRegionHook(ActivationHook):
    """The activation hook of the manual path: enters a tensor-parallel region.

    Called with `REGION_INPUT` names (`("batch", "inner_seq", "embed")`, at the input
    of `Attention`, `MLP`, `SwiGLU`) it applies `f`, or under SP all-gathers the
    sequence (with `collective_matmul`, as a ring of permutes); any other names pass
    `x` through (inside `shard_map` every axis is manual, so there is nothing to constrain).
    """

    axis: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True, default=False)
    collective_matmul: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Array, names: AxisNames) -> Array:
        if x.ndim != len(names):
            raise ValueError(f"activation of shape {x.shape} given {len(names)} axis names {names}.")
        if tuple(names) == REGION_INPUT:
            return enter_region(x, self.axis, self.sequence_parallel, self.collective_matmul)
        return x


# ---------------------------------------------------------------- linear layers


def _check_whole_sequence(x: Array, seq_len: int | None, where: str) -> None:
    """Under SP a column-parallel layer must see the whole sequence: its module entered the region."""
    if seq_len is None or x.ndim < 3 or x.shape[-2] == seq_len:
        return
    module = where.rpartition(".")[0] or "its module"
    raise ValueError(
        f"{where}: this column-parallel Linear got {x.shape[-2]} positions but the sequence has {seq_len}: "
        f"`{module}` never entered its tensor-parallel region. Under sequence parallelism the residual "
        "stream holds only this device's slice of the sequence, and a region starts by gathering it: call "
        f'`x = self.shard(x, ("batch", "inner_seq", "embed"))` at the input of `{module}` (a field '
        "`shard: eqgpt.nn.ActivationHook` holding `NoConstraint()`; one device and the automatic path are "
        "unchanged), or train without sequence parallelism (drop `sp`)."
    )


def _no_int8_ring(linear: Linear) -> None:
    """Collective matmul's rings multiply in the compute dtype: refuse an int8 layer there."""
    if linear.quant is not None:
        raise ValueError("--precision int8 does not run with --collective-matmul yet; drop one of them.")


class ColumnParallelLinear(eqx.Module):
    """A `Linear` whose output features are split over `axis`: `y_i = f(x) @ W[:, cols_i] + b_i`.

    The input is whole on every device (the region was entered); each device
    computes its own output columns; no forward communication. Backward, `f`
    all-reduces the input gradient (a no-op here if the region's hook already
    applied it, so q, k and v share one all-reduce). Under SP, `seq_len` is the
    whole sequence length the input must have (else a `ValueError` naming `where`).
    An input gathered by a collective-matmul ring is multiplied chunk by chunk.
    """

    linear: Linear
    axis: str = eqx.field(static=True)
    where: str = eqx.field(static=True, default="")
    seq_len: int | None = eqx.field(static=True, default=None)

    def vocab_start(self) -> Int[Array, ""]:
        """First output column this device holds (its first vocabulary id, for an output head)."""
        return axis_index(self.axis) * self.linear.weight.shape[-1]

    def __call__(self, x: Float[Array, "*batch in_features"]) -> Float[Array, "*batch out_shard"]:
        """**Arguments:** `x`, whole. **Returns:** this device's output columns."""
        _check_whole_sequence(x, self.seq_len, self.where)
        if ring_chunks(x) is None:
            return self.linear(copy_to_tensor(x, self.axis))
        _no_int8_ring(self.linear)
        y = column_matmul(x, self.linear.weight.astype(x.dtype), self.axis, dim=x.ndim - 2)
        return y if self.linear.bias is None else y + self.linear.bias.astype(y.dtype)


class RowParallelLinear(eqx.Module):
    """A `Linear` whose input features are split over `axis`: `y = g(sum_i x_i @ W[rows_i, :]) + b`.

    Each device multiplies its slice of the input features by its rows of the
    weight, giving a partial sum of the output; `g` (or, under SP, a
    reduce-scatter on `seq`, the dimension before the features) adds the
    partials. The bias is added once, after the sum. With `collective_matmul` (SP
    only) the matmul and the reduce-scatter run as one ring (`matmul_reduce_scatter`).
    """

    linear: Linear
    axis: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True, default=False)
    collective_matmul: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Float[Array, "*batch in_shard"]) -> Float[Array, "... out_features"]:  # SP: seq/n
        """**Arguments:** `x`, this device's input features. **Returns:** the full output
        (under SP this device's sequence shard of it)."""
        w = self.linear.weight.astype(x.dtype)
        if self.collective_matmul:
            _no_int8_ring(self.linear)
            y = matmul_reduce_scatter(x, w, self.axis, dim=x.ndim - 2)
        else:
            quant = self.linear.quant and dataclasses.replace(self.linear.quant, axis=self.axis)  # whole-row scales
            y = exit_region(matmul_2d(x, w, quant), self.axis, self.sequence_parallel, seq_dim=x.ndim - 2)
        if self.linear.bias is not None:
            y = y + self.linear.bias.astype(y.dtype)
        return y


def kv_replicated(num_kv_heads: int, size: int) -> bool:
    """Whether GQA keeps whole kv heads on every device (fewer kv heads than devices)."""
    return num_kv_heads < size


class ReplicatedKVLinear(eqx.Module):
    """`k_proj`/`v_proj` of an `Attention` with fewer kv heads than devices (GQA).

    Every device holds the whole weight and computes only the kv head its query
    heads read: group `index // (n / kv_heads)`, at a device-dependent column
    offset. The weight passes through `f`, so its gradient is all-reduced over
    `axis` (each device contributes the slice it used).
    """

    linear: Linear
    axis: str = eqx.field(static=True)
    size: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    where: str = eqx.field(static=True, default="")
    seq_len: int | None = eqx.field(static=True, default=None)

    def __call__(self, x: Float[Array, "*batch in_features"]) -> Float[Array, "*batch head_dim"]:
        """**Arguments:** `x`, whole. **Returns:** the one kv head of this device's query heads."""
        _check_axis(self.axis, self.size, self.where or "ReplicatedKVLinear")
        _check_whole_sequence(x, self.seq_len, self.where)
        start = axis_index(self.axis) // (self.size // self.num_kv_heads) * self.head_dim
        lin = copy_to_tensor(self.linear, self.axis)
        w = jax.lax.dynamic_slice_in_dim(lin.weight, start, self.head_dim, axis=-1)
        y = matmul_2d(copy_to_tensor(x, self.axis), w.astype(x.dtype), lin.quant)
        if lin.bias is not None:
            y = y + jax.lax.dynamic_slice_in_dim(lin.bias, start, self.head_dim).astype(y.dtype)
        return y


class TensorParallelExperts(eqx.Module):
    """An MoE layer's `Experts` with every expert's hidden width split over `axis`.

    Each device holds columns `cols_i` of every expert's `up` (and `gate`) and the
    matching rows of `down`, so it computes a partial output for every dispatched
    slot (or grouped row), and `g` sums the partials: one all-reduce of the
    dispatched tensor per layer forward (`E * capacity` slots per row, or `top_k`
    rows per token dropless); backward, as for an MLP, the region's entry all-reduces
    the input's gradient. The router is replicated and reads the layer's input before
    its region starts, so every device routes alike.
    """

    experts: Experts
    axis: str = eqx.field(static=True)

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def __call__(self, x: Float[Array, "experts *slots embed"]) -> Float[Array, "experts *slots embed"]:
        """**Arguments:** every expert's slots, whole. **Returns:** every expert's output, whole."""
        return reduce_from_tensor(self.experts(copy_to_tensor(x, self.axis)), self.axis)

    def grouped(self, x: Float[Array, "rows embed"], group_sizes: Int[Array, " experts"]) -> Float[Array, "rows embed"]:
        """As `Experts.grouped`, on this device's share of the width, the partials summed."""
        return reduce_from_tensor(self.experts.grouped(copy_to_tensor(x, self.axis), group_sizes), self.axis)


# -------------------------------------------------------------------- embeddings


class VocabParallelEmbedding(eqx.Module):
    """A token `Embedding` whose rows (the vocabulary) are split over `axis`.

    Device `i` holds rows `[i V/n, (i+1) V/n)`. Lookup: each device returns its
    rows for the ids it owns and zeros for the rest, and `g` sums them; under SP
    a reduce-scatter on the sequence (the ids' last dimension) both sums them and
    leaves this device's sequence shard, the residual stream's layout. `attend`
    is the tied output head: the logits of this device's vocabulary slice.
    """

    embed: Embedding
    axis: str = eqx.field(static=True)
    size: int = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True, default=False)

    @property
    def shard_size(self) -> int:
        return self.embed.num // self.size

    def vocab_start(self) -> Int[Array, ""]:
        """First vocabulary id held by this device."""
        return axis_index(self.axis) * self.shard_size

    def __call__(self, ids: Int[Array, "*batch seq"]) -> Float[Array, "*batch seq_out dim"]:
        """**Arguments:** whole token ids. **Returns:** their embeddings (under SP, this
        device's sequence shard of them)."""
        _check_axis(self.axis, self.size, "VocabParallelEmbedding")
        local = ids - self.vocab_start()
        owned = (local >= 0) & (local < self.shard_size)
        rows = jnp.take(self.embed.weight, jnp.clip(local, 0, self.shard_size - 1), axis=0)
        rows = jnp.where(owned[..., None], rows, jnp.zeros_like(rows))
        return exit_region(rows, self.axis, self.sequence_parallel, seq_dim=ids.ndim - 1)

    def attend(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch vocab_shard"]:
        """Tied-head logits for this device's vocabulary slice: `f(x) @ W_i.T`.

        `x` must hold every position the logits are wanted for (under SP, gather first).
        """
        return matmul_2d(copy_to_tensor(x, self.axis), self.embed.weight.astype(x.dtype).T)


class SequenceShardEmbedding(eqx.Module):
    """Under SP, a non-vocabulary `Embedding` (learned positions) looks up this device's slice.

    The residual stream holds a sequence shard, so the rows added to it are those
    of this device's positions: the ids' last dimension is sliced (no
    communication). The table is whole on every device; its gradient is summed
    over `axis` by `manual_grad_fn`.
    """

    embed: Embedding
    axis: str = eqx.field(static=True)

    def __call__(self, ids: Int[Array, "*batch seq"]) -> Float[Array, "*batch seq_shard dim"]:
        """**Arguments:** whole ids (e.g. positions `0..T-1`). **Returns:** embeddings of this device's slice."""
        n = axis_size(self.axis)
        check_sequence_length(ids.shape[-1], n)
        size = ids.shape[-1] // n
        return self.embed(jax.lax.dynamic_slice_in_dim(ids, axis_index(self.axis) * size, size, axis=ids.ndim - 1))


# ------------------------------------------------------------------------- loss


def vocab_parallel_cross_entropy(
    logits: Float[Array, "*batch vocab_shard"],
    targets: Int[Array, "*batch"],
    vocab_start: Int[Array, ""],
    axis: AxisName,
) -> tuple[Float[Array, "*batch"], Float[Array, "*batch"]]:
    """Cross-entropy from vocabulary-sharded logits, without gathering them.

    `lse = m + log(sum_i sum_v exp(l_v - m))` with `m` the all-reduced maximum;
    the target logit is taken by the one device that owns the target id and
    all-reduced. Three all-reduces of `[*batch]` floats (max, sum, target logit)
    instead of an all-gather of `[*batch, V]`. Computed in fp32.

    **Arguments:** this device's `logits` slice, global `targets`, the slice's
    first id `vocab_start`, and the `axis` the vocabulary is split over.

    **Returns:** `(nll, lse)` per position, invariant over `axis`.
    """
    logits = logits.astype(jnp.float32)
    shard = logits.shape[-1]
    m = all_reduce(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), axis, op="max")
    sum_exp = all_reduce(jnp.sum(jnp.exp(logits - m[..., None]), axis=-1), axis)
    lse = m + jnp.log(sum_exp)
    local = targets - vocab_start
    owned = (local >= 0) & (local < shard)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, shard - 1)[..., None], axis=-1)[..., 0]
    picked = all_reduce(jnp.where(owned, picked, 0.0), axis)
    return lse - picked, lse


def vocab_parallel_loss_sums(
    model,
    tokens: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    *,
    loss_mask: Float[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    chunk_size: int = 128,
    axis: str = "tensor",
    sequence_parallel: bool = False,
) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""], MoEStats | None]:
    """Sums of the next-token NLL and of `lse^2`, the token count and MoE statistics, of a swapped model.

    Runs inside `shard_map` on a model returned by `tensor_parallel`, read through
    the `eqgpt.nn.LanguageModel` protocol (`embed`, `run_blocks`, `norm`,
    `logits`). The model sees the whole `tokens` and positions (under SP its
    vocabulary embedding reduce-scatters onto this device's sequence shard, and
    attention gathers the sequence where its region starts); the final hidden
    states enter the head's region once (`f`, or under SP an all-gather). Logits
    exist only as `[batch, chunk, V/n]` slabs, one chunk of positions at a time
    (as `eqgpt.nn.lm_loss`), and never leave this device.

    **Arguments:** the swapped `model`, the whole `tokens`/`targets` (and optional
    `loss_mask`, `segment_ids`) of this device's rows, `chunk_size`, the tensor
    `axis` and whether the model was swapped for `sequence_parallel`.

    **Returns:** `(nll_sum, z_sum, count, stats)` over the rows, invariant over the tensor
    axis; `stats` are the MoE router statistics of the rows (`None` for a dense model).
    """
    positions = jnp.arange(tokens.shape[1])
    x = model.embed(tokens, positions)
    x, stats = model.run_blocks_with_stats(x, positions, segment_ids)
    hidden = model.norm(x)
    hidden = enter_region(hidden, axis, sequence_parallel)

    def cross_entropy(logits, y):
        return vocab_parallel_cross_entropy(logits, y, axis_index(axis) * logits.shape[-1], axis)

    sums = chunked_loss_sums(model.logits, hidden, targets, loss_mask=loss_mask, chunk_size=chunk_size,
                             cross_entropy=cross_entropy)
    return (*sums, stats)


# ------------------------------------------------------------------ swapping


def _tp_name(name) -> bool:
    return name in TENSOR_PARALLEL_NAMES


def _is_vocab_embedding(m) -> bool:
    return isinstance(m, Embedding) and m.axes[0] == "vocab"


_WHAT = {"heads": "attention width (heads)", "kv_heads": "kv width (kv heads)", "mlp": "MLP width",
         "vocab": "vocabulary"}
_FIX = {"mlp": "choose mlp_dim (hidden width) divisible by {size}",
        "vocab": "set vocab_pad_multiple to a multiple of {size}"}


def check_tensor_parallel(module: PyTree, size: int) -> None:
    """Raise `ValueError`, naming the module, if `module`'s heads, kv heads, MLP width or
    vocabulary (any weight dimension with a tensor-parallel logical name) do not split over `size`.

    Works on concrete and abstract (`eqx.filter_eval_shape`) models and on any part of one.
    """
    if size < 1:
        raise ValueError(f"tensor-parallel size must be positive, got {size}.")
    is_leaf = lambda x: isinstance(x, Attention | Linear | Embedding | Experts)  # noqa: E731
    for path, m in jax.tree_util.tree_flatten_with_path(module, is_leaf=is_leaf)[0]:
        where = path_str(path) or type(m).__name__
        if isinstance(m, Experts):
            if m.up.shape[-1] % size:
                raise ValueError(f"{where}: expert width {m.up.shape[-1]} does not split over {size} "
                                 f"tensor-parallel devices; choose expert_dim divisible by {size}.")
            continue
        if isinstance(m, Attention):
            if m.num_heads % size:
                raise ValueError(
                    f"{where}: {m.num_heads} attention heads do not split over {size} tensor-parallel "
                    f"devices; use a tensor axis that divides {m.num_heads}."
                )
            kv = m.num_kv_heads
            if (kv >= size and kv % size) or (kv < size and size % kv):
                raise ValueError(
                    f"{where}: {kv} kv heads neither split over {size} devices nor divide {size} "
                    "(for replication); use a tensor axis that divides or is a multiple of the kv heads."
                )
            continue  # its projections split by whole heads, as checked
        if not isinstance(m, Linear | Embedding):
            continue
        for name, dim in zip(m.axes, m.weight.shape[-2:], strict=True):
            if _tp_name(name) and dim % size:
                fix = _FIX.get(name, "use a tensor axis that divides it").format(size=size)
                raise ValueError(f"{where}: {_WHAT[name]} {dim} does not split over {size} tensor-parallel "
                                 f"devices; {fix}.")


def tensor_parallel(
    module: PyTree,
    *,
    size: int,
    axis: str = "tensor",
    sequence_parallel: bool = False,
    seq_len: int | None = None,
    collective_matmul: bool = False,
) -> PyTree:
    """`module` with its leaf layers swapped for tensor-parallel forms, to run inside `shard_map`.

    Swaps (see the module docs): column-parallel `Linear`s (output axis `heads`,
    `kv_heads`, `mlp` or `vocab`), row-parallel `Linear`s (input axis one of
    those), the vocabulary `Embedding`, replicated kv projections of an
    `Attention` with fewer kv heads than `size`, and every activation hook
    (`TensorRegionHook`). Under SP also every other `Embedding` (positions: this
    device's slice). Nothing else changes: the forward code of every module runs
    as written, on the local blocks of weights laid out by `tensor_parallel_specs`.

    **Arguments:**

    - `module`: the model or any part of it (whole arrays or local blocks: only
      static sizes are read here).
    - `size`: devices on the tensor axis; `axis`: its mesh axis name.
    - `sequence_parallel`: the residual stream is split on `seq` (Megatron SP).
    - `seq_len`: under SP, the whole sequence length; a column-parallel layer fed
      anything else (a module that never entered its region) raises a
      `ValueError` naming it.
    - `collective_matmul`: under SP, each region's all-gather and reduce-scatter run
      as rings of permutes interleaved with the matmuls (`eqgpt.parallel.collective_matmul`).

    **Returns:** the swapped module. Raises `ValueError` when sizes do not split.
    """
    check_tensor_parallel(module, size)
    if collective_matmul and not sequence_parallel:
        raise ValueError("collective_matmul splits sequence parallelism's all-gather and reduce-scatter into ring "
                         "steps; it needs sequence_parallel=True (use 'sp' in --strategy, e.g. dp+sp).")
    if sequence_parallel and seq_len is None:
        raise ValueError("tensor_parallel(..., sequence_parallel=True) needs seq_len, the whole sequence length "
                         "(column-parallel layers check that their region gathered it).")
    check = seq_len if sequence_parallel else None

    def swap_kv(path, m):
        if not (isinstance(m, Attention) and kv_replicated(m.num_kv_heads, size)):
            return m
        where = path_str(path)
        kv = lambda lin, name: ReplicatedKVLinear(  # noqa: E731
            lin, axis, size, m.num_kv_heads, m.head_dim, f"{where}.{name}".lstrip("."), check)
        return eqx.tree_at(lambda a: (a.k_proj, a.v_proj), m, (kv(m.k_proj, "k_proj"), kv(m.v_proj, "v_proj")))

    def swap_leaf(path, m):
        if isinstance(m, Linear):
            if _tp_name(m.axes[1]):
                return ColumnParallelLinear(m, axis, path_str(path), None if m.axes[1] == "vocab" else check)
            if _tp_name(m.axes[0]):
                return RowParallelLinear(m, axis, sequence_parallel, collective_matmul)
        elif isinstance(m, Experts):
            if sequence_parallel:
                raise ValueError(f"{path_str(path)}: MoE experts run on the manual path without sequence "
                                 "parallelism only (their router needs the whole sequence); use dp+tp, not sp.")
            return TensorParallelExperts(m, axis)
        elif _is_vocab_embedding(m):
            return VocabParallelEmbedding(m, axis, size, sequence_parallel)
        elif isinstance(m, Embedding) and sequence_parallel:
            return SequenceShardEmbedding(m, axis)
        return m

    module = jax.tree_util.tree_map_with_path(swap_kv, module, is_leaf=lambda x: isinstance(x, Attention))
    leaf = lambda x: isinstance(x, Linear | Embedding | ReplicatedKVLinear | Experts)  # noqa: E731
    module = jax.tree_util.tree_map_with_path(swap_leaf, module, is_leaf=leaf)
    return map_constraints(module, lambda _path, _hook: TensorRegionHook(axis, sequence_parallel, collective_matmul))


def tensor_parallel_specs(module: PyTree, mesh: Mesh, *, axis: str = "tensor") -> PyTree:
    """`PartitionSpec`s of `module`'s arrays for `tensor_parallel`: the automatic path's `tp` rules.

    `heads`, `kv_heads`, `mlp`, `vocab` over `axis`; kv projections are replicated
    whenever there are fewer kv heads than devices (the rules split whole heads
    only), which is where `tensor_parallel` swaps in `ReplicatedKVLinear`.

    **Arguments:** `module` (concrete or abstract), `mesh`, `axis`.

    **Returns:** the module's structure with a `PartitionSpec` at each array leaf.
    """
    check_tensor_parallel(module, mesh.shape[axis])
    rules = TP if axis == "tensor" else Rules(params={n: axis for n in TENSOR_PARALLEL_NAMES})
    return param_specs(module, rules, mesh=mesh)


__all__ = [
    "TENSOR_PARALLEL_NAMES", "REGION_INPUT", "copy_to_tensor", "reduce_from_tensor", "enter_region", "exit_region",
    "TensorRegionHook", "TensorParallelExperts", "ColumnParallelLinear", "RowParallelLinear", "ReplicatedKVLinear",
    "kv_replicated",
    "VocabParallelEmbedding", "SequenceShardEmbedding", "vocab_parallel_cross_entropy", "vocab_parallel_loss_sums",
    "check_tensor_parallel", "tensor_parallel", "tensor_parallel_specs",
]
