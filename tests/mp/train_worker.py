"""A multi-process training worker: `python -m eqgpt.launch --nproc 2 --devices-per-proc 4 -- train_worker.py DIR`.

For each strategy it trains a few steps on the global mesh of all processes'
devices (dp in a plain loop, fsdp+tp with the `Trainer`), checks that this
process loaded only its rows of each batch, and process 0 prints `RESULT {...}`
with the losses. The Trainer writes checkpoint STEPS into DIR/ckpt (every
process its own shards) and metrics into DIR/outputs-of-<rank> (process 0 only).
Then training goes on until process 1 alone gets SIGTERM: both processes must
stop after the same step and write that checkpoint. Last, in a copy of DIR/ckpt,
one file that only process 1 checks (processes split the files) is damaged: both
must fall back together, naming it (`FALLBACK ...`).
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from eqgpt.distributed import initialize  # noqa: E402

settings = initialize(timeout=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from eqgpt.data import BatchLoader  # noqa: E402
from eqgpt.distributed import check_replicas_agree, check_same_on_all_processes, mesh_fields  # noqa: E402
from eqgpt.train import Trainer, TrainerConfig  # noqa: E402
from eqgpt.train.checkpoint import Checkpointer  # noqa: E402
from mp.common import BATCH, setup, train  # noqa: E402

STEPS = 3
out = Path(sys.argv[1])
RUNS = {"dp": ("data=8", "dp"), "fsdp+tp": ("fsdp=4,tensor=2", "fsdp+tp")}

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
result = {"process_count": jax.process_count()}
for name, (mesh, strategy) in RUNS.items():
    placement, state, step_fn, loader = setup(mesh, strategy)
    check_same_on_all_processes({"mesh": mesh_fields(placement.mesh), "strategy": strategy}, "mesh")
    check_replicas_agree(state.model)
    # Each process reads only its rows; the global batch is the whole batch, in order.
    local = loader.local_batch(0)  # a Batch of this process's rows
    assert local.shape[0] == BATCH // 2, local.shape
    start, stop = loader.rows
    assert (start, stop) == (jax.process_index() * BATCH // 2, (jax.process_index() + 1) * BATCH // 2)
    whole = np.asarray(multihost_utils.process_allgather(placement.batch(local).tokens, tiled=True))
    rows = np.stack([loader.tokens[o: o + loader.seq_len] for o in loader.offsets(0)])
    assert np.array_equal(whole, rows), "the global batch is not the concatenation of the processes' rows"
    if name == "dp":
        state, result[name] = train(state, step_fn, loader, placement, STEPS)
    else:  # the library's Trainer: only process 0 writes metrics; every process writes its shards
        config = TrainerConfig(steps=STEPS, log_every=1, eval_every=0, progress=True,
                               out_dir=out / f"outputs-of-{jax.process_index()}")
        t = Trainer(step_fn, state, loader, placement, config=config,
                    checkpointer=Checkpointer(out / "ckpt", every=STEPS, config={"run": name}))
        t.run()
        result[name] = [row["loss"] for row in t.history.rows if "loss" in row]

# Preemption: only process 1 gets SIGTERM (JAX's notifier catches it); both must stop at one step.
SIGNAL_AT = STEPS + 2


class SignalAt(BatchLoader):
    def local_batch(self, step):
        if step == SIGNAL_AT and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().local_batch(step)


loader = SignalAt(loader.tokens, batch_size=loader.batch_size, seq_len=loader.seq_len, seed=loader.seed)
t = Trainer(step_fn, t.state, loader, placement, config=TrainerConfig(steps=STEPS + 50, log_every=1, eval_every=0,
                                                                     progress=False),
            checkpointer=Checkpointer(out / "ckpt", every=1000, config={"run": "fsdp+tp"}))
state = t.run()
print(f"STOPPED process {jax.process_index()} at step {int(state.step)} interrupted={t.interrupted}", flush=True)

# A damaged file in process 1's share of the files check (odd positions): both fall back together.
copy = out / "ckpt-copy"
if jax.process_index() == 0:
    import shutil

    shutil.copytree(out / "ckpt", copy)
    newest = max(int(p.name) for p in copy.iterdir() if p.name.isdigit())
    name = sorted(json.loads((copy / str(newest) / "files.json").read_text())["files"])[1]
    damaged = copy / str(newest) / name
    damaged.write_bytes(bytes([damaged.read_bytes()[0] ^ 1]) + damaged.read_bytes()[1:])
multihost_utils.sync_global_devices("eqgpt-test-damaged")
got = Checkpointer(copy, config={"run": "fsdp+tp"}).restore(state)
print(f"FALLBACK process {jax.process_index()} to {got.step}: {got.skipped}", flush=True)
if jax.process_index() == 0:
    print("RESULT " + json.dumps(result), flush=True)
