"""The automatic path: place models and optimizer state by logical rules; constrain activations.

This is the *automatic* path: parameters are laid out by `Rules`, activations are
pinned at module boundaries by `ShardingConstraint` hooks, and XLA's SPMD
partitioner inserts the collectives in between.

Per-module overrides: `overrides={"blocks.attn": rules_a, "tok_embed": rules_b}`
gives the module at that dotted attribute path (and everything inside it) its own
rule set, for both its weights and its activation constraints. The longest
matching prefix wins; other modules use the base rules.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PRNGKeyArray, PyTree

from eqgpt.nn.axes import REGION_INPUT, ActivationHook, LogicalAxes, logical_axes, map_constraints
from eqgpt.parallel.rules import (
    REPLICATE_IF_INDIVISIBLE,
    AxisNames,
    Rules,
    entry_axes,
    is_spec,
    spec_axes,
)
from eqgpt.tree import path_str

Overrides = Mapping[str, Rules] | None


def rules_for(module_path: str, rules: Rules, overrides: Overrides = None) -> Rules:
    """The rule set of the module at `module_path`: longest matching override prefix, else `rules`."""
    best, best_len = rules, -1
    for prefix, r in (overrides or {}).items():
        if (module_path == prefix or module_path.startswith(prefix + ".")) and len(prefix) > best_len:
            best, best_len = r, len(prefix)
    return best


def _check_overrides(model: PyTree, overrides: Overrides) -> None:
    if not overrides:
        return
    paths = {path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]}
    for prefix, r in overrides.items():
        if not isinstance(r, Rules):
            raise ValueError(f"override {prefix!r} must be a Rules, got {type(r).__name__}.")
        if not any(p == prefix or p.startswith(prefix + ".") for p in paths):
            raise ValueError(
                f"override {prefix!r} matches no array of the model; give a dotted module path "
                f"such as 'blocks.attn' or 'tok_embed' (some paths: {sorted(paths)[:6]})."
            )


def _head_units(model: PyTree) -> dict[str, dict[str, int]]:
    """Module path -> `{"heads": head_dim, "kv_heads": head_dim}` for modules with a `head_dim`.

    Attention stores heads flattened (`[embed, heads * head_dim]`); these units make
    the rules split whole heads only.
    """
    out: dict[str, dict[str, int]] = {}

    def visit(x: Any, path: str) -> None:
        if isinstance(x, eqx.Module):
            hd = getattr(x, "head_dim", None)
            if isinstance(hd, int) and hd > 0:
                out[path] = {"heads": hd, "kv_heads": hd}
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name, None), f"{path}.{f.name}" if path else f.name)
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                visit(v, f"{path}.{i}" if path else str(i))
        elif isinstance(x, dict):
            for k, v in x.items():
                visit(v, f"{path}.{k}" if path else str(k))

    visit(model, "")
    return out


def _units_for(module_path: str, units: dict[str, dict[str, int]]) -> dict[str, int] | None:
    best = None
    for prefix, u in units.items():
        if module_path == prefix or module_path.startswith(prefix + ".") or prefix == "":
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, u)
    return best[1] if best else None


def _is_array_like(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def put(tree: PyTree, shardings: Any) -> PyTree:
    """`jax.device_put(tree, shardings)`, where a `jax.ShapeDtypeStruct` leaf (a shape without data, as
    the planner compiles from) becomes one carrying its sharding instead of being moved."""

    shape_only = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    if not any(shape_only(x) for x in jax.tree.leaves(tree, is_leaf=shape_only)):
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda s, x: x if s is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shardings, tree, is_leaf=lambda s: s is None or isinstance(s, jax.sharding.Sharding))


def param_specs(model: PyTree, rules: Rules, overrides: Overrides = None, *, mesh: Mesh | None = None) -> PyTree:
    """A `PartitionSpec` for every array of `model` (a concrete or `eqx.filter_eval_shape` model).

    **Arguments:**

    - `model`: any pytree of `eqgpt.nn` modules.
    - `rules`: the base rule set; `overrides` per module path (see module docs).
    - `mesh`: if given, axes of size 1 are dropped and divisibility is checked.

    **Returns:** the model's structure with a `PartitionSpec` at each array leaf
    (and non-array leaves unchanged).
    """
    _check_overrides(model, overrides)
    axes_tree = logical_axes(model)
    units = _head_units(model)

    def one(path, names, leaf):
        if not _is_array_like(leaf):
            return leaf
        names = names.names if isinstance(names, LogicalAxes) else (None,) * leaf.ndim
        key = path_str(path)
        module_path = key.rpartition(".")[0]
        return rules_for(module_path, rules, overrides).spec(
            names, "params", shape=tuple(leaf.shape), mesh=mesh, units=_units_for(module_path, units)
        )

    return jax.tree_util.tree_map_with_path(
        one, axes_tree, model, is_leaf=lambda x: isinstance(x, LogicalAxes)
    )


def param_shardings(model: PyTree, mesh: Mesh, rules: Rules, overrides: Overrides = None) -> PyTree:
    """Like `param_specs`, with `NamedSharding(mesh, spec)` at each array leaf."""
    specs = param_specs(model, rules, overrides, mesh=mesh)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s) if is_spec(s) else s, specs, is_leaf=is_spec,
    )


class ShardingConstraint(ActivationHook):
    """Activation hook pinning `x` to the layout its logical names imply on `mesh`.

    Installed in place of `eqgpt.nn.NoConstraint` by `with_constraints`. Uses
    `jax.lax.with_sharding_constraint` on Auto axes and `jax.sharding.reshard`
    when any axis it names is Explicit.
    """

    mesh: Mesh = eqx.field(static=True)
    rules: Rules = eqx.field(static=True)

    def __call__(self, x: Array, names: AxisNames) -> Array:
        """**Arguments:** `x` and one logical name per dimension. **Returns:** `x`, constrained."""
        if x.ndim != len(names):
            raise ValueError(f"activation of shape {x.shape} given {len(names)} axis names {names}.")
        spec = self.rules.spec(names, "activations", shape=tuple(x.shape), mesh=self.mesh)
        used = set(spec_axes(spec))
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types, strict=True))
        if any(types[a] == AxisType.Explicit for a in used):
            return jax.sharding.reshard(x, NamedSharding(self.mesh, spec))
        sharding = NamedSharding(self.mesh, spec)
        if tuple(names) == REGION_INPUT:  # pin the forward only (see `_forward_constraint`)
            return _forward_constraint(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _forward_constraint(x: Array, sharding: NamedSharding) -> Array:
    """`with_sharding_constraint` on the forward pass only.

    At a region entry the forward layout is the point (under SP: gather the
    sequence once, before the projections); pinning the cotangent to it as well
    would make XLA all-reduce the input gradient there instead of
    reduce-scattering it (27% more bytes per `dp+sp` step, measured).
    """
    return jax.lax.with_sharding_constraint(x, sharding)


def _forward_constraint_fwd(x, sharding):
    return jax.lax.with_sharding_constraint(x, sharding), None


def _forward_constraint_bwd(sharding, _, g):
    return (g,)


_forward_constraint.defvjp(_forward_constraint_fwd, _forward_constraint_bwd)


def with_constraints(model: PyTree, mesh: Mesh, rules: Rules, overrides: Overrides = None) -> PyTree:
    """Install a `ShardingConstraint` (bound to `mesh` and the module's rules) in every hook.

    **Returns:** the model with every `shard` field replaced; arrays untouched.
    """
    _check_overrides(model, overrides)

    def install(path, _hook):
        module_path = path_str(path).rpartition(".")[0]
        return ShardingConstraint(mesh, rules_for(module_path, rules, overrides))

    return map_constraints(model, install)


def _split(model: PyTree):
    return eqx.partition(model, _is_array_like)


def place_model(model: PyTree, mesh: Mesh, rules: Rules, overrides: Overrides = None) -> PyTree:
    """Move `model`'s arrays to their shardings and install activation constraints.

    **Returns:** the placed, constrained model.
    """
    shardings = param_shardings(model, mesh, rules, overrides)
    dynamic, static = _split(model)
    dyn_shardings = _only_shardings(shardings)
    placed = put(dynamic, dyn_shardings)
    return with_constraints(eqx.combine(placed, static), mesh, rules, overrides)


def _only_shardings(shardings: PyTree) -> PyTree:
    """The shardings at array leaves, `None` elsewhere (the shape of `eqx.partition`'s first half)."""
    return eqx.partition(shardings, lambda s: isinstance(s, NamedSharding))[0]


_INIT_PROGRAMS: dict = {}


def _init_program(make, key, mesh, rules, overrides):
    """The jitted initialiser and the model's static part; kept for the last few `make`s
    so that `lower_init(...).compile()` and `init_sharded(...)` share one compile."""
    cache_key = (make, mesh, rules, tuple(sorted((overrides or {}).items())), jax.typeof(key))
    try:
        hit = _INIT_PROGRAMS.get(cache_key)
    except TypeError:  # unhashable `make`
        cache_key, hit = None, None
    if hit is not None:
        return hit
    abstract = eqx.filter_eval_shape(make, key)
    out_shardings = _only_shardings(param_shardings(abstract, mesh, rules, overrides))

    def build(k):
        return _split(make(k))[0]

    program = (jax.jit(build, out_shardings=out_shardings), _split(abstract)[1])
    if cache_key is not None:
        if len(_INIT_PROGRAMS) >= 8:
            _INIT_PROGRAMS.pop(next(iter(_INIT_PROGRAMS)))
        _INIT_PROGRAMS[cache_key] = program
    return program


def lower_init(
    make: Callable[[PRNGKeyArray], PyTree],
    key: PRNGKeyArray,
    mesh: Mesh,
    rules: Rules,
    overrides: Overrides = None,
) -> jax.stages.Lowered:
    """The initialisation program `init_sharded` runs, lowered (to inspect its memory)."""
    return _init_program(make, key, mesh, rules, overrides)[0].lower(key)


def init_sharded(
    make: Callable[[PRNGKeyArray], PyTree],
    key: PRNGKeyArray,
    mesh: Mesh,
    rules: Rules,
    overrides: Overrides = None,
) -> PyTree:
    """Build `make(key)` with every array created directly in its sharding.

    The shapes come from `eqx.filter_eval_shape`; then `make` runs under `jax.jit`
    with `out_shardings`, so each device computes only its own part of each
    parameter and no device ever holds a whole parameter it should not.

    **Arguments:** `make` (key -> model), `key`, `mesh`, `rules`, `overrides`.

    **Returns:** the placed model with activation constraints installed.
    """
    program, static = _init_program(make, key, mesh, rules, overrides)
    return with_constraints(eqx.combine(program(key), static), mesh, rules, overrides)


def opt_state_shardings(
    opt_state: PyTree, model: PyTree, mesh: Mesh, rules: Rules, overrides: Overrides = None
) -> PyTree:
    """Shardings for an optimizer state: moments follow their parameter, the rest is replicated.

    A subtree of `opt_state` with the structure of the model's arrays (Adam's `mu`
    and `nu`, momentum, ...) gets the parameters' shardings; any other array
    (step counts, scalars) is replicated.
    """
    params = eqx.filter(model, _is_array_like)
    return like_params(opt_state, params, param_shardings(params, mesh, rules, overrides),
                       NamedSharding(mesh, PartitionSpec()))


def like_params(opt_state: PyTree, params: PyTree, per_param: PyTree, other: Any) -> PyTree:
    """A tree shaped like `opt_state`: every subtree with the parameters' structure and shapes
    (Adam's moments, master weights) gets `per_param`'s leaves; every other array gets `other`."""
    params = eqx.filter(params, _is_array_like)
    treedef = jax.tree.structure(params)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]
    values = jax.tree.leaves(per_param, is_leaf=lambda s: is_spec(s) or isinstance(s, NamedSharding))

    def matches(x):
        try:
            return jax.tree.structure(x) == treedef
        except Exception:  # noqa: BLE001
            return False

    def assign(sub):
        if matches(sub) and [tuple(x.shape) for x in jax.tree.leaves(sub)] == shapes:
            return jax.tree.unflatten(treedef, values)
        return jax.tree.map(lambda x: other if _is_array_like(x) else None, sub)

    return jax.tree.map(assign, opt_state, is_leaf=lambda x: matches(x) or _is_array_like(x))


def place_opt_state(
    opt_state: PyTree, model: PyTree, mesh: Mesh, rules: Rules, overrides: Overrides = None
) -> PyTree:
    """Move an existing optimizer state to `opt_state_shardings`. **Returns:** the placed state."""
    shardings = opt_state_shardings(opt_state, model, mesh, rules, overrides)
    return put(opt_state, shardings)


def init_opt_state_sharded(
    optimizer: Any, model: PyTree, mesh: Mesh, rules: Rules, overrides: Overrides = None
) -> PyTree:
    """`optimizer.init(params)` compiled with output shardings: moments created sharded."""
    params = eqx.filter(model, eqx.is_array)
    abstract = jax.eval_shape(optimizer.init, params)
    shardings = opt_state_shardings(abstract, model, mesh, rules, overrides)
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def batch_sharding(
    mesh: Mesh, rules: Rules, ndim: int = 2, shape: tuple[int, ...] | None = None
) -> NamedSharding:
    """Sharding of an integer batch: `[batch, seq]` (`ndim=2`) or `[batch]` (`ndim=1`).

    The batch dimension follows the `batch` activation rule (it must divide). The
    sequence follows `seq` when `shape` is not given or its length divides; a window
    array of `seq + 1` tokens keeps its sequence whole instead (token ids are a few
    bytes per position, and the model's first constraint splits the activations).
    """
    if ndim not in (1, 2):
        raise ValueError(f"batches are [batch] or [batch, seq] arrays; got ndim={ndim}.")
    spec = rules.spec(("batch", "seq")[:ndim], "activations", mesh=mesh)
    if shape is not None:
        sizes = [math.prod(mesh.shape[a] for a in entry_axes(e)) for e in spec]
        if shape[0] % sizes[0]:
            raise ValueError(
                f"batch size {shape[0]} is not divisible by {sizes[0]}, the devices the batch is split over "
                f"(mesh axes {spec[0]}); use a multiple of {sizes[0]}."
            )
        if ndim == 2 and shape[1] % sizes[1]:
            spec = PartitionSpec(spec[0], None)
    return NamedSharding(mesh, spec)


def _spec_shards(spec: PartitionSpec, mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in spec_axes(spec))


def replicated_fraction(model: PyTree, mesh: Mesh, rules: Rules, overrides: Overrides = None) -> float:
    """Share of parameter bytes held redundantly, relative to full sharding over the rules' axes.

    With `S` the product of the mesh axes the rules split weights over, a parameter
    split `s` ways counts `1 - s/S` of its bytes. 0 means every weight is split over
    every such axis; a fully replicated weight counts (almost) all of its bytes.
    """
    axes = {a for r in [rules, *(overrides or {}).values()] for a in r.uses("params", mesh)}
    full = math.prod(mesh.shape[a] for a in axes)
    specs = jax.tree.leaves(param_specs(model, rules, overrides, mesh=mesh), is_leaf=is_spec)
    arrays = [x for x in jax.tree.leaves(model) if _is_array_like(x)]
    total = sum(x.size * x.dtype.itemsize for x in arrays)
    if full == 1 or total == 0:
        return 0.0
    extra = sum(x.size * x.dtype.itemsize * (1 - _spec_shards(s, mesh) / full)
                for x, s in zip(arrays, specs, strict=True))
    return extra / total


def check_replication(
    model: PyTree, mesh: Mesh, rules: Rules, max_fraction: float = 0.02, overrides: Overrides = None
) -> float:
    """Raise `ValueError` if a strategy that shards weights leaves > `max_fraction` replicated.

    Like MaxText's guard: a rule set that forgets a dimension (so some large
    weight sits whole on every device) fails loudly instead of running out of memory.

    **Returns:** the `replicated_fraction` (0.0 when the rules shard no weights).
    """
    frac = replicated_fraction(model, mesh, rules, overrides)
    if frac > max_fraction:
        specs = param_specs(model, rules, overrides, mesh=mesh)
        worst = []
        for (path, x), s in zip(
            [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(model)[0] if _is_array_like(x)],
            jax.tree.leaves(specs, is_leaf=is_spec), strict=True,
        ):
            if _spec_shards(s, mesh) == 1:
                worst.append((x.size * x.dtype.itemsize, path_str(path)))
        worst = ", ".join(f"{p} ({b} B)" for b, p in sorted(worst, reverse=True)[:5])
        raise ValueError(
            f"rules {rules.name!r} on mesh {dict(mesh.shape)} leave {frac:.1%} of parameter bytes "
            f"replicated (limit {max_fraction:.0%}); largest unsharded: {worst or 'none'}. Add rules for "
            "those dimensions, or raise max_fraction if that is intended."
        )
    return frac


def check_divisibility(
    model: Any, mesh: Mesh, rules: Rules, batch_size: int, seq_len: int,
    overrides: Overrides = None,
) -> None:
    """Raise `ValueError`, before anything compiles, if the mesh cannot split the model's sizes.

    `model` is anything with `logical_sizes()` (a `GPT`, its `eqx.filter_eval_shape`, or
    the model's config): the size of each logical axis (heads, kv heads, MLP width, vocabulary,
    embedding, layers) and its `seq_len`. Each, and the batch and sequence, is checked
    against the product of the mesh axes the rules (and overrides) map it to, in both
    tables. `kv_heads` that the tensor axis does not divide are replicated instead
    (Megatron's GQA layout).
    """
    c = dict(model.logical_sizes())
    max_len, head_dim = c.pop("seq_len"), c["head_dim"]
    sizes = {"batch": batch_size, "seq": seq_len, "inner_seq": seq_len, **c}
    counts = {"heads": ("heads", c["heads"] // head_dim), "kv_heads": ("kv heads", c["kv_heads"] // head_dim)}
    if seq_len > max_len:
        raise ValueError(f"seq_len {seq_len} is longer than the model's seq_len {max_len}.")
    for r in [rules, *(overrides or {}).values()]:
        for kind in ("params", "activations"):
            for name, axes in r.table(kind).items():
                axes = tuple(a for a in axes if mesh.shape[a] > 1)
                if name not in sizes or not axes:
                    continue
                n = math.prod(mesh.shape[a] for a in axes)
                label, count = counts.get(name, (name, sizes[name]))
                if count % n and name in REPLICATE_IF_INDIVISIBLE:
                    continue
                if count % n or sizes[name] % n:
                    what = {"batch": "batch size", "seq": "sequence length", "inner_seq": "sequence length",
                            "mlp": "mlp_dim", "vocab": "vocab_size", "embed": "embed_dim",
                            "layers": "num_layers"}.get(name, label)
                    raise ValueError(
                        f"{what} {count} is not divisible by {n} = product of mesh axes {axes} "
                        f"{[mesh.shape[a] for a in axes]} that rules {r.name!r} split {kind} {name!r} over; "
                        "choose sizes the mesh divides or a different mesh."
                    )


__all__ = [
    "param_specs", "param_shardings", "ShardingConstraint", "with_constraints", "place_model",
    "init_sharded", "lower_init", "opt_state_shardings", "place_opt_state", "init_opt_state_sharded",
    "batch_sharding", "replicated_fraction", "check_replication", "check_divisibility",
    "rules_for", "path_str", "like_params",
]
