"""Ring, all-gather and Ulysses attention equal the single-device reference; work balance; memory.

Kernel programs are compiled once per (devices, kernel, mask class) and run for
both orderings and for inputs with and without documents: the layout only
changes data (positions and the order of tokens), not the program.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eqgpt.nn.kernels.blockwise import blockwise_attention
from eqgpt.nn.kernels.reference import reference_attention
from eqgpt.nn.mask import CausalMask, SlidingWindowMask
from eqgpt.parallel import make_mesh
from eqgpt.parallel.context import (
    ContextKernel,
    block_counts,
    from_layout,
    layout_positions,
    ring_attention,
    step_counts,
    to_layout,
)
from eqgpt.profile.memory import memory
from helpers import unchecked

OPTIONS = {"xla_backend_optimization_level": 0}  # LLVM effort only; same HLO, faster compiles
MESHES = {4: "context=4,data=2", 8: "context=8"}
B, T, H, G, D = 2, 64, 4, 2, 8  # GQA: 4 query heads share 2 kv heads
BLOCK = 4
MASKS = {"causal": CausalMask(), "sliding": SlidingWindowMask(11)}
TOL = dict(rtol=1e-5, atol=2e-5)


@functools.cache
def _inputs():
    rng = np.random.default_rng(0)  # numpy: eager jax.random costs seconds of compiles
    q, ct = (rng.standard_normal((B, T, H, D), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, T, G, D), np.float32) for _ in range(2))
    # Documents of uneven lengths whose boundaries fall inside shards and chunks.
    bounds = np.array([[5, 21, 40], [13, 30, 50]])
    docs = np.sum(np.arange(T)[None, :, None] >= bounds[:, None, :], axis=-1).astype(np.int32)
    return q, k, v, ct, {"one document": np.zeros((B, T), np.int32), "documents": docs}


def _grad_program(kernel, mask):
    def program(q, k, v, ct, q_pos, seg):
        def loss(q, k, v):
            out = kernel(q, k, v, mask=mask, q_pos=q_pos, k_pos=q_pos, q_seg=seg, k_seg=seg)
            return jnp.sum(out * ct), out

        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    return jax.jit(program)


@functools.cache
def _reference(mask_name: str):
    q, k, v, ct, segs = _inputs()
    program = _grad_program(reference_attention, MASKS[mask_name])
    compiled = program.lower(q, k, v, ct, jnp.arange(T), segs["documents"]).compile(OPTIONS)
    return {name: compiled(q, k, v, ct, jnp.arange(T), seg) for name, seg in segs.items()}


def _index_positions(q, k, v, *, mask, q_pos, k_pos, **kw):
    """A kernel that, like cuDNN's, takes each token's sequence index for its position."""
    return reference_attention(q, k, v, mask=mask, q_pos=jnp.arange(q.shape[1]), k_pos=jnp.arange(k.shape[1]), **kw)


# Ulysses splits the 4 heads: on 4 devices (its 2 kv heads replicated), not on 8. Around the
# blockwise kernel it keeps the layout; around a kernel blind to positions it sorts the sequence.
ULYSSES = {"ulysses": "blockwise", "ulysses sorted": _index_positions}


@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("n, impl", [(n, i) for n in sorted(MESHES) for i in ("ring", "allgather")]
                         + [(4, u) for u in ULYSSES])
def test_context_attention_matches_reference(n, impl, mask_name):
    """Forward and d/dq, d/dk, d/dv, fp32, both orderings, with documents crossing shards."""
    mesh = make_mesh(MESHES[n])
    q, k, v, ct, segs = _inputs()
    kernel = ContextKernel(mesh, impl.split()[0], block_q=BLOCK, block_k=BLOCK, replaces=ULYSSES.get(impl, "reference"))
    program = _grad_program(kernel, MASKS[mask_name])
    compiled = None
    for ordering in ("zigzag", "contiguous"):
        lay = functools.partial(to_layout, size=n, ordering=ordering)
        pos = jnp.asarray(layout_positions(T, n, ordering))
        for seg_name, seg in segs.items():
            args = (lay(q), lay(k), lay(v), lay(ct), pos, lay(seg))
            if compiled is None:
                compiled = program.lower(*args).compile(OPTIONS)
            out, grads = compiled(*args)
            want_out, want_grads = _reference(mask_name)[seg_name]
            back = functools.partial(from_layout, size=n, ordering=ordering)
            where = f"{impl} n={n} {mask_name} {ordering} {seg_name}"
            np.testing.assert_allclose(back(out), want_out, **TOL, err_msg=f"out, {where}")
            for name, g, want in zip("qkv", grads, want_grads, strict=True):
                np.testing.assert_allclose(back(g), want, **TOL, err_msg=f"d{name}, {where}")


# ------------------------------------------------------------------------------- balance


@pytest.mark.parametrize("n", [4, 8])
def test_zigzag_balances_causal_work(n):
    seq = 16384
    mask = CausalMask()
    steps = {o: step_counts(seq, n, o, mask) for o in ("zigzag", "contiguous")}
    tiles = {o: block_counts(seq, n, o, mask, block_q=128, block_k=128) for o in ("zigzag", "contiguous")}
    assert tiles["zigzag"].max() / tiles["zigzag"].min() <= 1.1
    assert list(steps["zigzag"]) == [n] * n
    # Contiguous: device i computes i + 1 of the n ring steps (max/min = n), and the
    # tiles are at least as unequal.
    assert list(steps["contiguous"]) == list(range(1, n + 1))
    assert tiles["contiguous"].max() / tiles["contiguous"].min() >= n
    # Both orderings do the same total work: causal halves the square.
    assert tiles["zigzag"].sum() == tiles["contiguous"].sum()


class _CountingCausal(CausalMask):
    """A causal mask that reports, from inside the kernel, each tile it is evaluated on."""

    def _allowed(self, q_pos, k_pos):
        jax.debug.callback(_record, jax.lax.axis_index("context"))
        return super()._allowed(q_pos, k_pos)


_counts: list[int] = []


def _record(device):
    _counts.append(int(device))


@pytest.mark.parametrize("ordering", ["zigzag", "contiguous"])
def test_ring_computes_exactly_the_counted_tiles(ordering):
    """The tiles the ring kernel evaluates per device are those `block_counts` predicts."""
    n = 4
    mesh = make_mesh("context=4", devices=jax.devices()[:n])
    q, k, v, _, _ = _inputs()
    pos = jnp.asarray(layout_positions(T, n, ordering))
    # All mesh axes manual: `jax.debug.callback` does not run in a partly-automatic shard_map.
    seq = P(None, "context")
    kernel = jax.shard_map(
        lambda q, k, v, p: ring_attention(q, k, v, mask=_CountingCausal(), q_pos=p, k_pos=p,
                                          block_q=BLOCK, block_k=BLOCK, q_chunks=2),
        mesh=mesh, in_specs=(seq, seq, seq, P("context")), out_specs=seq,
    )
    _counts.clear()
    out = jax.jit(kernel)(q, k, v, pos)
    jax.block_until_ready(out)
    jax.effects_barrier()
    seen = np.bincount(np.asarray(_counts, int), minlength=n)
    np.testing.assert_array_equal(seen, block_counts(T, n, ordering, CausalMask(), block_q=BLOCK, block_k=BLOCK))


# -------------------------------------------------------------------------------- memory


def _temp_bytes(kernel, sharding, seq, b=1, h=8, g=2, d=64):
    mask, pos = CausalMask(), jnp.arange(seq)

    def loss(q, k, v, ct):
        return jnp.sum(kernel(q, k, v, mask=mask, q_pos=pos, k_pos=pos) * ct)

    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)  # noqa: E731
    args = spec(b, seq, h, d), spec(b, seq, g, d), spec(b, seq, g, d), spec(b, seq, h, d)
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).compile(OPTIONS)
    return memory(compiled).temp_bytes


def test_ring_memory_per_device_at_16k():
    """Compiled, not run: ring forward+backward temporaries per device on n=8 devices are at
    most one device's temporaries / n plus the ring's own buffers, all O(T/n):

    - k/v shards in flight (the current and the incoming one) and their fp32 gradients
      (accumulating and shifted): 4 |k_i + v_i|;
    - one query chunk's working set (its q, out and dout slices and its dq): 4 |q_i| / chunks.

    (A fixed "1/6 of one device" held on jax 0.10 only because its CPU compiler copied q,
    dout, k and v into the tile layout of the single-device kernel, 80 MiB of the 145 MiB
    reference; jax 0.12 reads them in place, so the reference fell to 65 MiB and the
    ring's fixed buffers, 8 of its 19 MiB here, made the ratio 0.29. See
    benchmarks/ring_memory.py for the table on both versions.)
    """
    seq, n, b, h, g, d = 16384, 8, 1, 8, 2, 64
    single = _temp_bytes(
        functools.partial(blockwise_attention, block_q=128, block_k=128),
        NamedSharding(make_mesh("context=1", devices=jax.devices()[:1]), P()), seq, b, h, g, d,
    )
    mesh = make_mesh(f"context={n}")
    kernel = ContextKernel(mesh, "ring")
    ring = _temp_bytes(kernel, NamedSharding(mesh, P(None, "context")), seq, b, h, g, d)
    shard, f32 = seq // n, 4
    q_i, kv_i = b * shard * h * d * f32, 2 * b * shard * g * d * f32
    own = 4 * kv_i + 4 * q_i // kernel.chunks_for(shard)
    assert ring <= single / n + own, (ring, single, own)


def _scanned_layers_temp_bytes(seq, impl="ring", layers=2):
    """Temporaries of grad through `layers` scanned attention layers (as a GPT runs them)."""
    b, h, g, d = 2, 4, 2, 16
    mesh = make_mesh(MESHES[4])
    kernel, pos = ContextKernel(mesh, impl), jnp.arange(seq)

    def layer(x, w):
        qkv = (x @ w).reshape(b, seq, h + 2 * g, d)
        q, k, v = qkv[:, :, :h], qkv[:, :, h:h + g], qkv[:, :, h + g:]
        return kernel(q, k, v, mask=CausalMask(), q_pos=pos, k_pos=pos).reshape(b, seq, h * d), None

    def loss(w, x):
        return jnp.sum(jax.lax.scan(layer, x, w)[0])

    x = jax.ShapeDtypeStruct((b, seq, h * d), jnp.float32, sharding=NamedSharding(mesh, P("data", "context")))
    w = jax.ShapeDtypeStruct((layers, h * d, (h + 2 * g) * d), jnp.float32)
    return memory(jax.jit(jax.grad(loss)).lower(w, x).compile(OPTIONS)).temp_bytes


def test_memory_stays_linear_inside_scanned_layers():
    """Masks depend on positions only; in a differentiated scan JAX would hoist them out of the
    kernel's loops and store every tile's (quadratic). Doubling the sequence must ~double memory."""
    small, large = _scanned_layers_temp_bytes(1024), _scanned_layers_temp_bytes(2048)
    assert large < 2.5 * small, (small, large)


# -------------------------------------------------------------------------------- errors


def test_zigzag_needs_a_multiple_of_2n():
    with pytest.raises(ValueError, match="divisible by 8"):
        layout_positions(100, 4, "zigzag")
    layout_positions(100, 4, "contiguous")  # 100 = 4 * 25 is fine contiguous
    with pytest.raises(ValueError, match="divisible by 4"):
        layout_positions(102, 4, "contiguous")
    with pytest.raises(ValueError, match="ordering"), unchecked():  # the explicit error, past the type check
        layout_positions(64, 4, "striped")


def test_kernel_runs_per_device_where_context_is_manual_and_defers_on_one_device():
    """Inside a `shard_map` that is already manual over `context` (as pipeline stages run),
    the kernel computes on the local shards; on a context axis of size 1 it calls the
    kernel it replaced."""
    n = 4
    mesh = make_mesh(MESHES[n])
    q, k, v, _, segs = _inputs()
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    pos = jnp.asarray(layout_positions(T, n, "zigzag"))
    lay = functools.partial(to_layout, size=n, ordering="zigzag")
    kernel = ContextKernel(mesh, "allgather", block_q=BLOCK, block_k=BLOCK)

    def local(q, k, v, p, s):
        return kernel(q, k, v, mask=CausalMask(), q_pos=p, k_pos=p, q_seg=s, k_seg=s)

    seq = P(None, "context")
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, P("context"), seq), out_specs=seq,
                           axis_names={"context"})
    out = jax.jit(mapped)(lay(q), lay(k), lay(v), pos, lay(segs["documents"]))
    docs = jnp.asarray(segs["documents"])
    want = reference_attention(q, k, v, mask=CausalMask(), q_pos=jnp.arange(T), k_pos=jnp.arange(T),
                               q_seg=docs, k_seg=docs)
    np.testing.assert_allclose(from_layout(out, n), want, **TOL)

    calls = []

    def mine(q, k, v, **kw):
        calls.append(q.shape)
        return reference_attention(q, k, v, **kw)

    one = ContextKernel(make_mesh("data=8"), "ring", replaces=mine)  # context=1: nothing to split
    out = one(q, k, v, mask=CausalMask(), q_pos=jnp.arange(T), k_pos=jnp.arange(T))
    assert calls == [q.shape]
    np.testing.assert_allclose(out, reference_attention(q, k, v, mask=CausalMask(), q_pos=jnp.arange(T),
                                                        k_pos=jnp.arange(T)), **TOL)


def test_kernel_rejects_bad_configuration():
    mesh = make_mesh(MESHES[4])
    with pytest.raises(ValueError, match="ring"), unchecked():  # the explicit error, past the type check
        ContextKernel(mesh, "tree")
    kernel = ContextKernel(mesh, "ring", block_q=BLOCK, block_k=BLOCK)
    q = jnp.zeros((1, 18, H, D))
    kv = jnp.zeros((1, 18, G, D))
    with pytest.raises(ValueError, match="divisible by 4"):
        kernel(q, kv, kv, mask=CausalMask(), q_pos=jnp.arange(18), k_pos=jnp.arange(18))
    with pytest.raises(ValueError, match="q_chunks"):
        ContextKernel(mesh, "ring", q_chunks=3)(
            q[:, :16], kv[:, :16], kv[:, :16], mask=CausalMask(), q_pos=jnp.arange(16), k_pos=jnp.arange(16)
        )
