"""Resuming: exactly (bitwise) on the same mesh, within fp32 noise on other meshes, after SIGTERM.

One uninterrupted 20-step fsdp=8 run is the reference; the other runs are cut
at step 10 (or wherever SIGTERM lands), checkpointed, restored and continued.
"""

import os
import signal
import sys
import threading
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

MP = Path(__file__).parent / "mp"
sys.path.insert(0, str(MP.parent))

from eqgpt.data import BatchLoader  # noqa: E402
from eqgpt.parallel import ShardedPlacement, make_mesh  # noqa: E402
from eqgpt.train import SingleDevice, make_train_step  # noqa: E402
from eqgpt.train.checkpoint import Checkpointer  # noqa: E402
from mp.common import OPTIMIZER, TOTAL_STEPS, losses, setup, target, trainer  # noqa: E402


def arrays(state):
    leaves = jax.tree.leaves(eqx.filter((state.model, state.opt_state, state.step), eqx.is_array))
    return [np.asarray(x) for x in leaves]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, and a 10-step run that checkpointed at 5 and 10 (fsdp=8)."""
    directory = tmp_path_factory.mktemp("resume")
    placement, state, step_fn, loader = setup("fsdp=8", "fsdp")
    copy = lambda t: jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, t)  # noqa: E731
    fresh, spare = copy(state), copy(state)  # the step donates its input state
    full = trainer(state, step_fn, loader, placement, steps=TOTAL_STEPS)
    final = full.run()
    first = trainer(fresh, step_fn, loader, placement, steps=10,
                    checkpointer=Checkpointer(directory, every=5, keep=3, config={"model": {"seed": 0}}))
    first.run()
    return {"dir": directory, "placement": placement, "step_fn": step_fn, "loader": loader, "like": final,
            "losses": losses(full), "final": arrays(final), "first_losses": losses(first),
            "spare": spare}


def resume(ref, directory, placement, step_fn):
    restored = Checkpointer(directory).restore(target(ref["like"], placement))
    t = trainer(restored.state, step_fn, ref["loader"], placement or SingleDevice(), steps=TOTAL_STEPS)
    return restored, t, t.run()


def test_exact_resume_same_mesh(reference):
    ref = reference
    assert Checkpointer(ref["dir"]).steps() == [5, 10]
    assert ref["first_losses"] == ref["losses"][:10]  # bitwise: same program, same data
    restored, t, final = resume(ref, ref["dir"], ref["placement"], ref["step_fn"])
    assert restored.step == 10 and restored.extras == {"data": {"seed": 0, "step": 10}}
    assert losses(t) == ref["losses"][10:]
    for a, b in zip(arrays(final), ref["final"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.parametrize("mesh, strategy", [("data=4,tensor=2", "dp+tp"), (None, None)])
def test_elastic_resume(reference, mesh, strategy):
    """Saved under fsdp=8; continued under data=4,tensor=2 and on one device."""
    ref = reference
    placement = ShardedPlacement(make_mesh(mesh), strategy) if mesh else None
    restored, t, final = resume(ref, ref["dir"], placement, make_train_step(OPTIMIZER))
    assert restored.step == 10
    leaf = restored.state.model.blocks.attn.q_proj.weight
    assert leaf.sharding.is_equivalent_to(target(ref["like"], placement).model.blocks.attn.q_proj.weight.sharding, 3)
    np.testing.assert_allclose(losses(t), ref["losses"][10:], rtol=2e-5)
    for a, b in zip(arrays(final), ref["final"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # Adam amplifies noise on ~0 gradients


class SignalAt(BatchLoader):
    """A loader that sends this process SIGTERM when the trainer fetches batch `at`."""

    at = 6

    def local_batch(self, step):
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().local_batch(step)


def test_sigterm_leaves_a_checkpoint_that_resumes_exactly(reference, tmp_path):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be installed from the main thread")
    ref = reference
    base = ref["loader"]
    loader = SignalAt(base.tokens, batch_size=base.batch_size, seq_len=base.seq_len, seed=base.seed)
    before = signal.getsignal(signal.SIGTERM)
    t = trainer(ref["spare"], ref["step_fn"], loader, ref["placement"], steps=TOTAL_STEPS,
                checkpointer=Checkpointer(tmp_path, every=1000))
    t.run()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is removed again
    assert t.interrupted and t.stop_signal == signal.SIGTERM
    stopped = int(t.state.step)
    assert stopped == SignalAt.at + 1  # the step in flight finished, then the loop stopped
    assert Checkpointer(tmp_path).steps() == [stopped]
    restored, resumed, final = resume(ref, tmp_path, ref["placement"], ref["step_fn"])
    assert restored.step == stopped
    assert losses(t) + losses(resumed) == ref["losses"]
    for a, b in zip(arrays(final), ref["final"], strict=True):
        np.testing.assert_array_equal(a, b)
