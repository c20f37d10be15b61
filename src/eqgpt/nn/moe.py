"""Mixture-of-Experts feed-forward layer: a top-k softmax router and stacked experts.

`MoE` stands wherever `MLP` stands in a `Block`. Each token's router picks `top_k`
of `num_experts` experts; the token goes through them and their outputs are summed,
weighted by the router's probabilities. Nothing here knows about devices: how the
dispatched tokens reach their experts is the `dispatch` field (`LocalExperts` by
default; `eqgpt.parallel.expert` installs one that sends them over the `expert`
mesh axis with `all_to_all` and back).

Two ways to compute:

- **capacity** (default): each expert has `C = ceil(capacity_factor * seq * top_k /
  num_experts)` slots per sequence. Assignments are served in order of choice rank
  (every token's first choice before any second choice), then of position in the
  sequence (the `positions` given, which a context-parallel layout permutes); those past an
  expert's `C` slots are dropped, and the token keeps only its residual (plus the other
  experts it got). Tokens are scattered into a dense `[experts, batch, C, embed]` tensor,
  computed, and gathered back.
- **dropless**: every assignment is computed. Assignments are sorted by expert and
  each expert runs one matmul over its rows (a grouped matmul, `eqgpt.nn.kernels.grouped`).

`with_stats` also returns the router's statistics as sums that add up across
sequences, devices and layers (see `MoEStats`); `moe_loss` turns them into the
load-balancing loss (Switch/GShard), the router z-loss and the metrics.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqgpt.config import MoEConfig
from eqgpt.nn.axes import REGION_INPUT, ActivationHook, NoConstraint
from eqgpt.nn.kernels.grouped import grouped_matmul
from eqgpt.nn.linear import Linear
from eqgpt.nn.mlp import MLP, SwiGLU, gelu_tanh


def expert_capacity(seq_len: int, num_experts: int, top_k: int, capacity_factor: float, dropless: bool) -> int:
    """Slots per expert and sequence: `ceil(capacity_factor * seq_len * top_k / num_experts)`,
    at most `seq_len` (a token picks an expert once); `seq_len` when `dropless`."""
    if dropless:
        return seq_len
    return min(seq_len, math.ceil(capacity_factor * seq_len * top_k / num_experts))


class Experts(eqx.Module):
    """`num_experts` feed-forward networks of one kind (GELU or SwiGLU), their
    weights stacked on a leading `expert` axis (no biases)."""

    up: Float[Array, "experts embed hidden"]
    gate: Float[Array, "experts embed hidden"] | None
    down: Float[Array, "experts hidden embed"]

    def __init__(
        self,
        num_experts: int,
        embed_dim: int,
        hidden_dim: int,
        *,
        kind: str = "gelu",
        init_std: float = 0.02,
        out_init_std: float | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:** `num_experts`, `embed_dim`, `hidden_dim` (one expert's width),
        `kind` ("gelu" or "swiglu"), `init_std` (normal init; `out_init_std` for `down`), `key`."""
        if kind not in ("gelu", "swiglu"):
            raise ValueError(f"Experts kind must be 'gelu' or 'swiglu', got {kind!r}.")
        ku, kg, kd = jax.random.split(key, 3)
        out_std = init_std if out_init_std is None else out_init_std
        shape = (num_experts, embed_dim, hidden_dim)
        self.up = init_std * jax.random.normal(ku, shape)
        self.gate = init_std * jax.random.normal(kg, shape) if kind == "swiglu" else None
        self.down = out_std * jax.random.normal(kd, (num_experts, hidden_dim, embed_dim))

    @property
    def num_experts(self) -> int:
        return self.up.shape[-3]  # also in a layer stack, `[layers, experts, embed, hidden]`

    def _act(self, x, up, gate):
        return jax.nn.silu(gate(x)) * up(x) if self.gate is not None else gelu_tanh(up(x))

    def __call__(self, x: Float[Array, "experts *slots embed"]) -> Float[Array, "experts *slots embed"]:
        """Expert `e` on `x[e]` (its slots), for every `e`."""
        e, d = x.shape[0], x.shape[-1]
        flat = x.reshape(e, -1, d)
        mm = lambda w: lambda h: jnp.einsum("end,edf->enf", h, w.astype(h.dtype))  # noqa: E731
        h = self._act(flat, mm(self.up), None if self.gate is None else mm(self.gate))
        return jnp.einsum("enf,efd->end", h, self.down.astype(h.dtype)).reshape(x.shape)

    def grouped(
        self, x: Float[Array, "rows embed"], group_sizes: Int[Array, " experts"]
    ) -> Float[Array, "rows embed"]:
        """Rows sorted by expert, `group_sizes[e]` of them for expert `e`: each expert's
        rows through it, as one grouped matmul per weight (`eqgpt.nn.kernels.grouped`)."""
        mm = lambda w: lambda h: grouped_matmul(h, w, group_sizes)  # noqa: E731
        h = self._act(x, mm(self.up), None if self.gate is None else mm(self.gate))
        return mm(self.down)(h)

    def param_axes(self) -> dict[str, tuple[str, ...]]:
        return {"up": ("expert", "embed", "mlp"), "gate": ("expert", "embed", "mlp"),
                "down": ("expert", "mlp", "embed")}


