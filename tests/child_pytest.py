"""The environment of a pytest that a test starts as a child process.

This process's environment, less pytest-xdist's worker variables (``PYTEST_XDIST_*``): under ``make test`` the
test runs on an xdist worker, and a child inheriting them would take itself for one (gpu-check's plugin then
leaves its outcome log to a controller the child does not have).
"""
from __future__ import annotations

import os


def child_pytest_env(*, drop: tuple[str, ...] = (), **overrides: str) -> dict[str, str]:
    """This environment without the xdist worker's variables and the names in ``drop``, with ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k not in drop}
    env.update(overrides)
    return env
