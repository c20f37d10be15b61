"""Stops for runs that train on garbage: too many non-finite steps in a row, or a diverging loss.

The step already drops an update whose loss or gradients are not finite
(`make_train_step`). `Guard` watches each step's loss and skip flag on the host
and says when to stop instead:

- `max_skipped=N`: N skipped updates in a row (a stream of NaN/Inf batches,
  or a model that has broken down) stop the run with `NON_FINITE_EXIT_CODE`;
- `divergence_factor=F`, `divergence_window=K`: K losses in a row above F times
  the running mean of the normal losses before them stop the run with
  `DIVERGED_EXIT_CODE`.

The `Trainer` then saves the last good state (see its docs) and stops; every
process reads the same losses, so all stop at the same step.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

# Exit statuses of `recipes/train_gpt.py` (after the checkpoint of the last good state is written).
# Distinct from success (0), a crash (1), preemption (75), the launcher's (100 + rank, 124) and
# death by signal (128 + n), so a wrapper never requeues these runs blindly.
NON_FINITE_EXIT_CODE = 76
DIVERGED_EXIT_CODE = 77


@dataclass(frozen=True)
class Stop:
    """Why a guard stopped the run.

    **Fields:** `code` (the exit status), `reason` (`"non-finite"` or `"diverged"`),
    `step` (steps done when it fired), `good_step` (steps of the last good state,
    the one saved), `message` (a sentence for the user).
    """

    code: int
    reason: str
    step: int
    good_step: int
    message: str


class Guard:
    """Judges each step's loss and skip flag.

    **Arguments:**

    - `max_skipped`: stop after this many skipped updates in a row (0: never).
    - `divergence_factor`: a loss above this times the running mean is divergent (0: never).
    - `divergence_window`: stop after this many divergent losses in a row (K).
    - `history`: normal losses in the running mean (the newest ones).
    - `min_history`: normal losses needed before any loss is judged divergent.
    """

    def __init__(self, max_skipped: int = 0, divergence_factor: float = 0.0, divergence_window: int = 3,
                 history: int = 50, min_history: int = 5):
        if max_skipped < 0:
            raise ValueError(f"--max-skipped must be 0 (off) or positive, got {max_skipped}.")
        if divergence_factor and divergence_factor <= 1.0:
            raise ValueError(f"--divergence-factor must be above 1 (or 0: off), got {divergence_factor}.")
        if divergence_window < 1:
            raise ValueError(f"--divergence-window must be at least 1 step, got {divergence_window}.")
        self.max_skipped, self.divergence_factor = max_skipped, divergence_factor
        self.divergence_window, self.min_history = divergence_window, min_history
        self._normal: collections.deque[float] = collections.deque(maxlen=history)
        self._skipped_run = 0
        self._divergent_run = 0

    @property
    def active(self) -> bool:
        return bool(self.max_skipped or self.divergence_factor)

    @property
    def divergence(self) -> bool:
        return bool(self.divergence_factor)

    @property
    def divergent_run(self) -> int:
        """Divergent losses in a row so far (the state before them is the last good one)."""
        return self._divergent_run

    def observe(self, step: int, loss: float, skipped: bool) -> Stop | None:
        """Record step `step`'s loss (0-based) and skip flag; **returns** a `Stop` when the run must end."""
        if skipped or not math.isfinite(loss):
            self._skipped_run += 1
            if self.max_skipped and self._skipped_run >= self.max_skipped:
                first = step + 1 - self._skipped_run
                return Stop(NON_FINITE_EXIT_CODE, "non-finite", step + 1, step + 1,
                            f"{self._skipped_run} updates in a row were skipped (non-finite loss or gradients, "
                            f"steps {first}..{step}; --max-skipped {self.max_skipped})")
            return None
        self._skipped_run = 0
        if not self.divergence_factor:
            return None
        mean = sum(self._normal) / len(self._normal) if len(self._normal) >= self.min_history else None
        if mean is not None and loss > self.divergence_factor * mean:
            self._divergent_run += 1
            if self._divergent_run >= self.divergence_window:
                first = step + 1 - self._divergent_run
                return Stop(DIVERGED_EXIT_CODE, "diverged", step + 1, first,
                            f"the loss diverged: {self._divergent_run} losses in a row above "
                            f"{self.divergence_factor:g} x the running mean {mean:.4g} (steps {first}..{step}, "
                            f"last {loss:.4g}; --divergence-factor {self.divergence_factor:g}, "
                            f"--divergence-window {self.divergence_window})")
            return None
        self._divergent_run = 0
        self._normal.append(loss)
        return None


__all__ = ["Guard", "Stop", "NON_FINITE_EXIT_CODE", "DIVERGED_EXIT_CODE"]
