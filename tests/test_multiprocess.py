"""Multi-process JAX: settings resolution, start-up failures, consistency checks, 2 x 4 == 1 x 8.

Real processes with gloo collectives; every child runs under a hard timeout and
is killed (with its process group) when a test ends early.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

from eqgpt.distributed import (
    STARTUP_TIMEOUT_EXIT_CODE,
    detect_cluster,
    flatten_fields,
    resolve_settings,
)
from eqgpt.launch import free_port
from eqgpt.parallel.flags import tyro_registry

MP = Path(__file__).parent / "mp"
sys.path.insert(0, str(MP.parent))
ROOT = MP.parent.parent


class Job:
    """A child process (or launcher) in its own session, stopped for sure when the test ends."""

    def __init__(self, args, env=None, launcher=False):
        self.launcher = launcher
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, *args], env=full_env, cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

    def result(self, timeout, peers=()):
        """(exit code, output); past `timeout` s, stops this job and its `peers` and fails with the
        output of each."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            outputs = []
            for job in (self, *[p for p in peers if p is not self]):
                job.stop()
                outputs.append(job.proc.communicate()[0][-3000:])
            pytest.fail(f"timed out after {timeout} s:\n" + "\n---- a peer:\n".join(outputs))
        return self.proc.returncode, out

    def stop(self):
        if self.proc.poll() is None:
            if self.launcher:  # twice: forward, then SIGKILL the ranks
                for _ in range(2):
                    self.proc.send_signal(signal.SIGTERM)
                    time.sleep(0.2)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def jobs():
    started = []

    def start(*args, **kw):
        started.append(Job(*args, **kw))
        return started[-1]

    yield start
    for job in started:
        job.stop()


def launch(nproc, devices, script, *args):
    return ["-m", "eqgpt.launch", "--nproc", str(nproc), "--devices-per-proc", str(devices),
            "--timeout", "280", "--grace", "3", "--", str(script), *args]


# --- settings (no processes) ---------------------------------------------------------------------


