"""Names of pytree leaves: a JAX key path as one dotted string, the one helper every part uses
(sharding overrides, checkpoints, Hugging Face tensor maps, replication checks)."""

from __future__ import annotations


def path_str(path: tuple) -> str:
    """A JAX key path as a dotted string: `(.blocks, .attn, .q_proj)` -> `"blocks.attn.q_proj"`."""
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


__all__ = ["path_str"]
