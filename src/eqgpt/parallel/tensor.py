"""Manual Megatron tensor parallelism (TP): wrappers around `eqgpt.nn` modules.

Everything here runs *inside* `jax.shard_map`, on the local blocks of the weights
laid out by `tensor_parallel_specs` (the automatic path's `tp` rules): each device
of the `tensor` axis holds `1/n` of the attention heads, of the MLP width and of
the vocabulary. The model code is unchanged: `tensor_parallel(model, size=n)`
swaps its `Attention`, `MLP`/`SwiGLU`, token `Embedding` and vocabulary head for
wrappers holding the very same modules, whose forward passes say every collective.

Megatron's two operators join a replicated activation to a tensor-parallel region:

- `f = copy_to_tensor`: identity forward, all-reduce of the gradient backward;
- `g = reduce_from_tensor`: all-reduce forward, identity backward.

In JAX they are not custom gradients: `f` is `pcast(x, to="varying")` and `g` is
`psum`, and each is the other's transpose under `shard_map`'s varying/invariant
types (see `docs/parallelism/manual.md`). A transformer layer has one `f`/`g`
pair around attention and one around the MLP: 2 all-reduces of `[b, T, D]`
forward and 2 backward. With `sequence_parallel=True`, `f` becomes an all-gather
on `seq` and `g` a reduce-scatter (`eqgpt.parallel.sequence`).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float, Int, PyTree

from eqgpt.nn.attention import Attention
from eqgpt.nn.embedding import Embedding
from eqgpt.nn.kernels import get_kernel
from eqgpt.nn.linear import Linear
from eqgpt.nn.loss import chunked_loss_sums
from eqgpt.nn.mlp import MLP, SwiGLU
from eqgpt.nn.rope import apply_rope
from eqgpt.parallel.collectives import (
    AxisName,
    all_gather,
    all_reduce,
    axis_index,
    axis_size,
    to_varying,
)
from eqgpt.parallel.rules import TP, Rules
from eqgpt.parallel.sequence import gather_sequence, scatter_sequence, shard_sequence
from eqgpt.parallel.shard import path_str
from eqgpt.parallel.shard_map import specs_from_rules

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


def enter_region(x: Array, axis: AxisName, sequence_parallel: bool) -> Array:
    """Into a tensor-parallel region: `f`, or under SP an all-gather of the sequence shards."""
    return gather_sequence(x, axis) if sequence_parallel else copy_to_tensor(x, axis)


def exit_region(y: Array, axis: AxisName, sequence_parallel: bool) -> Array:
    """Out of a tensor-parallel region: `g`, or under SP a reduce-scatter onto sequence shards."""
    return scatter_sequence(y, axis) if sequence_parallel else reduce_from_tensor(y, axis)


def _check_axis(axis: AxisName, size: int, what: str) -> None:
    if axis_size(axis) != size:
        raise ValueError(
            f"{what} was wrapped for {size} devices but runs on axis {axis!r} of size "
            f"{axis_size(axis)}; wrap it with size={axis_size(axis)}."
        )


# ---------------------------------------------------------------- linear layers


class ColumnParallelLinear(eqx.Module):
    """A `Linear` whose output features are split over `axis`: `y_i = f(x) @ W[:, cols_i] + b_i`.

    The input is whole on every device; each device computes its own output
    columns; no forward communication. Backward, `f` all-reduces the input gradient.
    """

    linear: Linear
    axis: str = eqx.field(static=True)

    def __call__(self, x: Float[Array, "*batch in_features"]) -> Float[Array, "*batch out_shard"]:
        """**Arguments:** `x`, whole. **Returns:** this device's output columns."""
        return self.linear(copy_to_tensor(x, self.axis))


class RowParallelLinear(eqx.Module):
    """A `Linear` whose input features are split over `axis`: `y = g(sum_i x_i @ W[rows_i, :]) + b`.

    Each device multiplies its slice of the input features by its rows of the
    weight, giving a partial sum of the output; `g` (or, under SP, a
    reduce-scatter) adds the partials. The bias is added once, after the sum.
    """

    linear: Linear
    axis: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Float[Array, "*batch in_shard"]) -> Float[Array, "*batch out_features"]:
        """**Arguments:** `x`, this device's input features. **Returns:** the full output."""
        partial = jnp.matmul(x, self.linear.weight.astype(x.dtype))
        y = exit_region(partial, self.axis, self.sequence_parallel)
        if self.linear.bias is not None:
            y = y + self.linear.bias.astype(y.dtype)
        return y


