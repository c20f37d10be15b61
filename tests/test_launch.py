"""`python -m eqgpt.launch`: rank-prefixed output, failure propagation, signal forwarding."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eqgpt import launch
from eqgpt.launch import child_env, culprit, free_port

ECHO = str(Path(__file__).parent / "mp" / "echo.py")
LAUNCH = [sys.executable, "-m", "eqgpt.launch"]


def run(args, timeout=60):
    return subprocess.run([*LAUNCH, *args], capture_output=True, text=True, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_prefixed_output_and_settings():
    r = run(["--nproc", "2", "--devices-per-proc", "3", "--", ECHO, "ok"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for rank in (0, 1):
        hello = [x for x in lines if x.startswith(f"[rank {rank}] hello from {rank} of 2 via 127.0.0.1:")]
        assert len(hello) == 1 and hello[0].endswith("with 3 devices")
        assert f"[rank {rank}] second line" in lines  # stderr is captured and prefixed too
    ports = {x.split("127.0.0.1:")[1].split()[0] for x in lines if "hello" in x}
    assert len(ports) == 1  # one coordinator for both


def test_one_failure_stops_the_others():
    start = time.monotonic()
    r = run(["--nproc", "3", "--grace", "2", "--", ECHO, "fail", "1", "7"])
    assert time.monotonic() - start < 30
    assert r.returncode == 101, (r.returncode, r.stderr)
    assert "rank 1 failed (exit status 7)" in r.stderr
    assert "[rank 1] failing now" in r.stdout
    pids = [int(x.split("pid ")[1].split()[0]) for x in r.stdout.splitlines() if "waiting" in x]
    assert len(pids) == 2 and not any(alive(p) for p in pids)  # the others were stopped


def test_sigterm_is_forwarded_and_status_kept():
    proc = subprocess.Popen([*LAUNCH, "--nproc", "2", "--", ECHO, "term"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready = 0
        for line in proc.stdout:
            ready += "READY" in line
            if ready == 2:
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err  # every rank's own (preempted) status
    assert out.count("got SIGTERM") == 2


def test_bad_invocations():
    r = run(["--nproc", "2", "--", "no_such_script.py"])
    assert r.returncode == 2 and "not found" in r.stderr
    r = run(["--nproc", "0", "--", ECHO, "ok"])
    assert r.returncode == 2 and "--nproc must be at least 1" in r.stderr
    r = run(["--nproc", "2"])
    assert r.returncode == 2 and "nothing to run" in r.stderr


def test_child_env_and_free_port():
    env = child_env(1, 4, 1234, 2, "cpu", base={"PATH": "/bin"})
    assert env["EQGPT_COORDINATOR"] == "127.0.0.1:1234" and env["EQGPT_NUM_PROCESSES"] == "4"
    assert env["EQGPT_PROCESS_ID"] == "1" and env["JAX_NUM_CPU_DEVICES"] == "2" and env["JAX_PLATFORMS"] == "cpu"
    assert child_env(1, 4, 1234, 2, "gpu", base={})["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert 0 < free_port() < 65536


@pytest.mark.parametrize("timeout", [1])
def test_job_timeout(timeout):
    r = run(["--nproc", "2", "--timeout", str(timeout), "--", ECHO, "fail", "5", "0"])
    assert r.returncode == 124 and "--timeout" in r.stderr


def test_culprit_of_simultaneous_failures():
    # A rank killed by a signal is blamed before ranks that then failed in a collective with it.
    assert culprit([(0, 1), (1, -9)]) == (1, -9)
    assert culprit([(2, 1), (1, 3)]) == (1, 3)  # else the lowest rank
    assert culprit([(3, -15), (2, -9)]) == (2, -9)


def test_the_help_example_trains_and_a_mismatched_batch_names_the_fix(tmp_path):
    """The example `--help` prints (no --mesh: data parallel over every process's devices), trimmed
    to a tiny model; then a global batch the two processes cannot split."""
    help_text = subprocess.run([*LAUNCH, "--help"], capture_output=True, text=True, timeout=60).stdout
    example = " ".join(help_text.split("example: ", 1)[1].split())
    assert example.startswith("python -m eqgpt.launch ") and " -- recipes/train_gpt.py " in example
    launch_args, recipe_args = example.removeprefix("python -m eqgpt.launch ").split(" -- recipes/train_gpt.py ")
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 300)
    tiny = ["--model.num-layers", "1", "--model.embed-dim", "32", "--model.seq-len", "32", "--batch-size", "8",
            "--eval-windows", "2", "--sample-tokens", "4", "--no-progress", "--peak-flops", "1e12",
            "--data.corpus", str(tmp_path / "corpus"), "--data.cache-dir", str(tmp_path / "cache")]
    recipe = [*launch_args.split(), "--", str(root / "recipes" / "train_gpt.py"), *recipe_args.split(), *tiny,
              "--steps", "2"]  # the example's flags, the run trimmed
    r = run([*recipe, "--out-dir", str(tmp_path / "run")], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Strategy(data=8: dp)" in r.stdout and "[rank 0] done:" in r.stdout
    assert (tmp_path / "run" / "samples.txt").read_text().count("--- sample") == 3
    bad = run([*recipe, "--batch-size", "5", "--out-dir", str(tmp_path / "bad")], timeout=300)
    assert bad.returncode in (100, 101) and "Traceback" not in bad.stdout + bad.stderr  # 100 + the rank blamed
    assert "Gloo" not in bad.stdout  # refused before start-up: the backend's output cannot split the line
    for rank in (0, 1):
        assert f"[rank {rank}] error: --batch-size 5 does not split over 2 processes" in bad.stdout + bad.stderr
    assert not (tmp_path / "bad").exists()



def test_the_malloc_restart_comes_before_jax_is_imported():
    """`eqgpt-train` and `recipes/train_gpt.py` restart with the malloc settings before importing JAX
    and the trainer: a restart after them would import them twice (about 2 s)."""
    env = {**os.environ, "GLIBC_TUNABLES": "set: no restart in this check"}
    code = "import sys, eqgpt.cli.entry; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    recipe = (Path(__file__).resolve().parents[1] / "recipes" / "train_gpt.py").read_text()
    assert recipe.index("restart_with_malloc_tunables()") < recipe.index("from eqgpt.cli.train import")


@pytest.mark.parametrize("platforms, files, cpu", [
    ("cpu", ["accel0"], True),  # JAX_PLATFORMS decides where it is set
    ("tpu,cpu", [], False),
    ("", [], True),  # else an accelerator's device file
    ("", ["accel0"], False),  # TPU v4, v5e
    ("", ["vfio/0"], False),  # TPU v5p, v6e
    ("", ["vfio/vfio"], True),  # the vfio control file alone: no device
    ("", ["nvidiactl"], False),
])
def test_steps_run_on_cpu_from_the_environment_and_device_files(tmp_path, platforms, files, cpu):
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    assert launch.steps_run_on_cpu({"JAX_PLATFORMS": platforms}, dev=str(tmp_path)) is cpu


@pytest.mark.parametrize("platforms, restarts", [("cpu", True), ("tpu", False)])
def test_the_malloc_restart_only_where_steps_run_on_cpu(monkeypatch, platforms, restarts):
    """On an accelerator the settings only slowed the host (the TPU compile: docs/profiling_results.md)."""
    calls = []
    monkeypatch.setattr(launch.sys, "platform", "linux")
    monkeypatch.setattr(launch.os, "execv", lambda exe, argv: calls.append(argv))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    launch.restart_with_malloc_tunables()
    assert bool(calls) is restarts
    assert os.environ.get("GLIBC_TUNABLES") == (launch.GLIBC_MALLOC_TUNABLES if restarts else None)
