"""`python -m eqgpt.launch --nproc N [--devices-per-proc K] -- script.py args...`

Starts N copies of a script on this machine as one multi-process JAX job: a
localhost coordinator on a free port, `EQGPT_COORDINATOR` / `EQGPT_NUM_PROCESSES`
/ `EQGPT_PROCESS_ID` in each child's environment (read by
`eqgpt.distributed.initialize`), K simulated CPU devices per process talking
through gloo (or K GPUs each with `--platform gpu`).

Every output line is prefixed with its rank (`[rank 1] ...`). When one process
fails, the others are stopped (SIGTERM, then SIGKILL after `--grace` seconds), after
`SETTLE_SECONDS` in which ranks failing for the same reason (a bad flag) say so too.

Exit status:

- every rank exited with 0: 0;
- after a forwarded SIGTERM/SIGINT, every rank exited with the same status `s`
  (the trainer's preemption status, 75): `s`;
- otherwise the first rank `r` to fail decides (when several end together: one
  killed by a signal, else the lowest): `100 + r` (ranks above 26 give 127), and
  the last line on stderr names the rank and its own status or signal
  (`rank 1 failed (killed by SIGKILL)`); the other ranks, typically blocked in a
  collective with the dead one, get SIGTERM, then SIGKILL after `--grace` seconds;
- `--timeout` expired: 124.

SIGTERM and SIGINT sent to the launcher are forwarded to every rank (so a
trainer can checkpoint and stop); a second one kills them.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

# The variables `eqgpt.distributed.initialize` reads (defined here so the launcher never imports JAX).
ENV_COORDINATOR = "EQGPT_COORDINATOR"
ENV_NUM_PROCESSES = "EQGPT_NUM_PROCESSES"
ENV_PROCESS_ID = "EQGPT_PROCESS_ID"

# glibc hands a step's large temporary buffers back to the kernel after every step and
# faults them in again on the next (~110,000 minor faults a step at 8 x 256 tokens);
# these settings keep freed memory in the process, from one heap, in huge pages, and
# cut system time ~30x (docs/profiling_results.md). glibc reads them only at start-up, and
# eqgpt never sets them behind a process's back: scripts opt in with
# `restart_with_malloc_tunables()`.
GLIBC_MALLOC_TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184:"
                         "glibc.malloc.arena_max=1")

SETTLE_SECONDS = 3.0
"""How long the other ranks may end by themselves after the first failure, before SIGTERM."""

# Device files of the accelerators JAX runs on: TPUs (/dev/accel*: v4, v5e; /dev/vfio/N: v5p, v6e),
# NVIDIA GPUs (/dev/nvidiactl also in containers) and AMD GPUs (/dev/kfd).
ACCELERATOR_DEVICE_FILES = ("accel*", "vfio/[0-9]*", "nvidiactl", "nvidia[0-9]*", "kfd")


def steps_run_on_cpu(environ: Mapping[str, str] | None = None, dev: str = "/dev") -> bool:
    """Whether this process's JAX will run on the CPU, judged before JAX is imported (which would
    start a backend): `JAX_PLATFORMS`' first entry where it is set, else whether no accelerator's
    device file (`ACCELERATOR_DEVICE_FILES`) is under `dev`."""
    environ = os.environ if environ is None else environ
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(glob.glob(os.path.join(dev, pattern)) for pattern in ACCELERATOR_DEVICE_FILES)


def restart_with_malloc_tunables() -> None:
    """Re-execute this Python process once with `GLIBC_MALLOC_TUNABLES`, where its steps run on the
    CPU (`steps_run_on_cpu`): they are for the step's host buffers. On an accelerator they only slow
    the host: one malloc arena for every thread of XLA's compiler (docs/profiling_results.md).
    Linux only; a no-op where `GLIBC_TUNABLES` is already set, so a user's own choice wins."""
    if sys.platform == "linux" and "GLIBC_TUNABLES" not in os.environ and steps_run_on_cpu():
        os.environ["GLIBC_TUNABLES"] = GLIBC_MALLOC_TUNABLES
        os.execv(sys.executable, [sys.executable, *sys.argv])


