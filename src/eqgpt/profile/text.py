"""Render a rich table to plain text (for printing, logs and docs)."""

from __future__ import annotations

import io


def table_text(table, width: int = 120) -> str:
    """The text of a `rich.table.Table`, laid out `width` columns wide, without styling."""
    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), no_color=True)
    console.print(table)
    return console.file.getvalue()
