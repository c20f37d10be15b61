"""Multi-process start-up: `jax.distributed.initialize` with clear settings and clear failures.

eqgpt does not run its own distributed runtime: JAX's multi-controller runtime is
the engine (one Python process per host or per GPU, NCCL between GPUs, gloo
between CPU processes). This module only

- finds the settings (`resolve_settings`): explicit arguments first, then the
  `EQGPT_COORDINATOR` / `EQGPT_NUM_PROCESSES` / `EQGPT_PROCESS_ID` environment
  variables, then a cluster JAX can detect (SLURM, Open MPI);
- turns the runtime's failure modes (no coordinator, too few processes, a port
  that is taken, disagreeing process counts) into errors that say what to fix,
  within a timeout, instead of a hang or a C++ abort (`initialize`);
- checks at start-up that every process holds the same configuration, mesh and
  initial parameters as process 0 (`check_same_on_all_processes`,
  `check_replicas_agree`).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import PyTree

from eqgpt.launch import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

# Kubernetes indexed Jobs number their pods in this variable; used when EQGPT_PROCESS_ID is unset.
ENV_K8S_INDEX = "JOB_COMPLETION_INDEX"

# Exit status of a process whose start-up did not complete within the timeout.
STARTUP_TIMEOUT_EXIT_CODE = 3

# Environment variables whose presence means "JAX can read this cluster's layout" (as JAX checks).
_CLUSTERS: dict[str, dict[str, str]] = {
    "slurm": {"present": "SLURM_JOB_ID,SLURM_STEP_NODELIST,SLURM_NTASKS,SLURM_PROCID,SLURM_LOCALID",
              "count": "SLURM_NTASKS", "id": "SLURM_PROCID"},
    "ompi": {"present": "OMPI_MCA_orte_hnp_uri,OMPI_COMM_WORLD_SIZE,OMPI_COMM_WORLD_RANK",
             "count": "OMPI_COMM_WORLD_SIZE", "id": "OMPI_COMM_WORLD_RANK"},
}


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Where this process finds the others.

    **Fields:**

    - `coordinator`: `"host:port"` of process 0's coordination service; `None`
      when a detected cluster supplies it (JAX derives it) or for one process.
    - `num_processes`, `process_id`: the job size and this process's rank.
    - `sources`: for each setting, where it came from (`"argument"`, an
      environment variable name, `"slurm"`, `"ompi"`, or `"default"`).
    - `cluster`: the detected cluster JAX should read the rest from, or `None`.
    """

    coordinator: str | None
    num_processes: int
    process_id: int
    sources: Mapping[str, str]
    cluster: str | None = None

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
    """The cluster (`"slurm"` or `"ompi"`) whose variables are set, or `None`.

    **Arguments:** `environ`, the environment to read (default `os.environ`).

    **Returns:** the name JAX's `cluster_detection_method` understands.
    """
    env = os.environ if environ is None else environ
    for name, spec in _CLUSTERS.items():
        if all(v in env for v in spec["present"].split(",")):
            return name
    return None


def _parse_int(value: Any, what: str, where: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} from {where} must be an integer, got {value!r}.") from None


def _check_coordinator(address: str, where: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator address {address!r} (from {where}) must be host:port with a port in "
            "1..65535, e.g. 10.0.0.1:12355 or node001:12355."
        )