FAILED_RANK_BASE = 100
TIMEOUT_EXIT_CODE = 124


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def describe_status(code: int) -> str:
    """`"exit status 3"` or `"killed by SIGKILL"` for a `Popen.returncode`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def culprit(failed: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The rank to blame among `(rank, returncode)` failures seen at the same time: one killed by a
    signal first (the others then fail in their collectives with it, not the other way round), else
    the lowest rank."""
    return min(failed, key=lambda rc: (rc[1] >= 0, rc[0]))


def child_env(
    rank: int, nproc: int, port: int, devices_per_proc: int | None, platform: str,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of rank `rank`: coordinator settings plus device selection."""
    env = dict(os.environ if base is None else base)
    env.update({
        ENV_COORDINATOR: f"127.0.0.1:{port}",
        ENV_NUM_PROCESSES: str(nproc),
        ENV_PROCESS_ID: str(rank),
        "PYTHONUNBUFFERED": "1",
    })
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        if devices_per_proc is not None:
            env["JAX_NUM_CPU_DEVICES"] = str(devices_per_proc)
    elif devices_per_proc is not None:
        first = rank * devices_per_proc
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(devices_per_proc))
    return env


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        with lock:
            out.write(prefix + text if text.endswith("\n") else prefix + text + "\n")
            out.flush()
    stream.close()


def _signal_all(procs: Sequence[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)  # the child and anything it started
            except (ProcessLookupError, PermissionError):
                pass


def _check_args(command: Sequence[str], nproc: int, devices_per_proc: int | None, platform: str) -> None:
    """`ValueError` naming the flag for a bad `launch` argument, before any process starts."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}.")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ValueError(f"--devices-per-proc must be at least 1, got {devices_per_proc}.")
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"--platform must be cpu or gpu, got {platform!r}.")
    if not command:
        raise ValueError("nothing to run: give the script after `--`, e.g. `-- recipes/train_gpt.py --steps 10`.")
    if command[0] != "-m" and not os.path.exists(command[0]):
        raise ValueError(f"script {command[0]!r} not found (run from the directory it is relative to).")


def _exit_status(codes: list[int], status: int | None, timeout: float | None, signals_seen: list[int],
                 first_failure: tuple[int, int] | None) -> int:
    """The job's exit status from the ranks' `codes`; a failure or a timeout is explained on stderr."""
    if status == TIMEOUT_EXIT_CODE:
        sys.stderr.write(f"eqgpt.launch: the job ran past --timeout {timeout:g} s; all ranks were killed.\n")
        return status
    if all(c == 0 for c in codes):
        return 0
    if signals_seen and len(set(codes)) == 1:  # e.g. every rank checkpointed and exited "preempted"
        return codes[0] if codes[0] >= 0 else 128 - codes[0]
    if first_failure is None:  # ranks ended between two polls
        first_failure = culprit([(r, c) for r, c in enumerate(codes) if c != 0])
    rank, code = first_failure
    others = [f"rank {r}: {describe_status(c)}" for r, c in enumerate(codes) if r != rank]
    sys.stderr.write(
        f"eqgpt.launch: rank {rank} failed ({describe_status(code)}); the other ranks were stopped "
        f"({', '.join(others) or 'none'}). Its output above is prefixed [rank {rank}].\n"
    )
    return FAILED_RANK_BASE + rank if rank <= 26 else 127


