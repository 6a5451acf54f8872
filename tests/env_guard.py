"""No test may leave the process's Triton mode, visible GPUs or torch default dtype changed.

Imported by ``conftest.py`` (three autouse fixtures). ``TRITON_INTERPRET`` decides whether the Triton kernels a
later test launches run interpreted or compiled, ``CUDA_VISIBLE_DEVICES`` is inherited by every child process a
later test starts, and the default dtype is what every later ``torch.randn`` makes. A change left behind breaks
whichever test runs next, on another machine or in another order, far from its cause. So the state is compared
before and after each test (its function fixtures included), each module (module and class fixtures) and the
session; a difference fails the test that made it (the last test of the module or session for a fixture of that
scope), names what changed, and is put back so the tests after it run as they would have.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

GUARDED_ENV = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class ProcessState:
    """The guarded environment variables (``None``: unset) and torch's default dtype."""

    env: tuple[tuple[str, str | None], ...]
    default_dtype: torch.dtype

    @classmethod
    def now(cls) -> ProcessState:
        return cls(tuple((name, os.environ.get(name)) for name in GUARDED_ENV), torch.get_default_dtype())

    def changes_since(self, before: ProcessState) -> list[str]:
        """One ``what: before -> now`` line per difference."""
        changes = [f"{name}={old!r} -> {new!r}"
                   for (name, old), (_, new) in zip(before.env, self.env, strict=True) if old != new]
        if self.default_dtype != before.default_dtype:
            changes.append(f"torch default dtype {before.default_dtype} -> {self.default_dtype}")
        return changes

    def restore(self) -> None:
        for name, value in self.env:
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.set_default_dtype(self.default_dtype)


def check_unchanged(before: ProcessState, who: str) -> None:
    """Fail, naming ``who`` and each change, if the state differs from ``before``; put ``before`` back first."""
    changes = ProcessState.now().changes_since(before)
    if changes:
        before.restore()
        pytest.fail(f"{who} left the process changed: {'; '.join(changes)} (restored). Change these only through "
                    "monkeypatch (setenv/delenv) or a fixture that puts them back", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def process_state_session() -> Iterator[None]:
    before = ProcessState.now()
    yield
    check_unchanged(before, "a session-scoped fixture")


@pytest.fixture(scope="module", autouse=True)
def process_state_module(request: pytest.FixtureRequest) -> Iterator[None]:
    before = ProcessState.now()
    yield
    check_unchanged(before, f"a module- or class-scoped fixture of {request.node.nodeid}")


@pytest.fixture(autouse=True)
def process_state_test(request: pytest.FixtureRequest) -> Iterator[None]:
    before = ProcessState.now()
    yield
    check_unchanged(before, request.node.nodeid)
