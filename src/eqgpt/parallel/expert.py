"""Expert parallelism: the experts of every MoE layer split over the `expert` mesh axis.

Device `j` of the axis holds experts `j*E/n .. (j+1)*E/n - 1` of each layer (the
`expert` logical axis of `Experts`' weights maps to the `expert` mesh axis) and a
`1/n` share of the batch's rows (the axis is a data-parallel axis everywhere but
inside the experts). Each MoE layer routes its rows' tokens into a dense
`[experts, rows, capacity, embed]` tensor (`eqgpt.nn.moe`), then:

1. **dispatch**: `all_to_all` over `expert`, splitting the experts dimension and
   concatenating rows: each device now holds, for its own experts, the slots of
   every row of the `expert` group, `[E/n, n*rows, capacity, embed]`;
2. its experts compute their slots;
3. **combine**: the inverse `all_to_all` sends each slot back to its row's device.

The backward pass is the same two all-to-alls, transposed. Per MoE layer and
device, each all-to-all moves `(n-1)/n` of the local dispatched tensor:
`(n-1)/n * E * rows * capacity * embed * bytes` (see `all_to_all_bytes`).

`ExpertParallel` is the dispatch that does this with the kit's typed
collectives under `jax.shard_map`, manual over the axes that split the rows
(`expert`, `data`, `fsdp`; `tensor` stays with the automatic partitioner, so
data, FSDP and tensor parallelism compose). Where `expert`
is already manual (inside the pipeline's `shard_map`) it runs the per-device
steps directly. The alternative, `Expert(impl="gspmd")`, keeps the local
dispatch and lets GSPMD move the tokens from the activation rules.

Dropless MoE under expert parallelism uses capacity = sequence length (nothing
can drop; the all-to-all needs fixed sizes: `jax.lax.ragged_all_to_all` would
send only the routed tokens, but does not run on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec, get_abstract_mesh
from jaxtyping import Array, Float, PyTree

from eqgpt.nn.moe import Experts, LocalExperts, moe_layers
from eqgpt.parallel.collectives import all_gather, all_to_all
from eqgpt.parallel.part import Part
from eqgpt.parallel.rules import Rules, entry_axes, is_spec

if TYPE_CHECKING:
    from eqgpt.parallel.strategy import Strategy

AXIS = "expert"

#: Expert weights over `expert`; the batch over it too (it is data-parallel outside the experts).
EP = Rules(params={"expert": AXIS}, activations={"batch": AXIS, "expert": AXIS}, name="ep")


def exchange(experts: Experts, x: Float[Array, "experts rows slots embed"]) -> Array:
    """One device's step: dispatch all-to-all, its own experts, combine all-to-all.

    `x` holds every expert's slots for this device's rows; `experts` this device's experts.
    """
    sent = all_to_all(x, AXIS, split_dim=0, concat_dim=1)  # [E/n, n*rows, slots, embed]
    return all_to_all(experts(sent), AXIS, split_dim=1, concat_dim=0)


class ExpertParallel(eqx.Module):
    """The dispatch of an `MoE` layer over the `expert` axis of `mesh` (see the module docstring).

    The `shard_map` is manual over every axis splitting the rows (`rows`: `expert`,
    `data`, `fsdp`, in the order the rules place the batch), so each device exchanges
    only its own rows; an expert weight split over `fsdp` is gathered inside (its
    gradient reduce-scattered by the transpose). `tensor` stays automatic.
    """

    mesh: Mesh = eqx.field(static=True)
    rules: Rules = eqx.field(static=True)  # where the expert weights live (their `params` table)
    rows: tuple[str, ...] = eqx.field(static=True, default=(AXIS,))
    # The dispatched tensor keeps the rows' layout (split like the batch).
    layout: tuple = eqx.field(static=True, default=(None, "batch", None, "embed"))
    grouped: bool = eqx.field(static=True, default=False)  # fixed-size exchanges: no grouped matmul

    def _spec(self, names: tuple[str, ...]) -> PartitionSpec:
        """A weight's split over the manual `rows` axes (what the shard_map hands each device)."""
        dims = [tuple(a for a in self.rules.axes(n) if a in self.rows) for n in names]
        return PartitionSpec(*(d[0] if len(d) == 1 else (d or None) for d in dims))

    def __call__(self, experts: Experts, x: Float[Array, "experts rows slots embed"]) -> Array:
        if AXIS in get_abstract_mesh().manual_axes:  # inside a shard_map over `expert`: local blocks
            return exchange(experts, x)
        params, static = eqx.partition(experts, eqx.is_array)
        names = experts.param_axes()
        specs = eqx.tree_at(lambda e: [getattr(e, k) for k in names if getattr(e, k) is not None], params,
                            [self._spec(v) for k, v in names.items() if getattr(params, k) is not None])

        def local(p, x_):
            def gather(w, spec):  # FSDP's split of a weight (not the experts' own split)
                for dim, axes in enumerate(spec):
                    axes = tuple(a for a in entry_axes(axes) if a != AXIS)
                    w = all_gather(w, axes, dim=dim) if axes else w
                return w

            p = jax.tree.map(gather, p, specs, is_leaf=is_spec)
            return exchange(eqx.combine(p, static), x_)

        rows = PartitionSpec(None, self.rows)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(specs, rows), out_specs=rows,
                             axis_names=set(self.rows))(params, x)


