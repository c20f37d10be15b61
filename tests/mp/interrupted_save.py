"""Writes checkpoint 1, then starts checkpoint 2 and stalls inside the write until killed.

Usage: python interrupted_save.py DIR. Prints "WRITING" once checkpoint 2's
arrays are on disk in Orbax's temporary directory and only the commit (rename)
is left; the test then SIGKILLs this process.
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from orbax.checkpoint._src.path import atomicity  # noqa: E402

from eqgpt.train.checkpoint import Checkpointer  # noqa: E402


def stall(self):
    print("WRITING", flush=True)
    while True:
        time.sleep(1)


async def stalled_finalize(self):
    stall(self)


def main(directory: str) -> None:
    state = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64), "rng": jax.random.key(0)}
    ck = Checkpointer(directory, every=1, keep=3)
    ck.save(1, state, extras={"note": "good"})
    ck.wait()
    atomicity.AtomicRenameTemporaryPath.finalize = stalled_finalize
    ck.save(2, jax.tree.map(lambda x: x, {"w": state["w"] + 1, "rng": state["rng"]}))
    ck.wait()  # never returns: the commit stalls


if __name__ == "__main__":
    main(sys.argv[1])
