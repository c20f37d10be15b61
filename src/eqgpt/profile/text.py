"""Render a rich table to plain text (for printing, logs and docs), and byte counts for people."""

from __future__ import annotations

import io


def table_text(table, width: int = 120) -> str:
    """The text of a `rich.table.Table`, laid out `width` columns wide, without styling."""
    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), no_color=True)
    console.print(table)
    return console.file.getvalue()


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
