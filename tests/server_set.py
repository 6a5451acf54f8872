"""Several real ``serve`` processes of one checkpoint for a test module, started in turn and always stopped."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from runner.entrypoints.benchserve.server_proc import ServerProcess


@contextmanager
def started_servers(model: str, engine_args: str, variants: Sequence[tuple[str, str]]
                    ) -> Iterator[dict[str, ServerProcess]]:
    """One server per ``(name, extra flags)`` of ``variants``, each with ``engine_args`` too; on leaving, every
    server that started is stopped, and each must have exited 0."""
    started: dict[str, ServerProcess] = {}
    try:
        for name, extra in variants:
            started[name] = ServerProcess(model, f"{engine_args} {extra}", startup_timeout_s=300, name=name)
            started[name].start()
        yield started
    finally:
        codes = {name: srv.stop() for name, srv in started.items()}
    assert all(code == 0 for code in codes.values()), codes
