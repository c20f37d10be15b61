"""The console scripts `eqgpt-train` and `eqgpt-sample` (`recipes/*.py` call them too)."""

from __future__ import annotations

import re
import sys


def flags_named_in(text: str, args: list[str]) -> list[str]:
    """The `--flag value` pairs of `args` whose field name `text` mentions (`microbatches`,
    `profile steps`, ...): for messages of library code, which knows fields, not flags."""
    found = []
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, _, value = arg.partition("=")
        value = value or (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "")
        field = name[2:].rsplit(".", 1)[-1].replace("-", "_")
        if re.search(rf"\b({re.escape(field)}|{re.escape(field.replace('_', ' '))})\b", text, re.I):
            found.append(f"{name} {value}".strip())
    return found


def one_line(error: BaseException, args: list[str] | None = None) -> str:
    """`error: ...` on one line: what a user error prints instead of a traceback. A message that
    names no flag gets the flags of `args` (default: the command line) it is about."""
    text = " ".join(str(error).split()) or type(error).__name__
    if "--" not in text and (named := flags_named_in(text, sys.argv[1:] if args is None else args)):
        text = f"{', '.join(named)}: {text}"
    return f"error: {text}"


def exit_on_user_error(run, errors=(ValueError, OSError), args: list[str] | None = None):
    """Call `run()`; a user error (`errors`) exits 1 with one line on stderr, no traceback."""
    try:
        return run()
    except errors as e:
        print(one_line(e, args), file=sys.stderr, flush=True)
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
