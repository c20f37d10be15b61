"""Resuming: exactly (bitwise) on the same mesh, within fp32 noise on other meshes, after SIGTERM.

One uninterrupted 20-step fsdp=8 run is the reference; the other runs are cut
at step 10 (or wherever SIGTERM lands), checkpointed, restored and continued.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

MP = Path(__file__).parent / "mp"
sys.path.insert(0, str(MP.parent))

from eqgpt.parallel import ShardedPlacement, make_mesh  # noqa: E402
from eqgpt.train import SingleDevice, make_train_step  # noqa: E402
from eqgpt.train.checkpoint import Checkpointer  # noqa: E402
from eqgpt.train.preemption import PREEMPTED_EXIT_CODE  # noqa: E402
from mp.common import OPTIMIZER, TOTAL_STEPS, losses, setup, target, trainer  # noqa: E402


def arrays(state):
    leaves = jax.tree.leaves(eqx.filter((state.model, state.opt_state, state.step), eqx.is_array))
    return [np.asarray(x) for x in leaves]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, and a 10-step run that checkpointed at 5 and 10 (fsdp=8)."""
    directory = tmp_path_factory.mktemp("resume")
    placement, state, step_fn, loader = setup("fsdp=8", "fsdp")
    like = jax.tree.map(lambda x: x, state)  # shapes and shardings of a fresh state
    full = trainer(state, step_fn, loader, placement, steps=TOTAL_STEPS)
    final = full.run()
    _, state, _, _ = setup("fsdp=8", "fsdp")
    first = trainer(state, step_fn, loader, placement, steps=10,
                    checkpointer=Checkpointer(directory, every=5, keep=3, config={"model": {"seed": 0}}))
    first.run()
    return {"dir": directory, "placement": placement, "step_fn": step_fn, "loader": loader, "like": like,
            "losses": losses(full), "final": arrays(final), "first_losses": losses(first)}


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


def test_sigterm_leaves_a_checkpoint_that_resumes_exactly(reference, tmp_path):
    ref = reference
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(MP / "resume_worker.py"), str(tmp_path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("STEP 6"):
                proc.send_signal(signal.SIGTERM)
                break
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(seen) + out
    assert proc.returncode == PREEMPTED_EXIT_CODE, text[-3000:]
    stopped = int(text.split("STOPPED AT ")[1].split()[0])
    assert 6 < stopped < TOTAL_STEPS and "interrupted=True" in text and f"signal={int(signal.SIGTERM)}" in text
    assert Checkpointer(tmp_path).steps() == [stopped]
    restored, t, final = resume(ref, tmp_path, ref["placement"], ref["step_fn"])
    assert restored.step == stopped
    assert losses(t) == ref["losses"][stopped:]
    for a, b in zip(arrays(final), ref["final"], strict=True):
        np.testing.assert_array_equal(a, b)
