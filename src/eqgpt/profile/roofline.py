"""The memory roofline of a decode step: the bytes it must read over the chip's HBM bandwidth.

A decode step at small batch does little arithmetic per byte, so its floor is reading
every weight once (the position table aside: one row) and the keys and values of every
filled cache position. `decode_step_bytes / hbm_bandwidth` is that floor in seconds.
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np

# HBM bandwidth per chip in bytes/s, by JAX's `device_kind` (Google Cloud's TPU pages).
TPU_HBM_BYTES_PER_S = {"TPU v5 lite": 819e9, "TPU v6 lite": 1640e9, "TPU v5p": 2765e9, "TPU v4": 1228e9}


def hbm_bandwidth(device: jax.Device | None = None) -> float | None:
    """The device's HBM bandwidth in bytes/s from the table, or `None` where it has no entry."""
    device = jax.devices()[0] if device is None else device
    kind = device.device_kind.lower()
    return next((bw for name, bw in TPU_HBM_BYTES_PER_S.items() if name.lower() in kind), None)


def decode_step_bytes(model, batch: int, filled: float, cache_itemsize: int) -> float:
    """Bytes one decode step of `model` must read: its weights (the position table and an
    untied token table excepted: the step reads a row of each) and the keys and values
    of `filled` cache positions for each of `batch` rows."""
    skip = {id(model.pos_embed.weight)} if model.pos_embed is not None else set()
    if model.head is not None:
        skip.add(id(model.tok_embed.weight))
    weights = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)) if id(x) not in skip)
    c = model.config
    cache = 2 * c.num_layers * batch * filled * c.kv_heads * c.head_dim * cache_itemsize
    return float(weights + np.float64(cache))
