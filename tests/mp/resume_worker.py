"""Trains the shared set-up on fsdp=8 until SIGTERM: `python resume_worker.py DIR`.

Prints `STEP n` as it fetches each batch (so a test knows when to signal), and
exits with `PREEMPTED_EXIT_CODE` after the Trainer wrote its checkpoint.
"""

import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
sys.path.insert(0, str(Path(__file__).parent.parent))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

from eqgpt.data import BatchLoader  # noqa: E402
from eqgpt.train.checkpoint import Checkpointer  # noqa: E402
from eqgpt.train.preemption import PREEMPTED_EXIT_CODE  # noqa: E402
from mp.common import TOTAL_STEPS, setup, trainer  # noqa: E402


class Announcing(BatchLoader):
    def local_batch(self, step):
        print(f"STEP {step}", flush=True)
        return super().local_batch(step)


placement, state, step_fn, loader = setup("fsdp=8", "fsdp")
loader.__class__ = Announcing
t = trainer(state, step_fn, loader, placement, steps=TOTAL_STEPS,
            checkpointer=Checkpointer(sys.argv[1], every=1000, keep=2))
state = t.run()
print(f"STOPPED AT {int(state.step)} interrupted={t.interrupted} signal={t.stop_signal}", flush=True)
sys.exit(PREEMPTED_EXIT_CODE if t.interrupted else 0)
