"""``pytest --stream-sanitizer``: run the tests under the stream-order sanitizer (``ubatch.stream_sanitizer``).

Imported by ``conftest.py``. The option (or ``UBATCH_STREAM_SANITIZER=1`` in the environment) turns the
sanitizer on for the whole session, in raise mode, and exports the variable so child processes (launched
ranks, CLI runs) are sanitised too. Each test starts from a clean history, so a race is reported in the
test that made it.
"""
from __future__ import annotations

import os
from typing import Iterator

import pytest

from ubatch import stream_sanitizer


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--stream-sanitizer", action="store_true", default=False,
                     help="report cross-stream accesses with no happens-before edge (ubatch.stream_sanitizer); "
                          f"same as {stream_sanitizer.ENV_VAR}=1")


@pytest.fixture(scope="session", autouse=True)
def stream_sanitizer_session(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.config.getoption("--stream-sanitizer") and stream_sanitizer.active() is None:
        os.environ[stream_sanitizer.ENV_VAR] = "1"
        stream_sanitizer.enable()
    yield


@pytest.fixture(autouse=True)
def stream_sanitizer_fresh_history() -> Iterator[None]:
    san = stream_sanitizer.active()
    if san is not None:
        san.reset()
    yield
