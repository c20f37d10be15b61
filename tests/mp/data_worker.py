"""Each of 2 processes (4 devices each) loads its rows through the Grain loader; process 0 prints the global batches.

`python -m eqgpt.launch --nproc 2 --devices-per-proc 4 -- data_worker.py`. The rows
are assembled into global arrays on a `data=8` mesh and gathered back, so the test
can compare them with the batches one process builds alone.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from eqgpt.distributed import initialize  # noqa: E402

initialize(timeout=60)

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from eqgpt.data.grain_source import LoaderConfig, make_loader  # noqa: E402
from eqgpt.parallel import ShardedPlacement, make_mesh  # noqa: E402
from test_data import packed_corpus  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8
tokens, bounds = packed_corpus()
placement = ShardedPlacement(make_mesh("data=8"), "dp")
result = {}
for mode in ("windows", "packed"):
    loader = make_loader(tokens, batch_size=8, seq_len=32, seed=7, docs=bounds, config=LoaderConfig(mode=mode))
    rows = []
    for step in range(4):
        local = loader.local_batch(step)
        assert local.shape == (4, 32)  # this process's rows only
        full = placement.batch(local)
        rows.append({k: multihost_utils.process_allgather(getattr(full, k), tiled=True).tolist()
                     for k in ("tokens", "targets", "segment_ids", "positions", "loss_mask")
                     if getattr(full, k) is not None})
    loader.close()
    result[mode] = rows
if jax.process_index() == 0:
    print("RESULT " + json.dumps(result), flush=True)
