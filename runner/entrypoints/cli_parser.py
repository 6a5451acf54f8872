"""The CLI's argument parser: exact flag names only, and errors as one line with a pointer to ``--help``.

argparse's defaults trip vLLM users: prefix matching takes ``--prompt`` for ``--prompts-file``, and every
error follows the subcommand's whole usage block. ``CliParser`` turns prefix matching off (``allow_abbrev``)
for itself and its subcommands, and prints ``PROG: error: MESSAGE (see: PROG --help)``, exit 2.
"""
from __future__ import annotations

import argparse
from typing import Any, NoReturn


class CliParser(argparse.ArgumentParser):
    """``ArgumentParser`` without prefix matching, whose errors are one line (subparsers are CliParsers too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")
