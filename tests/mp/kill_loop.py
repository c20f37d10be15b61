"""SIGKILL a training run that checkpoints every step, KILLS times at seeded moments, resuming each time.

Usage: python kill_loop.py DIR KILLS SEED. Prints `SUMMARY {json}` at the end.

To pay the imports once, this process imports JAX, Orbax and eqgpt (no backend
yet: one thread) and forks one child per attempt. Each child restores the newest
checkpoint as `recipes/train_gpt.py --resume` does (`Checkpointer.restore`), trains tiny-GPT steps
with the library's `Trainer` and a checkpoint every step (asynchronous), and is
SIGKILLed. Attempt 0 is killed the moment its first checkpoint's temporary
directory appears (so the next attempt finds no complete checkpoint, and must
refuse to start afresh unless asked); the others at a seeded delay after their
first step. A last child, never killed, is the uninterrupted reference run.
Compiled programs are shared through a persistent compilation cache in DIR.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "1"
sys.path.insert(0, str(Path(__file__).parent.parent))

import jax  # noqa: E402
import optax  # noqa: E402

from eqgpt.data import BatchLoader  # noqa: E402
from eqgpt.train import SingleDevice, Trainer, TrainerConfig, TrainState, make_train_step  # noqa: E402
from eqgpt.train.checkpoint import Checkpointer, CheckpointError  # noqa: E402
from mp.common import CONFIG, corpus, host_model  # noqa: E402

NEVER = 100_000  # the runs' step budget: they are killed long before (constant lr: no schedule to end)
REFUSED = 3  # a child's exit status when it refuses to start afresh


class Signalling(BatchLoader):
    """Writes one byte to `fd` when the third batch is fetched (two steps and their saves are under way)."""

    fd, first = None, None

    def local_batch(self, step):
        if step == self.first + 2 and self.fd is not None:
            os.write(self.fd, b"x")
        return super().local_batch(step)


def child(directory: Path, attempt: int, fd: int, allow_fresh: bool, steps: int | None) -> None:
    jax.config.update("jax_compilation_cache_dir", str(directory / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    optimizer = optax.adam(1e-3)
    model = jax.device_put(host_model())
    state = TrainState(model, optimizer.init(model), rng=jax.random.key(1))
    loader = Signalling(corpus(), batch_size=8, seq_len=CONFIG.seq_len, seed=0)
    ckpt = None
    if steps is None:  # the killed runs: checkpoint every step, resume as `--resume` does
        ckpt = Checkpointer(directory / "ckpt", every=1, keep=3)
        try:
            restored = ckpt.restore(state, allow_fresh=allow_fresh)
        except CheckpointError as e:
            print(f"REFUSED {e}", flush=True)
            os._exit(REFUSED)
        if restored is not None:
            loader.restore(restored.extras["data"])
            state = restored.state
        print(f"RESUMED {-1 if restored is None else restored.step} {len(restored.skipped) if restored else 0}",
              flush=True)
    loader.fd, loader.first = fd, int(state.step)
    config = TrainerConfig(steps=steps or NEVER, log_every=1, eval_every=0, progress=False,
                           out_dir=directory / f"attempt-{attempt}")
    Trainer(make_train_step(optimizer), state, loader, SingleDevice(), config=config, checkpointer=ckpt).run()


def fork(directory: Path, attempt: int, allow_fresh: bool = False, steps: int | None = None):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 0
        try:
            out = os.open(directory / f"attempt-{attempt}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            child(directory, attempt, write, allow_fresh, steps)
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(write)
    return pid, read


def committed(ckpt: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


def partial(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.glob("*.orbax-checkpoint-tmp*")) if ckpt.exists() else []


def losses(directory: Path, attempt: int) -> dict[int, float]:
    """`{step index: loss}` of one attempt's metrics.jsonl (a line torn by the kill is ignored)."""
    out = {}
    path = directory / f"attempt-{attempt}" / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row:
            out[row["step"] - 1] = row["loss"]
    return out


def main(directory: Path, kills: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ckpt = directory / "ckpt"
    events, attempt, refusals = [], 0, []
    allow_fresh = False
    t0 = time.monotonic()
    while len(events) < kills:
        pid, pipe = fork(directory, attempt, allow_fresh)
        if attempt == 0:  # kill inside the very first save
            while not partial(ckpt):
                time.sleep(0.0005)
                if os.waitpid(pid, os.WNOHANG)[0]:
                    raise SystemExit("attempt 0 ended before its first checkpoint")
            delay = 0.0
        else:
            if not os.read(pipe, 1):  # the child ended (refused, or crashed) before its first step
                _, status = os.waitpid(pid, 0)
                log = (directory / f"attempt-{attempt}.log").read_text()
                if os.waitstatus_to_exitcode(status) == REFUSED and not allow_fresh:
                    assert not committed(ckpt), "refused although a checkpoint is complete"
                    refusals.append(next(x for x in log.splitlines() if x.startswith("REFUSED ")))
                    allow_fresh = True  # "start fresh only when asked": now we ask
                    attempt += 1
                    os.close(pipe)
                    continue
                raise SystemExit(f"attempt {attempt} failed:\n{log[-3000:]}")
            delay = float(rng.uniform(0.0, 0.35))
            time.sleep(delay)
        before = committed(ckpt)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(pipe)
        events.append({"attempt": attempt, "delay": round(delay, 3), "committed": committed(ckpt),
                       "committed_before_kill": before, "partial": partial(ckpt)})
        allow_fresh = False
        attempt += 1
    # One more resume, to check that the last kill left a usable checkpoint too, then stop it.
    pid, pipe = fork(directory, attempt, allow_fresh)
    os.read(pipe, 1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    resumes = {}
    for a in range(attempt + 1):
        log = (directory / f"attempt-{a}.log").read_text() if (directory / f"attempt-{a}.log").exists() else ""
        line = next((x for x in log.splitlines() if x.startswith("RESUMED ")), None)
        if line:
            step, skipped = map(int, line.split()[1:])
            resumes[a] = {"step": step, "skipped": skipped}
    got = {a: losses(directory, a) for a in range(attempt + 1)}
    last = max(s for run in got.values() for s in run)
    loop_seconds = time.monotonic() - t0
    ref_attempt = attempt + 1
    pid, pipe = fork(directory, ref_attempt, steps=last + 1)  # the uninterrupted run
    _, status = os.waitpid(pid, 0)
    assert status == 0, (directory / f"attempt-{ref_attempt}.log").read_text()[-3000:]
    print("SUMMARY " + json.dumps({
        "events": events, "refusals": refusals, "resumes": resumes, "losses": got,
        "reference": losses(directory, ref_attempt), "loop_seconds": loop_seconds,
    }), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
