"""One option's value in a command line as argparse reads it (``--name VALUE`` or ``--name=VALUE``), without
parsing the rest: for lines that belong to another parser (an engine's, or preload's before its engine is known)."""

from __future__ import annotations


def option_value(argv: list[str], name: str) -> str | None:
    """The first value given to ``name``; None when it is not there."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None
