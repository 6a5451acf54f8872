"""One rule for every file a run writes at its end (``--output-json``, ``--output-csv``, ``--trace-file``):
checked before any rank starts, never created or truncated by the check, and its directory must exist (a
missing directory is refused, not created: a typo in a path should not leave new directories behind).

A file that still cannot be written at the end (a disk filled, a directory vanished) costs that file only:
the summary and every other file are still written, and the failure is reported naming the flag.
"""
from __future__ import annotations

import contextlib
from pathlib import Path


def output_path_error(path: str) -> str | None:
    """Why results could not be written to ``path``, or None. Found by opening it for appending now (a file
    that did not exist is removed again), so permissions and read-only file systems count too."""
    p = Path(path)
    if p.is_dir():
        return f"{path!r} is a directory"
    parent = p.parent
    if not parent.exists():
        return f"cannot write {path!r}: its directory {str(parent)!r} does not exist (create it first)"
    if not parent.is_dir():
        return f"cannot write {path!r}: {str(parent)!r} is not a directory"
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        return f"cannot write {path!r}: {e.strerror or e}"
    if not existed:
        with contextlib.suppress(OSError):
            p.unlink()
    return None