def _start_ranks(command: Sequence[str], nproc: int, port: int, devices_per_proc: int | None, platform: str, out,
                 procs: list[subprocess.Popen], pumps: list[threading.Thread]) -> None:
    """Start the ranks, each appended to `procs` as soon as it runs (the signal handler reads that list),
    with a thread in `pumps` copying its output, prefixed `[rank i]`, to `out`."""
    lock = threading.Lock()
    for rank in range(nproc):
        p = subprocess.Popen(
            [sys.executable, *command],
            env=child_env(rank, nproc, port, devices_per_proc, platform),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[rank {rank}] ", out, lock), daemon=True)
        t.start()
        pumps.append(t)


def launch(
    command: Sequence[str],
    nproc: int,
    *,
    devices_per_proc: int | None = None,
    platform: str = "cpu",
    port: int | None = None,
    grace: float = 10.0,
    timeout: float | None = None,
    out=None,
) -> int:
    """Run `python command...` as `nproc` processes of one job; return the exit status (see module docs).

    **Arguments:**

    - `command`: a script and its arguments (`["recipes/train_gpt.py", "--steps", "10"]`),
      or `["-m", "module", ...]`.
    - `nproc`: number of processes; `devices_per_proc`: CPU devices (or GPUs) each.
    - `platform`: `"cpu"` (simulated devices, gloo) or `"gpu"`.
    - `port`: coordinator port (default: a free one); `grace`: seconds between
      SIGTERM and SIGKILL when stopping ranks; `timeout`: seconds for the whole job.
    - `out`: where prefixed output goes (default `sys.stdout`).

    **Returns:** the exit status.
    """
    _check_args(command, nproc, devices_per_proc, platform)
    out = sys.stdout if out is None else out
    port = free_port() if port is None else port
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    signals_seen = []

    def forward(signum, _frame):
        signals_seen.append(signum)
        _signal_all(procs, signal.SIGKILL if len(signals_seen) > 1 else signum)

    # Forward signals from before the first rank starts: a rank may be up (and its
    # supervisor signalled) before this thread reaches the wait loop.
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    first_failure: tuple[int, int] | None = None
    stop_at: float | None = None  # SIGTERM to the others, a moment after the first failure
    stop_deadline: float | None = None
    start = time.monotonic()
    status: int | None = None
    try:
        _start_ranks(command, nproc, port, devices_per_proc, platform, out, procs, pumps)
        if signals_seen:  # signalled while the ranks were starting: the later ones get it too
            _signal_all(procs, signals_seen[-1])
        while any(p.poll() is None for p in procs):
            if first_failure is None and not signals_seen:
                failed = [(rank, p.poll()) for rank, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    first_failure = culprit(failed)
                    stop_at = time.monotonic() + min(SETTLE_SECONDS, grace)
            if stop_at is not None and time.monotonic() > stop_at:
                stop_at = None
                _signal_all(procs, signal.SIGTERM)
                stop_deadline = time.monotonic() + grace
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                _signal_all(procs, signal.SIGKILL)
            if timeout is not None and status is None and time.monotonic() - start > timeout:
                status = TIMEOUT_EXIT_CODE
                _signal_all(procs, signal.SIGKILL)
            time.sleep(0.05)
    finally:
        _signal_all(procs, signal.SIGKILL)
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
        for s, handler in old.items():
            signal.signal(s, handler)
    return _exit_status([p.returncode for p in procs], status, timeout, signals_seen, first_failure)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: parse `--nproc ... -- script args` and `launch`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(
        prog="python -m eqgpt.launch",
        description="Run a script as N local processes of one JAX job (see eqgpt.launch docs).",
        epilog="example: python -m eqgpt.launch --nproc 2 --devices-per-proc 4 -- recipes/train_gpt.py --steps 20",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument("--devices-per-proc", type=int, default=None,
                        help="CPU devices per process (or GPUs each, with --platform gpu)")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping ranks")
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the whole job (exit 124 past it)")
    args = parser.parse_args(own)
    try:
        return launch(command, args.nproc, devices_per_proc=args.devices_per_proc, platform=args.platform,
                      port=args.port, grace=args.grace, timeout=args.timeout)
    except ValueError as e:
        parser.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