# --------------------------------------------------------------------- attention


def kv_replicated(num_kv_heads: int, size: int) -> bool:
    """Whether GQA keeps whole kv heads on every device (fewer kv heads than devices)."""
    return num_kv_heads < size


class TensorParallelAttention(eqx.Module):
    """`Attention` with its heads split over `axis` (Megatron).

    Device `i` holds query heads `[i h/n, (i+1) h/n)`: columns of `q_proj`, rows
    of `o_proj`. Key/value heads are split the same way when there are at least
    `n` of them; with fewer (GQA, `n % kv_heads == 0`) each device keeps all of
    `k_proj`/`v_proj` and computes only the one kv head its query heads read, at
    a device-dependent offset; that weight goes through `f`, so its gradient is
    all-reduced over `axis`.
    """

    attn: Attention
    axis: str = eqx.field(static=True)
    size: int = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True, default=False)

    def _kv(self, lin: Linear, x: Array) -> Array:
        a = self.attn
        if not kv_replicated(a.num_kv_heads, self.size):
            return ColumnParallelLinear(lin, self.axis)(x)
        group = axis_index(self.axis) // (self.size // a.num_kv_heads)
        w = copy_to_tensor(lin.weight, self.axis)
        w = jax.lax.dynamic_slice_in_dim(w, group * a.head_dim, a.head_dim, axis=-1)
        y = jnp.matmul(x, w.astype(x.dtype))
        if lin.bias is not None:
            b = jax.lax.dynamic_slice_in_dim(copy_to_tensor(lin.bias, self.axis), group * a.head_dim, a.head_dim)
            y = y + b.astype(y.dtype)
        return y

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """**Arguments:** as `Attention`: activations (a sequence shard under SP), global
        `positions`, optional `segment_ids`. **Returns:** the output, shaped like `x`."""
        _check_axis(self.axis, self.size, "TensorParallelAttention")
        a, n = self.attn, self.size
        if positions is None:
            positions = jnp.arange(x.shape[1]) + (axis_index(self.axis) * x.shape[1] if self.sequence_parallel else 0)
        if self.sequence_parallel:
            positions = all_gather(positions, self.axis)
            if segment_ids is not None:
                segment_ids = gather_sequence(segment_ids, self.axis)
        x = enter_region(x, self.axis, self.sequence_parallel)
        b, t, _ = x.shape
        heads = a.num_heads // n
        kv_heads = 1 if kv_replicated(a.num_kv_heads, n) else a.num_kv_heads // n
        q = checkpoint_name(ColumnParallelLinear(a.q_proj, self.axis)(x), "query_proj")
        k = checkpoint_name(self._kv(a.k_proj, x), "key_proj")
        v = checkpoint_name(self._kv(a.v_proj, x), "value_proj")
        q = q.reshape(b, t, heads, a.head_dim)
        k = k.reshape(b, t, kv_heads, a.head_dim)
        v = v.reshape(b, t, kv_heads, a.head_dim)
        if a.rope_theta is not None:
            q = apply_rope(q, positions, a.rope_theta)
            k = apply_rope(k, positions, a.rope_theta)
        o = get_kernel(a.kernel)(
            q, k, v, mask=a.mask, q_pos=positions, k_pos=positions, q_seg=segment_ids, k_seg=segment_ids
        )
        out = RowParallelLinear(a.o_proj, self.axis, self.sequence_parallel)(o.reshape(b, t, heads * a.head_dim))
        return checkpoint_name(out, "attn_out")


# --------------------------------------------------------------------------- MLP


