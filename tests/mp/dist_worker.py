"""Start-up checks in real processes. `python dist_worker.py MODE`; settings from EQGPT_*/SLURM env.

Modes: `init` (join and report), `config` (rank 1 holds another num_layers),
`params` (rank 1 holds other values of a replicated array). Extra settings:
TEST_TIMEOUT (start-up timeout, s), TEST_NUM_PROCESSES (overrides the process count).
"""

import os
import sys

from eqgpt.distributed import initialize

mode = sys.argv[1]
count = os.environ.get("TEST_NUM_PROCESSES")
settings = initialize(num_processes=int(count) if count else None,
                      timeout=float(os.environ.get("TEST_TIMEOUT", "60")), shutdown_timeout=10)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from eqgpt.distributed import check_replicas_agree, check_same_on_all_processes  # noqa: E402

rank = jax.process_index()
if mode == "init":
    print(f"OK process {rank} of {jax.process_count()}, {jax.device_count()} devices, "
          f"coordinator from {settings.sources.get('coordinator', settings.cluster)}", flush=True)
elif mode == "config":
    check_same_on_all_processes({"model": {"num_layers": 2 + rank, "embed_dim": 32}, "seed": 0})
elif mode == "params":
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = NamedSharding(mesh, PartitionSpec())

    def replicated_from_local(value):  # as a jit with a per-process seed would leave it
        shards = [jax.device_put(value, d) for d in replicated.addressable_devices]
        return jax.make_array_from_single_device_arrays(value.shape, replicated, shards)

    same = replicated_from_local(np.arange(4.0))
    differs = replicated_from_local(np.full((4,), float(rank)))
    check_replicas_agree({"same": same, "blocks": {"w": differs}})
print(f"DONE {rank}", flush=True)
