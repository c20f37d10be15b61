"""Checkpoints: round trips across meshes, retention, atomicity, damage and incompatibility."""

import glob
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eqgpt.nn import GPT
from eqgpt.parallel import ShardedPlacement, make_mesh
from eqgpt.train import TrainState
from eqgpt.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    abstract_state,
    named_leaves,
)
from helpers import TINY
from mp.common import host_model

HERE = Path(__file__).parent
OPT = optax.adamw(1e-3)


def make_state(optimizer=OPT):
    """A TinyGPT TrainState on one device (values drawn on the host: nothing to compile)."""
    if optimizer not in _STATES:
        model = jax.device_put(host_model())
        _STATES[optimizer] = TrainState(model, optimizer.init(eqx.filter(model, eqx.is_array)), 7,
                                        rng=jax.random.key(1))
    return _STATES[optimizer]


_STATES: dict = {}


def place(state, placement):
    """`state` moved to `placement` (a ShardedPlacement), `scale` times its floating values."""
    model = placement.place_model(state.model)
    return TrainState(model, placement.place_opt_state(state.opt_state, model), state.step, rng=state.rng)


def scaled(state, factor):
    return jax.tree.map(lambda x: x * factor if eqx.is_inexact_array(x) else x, state)


def host(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def assert_same_arrays(a, b):
    la, lb = named_leaves(eqx.filter(a, eqx.is_array)), named_leaves(eqx.filter(b, eqx.is_array))
    assert la.keys() == lb.keys()
    for k in la:
        np.testing.assert_array_equal(host(la[k]), host(lb[k]), err_msg=k)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A TINY GPT + AdamW state on fsdp=8, saved as checkpoints 10 and 20."""
    directory = tmp_path_factory.mktemp("ckpt")
    state = place(make_state(), ShardedPlacement(make_mesh("fsdp=8"), "fsdp"))
    config = {"model": TINY, "train": {"lr": 1e-3}}
    with Checkpointer(directory, every=10, keep=3, config=config) as ck:
        ck.save(10, state, extras={"data": {"seed": 0, "step": 10}})
        ck.save(20, state, extras={"data": {"seed": 0, "step": 20}})
    return directory, state, config


def copy_dir(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_round_trip_onto_other_meshes(saved):
    directory, state, config = saved
    for target in (place(make_state(), ShardedPlacement(make_mesh("data=4,tensor=2"), "dp+tp")),
                   make_state()):
        target = scaled(target, 0.0)  # other values, this run's shardings
        got = Checkpointer(directory, config=config).restore(target)
        assert got.step == 20 and got.extras == {"data": {"seed": 0, "step": 20}} and not got.skipped
        assert got.config["model"]["num_layers"] == TINY.num_layers
        assert_same_arrays(got.state, state)
        for new, want in zip(jax.tree.leaves(eqx.filter(got.state, eqx.is_array)),
                             jax.tree.leaves(eqx.filter(target, eqx.is_array)), strict=True):
            assert new.sharding.is_equivalent_to(want.sharding, new.ndim)
        assert jnp.issubdtype(got.state.rng.dtype, jax.dtypes.prng_key)


def test_restore_into_abstract_target(saved):
    directory, state, config = saved
    mesh = make_mesh("data=8")
    target = abstract_state(make_state())
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
        if isinstance(x, jax.ShapeDtypeStruct) else x, target)
    got = Checkpointer(directory, config=config).restore(target, step=10)
    assert got.step == 10
    assert_same_arrays(got.state, state)
    assert got.state.model.tok_embed.weight.sharding == NamedSharding(mesh, P())


def test_small_replicated_arrays_are_saved_whole(tmp_path, caplog):
    """On data=8 every array is replicated 8 times. Orbax would cut each into 8 slices, one compiled
    jax.jit(slice) apiece (~80 compiles, 1.8 s of each save of a toy model); arrays this small are
    written whole by one replica, by a handler of the Checkpointer's own (Orbax's global one is kept)."""
    import orbax.checkpoint as ocp

    orbax_default = ocp.type_handlers.get_type_handler(jax.Array)
    state = place(make_state(), ShardedPlacement(make_mesh("data=8"), "dp"))
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        with Checkpointer(tmp_path, every=1) as ck:
            ck.save(1, state)
    assert not [r.getMessage() for r in caplog.records if "jit(slice)" in r.getMessage()]
    assert ocp.type_handlers.get_type_handler(jax.Array) is orbax_default
    got = Checkpointer(tmp_path).restore(scaled(state, 0.0))
    assert_same_arrays(got.state, state)


def test_every_and_keep(tmp_path):
    state = {"w": jnp.arange(6.0), "step": jnp.asarray(0)}
    with Checkpointer(tmp_path, every=2, keep=2) as ck:
        saved = [s for s in range(1, 8) if ck.maybe_save(s, {k: v + s for k, v in state.items()})]
        assert saved == [2, 4, 6]
        assert ck.maybe_save(7, state, force=True)  # e.g. on preemption
        ck.wait()
        assert ck.steps() == [6, 7]
        assert not ck.save(7, state)  # an existing step is not rewritten
    got = Checkpointer(tmp_path).restore(state)
    assert got.step == 7
    np.testing.assert_array_equal(got.state["w"], np.arange(6.0))


def test_interrupted_write_is_never_used(tmp_path):
    """A writer SIGKILLed after writing checkpoint 2's arrays, before the commit: 1 is used."""
    proc = subprocess.Popen([sys.executable, str(HERE / "mp" / "interrupted_save.py"), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        for line in proc.stdout:
            if "WRITING" in line:
                break
        assert "WRITING" in line, "the writer ended before it reached the commit"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    leftovers = glob.glob(str(tmp_path / "2.orbax-checkpoint-tmp*"))
    assert leftovers and any(Path(p).rglob("ocdbt.process_0") for p in leftovers), "no partial write left"
    ck = Checkpointer(tmp_path)
    assert ck.steps() == [1]
    target = {"w": jnp.zeros((64, 64)), "rng": jax.random.key(9)}
    got = ck.restore(target)
    assert got.step == 1 and got.extras == {"note": "good"}
    np.testing.assert_array_equal(got.state["w"], np.arange(4096, dtype=np.float32).reshape(64, 64))
    assert ck.interrupted_writes and glob.glob(str(tmp_path / "2.orbax-checkpoint-tmp*"))  # kept until a save
    ck.save(2, got.state)  # the step can be written again
    ck.close()
    assert not glob.glob(str(tmp_path / "2.orbax-checkpoint-tmp*"))  # the first save removed the leftovers
    assert Checkpointer(tmp_path).steps() == [1, 2]


def _damage(kind, step_dir):
    state_dir = step_dir / "state"
    if kind == "missing data file":
        for f in glob.glob(str(state_dir / "ocdbt.process_0" / "d" / "*")):
            os.remove(f)
    elif kind == "flipped bytes":
        f = max(glob.glob(str(state_dir / "ocdbt.process_0" / "d" / "*")), key=os.path.getsize)
        data = bytearray(Path(f).read_bytes())
        data[len(data) // 2] ^= 0xFF
        Path(f).write_bytes(bytes(data))
    elif kind == "missing array metadata":
        os.remove(state_dir / "_METADATA")
    elif kind == "missing meta file":
        os.remove(step_dir / "meta" / "metadata")


@pytest.mark.parametrize("kind", ["missing data file", "flipped bytes", "missing array metadata", "missing meta file"])
def test_damaged_checkpoint_falls_back(tmp_path, kind, caplog):
    state = {"w": jnp.arange(4096.0).reshape(64, 64), "b": jnp.ones(3)}
    with Checkpointer(tmp_path / "run", async_save=False) as ck:
        ck.save(10, state)
        ck.save(20, jax.tree.map(lambda x: x * 2, state))
    _damage(kind, tmp_path / "run" / "20")
    with caplog.at_level(logging.WARNING, logger="eqgpt.train.checkpoint"):
        got = Checkpointer(tmp_path / "run").restore(state)
    assert got.step == 10 and [s for s, _ in got.skipped] == [20]
    np.testing.assert_array_equal(got.state["w"], np.asarray(state["w"]))
    assert "checkpoint 20" in caplog.text and "is corrupt" in caplog.text and "falling back to 10" in caplog.text
    assert (tmp_path / "run" / "20.corrupt").is_dir()  # set aside, so step 20 can be saved again
    assert Checkpointer(tmp_path / "run").steps() == [10]


def test_every_checkpoint_damaged(tmp_path):
    state = {"w": jnp.arange(8.0)}
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, state)
    os.remove(tmp_path / "1" / "meta" / "metadata")
    with pytest.raises(CorruptCheckpointError,
                       match=r"no usable checkpoint .*checkpoint 1: DamagedFileError: file .*meta/metadata is missing"):
        Checkpointer(tmp_path).restore(state)


def test_different_model_config_is_named(saved):
    directory, state, config = saved
    other = {**config, "model": TINY.replace(num_layers=3), "train": {"lr": 5.0}}  # train may change
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"checkpoint 20 .*model\.num_layers: 2 in the checkpoint, 3 in this run"):
        Checkpointer(directory, config=other).restore(state)


def test_how_the_layers_run_may_change_on_resume():
    # The recipe's checkpoints compare `GPTConfig.architecture()`: kernel, remat and
    # scan/unroll change how the same parameters are run, not which parameters they are.
    running = TINY.replace(attention_kernel="blockwise", remat="full", scan_layers=not TINY.scan_layers)
    assert running.architecture() == TINY.architecture()
    assert TINY.replace(num_layers=3).architecture() != TINY.architecture()


def test_different_state_layout_is_named(saved):
    directory, state, config = saved
    def abstract(config, optimizer):  # shapes only: the layout check needs no arrays
        def init(key):
            model = GPT(config, key=key)
            return TrainState(model, optimizer.init(eqx.filter(model, eqx.is_array)), rng=key)
        return eqx.filter_eval_shape(init, jax.random.key(0))

    wider = abstract(TINY.replace(mlp_dim=64), OPT)
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"model\.blocks\.mlp\.up\.weight: \(2, 32, 128\) float32 in the checkpoint, "
                             r"\(2, 32, 64\)"):
        Checkpointer(directory).restore(wider)  # no config given: the arrays tell
    sgd = abstract(TINY, optax.sgd(0.1))
    with pytest.raises(IncompatibleCheckpointError, match=r"the checkpoint has arrays this run lacks: opt_state"):
        Checkpointer(directory, config=config).restore(sgd)


def test_missing_step_and_empty_directory(tmp_path, saved):
    directory, state, config = saved
    assert Checkpointer(tmp_path / "empty").restore(state) is None
    with pytest.raises(CheckpointError, match=r"no committed checkpoint 15 .*committed steps: \[10, 20\]"):
        Checkpointer(directory).restore(state, step=15)
    with pytest.raises(ValueError, match="every"):
        Checkpointer(tmp_path, every=0)
