"""``pytest --stream-sanitizer``: run the tests under the stream-order sanitizer (``ubatch.testing.stream_sanitizer``).

Imported by ``conftest.py``. The option (or ``UBATCH_STREAM_SANITIZER=1`` in the environment) turns the
sanitizer on for the whole session, in raise mode, and makes child processes (launched ranks, CLI runs) turn
it on at start-up too: it exports the variable and puts ``stream_sanitizer_site/`` (a ``sitecustomize``)
first on ``PYTHONPATH``. Each test starts from a clean history, so a race is reported in the test that made it.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ubatch.testing import stream_sanitizer

SITE_DIR = str(Path(__file__).resolve().parent / "stream_sanitizer_site")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--stream-sanitizer", action="store_true", default=False,
                     help="report cross-stream accesses with no happens-before edge (ubatch.testing.stream_sanitizer); "
                          f"same as {stream_sanitizer.ENV_VAR}=1")


def sanitize_child_processes(env: dict[str, str]) -> dict[str, str]:
    """``env`` with what makes a Python process started with it turn the sanitizer on at start-up."""
    path = env.get("PYTHONPATH", "")
    return dict(env, **{stream_sanitizer.ENV_VAR: "1",
                        "PYTHONPATH": SITE_DIR + (os.pathsep + path if path else "")})


@pytest.fixture(scope="session", autouse=True)
def stream_sanitizer_session(request: pytest.FixtureRequest) -> Iterator[None]:
    wanted = request.config.getoption("--stream-sanitizer") or \
        os.environ.get(stream_sanitizer.ENV_VAR, "0") not in ("", "0")
    if wanted and stream_sanitizer.active() is None:
        os.environ.update(sanitize_child_processes(dict(os.environ)))
        stream_sanitizer.enable()
    yield


@pytest.fixture(autouse=True)
def stream_sanitizer_fresh_history() -> Iterator[None]:
    san = stream_sanitizer.active()
    if san is not None:
        san.reset()
    yield
