"""Log a message once per process.

Several DP ranks run as threads of one process in the tests and the benchmarks, a process may build several
ModelRunners, and every MoE layer builds its own kernel: a choice made at set-up ("auto picked ...", "CUDA
graphs need a GPU") would otherwise be logged once per rank, runner or layer.
"""
from __future__ import annotations

import logging
import threading

_SEEN: set[tuple[str, str]] = set()  # (logger name, message)
_LOCK = threading.Lock()


def log_once(logger: logging.Logger, level: int, message: str) -> bool:
    """Log ``message`` on ``logger`` at ``level`` unless this process already did; True if it logged now."""
    key = (logger.name, message)
    with _LOCK:
        if key in _SEEN:
            return False
        _SEEN.add(key)
    logger.log(level, message)
    return True


def forget_logged() -> None:
    """Let every message be logged again (tests that check a message is logged)."""
    with _LOCK:
        _SEEN.clear()
