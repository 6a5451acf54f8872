"""An ``OutputSink`` that keeps nothing: a request handler's buffer where a test or a benchmark looks only at what
the engine client does (which rank it sends to, what its output path costs)."""
from __future__ import annotations

from runner.outputs import RequestOutput


class DiscardSink:
    def put(self, output: RequestOutput) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        pass

    def end(self) -> None:
        pass
