"""The console scripts `eqgpt-train` and `eqgpt-sample` (`recipes/*.py` call them too)."""

from __future__ import annotations

import contextlib
import io
import re
import sys

USER_ERROR_EXIT_CODE = 1  # every console script (eqgpt-train, eqgpt-sample, python -m eqgpt.interop): a user error


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
    """Call `run()`; a user error (`errors`) exits `USER_ERROR_EXIT_CODE` with one line on stderr, no traceback."""
    try:
        return run()
    except errors as e:
        print(one_line(e, args), file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT_CODE) from None


_BOX = "│|╭╮╰╯┃"


def usage_message(text: str) -> str:
    """The message of a tyro usage error box, on one line, with tyro's first suggestion as `did you mean`."""
    lines = [line.strip().strip(_BOX).strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not set(line) <= set("─-━═")]
    body, suggestion = [], None
    for i, line in enumerate(lines[1:], 1):  # lines[0]: the box's title
        if line.startswith("Perhaps you meant"):
            suggestion = next((w for w in " ".join(lines[i + 1:i + 2]).split() if w.startswith("--")), None)
            break
        if line.startswith(("For full helptext", "Argument helptext")):
            break
        body.append(line)
    message = " ".join(body) or (lines[0] if lines else "invalid command line")
    return message + (f"; did you mean {suggestion}?" if suggestion else "")


def nearest_flag(cls, args: list[str]) -> str | None:
    """The real flag nearest to the first unknown `--flag` of `args` (`None` when none is close)."""
    import difflib
    import warnings

    import tyro

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            known = {s for a in tyro.extras.get_parser(cls)._actions for s in a.option_strings}
    except Exception:  # noqa: BLE001 - a suggestion is a courtesy
        return None
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            near = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.6)
            return near[0] if near else None
    return None


def parse_cli(cls, args: list[str] | None = None, **kwargs):
    """`tyro.cli(cls, args=args, **kwargs)`, whose usage errors (an unknown flag, a value of the wrong type or
    choice, a missing value) become one `ValueError` line (the unknown flag's nearest real one named) instead
    of tyro's box and exit status 2; `--help` prints as tyro prints it."""
    import tyro

    from eqgpt.parallel.flags import tyro_registry

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(cls, args=args, registry=tyro_registry(), **kwargs)
    except SystemExit as e:
        if not e.code:
            raise
        message = usage_message(err.getvalue())
        if "did you mean" not in message and (near := nearest_flag(cls, sys.argv[1:] if args is None else args)):
            message += f"; did you mean {near}?"
        raise ValueError(message) from None
    finally:
        if err.getvalue() and sys.exc_info()[0] is None:
            sys.stderr.write(err.getvalue())  # what a successful parse said (warnings)


def imports_in(args: list[str]) -> list[str]:
    """The modules of every `--import MODULE` (or `--import=MODULE`) in `args`."""
    found = []
    for i, arg in enumerate(args):
        if arg == "--import" and i + 1 < len(args):
            found.append(args[i + 1])
        elif arg.startswith("--import="):
            found.append(arg.split("=", 1)[1])
    return found