def test_settings_order_explicit_env_cluster():
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[001-004]", "SLURM_NTASKS": "4",
             "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}
    assert detect_cluster(slurm) == "slurm" and detect_cluster({}) is None
    s = resolve_settings(environ=slurm)
    assert (s.num_processes, s.process_id, s.coordinator, s.cluster) == (4, 2, None, "slurm")
    assert s.sources == {"num_processes": "slurm", "process_id": "slurm"}
    env = {**slurm, "EQGPT_COORDINATOR": "10.0.0.1:1234", "EQGPT_NUM_PROCESSES": "4", "EQGPT_PROCESS_ID": "3"}
    s = resolve_settings(environ=env)
    assert (s.coordinator, s.process_id, s.cluster) == ("10.0.0.1:1234", 3, None)
    assert s.sources["process_id"] == "EQGPT_PROCESS_ID"
    s = resolve_settings("h:1", 8, 5, environ=env)
    assert (s.coordinator, s.num_processes, s.process_id) == ("h:1", 8, 5)
    assert set(s.sources.values()) == {"argument"}
    # Kubernetes indexed Job: the pod index stands in for EQGPT_PROCESS_ID.
    k8s = {"EQGPT_COORDINATOR": "train-0.train:1234", "EQGPT_NUM_PROCESSES": "4", "JOB_COMPLETION_INDEX": "3"}
    assert resolve_settings(environ=k8s).process_id == 3
    ompi = {"OMPI_MCA_orte_hnp_uri": "1;tcp://10.0.0.2:5", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
    assert resolve_settings(environ=ompi).cluster == "ompi"
    assert resolve_settings(environ={}).num_processes == 1  # nothing set: one process


@pytest.mark.parametrize("env, match", [
    ({"EQGPT_NUM_PROCESSES": "2", "EQGPT_PROCESS_ID": "2", "EQGPT_COORDINATOR": "h:1"},
     r"process_id 2 .* outside 0\.\.1"),
    ({"EQGPT_NUM_PROCESSES": "2", "EQGPT_PROCESS_ID": "0"}, r"no coordinator address"),
    ({"EQGPT_NUM_PROCESSES": "two"}, r"num_processes from EQGPT_NUM_PROCESSES must be an integer"),
    ({"EQGPT_NUM_PROCESSES": "2", "EQGPT_PROCESS_ID": "1", "EQGPT_COORDINATOR": "h"}, r"must be host:port"),
    ({"EQGPT_NUM_PROCESSES": "2", "EQGPT_COORDINATOR": "h:1"}, r"has no rank"),
    ({"EQGPT_PROCESS_ID": "1"}, r"not the number of processes"),
])
def test_bad_settings(env, match):
    with pytest.raises(ValueError, match=match):
        resolve_settings(environ=env)


def test_flatten_fields():
    from helpers import TINY

    flat = flatten_fields({"model": TINY, "seed": 0})
    assert flat["model.num_layers"] == 2 and flat["seed"] == 0


# --- start-up failures: clear errors, within the timeout ----------------------------------------


@pytest.mark.multiprocess
def test_startup_errors_are_clear_and_bounded(jobs):
    worker = str(MP / "dist_worker.py")
    fast = {"TEST_TIMEOUT": "4", "JAX_NUM_CPU_DEVICES": "1"}
    port_missing = free_port()
    missing = jobs([worker, "init"], env={**fast, "EQGPT_COORDINATOR": f"127.0.0.1:{port_missing}",
                                          "EQGPT_NUM_PROCESSES": "2", "EQGPT_PROCESS_ID": "1"})
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = jobs([worker, "init"], env={**fast, "EQGPT_COORDINATOR": f"127.0.0.1:{busy.getsockname()[1]}",
                                        "EQGPT_NUM_PROCESSES": "2", "EQGPT_PROCESS_ID": "0"})
    # Two processes started, both told there are three: nobody can finish joining.
    too_few = jobs(launch(2, 1, worker, "init"), env={**fast, "TEST_NUM_PROCESSES": "3"}, launcher=True)
    start = time.monotonic()
    try:
        code, out = missing.result(timeout=60)
        assert code != 0 and "could not reach the coordinator" in out and "Start process 0" in out, out[-2000:]
        code, out = taken.result(timeout=60)
        assert code != 0 and "is already in use" in out, out[-2000:]
        code, out = too_few.result(timeout=90)
        assert code == 100 or code == 101, out[-2000:]
        assert f"exit status {STARTUP_TIMEOUT_EXIT_CODE}" in out or "timed out" in out
        assert "waiting for all 3 processes" in out and "Check that 3 processes were started" in out, out[-2000:]
    finally:
        busy.close()
    assert time.monotonic() - start < 90


@pytest.mark.multiprocess
def test_disagreeing_process_counts(jobs):
    """Rank 0 says 2 processes, rank 1 says 3: rank 1 stops with a message naming the counts."""
    port = free_port()
    env = {"EQGPT_COORDINATOR": f"127.0.0.1:{port}", "TEST_TIMEOUT": "20", "JAX_NUM_CPU_DEVICES": "1"}
    worker = str(MP / "dist_worker.py")
    r0 = jobs([worker, "init"], env={**env, "EQGPT_NUM_PROCESSES": "2", "EQGPT_PROCESS_ID": "0"})
    r1 = jobs([worker, "init"], env={**env, "EQGPT_NUM_PROCESSES": "3", "EQGPT_PROCESS_ID": "1"})
    code, out = r1.result(timeout=60)
    assert code != 0 and "told it is process 1 of 3" in out and "runs 2 processes" in out, out[-2000:]
    r0.stop()


@pytest.mark.multiprocess
def test_slurm_detection_starts_a_job(jobs):
    """The variables `srun` sets (as in docs/multinode.md's sbatch script) are enough to join."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "JAX_COORDINATOR_PORT": str(port),
               "JAX_NUM_CPU_DEVICES": "2", "TEST_TIMEOUT": "40"}
        procs.append(jobs([str(MP / "dist_worker.py"), "init"], env=env))
    for rank, job in enumerate(procs):
        code, out = job.result(timeout=90, peers=procs)
        assert code == 0 and f"OK process {rank} of 2, 4 devices, coordinator from slurm" in out, out[-2000:]


# --- start-up consistency ------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_mismatches_stop_every_process(jobs):
    config = jobs(launch(2, 2, MP / "dist_worker.py", "config"), launcher=True)
    params = jobs(launch(2, 2, MP / "dist_worker.py", "params"), launcher=True)
    code, out = config.result(timeout=120)
    assert code in (100, 101) and "DONE" not in out, out[-3000:]
    for rank in (0, 1):  # both processes raise, naming the field
        assert f"[rank {rank}] ValueError: processes disagree on the configuration:" in out, out[-3000:]
    assert "process 1 differs from process 0 in: model.num_layers" in out
    assert "here (process 1): model.num_layers = 3" in out
    code, out = params.result(timeout=120)
    assert code in (100, 101) and "DONE" not in out, out[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] ValueError: the parameters differ between processes: blocks.w" in out, out[-3000:]
    assert "same (" not in out  # the agreeing array is not blamed


# --- 2 processes x 4 devices == 1 process x 8 devices --------------------------------------------


@pytest.mark.multiprocess
def test_two_processes_match_one(jobs, tmp_path):
    job = jobs(launch(2, 4, MP / "train_worker.py", str(tmp_path / "job")), launcher=True)
    from eqgpt.train.checkpoint import Checkpointer
    from mp.common import setup, target, train

    steps = 3
    # 1 process x 8 devices; every strategy equals it (tests/test_parallel_*), so one run is the reference.
    placement, state, step_fn, loader = setup("fsdp=8", "fsdp")
    final, reference = train(state, step_fn, loader, placement, steps)
    code, out = job.result(timeout=290)
    assert code == 0, out[-4000:]
    lines = [x for x in out.splitlines() if "RESULT " in x]
    assert len(lines) == 1 and lines[0].startswith("[rank 0] RESULT ")  # only process 0 reports
    got = json.loads(lines[0].split("RESULT ", 1)[1])
    assert got["process_count"] == 2
    for name in ("dp", "fsdp+tp"):
        np.testing.assert_allclose(got[name], reference, rtol=2e-6, err_msg=name)
        assert got[name][-1] < got[name][0]
    # The checkpoint written by two processes (each its own shards) restores in one.
    assert (tmp_path / "job" / "outputs-of-0" / "metrics.jsonl").is_file()  # process 0 logs ...
    assert not (tmp_path / "job" / "outputs-of-1" / "metrics.jsonl").exists()  # ... the others do not
    assert sorted(p.name for p in (tmp_path / "job" / "ckpt" / "3" / "state").glob("ocdbt.process_*")) == [
        "ocdbt.process_0", "ocdbt.process_1"]
    stops = re.findall(r"\[rank (\d)\] STOPPED process \1 at step (\d+) interrupted=True", out)
    assert len(stops) == 2 and stops[0][1] == stops[1][1], out[-3000:]  # the same step in both
    preempted = int(stops[0][1])
    assert steps + 2 < preempted < steps + 50
    assert Checkpointer(tmp_path / "job" / "ckpt").steps() == [steps, preempted]
    # A damaged file that only process 1 reads: both processes fall back to `steps`, naming it.
    fallbacks = re.findall(r"\[rank (\d)\] FALLBACK process \1 to (\d+): (.*)", out)
    assert len(fallbacks) == 2 and fallbacks[0][1:] == fallbacks[1][1:] == (str(steps), fallbacks[0][2]), out[-3000:]
    assert f"({preempted}, 'DamagedFileError: file " in fallbacks[0][2] and "CRC-32 differs" in fallbacks[0][2]
    restored = Checkpointer(tmp_path / "job" / "ckpt").restore(target(final, placement), step=steps)
    assert restored.step == steps and restored.extras["data"] == {"seed": 0, "step": steps, "mode": "windows",
                                                                "batch_size": 8, "seq_len": 32}
    for a, b in zip(jax.tree.leaves(eqx.filter(restored.state.model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(final.model, eqx.is_array)), strict=True):
        # Adam divides by sqrt(v): where gradients are ~0 (some biases), reduction-order noise
        # is amplified up to ~lr-sized steps, so compare against the parameters' scale.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5)


# --- the documented cluster set-ups (docs/multinode.md) ------------------------------------------


def _recipe_config(args):
    import importlib.util

    import tyro

    spec = importlib.util.spec_from_file_location("recipe_train_gpt_mp", ROOT / "recipes" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return tyro.cli(module.TrainConfig, registry=tyro_registry(), args=args)


def _blocks(kind):
    import re

    text = (ROOT / "docs" / "multinode.md").read_text()
    return re.findall(rf"^```{kind}\n(.*?)^```", text, re.S | re.M)


def test_documented_sbatch_and_indexed_job():
    import re
    import shlex

    sbatch = next(b for b in _blocks("bash") if "#SBATCH" in b)
    command = shlex.split(re.search(r"^srun .*?(?<!\\)$", sbatch.replace("\\\n", " "), re.M).group(0))
    cfg = _recipe_config(command[command.index("recipes/train_gpt.py") + 1:])
    assert cfg.resume and cfg.checkpoint_every == 500 and cfg.parallel.mesh == "data=2,fsdp=8"
    assert "--kill-on-bad-exit=1" in command and "--signal=TERM@120" in sbatch
    job = next(b for b in _blocks("yaml") if "completionMode: Indexed" in b)
    command = json.loads(re.search(r"command: (\[.*?\])", job, re.S).group(1))
    cfg = _recipe_config(command[2:])
    assert cfg.resume and cfg.parallel.mesh == "data=4,fsdp=8"
    env = dict(re.findall(r"\{name: (EQGPT_\w+), value: \"([^\"]+)\"\}", job))
    s = resolve_settings(environ={**env, "JOB_COMPLETION_INDEX": "2"})  # what the pod of index 2 sees
    assert (s.coordinator, s.num_processes, s.process_id) == ("eqgpt-0.eqgpt:12355", 4, 2)
    from eqgpt.train.preemption import PREEMPTED_EXIT_CODE

    assert f"values: [{PREEMPTED_EXIT_CODE}]" in job  # requeue exactly the preempted runs


# --- a dead rank ---------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_dead_rank_stops_the_job_and_resumes_on_fewer_devices(jobs, tmp_path):
    """2 x 4: rank 1 is SIGKILLed mid-run while rank 0 waits in a collective. Launcher and ranks exit
    within 60 s, naming rank 1 and SIGKILL; the newest complete checkpoint resumes on 1 x 4 devices
    and matches an uninterrupted run on that mesh."""
    from eqgpt.train.checkpoint import Checkpointer
    from mp.common import TOTAL_STEPS, losses, setup, target, trainer

    job = jobs(launch(2, 4, MP / "dead_rank_worker.py", str(tmp_path)), launcher=True)
    out, killed_at = [], None
    for line in job.proc.stdout:  # follow the job until rank 1 dies
        out.append(line)
        if "KILLING process 1" in line:
            killed_at, kill_step = time.monotonic(), int(line.split()[-1])
            break
    assert killed_at is not None, "".join(out)[-3000:]
    code, rest = job.result(timeout=120)
    elapsed = time.monotonic() - killed_at
    text = "".join(out) + rest
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop after the kill"
    assert code == 101, (code, text[-3000:])
    assert "eqgpt.launch: rank 1 failed (killed by SIGKILL)" in text, text[-2000:]
    assert "FINISHED" not in text
    print(f"\nrank 1 SIGKILLed at step {kill_step}: launcher and rank 0 gone {elapsed:.1f} s later, exit {code}")

    # Elastic resume: the newest complete checkpoint onto fsdp=4 over 4 devices of one process.
    ckpt = Checkpointer(tmp_path / "ckpt")
    steps = ckpt.steps()
    assert steps and steps[-1] <= kill_step, steps
    devices = jax.devices()[:4]
    placement, fresh, step_fn, loader = setup("fsdp=4", "fsdp", devices=devices)
    restored = ckpt.restore(target(fresh, placement))
    assert restored.step == steps[-1] and not restored.skipped
    assert len(restored.state.model.tok_embed.weight.sharding.device_set) == 4
    resumed = trainer(restored.state, step_fn, loader, placement, steps=TOTAL_STEPS)
    resumed.run()
    uninterrupted = trainer(fresh, step_fn, loader, placement, steps=TOTAL_STEPS)
    uninterrupted.run()
    reference = losses(uninterrupted)
    # Before the kill (2 x 4, fsdp=8) and after the restore (1 x 4, fsdp=4): fp32 reduction-order noise.
    before = {int(s): float(v) for s, v in re.findall(r"\[rank 0\] LOSS (\d+) (\S+)", text)}
    assert len(before) >= restored.step - 1  # the last step before the kill may not have printed yet
    np.testing.assert_allclose([before[s] for s in sorted(before)], reference[:len(before)], rtol=2e-6)
    np.testing.assert_allclose(losses(resumed), reference[restored.step:], rtol=2e-5)
