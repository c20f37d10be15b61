"""Resuming: exactly (bitwise) on the same mesh, within fp32 noise on other meshes, after SIGTERM.

One uninterrupted 20-step fsdp=8 run is the reference; the other runs are cut
at step 10 (or where SIGTERM lands), checkpointed, restored and continued.
"""

import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from filelock import FileLock

MP = Path(__file__).parent / "mp"
sys.path.insert(0, str(MP.parent))

from eqgpt.data import BatchLoader  # noqa: E402
from eqgpt.parallel import ShardedPlacement, make_mesh  # noqa: E402
from eqgpt.train import SingleDevice  # noqa: E402
from eqgpt.train.checkpoint import Checkpointer  # noqa: E402
from mp.common import TOTAL_STEPS, losses, setup, step_fn, target, trainer  # noqa: E402


def arrays(state):
    leaves = jax.tree.leaves(eqx.filter((state.model, state.opt_state, state.step), eqx.is_array))
    return [np.asarray(x) for x in leaves]


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted run's losses and final arrays, and checkpoints 5 and 10 of a 10-step run.

    Computed once per test session and shared through files, so that with
    pytest-xdist a second worker loads it instead of compiling it again.
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # workers' base dirs share this session's parent
        base = base.parent
    root = base / "eqgpt-resume-reference"
    with FileLock(str(root) + ".lock"):
        if not (root / "done").exists():
            placement, state, step, loader = setup("fsdp=8", "fsdp")
            fresh = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, state)  # steps donate
            full = trainer(state, step, loader, placement, steps=TOTAL_STEPS)
            final = full.run()
            first = trainer(fresh, step, loader, placement, steps=10,
                            checkpointer=Checkpointer(root / "ckpt", every=5, keep=3))
            first.run()
            np.savez(root / "final.npz", *arrays(final))
            (root / "losses.json").write_text(json.dumps({"full": losses(full), "first": losses(first)}))
            (root / "done").touch()
    got = json.loads((root / "losses.json").read_text())
    with np.load(root / "final.npz") as f:
        final = [f[f"arr_{i}"] for i in range(len(f.files))]
    return {"dir": root / "ckpt", "losses": got["full"], "first_losses": got["first"], "final": final}


def continue_from(directory, placement, loader=None):
    """Restore the latest checkpoint onto `placement` (None: one device) and train to the end."""
    like = setup("fsdp=8", "fsdp")[1]  # shapes and structure only
    restored = Checkpointer(directory).restore(target(like, placement))
    loader = loader or setup("fsdp=8", "fsdp")[3]
    t = trainer(restored.state, step_fn(), loader, placement or SingleDevice(), steps=TOTAL_STEPS)
    sharding = restored.state.model.blocks.attn.q_proj.weight.sharding  # read before the steps donate it
    return dataclasses.replace(restored, extras={**restored.extras, "sharding": sharding}), t, t.run()


class SignalAt(BatchLoader):
    """A loader that sends this process SIGTERM when the trainer fetches batch `at`."""

    at = 6

    def local_batch(self, step):
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().local_batch(step)


def test_exact_resume_and_preemption(reference, tmp_path):
    ref = reference
    # 10 steps + checkpoint + restore + 10 steps == 20 steps, bitwise.
    assert Checkpointer(ref["dir"]).steps() == [5, 10]
    assert ref["first_losses"] == ref["losses"][:10]
    restored, t, final = continue_from(ref["dir"], ShardedPlacement(make_mesh("fsdp=8"), "fsdp"))
    assert restored.step == 10 and restored.extras["data"] == {"seed": 0, "step": 10}
    assert losses(t) == ref["losses"][10:]
    for a, b in zip(arrays(final), ref["final"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert ref["losses"][-1] < ref["losses"][0]

    # SIGTERM during training: the step in flight finishes, a checkpoint is written, the loop stops.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be installed from the main thread")
    placement, state, step, base = setup("fsdp=8", "fsdp")
    loader = SignalAt(base.tokens, batch_size=base.batch_size, seq_len=base.seq_len, seed=base.seed)
    before = signal.getsignal(signal.SIGTERM)
    stopped_run = trainer(state, step, loader, placement, steps=TOTAL_STEPS,
                          checkpointer=Checkpointer(tmp_path, every=1000))
    stopped_run.run()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is removed again
    assert stopped_run.interrupted and stopped_run.stop_signal == signal.SIGTERM
    stopped = int(stopped_run.state.step)
    assert stopped == SignalAt.at + 1
    assert Checkpointer(tmp_path).steps() == [stopped]
    restored, resumed, final = continue_from(tmp_path, placement)
    assert restored.step == stopped
    assert losses(stopped_run) + losses(resumed) == ref["losses"]
    for a, b in zip(arrays(final), ref["final"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_elastic_resume(reference):
    """Saved under fsdp=8; continued under data=4,tensor=2 and on one device."""
    ref = reference
    for placement in (ShardedPlacement(make_mesh("data=4,tensor=2"), "dp+tp"), None):
        restored, t, final = continue_from(ref["dir"], placement)
        assert restored.step == 10
        if placement is None:
            assert len(restored.extras['sharding'].device_set) == 1
        else:
            assert restored.extras['sharding'].mesh.shape == placement.mesh.shape
            assert "tensor" in str(restored.extras['sharding'].spec)
        np.testing.assert_allclose(losses(t), ref["losses"][10:], rtol=2e-5)
        for a, b in zip(arrays(final), ref["final"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # Adam amplifies noise on ~0 gradients