class LocalExperts(eqx.Module):
    """The default dispatch: every expert on this device, dispatched tokens computed in place."""

    # Names of the dispatched `[experts, batch, slots, embed]` tensor for the activation
    # hooks: the automatic path may split experts over the `expert` mesh axis (GSPMD).
    layout: tuple = eqx.field(static=True, default=("expert", "batch", None, "embed"))
    grouped: bool = eqx.field(static=True, default=True)  # dropless may use the grouped matmul

    # `experts`: an `Experts`, or a parallel form
    def __call__(self, experts: eqx.Module, x: Float[Array, "experts batch slots embed"]):
        return experts(x)


class MoEStats(NamedTuple):
    """Router statistics of one or more MoE layers, as sums (so they add up across
    sequences, devices, microbatches and layers; `moe_loss` normalises them).

    - `balance`: sum over sequences of `E * sum_e f_e * P_e`, where `f_e` is the
      fraction of the sequence's assignments routed to expert `e` and `P_e` its mean
      router probability (Switch Transformer's load-balancing loss).
    - `router_z`: sum over tokens of `logsumexp(router logits)^2`.
    - `dropped`: assignments dropped for want of capacity.
    - `load`: assignments routed to each expert (before dropping), `[experts]`.
    - `layers`: MoE layers counted.
    """

    balance: Float[Array, ""]
    router_z: Float[Array, ""]
    dropped: Float[Array, ""]
    load: Float[Array, " experts"]
    layers: Float[Array, ""]


def assign_slots(
    experts: Int[Array, "batch seq k"], num_experts: int, capacity: int
) -> Int[Array, "batch seq k"]:
    """Each assignment's slot `e * capacity + position` among expert `e`'s assignments in
    its sequence, or `num_experts * capacity` when it is dropped.

    Priority: choice rank first (all first choices, then all second choices, ...),
    then position in the sequence.
    """
    b, t, k = experts.shape
    order = jnp.swapaxes(experts, 1, 2).reshape(b, k * t)  # rank-major
    hits = jax.nn.one_hot(order, num_experts, dtype=jnp.int32)
    position = jnp.take_along_axis(jnp.cumsum(hits, axis=1) - 1, order[..., None], axis=-1)[..., 0]
    slot = jnp.where(position < capacity, order * capacity + position, num_experts * capacity)
    return jnp.swapaxes(slot.reshape(b, k, t), 1, 2)


def assign_slots_in_order(
    experts: Int[Array, "batch seq k"], num_experts: int, capacity: int, positions: Int[Array, " seq"] | None
) -> Int[Array, "batch seq k"]:
    """`assign_slots` with the sequence ranked by `positions` (each token's place in the
    sequence) rather than by where it lies in `experts`; `None`: where it lies."""
    if positions is None:
        return assign_slots(experts, num_experts, capacity)
    order = jnp.argsort(positions)
    slot = assign_slots(jnp.take(experts, order, axis=1), num_experts, capacity)
    return jnp.take(slot, jnp.argsort(order), axis=1)


def scatter_to_slots(
    x: Float[Array, "batch seq embed"], slot: Int[Array, "batch seq k"], num_experts: int, capacity: int
) -> Float[Array, "experts batch capacity embed"]:
    """Every kept assignment's token copied into its expert's slot (empty slots are zero)."""
    k = slot.shape[-1]

    def row(xr, sr):
        buf = jnp.zeros((num_experts * capacity + 1, xr.shape[-1]), xr.dtype)
        buf = buf.at[sr.reshape(-1)].add(jnp.repeat(xr, k, axis=0))  # the last row collects the dropped
        return buf[:-1].reshape(num_experts, capacity, -1)

    return jax.vmap(row, out_axes=1)(x, slot)


def gather_from_slots(
    y: Float[Array, "experts batch capacity embed"], slot: Int[Array, "batch seq k"],
    weights: Float[Array, "batch seq k"],
) -> Float[Array, "batch seq embed"]:
    """Each token's expert outputs read back from its slots and summed with its router
    weights (a dropped assignment contributes nothing)."""

    def row(yr, sr, wr):
        flat = jnp.concatenate([yr.reshape(-1, yr.shape[-1]), jnp.zeros((1, yr.shape[-1]), yr.dtype)])
        return jnp.einsum("tkd,tk->td", flat[sr], wr.astype(yr.dtype))

    return jax.vmap(row, in_axes=(1, 0, 0))(y, slot, weights)