class TensorParallelMLP(eqx.Module):
    """`MLP` or `SwiGLU` with its hidden width split over `axis`.

    Up (and gate) projections are column-parallel, the down projection is
    row-parallel; the elementwise activation needs no communication.
    """

    mlp: MLP | SwiGLU
    axis: str = eqx.field(static=True)
    size: int = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        """**Arguments:** activations (a sequence shard under SP). **Returns:** the output, shaped like `x`."""
        _check_axis(self.axis, self.size, "TensorParallelMLP")
        m = self.mlp
        x = enter_region(x, self.axis, self.sequence_parallel)
        if isinstance(m, SwiGLU):
            g = checkpoint_name(ColumnParallelLinear(m.gate, self.axis)(x), "mlp_in")
            u = checkpoint_name(ColumnParallelLinear(m.up, self.axis)(x), "mlp_in")
            h = jax.nn.silu(g) * u
        else:
            h = jax.nn.gelu(checkpoint_name(ColumnParallelLinear(m.up, self.axis)(x), "mlp_in"), approximate=True)
        y = RowParallelLinear(m.down, self.axis, self.sequence_parallel)(h)
        return checkpoint_name(y, "mlp_out")


# -------------------------------------------------------------------- vocabulary


class VocabParallelEmbedding(eqx.Module):
    """A token `Embedding` whose rows (the vocabulary) are split over `axis`.

    Device `i` holds rows `[i V/n, (i+1) V/n)`. Lookup: each device returns its
    rows for the ids it owns and zeros for the rest, and `g` (under SP, a
    reduce-scatter on `seq`) sums them. `attend` is the tied output head: the
    logits of this device's vocabulary slice.
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

    def __call__(self, ids: Int[Array, "batch seq"]) -> Float[Array, "batch seq dim"]:
        """**Arguments:** token ids (a sequence shard under SP). **Returns:** their embeddings."""
        _check_axis(self.axis, self.size, "VocabParallelEmbedding")
        if self.sequence_parallel:
            ids = all_gather(ids, self.axis, dim=1)  # int32 ids: b*T*4 bytes
        local = ids - self.vocab_start()
        owned = (local >= 0) & (local < self.shard_size)
        rows = jnp.take(self.embed.weight, jnp.clip(local, 0, self.shard_size - 1), axis=0)
        rows = jnp.where(owned[..., None], rows, jnp.zeros_like(rows))
        return exit_region(rows, self.axis, self.sequence_parallel)

    def attend(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch vocab_shard"]:
        """Tied-head logits for this device's vocabulary slice: `f(x) @ W_i.T`.

        `x` must hold every position the logits are wanted for (under SP, gather first).
        """
        return jnp.matmul(copy_to_tensor(x, self.axis), self.embed.weight.astype(x.dtype).T)


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
) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]:
    """Sums of the next-token NLL and of `lse^2`, and the token count, of a wrapped GPT.

    Runs inside `shard_map` on a `tensor_parallel` GPT. Logits exist only as
    `[batch, chunk, V/n]` slabs, one chunk of positions at a time inside a
    checkpointed loop (as `eqgpt.nn.lm_loss`). Under SP the model sees this
    device's sequence shard and the final hidden states are all-gathered before
    the head (Megatron's layout).

    **Arguments:** the wrapped `model`, the whole `tokens`/`targets` (and optional
    `loss_mask`, `segment_ids`) of this device's rows, `chunk_size`.

    **Returns:** `(nll_sum, z_sum, count)` over the rows, invariant over the tensor axis.
    """
    embed = model.tok_embed
    if not isinstance(embed, VocabParallelEmbedding):
        raise ValueError("vocab_parallel_loss_sums needs a model wrapped by tensor_parallel(...).")
    axis, sp = embed.axis, embed.sequence_parallel
    t = tokens.shape[1]
    positions = jnp.arange(t)
    if sp:
        seg = None if segment_ids is None else shard_sequence(segment_ids, axis)
        hidden = model.features(
            shard_sequence(tokens, axis), positions=shard_sequence(positions[None], axis)[0], segment_ids=seg
        )
        hidden = gather_sequence(hidden, axis)
    else:
        hidden = copy_to_tensor(model.features(tokens, segment_ids=segment_ids), axis)
    head = embed.attend if model.head is None else model.head
    start = embed.vocab_start()
    return chunked_loss_sums(
        head, hidden, targets, loss_mask=loss_mask, chunk_size=chunk_size,
        cross_entropy=lambda logits, y: vocab_parallel_cross_entropy(logits, y, start, axis),
    )


# ------------------------------------------------------------------ wrapping


def _is_wrappable(x) -> bool:
    return isinstance(x, Attention | MLP | SwiGLU | Embedding | Linear)


def _is_vocab_head(lin: Linear) -> bool:
    return lin.axes[1] == "vocab"


def check_tensor_parallel(module: PyTree, size: int) -> None:
    """Raise `ValueError` if `module`'s heads, kv heads, MLP width or vocabulary do not split over `size`."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be positive, got {size}.")
    leaves = jax.tree_util.tree_flatten_with_path(module, is_leaf=_is_wrappable)[0]
    for path, m in leaves:
        where = path_str(path) or type(m).__name__
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
        elif isinstance(m, MLP | SwiGLU):
            width = m.up.out_features
            if width % size:
                raise ValueError(
                    f"{where}: MLP width {width} does not split over {size} tensor-parallel devices; "
                    f"choose mlp_dim divisible by {size}."
                )
        elif (isinstance(m, Embedding) and m.axes[0] == "vocab") or (isinstance(m, Linear) and _is_vocab_head(m)):
            num = m.num if isinstance(m, Embedding) else m.out_features
            if num % size:
                raise ValueError(
                    f"{where}: vocabulary of {num} does not split over {size} tensor-parallel devices; "
                    f"pad vocab_size to a multiple of {size}."
                )


def tensor_parallel(module: PyTree, *, size: int, axis: str = "tensor", sequence_parallel: bool = False) -> PyTree:
    """Wrap `module` (an `Attention`, `MLP`, `Block`, `GPT`, ...) for manual tensor parallelism.

    Every `Attention` becomes a `TensorParallelAttention`, every `MLP`/`SwiGLU` a
    `TensorParallelMLP`, a vocabulary `Embedding` a `VocabParallelEmbedding` and a
    vocabulary head `Linear` a `ColumnParallelLinear`; everything else (norms,
    position embeddings, the code of `Block` and `GPT`) is kept. The result runs
    inside `jax.shard_map` on weights laid out by `tensor_parallel_specs`.

    **Arguments:**

    - `module`: the model or part of it (whole arrays or local blocks: only
      static sizes are read here).
    - `size`: devices on the tensor axis.
    - `axis`: the mesh axis name.
    - `sequence_parallel`: the residual stream is split on `seq` (Megatron SP).

    **Returns:** the wrapped module. Raises `ValueError` when sizes do not split.
    """
    check_tensor_parallel(module, size)

    def wrap(m):
        if isinstance(m, Attention):
            return TensorParallelAttention(m, axis, size, sequence_parallel)
        if isinstance(m, MLP | SwiGLU):
            return TensorParallelMLP(m, axis, size, sequence_parallel)
        if isinstance(m, Embedding) and m.axes[0] == "vocab":
            return VocabParallelEmbedding(m, axis, size, sequence_parallel)
        if isinstance(m, Linear) and _is_vocab_head(m):
            return ColumnParallelLinear(m, axis)
        return m

    return jax.tree.map(wrap, module, is_leaf=_is_wrappable)


def tensor_parallel_specs(module: PyTree, mesh: Mesh, *, axis: str = "tensor") -> PyTree:
    """`PartitionSpec`s of `module`'s arrays for `tensor_parallel`, from the `tp` rules.

    The rules are the automatic path's (`heads`, `kv_heads`, `mlp`, `vocab` over
    `axis`), except that kv projections are replicated whenever there are fewer kv
    heads than devices: the manual attention keeps kv heads whole.

    **Arguments:** `module` (concrete or abstract), `mesh`, `axis`.

    **Returns:** the module's structure with a `PartitionSpec` at each array leaf.
    """
    size = mesh.shape[axis]
    check_tensor_parallel(module, size)
    rules = TP if axis == "tensor" else Rules(params={n: axis for n in ("heads", "kv_heads", "mlp", "vocab")})
    specs = specs_from_rules(module, rules, mesh)

    def fix(spec_module, m):
        if isinstance(m, Attention) and kv_replicated(m.num_kv_heads, size):
            for name in ("k_proj", "v_proj"):
                for field in ("weight", "bias"):
                    if getattr(getattr(m, name), field) is not None:
                        spec = getattr(getattr(spec_module, name), field)
                        spec_module = eqx.tree_at(
                            lambda s, n=name, f=field: getattr(getattr(s, n), f), spec_module,
                            PartitionSpec(*(None,) * len(spec)),
                        )
        return spec_module

    return jax.tree.map(fix, specs, module, is_leaf=lambda x: isinstance(x, Attention))
