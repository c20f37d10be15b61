"""Fill the disk under a checkpoint directory, then save: `python disk_full.py DIR MODE`.

MODE `tmpfs`: DIR is a small tmpfs (the test mounts it in a user namespace); after
checkpoint 1 the rest of it is filled, leaving a few KiB. MODE `fsize`: the
process's file-size limit (RLIMIT_FSIZE) drops to 4 KiB after checkpoint 1, so
every larger write fails (EFBIG), as on a full disk. Checkpoint 2 must fail
with a `CheckpointWriteError` naming step 2, and checkpoint 1 must restore.
Prints `ERROR <message>` and `RESTORED <step>`.
"""

import os
import resource
import signal
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eqgpt.train.checkpoint import Checkpointer, CheckpointWriteError  # noqa: E402

directory, mode = Path(sys.argv[1]), sys.argv[2]
state = {"w": jnp.arange(32_768, dtype=jnp.float32), "b": jnp.ones(3)}
ck = Checkpointer(directory / "ckpt", every=1, keep=3)
ck.save(1, state)
ck.wait()
if mode == "tmpfs":
    free = os.statvfs(directory)
    with open(directory / "filler", "wb") as f:  # leave 8 KiB
        f.write(b"\0" * max(0, free.f_bavail * free.f_frsize - 8192))
else:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    ck.save(2, {"w": state["w"] * 2, "b": state["b"]})
    ck.wait()
    print("SAVED 2 (no error)", flush=True)
except CheckpointWriteError as e:
    print(f"ERROR {e}", flush=True)
got = Checkpointer(directory / "ckpt").restore(state)
assert not got.skipped, got.skipped
np.testing.assert_array_equal(np.asarray(got.state["w"]), np.arange(32_768, dtype=np.float32))
print(f"RESTORED {got.step}", flush=True)