class MoE(eqx.Module):
    """Top-k routed experts (and optional shared experts) in place of a dense MLP.

    **Fields:** `router` (`[embed, experts]`, computed in fp32), `experts`,
    `shared` (an `MLP`/`SwiGLU` every token goes through, or `None`), `dispatch`
    (where experts run; see the module docstring), and the static `top_k`,
    `capacity_factor`, `dropless`, `renormalize`.
    """

    router: Linear
    experts: Experts
    shared: MLP | SwiGLU | None
    dispatch: eqx.Module
    shard: ActivationHook
    top_k: int = eqx.field(static=True)
    capacity_factor: float = eqx.field(static=True)
    dropless: bool = eqx.field(static=True)
    renormalize: bool = eqx.field(static=True)

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        num_experts: int,
        *,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        dropless: bool = False,
        num_shared: int = 0,
        kind: str = "gelu",
        renormalize: bool = True,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:** `embed_dim`, `hidden_dim` (one expert's width), `num_experts`,
        `top_k`, `capacity_factor`, `dropless`, `num_shared` (shared experts, as one
        MLP `num_shared * hidden_dim` wide), `kind` ("gelu" or "swiglu"), `renormalize`,
        `init_std`, `out_init_std`, `key`. See `eqgpt.MoEConfig`."""
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and num_experts ({num_experts}).")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}.")
        kr, ke, ks = jax.random.split(key, 3)
        self.router = Linear(embed_dim, num_experts, axes=("embed", None), use_bias=False, init_std=init_std, key=kr)
        self.experts = Experts(num_experts, embed_dim, hidden_dim, kind=kind, init_std=init_std,
                               out_init_std=out_init_std, key=ke)
        shared_cls = SwiGLU if kind == "swiglu" else MLP
        self.shared = (shared_cls(embed_dim, num_shared * hidden_dim, use_bias=False, init_std=init_std,
                                  out_init_std=out_init_std, key=ks) if num_shared else None)
        self.dispatch = LocalExperts()
        self.shard = NoConstraint()
        self.top_k, self.capacity_factor, self.dropless, self.renormalize = (
            top_k, capacity_factor, dropless, renormalize)

    @property
    def num_experts(self) -> int:
        return self.router.out_features  # static: also inside a shard_map holding a share of the experts

    def capacity(self, seq_len: int) -> int:
        """Slots per expert and sequence (see `expert_capacity`)."""
        return expert_capacity(seq_len, self.num_experts, self.top_k, self.capacity_factor, self.dropless)

    def route(self, x: Float[Array, "batch seq embed"]):
        """Router logits (fp32), each token's `top_k` experts and their weights."""
        logits = jnp.matmul(x.astype(jnp.float32), self.router.weight.astype(jnp.float32))
        probs = jax.nn.softmax(logits, axis=-1)
        top_e = jax.lax.top_k(jax.lax.stop_gradient(probs), self.top_k)[1]
        # the chosen probabilities read through a one-hot, whose derivative is elementwise
        # (top_k's own derivative is a scatter-add, which accelerators serialise); a product and
        # a sum, exact, where an einsum could run as a TPU matmul at reduced precision
        top_p = jnp.sum(probs[..., None, :] * jax.nn.one_hot(top_e, probs.shape[-1], dtype=probs.dtype), axis=-1)
        if self.renormalize and self.top_k > 1:
            top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        return logits, probs, top_e, top_p

    def with_stats(
        self, x: Float[Array, "batch seq embed"], positions: Int[Array, " seq"] | None = None
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
        """**Arguments:** `x`; `positions`, each token's place in the sequence (the capacity
        path serves earlier places first; default: the order of `x`).

        **Returns:** the layer's output and its `MoEStats` (this layer's sums).

        The router reads `x` before the experts' region starts (`self.shard(x, REGION_INPUT)`):
        under manual tensor parallelism every device then routes the same replicated
        input, and the router's losses are counted once, not once per device.
        """
        b, t, _ = x.shape
        e, k = self.num_experts, self.top_k
        logits, probs, top_e, weights = self.route(x)
        x = self.shard(x, REGION_INPUT)
        if self.dropless and self.dispatch.grouped:
            y, dropped = self._grouped(x, top_e, weights), jnp.float32(0)
        else:
            c = self.capacity(t)
            slot = assign_slots_in_order(top_e, e, c, positions)
            xd = self.shard(scatter_to_slots(x, slot, e, c), self.dispatch.layout)
            yd = self.shard(self.dispatch(self.experts, xd), self.dispatch.layout)
            y = gather_from_slots(yd, slot, weights)
            dropped = jnp.sum(slot == e * c).astype(jnp.float32)
        if self.shared is not None:
            y = y + self.shared(x)
        hits = jax.nn.one_hot(top_e, e, dtype=jnp.float32)  # [b, t, k, e]
        frac = jnp.sum(hits, axis=(1, 2)) / (t * k)  # per sequence
        stats = MoEStats(
            balance=e * jnp.sum(jax.lax.stop_gradient(frac) * jnp.mean(probs, axis=1)),
            router_z=jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
            dropped=dropped,
            load=jnp.sum(hits, axis=(0, 1, 2)),
            layers=jnp.float32(1),
        )
        return self.shard(y, ("batch", "seq", "embed")), stats

    def _grouped(self, x, top_e, weights):
        b, t, d = x.shape
        flat_e = top_e.reshape(-1)  # token-major: [t0 k0, t0 k1, t1 k0, ...]
        order = jnp.argsort(flat_e, stable=True)
        back = jnp.argsort(order)  # the inverse permutation
        rows = _permute(jnp.repeat(x.reshape(b * t, d), self.top_k, axis=0), order, back)
        sizes = jnp.sum(flat_e[:, None] == jnp.arange(self.num_experts), axis=0, dtype=jnp.int32)  # no scatter
        done = self.experts.grouped(rows, sizes)
        out = _permute(done, back, order)  # back in token order
        y = jnp.einsum("nkd,nk->nd", out.reshape(b * t, self.top_k, d), weights.reshape(b * t, -1).astype(x.dtype))
        return y.reshape(b, t, d)

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        """**Returns:** the layer's output (statistics dropped; training uses `with_stats`)."""
        return self.with_stats(x)[0]


@jax.custom_vjp
def _permute(x: Array, order: Array, back: Array) -> Array:
    """`x[order]` for a permutation `order` whose inverse is `back`, differentiated as the gather
    `g[back]`: autodiff of a gather would scatter-add, which accelerators serialise."""
    return x[order]


def _permute_fwd(x, order, back):
    return x[order], (order, back)


def _permute_bwd(res, g):
    order, back = res
    return g[back], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def mlp_with_stats(mlp: eqx.Module, x: Array, positions: Array | None = None) -> tuple[Array, MoEStats | None]:
    """`mlp(x)` and its router statistics: an `MoE`'s (anything with `with_stats`), else `None`.
    An `MoE` also gets the tokens' `positions` (see `MoE.with_stats`)."""
    if isinstance(mlp, MoE):
        return mlp.with_stats(x, positions)
    with_stats = getattr(mlp, "with_stats", None)
    return with_stats(x) if with_stats is not None else (mlp(x), None)


#: The metrics `moe_loss` returns, by name.
MOE_METRICS = ("moe_balance", "moe_router_z", "moe_drop_rate", "moe_load", "moe_load_max")


def moe_loss(
    stats: MoEStats, config: MoEConfig, *, rows: int | Array, tokens: int | Array
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The weighted auxiliary loss and the metrics of `stats` summed over a step.

    **Arguments:** `stats` (sums over every sequence and MoE layer of the step), the
    model's `MoEConfig` (`top_k` and the two loss weights), the step's `rows`
    (sequences) and `tokens`.

    **Returns:** `(aux_loss_weight * balance + router_z_weight * router_z, metrics)`,
    each term a mean per MoE layer (balance per sequence, z per token). Metrics:
    `moe_balance`, `moe_router_z`, `moe_drop_rate` (share of assignments dropped),
    `moe_load` (`[experts]`, each expert's share of assignments; `1/E` is balanced)
    and `moe_load_max` (the busiest expert's load over the mean).
    """
    layers = jnp.maximum(stats.layers, 1.0)
    balance = stats.balance / (rows * layers)
    router_z = stats.router_z / (tokens * layers)
    load = stats.load / jnp.maximum(jnp.sum(stats.load), 1.0)
    metrics = {
        "moe_balance": balance,
        "moe_router_z": router_z,
        "moe_drop_rate": stats.dropped / (tokens * config.top_k * layers),
        "moe_load": load,
        "moe_load_max": jnp.max(load) * load.shape[0],
    }
    return config.aux_loss_weight * balance + config.router_z_weight * router_z, metrics


def _is_moe(x) -> bool:
    return isinstance(x, MoE)


def moe_layers(model) -> list[MoE]:
    """The `MoE` layers of `model` (one per stacked block: stacked layers count once)."""
    return [x for x in jax.tree.leaves(model, is_leaf=_is_moe) if _is_moe(x)]
