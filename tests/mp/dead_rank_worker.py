"""A rank that dies: `python -m eqgpt.launch --nproc 2 --devices-per-proc 4 -- dead_rank_worker.py DIR`.

Both processes train the shared tiny set-up on fsdp=8 with the library's
`Trainer`, checkpointing every 2 steps into DIR/ckpt; process 0 prints each
step's loss (`LOSS step value`). When fetching batch KILL_AT, process 1 SIGKILLs
itself: process 0 is then inside that step's collectives, waiting for a peer
that will never answer. The launcher must stop the job and name rank 1.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from eqgpt.distributed import initialize  # noqa: E402

initialize(timeout=60)

import jax  # noqa: E402

from eqgpt.data import BatchLoader  # noqa: E402
from eqgpt.train import Trainer, TrainerConfig  # noqa: E402
from eqgpt.train.checkpoint import Checkpointer  # noqa: E402
from mp.common import TOTAL_STEPS, setup  # noqa: E402

KILL_AT = 7


class Dying(BatchLoader):
    def local_batch(self, step):
        if step == KILL_AT and jax.process_index() == 1:
            print(f"KILLING process 1 at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().local_batch(step)


placement, state, step_fn, loader = setup("fsdp=8", "fsdp")
loader = Dying(loader.tokens, batch_size=loader.batch_size, seq_len=loader.seq_len, seed=loader.seed)
config = TrainerConfig(steps=TOTAL_STEPS, log_every=1, eval_every=0, progress=False)
t = Trainer(step_fn, state, loader, placement, config=config,
            checkpointer=Checkpointer(Path(sys.argv[1]) / "ckpt", every=2, keep=10))


def report(row):
    if "loss" in row:
        print(f"LOSS {row['step']} {row['loss']!r}", flush=True)
    t.history.rows.append(row)


t._log = report
t.run()
print("FINISHED (should not happen)", flush=True)
