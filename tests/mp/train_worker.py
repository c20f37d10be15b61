"""A multi-process training worker: `python -m eqgpt.launch --nproc 2 --devices-per-proc 4 -- train_worker.py DIR`.

For each strategy it trains a few steps on the global mesh of all processes'
devices, checks that this process loaded only its rows of each batch, and
process 0 prints `RESULT {...}` with the losses. After the last strategy every
process writes its shards of checkpoint STEPS into DIR.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from eqgpt.distributed import initialize  # noqa: E402

settings = initialize(timeout=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from eqgpt.distributed import check_replicas_agree, check_same_on_all_processes, mesh_fields  # noqa: E402
from eqgpt.parallel import ShardedPlacement, make_mesh  # noqa: E402
from eqgpt.train import make_train_step  # noqa: E402
from eqgpt.train.checkpoint import Checkpointer  # noqa: E402
from mp.common import BATCH, OPTIMIZER, moved, setup, train  # noqa: E402

STEPS = 3
RUNS = {"dp": ("data=8", "dp"), "fsdp+tp": ("fsdp=4,tensor=2", "fsdp+tp")}

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
result = {"process_count": jax.process_count()}
placement, initial, _, loader = setup(*RUNS["dp"])  # initialised once, then moved to each mesh
for name, (mesh, strategy) in RUNS.items():
    placement = ShardedPlacement(make_mesh(mesh), strategy)
    state, step_fn = moved(initial, placement), make_train_step(OPTIMIZER)
    check_same_on_all_processes({"mesh": mesh_fields(placement.mesh), "strategy": strategy}, "mesh")
    check_replicas_agree(state.model)
    # Each process reads only its rows; the global batch is the whole batch, in order.
    local = loader.local_batch(0)
    assert local.shape[0] == BATCH // 2, local.shape
    start, stop = loader.rows
    assert (start, stop) == (jax.process_index() * BATCH // 2, (jax.process_index() + 1) * BATCH // 2)
    whole = np.asarray(multihost_utils.process_allgather(placement.batch(local), tiled=True))
    rows = np.stack([loader.tokens[o: o + loader.seq_len + 1] for o in loader.offsets(0)])
    assert np.array_equal(whole, rows), "the global batch is not the concatenation of the processes' rows"
    state, losses = train(state, step_fn, loader, placement, STEPS)
    result[name] = losses

with Checkpointer(sys.argv[1], every=STEPS, config={"run": "fsdp+tp"}) as ck:
    ck.save(STEPS, state, extras={"data": {"seed": 0, "step": STEPS}})
    ck.wait()
if jax.process_index() == 0:
    print("RESULT " + json.dumps(result), flush=True)