def resolve_settings(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> DistributedSettings:
    """Decide each setting: explicit argument, else `EQGPT_*` variable, else detected cluster.

    Nothing is contacted; this only reads arguments and the environment, so it
    is safe to call anywhere (and to test with a made-up `environ`).

    **Arguments:** `coordinator` (`"host:port"`), `num_processes`, `process_id`,
    and `environ` (default `os.environ`).

    **Returns:** the `DistributedSettings`; a single process (1, rank 0) when
    nothing says otherwise. Raises `ValueError` for malformed or inconsistent values.
    """
    env = os.environ if environ is None else environ
    cluster = detect_cluster(env)
    sources: dict[str, str] = {}

    def pick(name: str, explicit: Any, var: str, cluster_key: str | None, fallback_var: str | None = None):
        if explicit is not None:
            sources[name] = "argument"
            return explicit
        for v in (var, fallback_var):
            if v and env.get(v, "") != "":
                sources[name] = v
                return env[v]
        if cluster and cluster_key:
            sources[name] = cluster
            return env[_CLUSTERS[cluster][cluster_key]]
        return None

    coord = pick("coordinator", coordinator, ENV_COORDINATOR, None)
    count = pick("num_processes", num_processes, ENV_NUM_PROCESSES, "count")
    rank = pick("process_id", process_id, ENV_PROCESS_ID, "id", ENV_K8S_INDEX)
    if count is None:
        if coord is not None or rank is not None:
            raise ValueError(
                f"a coordinator or process id is set ({sources}) but not the number of processes; "
                f"pass num_processes=N or set {ENV_NUM_PROCESSES}."
            )
        return DistributedSettings(None, 1, 0, {"num_processes": "default"}, None)
    count = _parse_int(count, "num_processes", sources["num_processes"])
    if count < 1:
        raise ValueError(f"num_processes must be at least 1, got {count} (from {sources['num_processes']}).")
    if rank is None:
        if count > 1:
            raise ValueError(
                f"num_processes={count} but this process has no rank; pass process_id=i or set "
                f"{ENV_PROCESS_ID} (0..{count - 1}) in each process."
            )
        rank, sources["process_id"] = 0, "default"
    rank = _parse_int(rank, "process_id", sources["process_id"])
    if not 0 <= rank < count:
        raise ValueError(
            f"process_id {rank} (from {sources['process_id']}) is outside 0..{count - 1} for "
            f"num_processes={count} (from {sources['num_processes']}); give each process a distinct "
            "id below the process count."
        )
    if coord is None and count > 1 and cluster is None:
        raise ValueError(
            f"num_processes={count} but no coordinator address; pass coordinator='host:port' or set "
            f"{ENV_COORDINATOR} to process 0's host and a free port (the same in every process)."
        )
    if coord is not None:
        _check_coordinator(str(coord), sources["coordinator"])
    use_cluster = cluster if coord is None else None
    return DistributedSettings(None if coord is None else str(coord), count, rank, sources, use_cluster)


def _port_is_free(port: int) -> bool:
    """Whether process 0 could listen on `port` (a listener there means it cannot)."""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((addr, port))
            return True
        except OSError as e:
            if e.errno == 98 or "in use" in str(e).lower():  # EADDRINUSE
                return False
            continue  # family not available here: try the next one
    return True


def _wait_for_listener(address: str, deadline: float) -> bool:
    """Poll until something accepts TCP connections at `address`, or `deadline` passes."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


class _Watchdog:
    """Ends the process with a clear message if start-up has not finished by a deadline.

    JAX's runtime aborts in C++ (or waits) when processes are missing; this
    fires first, from a thread (the runtime releases the GIL while it waits).
    """

    def __init__(self, seconds: float, message: str):
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(seconds, message), daemon=True)

    def _run(self, seconds: float, message: str) -> None:
        if not self._done.wait(seconds):
            sys.stderr.write(f"\neqgpt.distributed: {message}\n")
            sys.stderr.flush()
            os._exit(STARTUP_TIMEOUT_EXIT_CODE)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()


_SETTINGS: DistributedSettings | None = None


def _join(settings: DistributedSettings, timeout: float, local_device_ids: Sequence[int] | None,
          heartbeat_timeout: int, shutdown_timeout: int) -> None:
    """Check the coordinator's address, then join the job through `jax.distributed.initialize` under a
    watchdog that turns a hang into a clear exit (see `initialize`)."""
    rank, count, address = settings.process_id, settings.num_processes, settings.coordinator
    where = settings.sources.get("coordinator", settings.cluster)
    deadline = time.monotonic() + timeout
    if address is not None and rank == 0:
        port = int(address.rpartition(":")[2])
        if not _port_is_free(port):
            raise ValueError(
                f"process 0 cannot host the coordinator: port {port} (from {where}) is already in use "
                "on this machine. Pick a free port (the same in every process), or stop whatever holds it."
            )
    if address is not None and rank != 0 and not _wait_for_listener(address, deadline):
        raise RuntimeError(
            f"process {rank} could not reach the coordinator at {address} (from {where}) within "
            f"{timeout:g} s. Start process 0 (it hosts the coordinator) with the same address, check "
            "the host name and that the port is open between the hosts."
        )
    message = (
        f"process {rank} timed out after {timeout:g} s waiting for all {count} processes to join the "
        f"coordinator at {address or settings.cluster}. Check that {count} processes were started "
        f"(num_processes from {settings.sources['num_processes']}) with distinct process ids "
        f"0..{count - 1}, all pointing at the same coordinator."
    )
    remaining = max(1.0, deadline - time.monotonic())
    with _Watchdog(remaining, message):
        try:
            jax.distributed.initialize(
                coordinator_address=address,
                num_processes=count,
                process_id=rank,
                local_device_ids=local_device_ids,
                cluster_detection_method=settings.cluster,
                # JAX's own deadline is later than the watchdog's, so the clear message wins.
                initialization_timeout=int(remaining) + 30,
                heartbeat_timeout_seconds=heartbeat_timeout,
                shutdown_timeout_seconds=shutdown_timeout,
            )
        except Exception as e:  # the runtime raises JaxRuntimeError (a RuntimeError) or ValueError
            if "Failed to start RPC server" in str(e):
                raise ValueError(
                    f"process 0 could not start the coordinator at {address} (from {where}): the port "
                    "is taken or the address is not local. Pick a free port."
                ) from e
            raise


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    num_cpu_devices: int | None = None,
    timeout: float = 300.0,
    heartbeat_timeout: int = 100,
    shutdown_timeout: int = 60,
) -> DistributedSettings:
    """Join the job's processes (or do nothing for a single process). Call before any JAX work.

    Settings come from, in order: these arguments, `EQGPT_COORDINATOR` /
    `EQGPT_NUM_PROCESSES` / `EQGPT_PROCESS_ID`, then SLURM or Open MPI
    variables (read by JAX's own cluster detection). CPU processes talk through
    gloo.

    **Arguments:**

    - `coordinator`: `"host:port"` of process 0, which hosts the coordination service.
    - `num_processes`, `process_id`: job size and this process's rank.
    - `local_device_ids`: the accelerators this process drives (default: JAX's choice).
    - `num_cpu_devices`: CPU devices per process (sets `jax_num_cpu_devices`).
    - `timeout`: seconds to wait for every process to connect; past it the
      process exits with status `STARTUP_TIMEOUT_EXIT_CODE` and says why.
    - `heartbeat_timeout`: seconds without a heartbeat before the runtime
      declares a process dead and stops the others.
    - `shutdown_timeout`: seconds to wait for the others at exit.

    **Returns:** the `DistributedSettings` in force. Raises `ValueError` for bad
    settings (rank out of range, malformed address, port in use, process counts
    that disagree) and `RuntimeError` when the coordinator cannot be reached.
    """
    global _SETTINGS
    settings = resolve_settings(coordinator, num_processes, process_id)
    if num_cpu_devices is not None:
        if num_cpu_devices < 1:
            raise ValueError(f"num_cpu_devices must be positive, got {num_cpu_devices}.")
        jax.config.update("jax_num_cpu_devices", int(num_cpu_devices))
    if not settings.multi_process:
        _SETTINGS = settings
        return settings
    if _SETTINGS is not None and _SETTINGS.multi_process:
        if _SETTINGS == settings:
            return settings
        raise RuntimeError(f"eqgpt.distributed.initialize already ran with {_SETTINGS}; it runs once per process.")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    rank, count, address = settings.process_id, settings.num_processes, settings.coordinator
    _join(settings, timeout, local_device_ids, heartbeat_timeout, shutdown_timeout)
    if jax.process_count() != count or jax.process_index() != rank:
        raise ValueError(
            f"this process was told it is process {rank} of {count} (from {settings.sources}), but the "
            f"coordinator at {address or settings.cluster} runs {jax.process_count()} processes and "
            f"registered this one as {jax.process_index()}. Give every process the same "
            f"{ENV_NUM_PROCESSES}."
        )
    # Open the processes' collective context now, while they start together: on CPU its first use
    # times out (gloo, 30 s) when one process reaches it much later than another, as after a
    # compile that a loaded machine slows down for one process only.
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("eqgpt.distributed.initialize")
    _leave_the_job_at_exit()
    _SETTINGS = settings
    return settings


def _leave_the_job_at_exit() -> None:
    """Leave through JAX's shutdown barrier when the interpreter exits normally, before it tears
    down: otherwise the order of teardown is left to chance, and process 0 (which hosts the
    coordination service) can drop it while a peer is still leaving, which hangs or aborts that
    peer. After an uncaught exception this process does not enter the barrier itself: its
    launcher stops the others (JAX's own teardown may still wait for them, up to the shutdown
    timeout, on jax 0.10)."""
    failed = threading.Event()
    previous_hook = sys.excepthook

    def note_failure(*exc_info):
        failed.set()
        previous_hook(*exc_info)

    def leave():
        if failed.is_set():
            return
        try:
            jax.distributed.shutdown()
        except Exception as e:  # a peer already gone: nothing left to wait for
            print(f"eqgpt: leaving the job at exit: {e}", file=sys.stderr)

    sys.excepthook = note_failure
    atexit.register(leave)


def is_main_process() -> bool:
    """Whether this is process 0: the one that logs, draws progress bars and writes plots."""
    return jax.process_index() == 0


# --- start-up consistency -------------------------------------------------------------------------


def _hash_words(value: Any) -> np.ndarray:
    """Two uint32 words of a SHA-256 of `value`'s canonical JSON (or repr) form."""
    try:
        text = json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    digest = hashlib.sha256(text.encode()).digest()
    return np.frombuffer(digest[:8], dtype=np.uint32).copy()


def flatten_fields(value: Any, prefix: str = "") -> dict[str, Any]:
    """`{"model.num_layers": 2, ...}`: dataclasses and mappings flattened to dotted leaf names."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k in sorted(value, key=str):
            out.update(flatten_fields(value[k], f"{prefix}{k}."))
        return out
    return {prefix[:-1] or "value": value}


def _fail_everywhere(local_bad: np.ndarray, names: Sequence[str], what: str, detail: dict[str, str]) -> None:
    """All-gather each process's mismatch flags and raise the same kind of error in every process."""
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(local_bad.astype(np.int32)))
    flags = flags.reshape(jax.process_count(), -1)
    if not flags.any():
        return
    lines = []
    for p in range(flags.shape[0]):
        bad = [names[i] for i in np.flatnonzero(flags[p])]
        if bad:
            lines.append(f"process {p} differs from process 0 in: {', '.join(bad)}")
    mine = [f"{k} = {detail[k]}" for k in detail if k in {names[i] for i in np.flatnonzero(local_bad)}]
    raise ValueError(
        f"processes disagree on the {what}:\n  " + "\n  ".join(lines)
        + (f"\n  here (process {jax.process_index()}): " + "; ".join(mine) if mine else "")
        + "\nEvery process must run the same code with the same settings; fix the differing field(s)."
    )


def check_same_on_all_processes(fields: Mapping[str, Any] | Any, what: str = "configuration") -> None:
    """Check that every process holds the same values as process 0; raise everywhere if not.

    Each field is hashed; process 0 broadcasts its hashes
    (`multihost_utils.broadcast_one_to_all`), every process compares them with
    its own, and the per-process verdicts are gathered so that all processes
    stop with the same error naming the differing fields. One process: no-op.

    **Arguments:** `fields`, a mapping or dataclass (nested ones are flattened to
    dotted names such as `model.num_layers`); `what` names it in the error.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    flat = flatten_fields(fields)
    names = sorted(flat)
    # Phase 1: the same field names? (Phase 2 needs equal shapes in every process.)
    header = np.concatenate([np.array([len(names), 0], np.uint32), _hash_words(names)])
    header0 = np.asarray(multihost_utils.broadcast_one_to_all(header))
    _fail_everywhere(np.array([not np.array_equal(header, header0)]), [f"the set of {what} field names"],
                     what, {f"the set of {what} field names": ", ".join(names)})
    # Phase 2: the same value in each field?
    mine = np.stack([_hash_words(flat[n]) for n in names]) if names else np.zeros((0, 2), np.uint32)
    theirs = np.asarray(multihost_utils.broadcast_one_to_all(mine))
    bad = np.any(mine != theirs, axis=1)
    _fail_everywhere(bad, names, what, {n: repr(flat[n]) for n in names})


def mesh_fields(mesh: Mesh) -> dict[str, Any]:
    """What every process must agree on about a mesh: axis names, sizes and the device at each position."""
    return {
        "axes": list(mesh.axis_names),
        "shape": [int(mesh.shape[a]) for a in mesh.axis_names],
        "device_ids": [int(d.id) for d in np.asarray(mesh.devices).flat],
        "process_of_device": [int(d.process_index) for d in np.asarray(mesh.devices).flat],
    }


def check_replicas_agree(tree: PyTree, what: str = "parameters") -> None:
    """Check that every copy of every shard of `tree`'s arrays holds the same bytes, on all processes.

    Each process hashes the shards it holds; the hashes (with device ids) are
    gathered, and copies of the same shard index on different devices must
    agree. This catches processes that initialised from different seeds or
    loaded different weights. Every process raises the same `ValueError`,
    naming the array and the processes. One process: the local copies are compared.

    **Arguments:** `tree`, a pytree whose `jax.Array` leaves are checked; `what` names it.
    """
    from jax.experimental import multihost_utils

    from eqgpt.tree import path_str

    leaves = [(path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
              if isinstance(x, jax.Array)]
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    row = {d.id: i for i, d in enumerate(local)}
    table = np.zeros((len(local), 1 + len(leaves)), np.uint32)
    table[:, 0] = [d.id for d in local]
    for j, (_, x) in enumerate(leaves):
        for shard in x.addressable_shards:
            digest = hashlib.sha256(np.ascontiguousarray(np.asarray(shard.data)).tobytes()).digest()
            table[row[shard.device.id], 1 + j] = int.from_bytes(digest[:4], "little") | 1
    if jax.process_count() > 1:
        table = np.asarray(multihost_utils.process_allgather(table, tiled=True))
    by_device = {int(r[0]): r[1:] for r in table}
    process_of = {d.id: d.process_index for d in jax.devices()}
    problems: list[str] = []
    for j, (name, x) in enumerate(leaves):
        groups: dict[str, list[int]] = {}
        for device, index in x.sharding.devices_indices_map(tuple(x.shape)).items():
            groups.setdefault(repr(index), []).append(device.id)
        for index, devices in groups.items():
            values = {int(by_device[d][j]) for d in devices if d in by_device}
            if len(values) > 1:
                procs = sorted({process_of[d] for d in devices})
                problems.append(f"{name} (shard {index}, copies on processes {procs} differ)")
                break
    if problems:
        raise ValueError(
            f"the {what} differ between processes: {'; '.join(problems[:5])}"
            + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
            + ". Every process must initialise from the same seed (or load the same checkpoint)."
        )


__all__ = [
    "DistributedSettings", "resolve_settings", "detect_cluster", "initialize", "is_main_process",
    "check_same_on_all_processes", "check_replicas_agree", "mesh_fields", "flatten_fields",
    "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "STARTUP_TIMEOUT_EXIT_CODE",
]
