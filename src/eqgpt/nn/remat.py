"""Gradient-checkpointing policies by name, built on `jax.checkpoint` policies.

- `"none"`: save every residual (no recomputation).
- `"full"`: save nothing inside the block; recompute it in the backward pass.
- `"dots"`: save matmul outputs without batch dimensions, recompute the rest.
- `"names:a,b"`: save only the tensors tagged `a`, `b` with `checkpoint_name`.
- `"offload:a,b"`: move the tensors tagged `a`, `b` to host memory instead of
  keeping them on the device (needs a backend with pinned host memory).

Named by what they save, as MaxText names its policies (`POLICIES`):

- `"minimal"`: every matmul output (`"dots"`): the least recomputation;
- `"save_dot_except_mlp"`: the attention projections (q, k, v and out);
- `"save_qkv_proj"`: the q, k, v projections;
- `"save_out_proj"`: the attention output projection.

Tag names: query_proj, key_proj, value_proj, attn_out, mlp_in, mlp_out.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

CHECKPOINT_NAMES = ("query_proj", "key_proj", "value_proj", "attn_out", "mlp_in", "mlp_out")


POLICIES = {
    "minimal": "dots",
    "save_dot_except_mlp": "names:query_proj,key_proj,value_proj,attn_out",
    "save_qkv_proj": "names:query_proj,key_proj,value_proj",
    "save_out_proj": "names:attn_out",
}
REMAT_CHOICES = ("none", "full", *POLICIES, "dots", "names:...", "offload:...")


def _names(spec: str) -> list[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CHECKPOINT_NAMES))
    if not names or unknown:
        raise ValueError(f"remat names {unknown or '(none)'} not among {CHECKPOINT_NAMES}.")
    return names


def remat_policy(remat: str) -> Callable | None:
    """The `jax.checkpoint` policy for `remat`, or `None` for `"full"`."""
    cp = jax.checkpoint_policies
    remat = POLICIES.get(remat, remat)
    if remat == "full":
        return None
    if remat == "dots":
        return cp.dots_with_no_batch_dims_saveable
    if remat.startswith("names:"):
        return cp.save_only_these_names(*_names(remat[len("names:"):]))
    if remat.startswith("offload:"):
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=_names(remat[len("offload:"):]),
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ValueError(f"Unknown remat {remat!r}; choose one of {', '.join(REMAT_CHOICES)}.")


def apply_remat(fn: Callable, remat: str) -> Callable:
    """`fn` wrapped in `jax.checkpoint` with the policy named by `remat`."""
    if remat == "none":
        return fn
    return jax.checkpoint(fn, policy=remat_policy(remat))
