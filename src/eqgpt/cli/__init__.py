"""The console scripts `eqgpt-train` and `eqgpt-sample` (`recipes/*.py` call them too)."""

from __future__ import annotations

import sys


def one_line(error: BaseException) -> str:
    """`error: ...` on one line: what a user error prints instead of a traceback."""
    text = " ".join(str(error).split()) or type(error).__name__
    return f"error: {text}"


def exit_on_user_error(run, errors=(ValueError, OSError)):
    """Call `run()`; a user error (`errors`) exits 1 with one line on stderr, no traceback."""
    try:
        return run()
    except errors as e:
        print(one_line(e), file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def imports_in(args: list[str]) -> list[str]:
    """The modules of every `--import MODULE` (or `--import=MODULE`) in `args`."""
    found = []
    for i, arg in enumerate(args):
        if arg == "--import" and i + 1 < len(args):
            found.append(args[i + 1])
        elif arg.startswith("--import="):
            found.append(arg.split("=", 1)[1])
    return found