def use_dispatch(model: PyTree, dispatch: eqx.Module) -> PyTree:
    """`model` with every MoE layer's `dispatch` replaced (the arrays are unchanged)."""
    layers = moe_layers(model)
    if not layers:
        return model
    return eqx.tree_at(lambda m: [layer.dispatch for layer in moe_layers(m)], model, [dispatch] * len(layers))


def use_expert_parallel(model: PyTree, mesh: Mesh, impl: str = "alltoall", rules: Rules = EP) -> PyTree:
    """Install the dispatch of `impl` ("alltoall": explicit all-to-alls, or "gspmd") into every
    MoE layer; `rules` place the batch's rows and the expert weights (they must split the batch
    over `expert`)."""
    if impl == "gspmd":
        return use_dispatch(model, LocalExperts())
    rows = tuple(a for a in rules.axes("batch", "activations") if a in (AXIS, "data", "fsdp"))
    if AXIS not in rows:
        raise ValueError(f"rules {rules.name!r} do not split the batch over 'expert'; merge EP into them.")
    return use_dispatch(model, ExpertParallel(mesh, rules, rows))


def check_expert(model_like: PyTree, mesh: Mesh) -> None:
    """Raise `ValueError` for a model the `expert` axis cannot split (before any compile)."""
    n = mesh.shape.get(AXIS, 1)
    layers = moe_layers(model_like)
    if not layers:
        raise ValueError(
            f"the mesh has expert={n} but the model has no MoE layers: the devices would repeat the same "
            "work. Use an MoE model (--model.preset moe-nano, or a config with moe=MoEConfig(...)), or drop "
            "expert from --mesh."
        )
    e = layers[0].num_experts
    if e % n:
        raise ValueError(
            f"the model's moe.num_experts={e} is not divisible by the expert axis ({n} devices, --mesh expert={n}); "
            f"use an expert axis in {[d for d in range(1, e + 1) if e % d == 0]} or change num_experts."
        )


@dataclass(frozen=True)
class Expert(Part):
    """Expert parallelism: MoE layers' experts over the mesh's `expert` axis. Present whenever
    that axis is > 1 (`implied`); `Expert("gspmd")` chooses the other implementation."""

    impl: Literal["alltoall", "gspmd"] = "alltoall"
    ("MoE experts over the mesh's 'expert' axis: 'alltoall' (default: explicit dispatch and combine) or 'gspmd' (the "
     "partitioner moves the tokens); see docs/parallelism/expert.md.")

    name = "expert"
    order = 30
    hints = {AXIS: "train an MoE model (--model.preset moe-nano) to split its experts"}
    on_manual_path = False
    switch = "impl"

    def __post_init__(self):
        if self.impl not in ("alltoall", "gspmd"):
            raise ValueError(f"--expert must be 'alltoall' or 'gspmd', got {self.impl!r}.")

    @classmethod
    def implied(cls, mesh: Any) -> Expert | None:
        return None if mesh is None or mesh.shape.get(AXIS, 1) == 1 else cls()

    def axes(self, strategy: Strategy) -> set[str]:
        return {AXIS}

    def validate(self, strategy: Strategy) -> None:
        if not all(p.automatic for p in strategy.parts):
            raise ValueError("the manual path runs data, tensor and sequence parallelism only; drop --manual for "
                             "expert parallelism (it runs its all-to-alls under shard_map on the automatic path).")
        if self.impl != "alltoall" and any(p.runs_layers for p in strategy.parts):
            raise ValueError("inside the pipeline the experts are exchanged with explicit all-to-alls; "
                             "use --expert alltoall with --pipeline.")

    def rules(self, strategy: Strategy, rules: Rules) -> Rules:
        return rules.merge(EP).update(name=f"{rules.name}+ep")

    def prepare(self, strategy: Strategy, model: PyTree) -> PyTree:
        return use_expert_parallel(model, strategy.mesh, self.impl, strategy.rules)

    @classmethod
    def unprepare(cls, model: PyTree) -> PyTree:
        return use_dispatch(model, LocalExperts())  # the layers' own dispatch, on whatever devices

    def check(self, strategy: Strategy, model_like: PyTree, *, rows: int, seq_len: int) -> None:
        check_expert(model_like, strategy.mesh)

    def describe(self, strategy: Strategy) -> str:
        return f"expert {self.impl}"


def all_to_all_bytes(*, num_experts: int, rows: int, capacity: int, embed: int, n: int, itemsize: int = 4) -> float:
    """Bytes one device sends in one all-to-all of one MoE layer: `(n-1)/n` of its
    dispatched `[experts, rows, capacity, embed]` tensor (`rows` on this device).
    A training step runs four per MoE layer: dispatch and combine, forward and backward."""
    return (n - 1) / n * num_experts * rows * capacity * embed * itemsize


__all__ = ["EP", "Expert", "ExpertParallel", "exchange", "use_expert_parallel", "use_dispatch", "check_expert",
           "all_to_all_bytes"]
