"""Running the OpenAI server for tests: a real uvicorn server on 127.0.0.1 and a free port, in a thread with its
own event loop (``ServerThread``), over ``FakeEngineClient``. Always stopped: leaving the ``with`` block drains
the server as SIGTERM would and asserts that it returned and what it returned."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx
import openai

from fake_engine_client import FakeEngineClient
from runner.entrypoints.openai.api_server import bind_socket, build_app, serve_app
from runner.entrypoints.openai.limits import ServerLimits
from runner.entrypoints.openai.metrics import ServerMetrics

MODEL = "fake-model"
TIMEOUT_S = 30.0
DEFAULT_LIMITS = ServerLimits()  # frozen, so one shared default is safe

_T = TypeVar("_T")


class ServerThread:
    def __init__(self, engine: FakeEngineClient | None = None, *, names: tuple[str, ...] = (MODEL,),
                 api_key: str | None = None, shutdown_timeout_s: float = 5.0, with_dead_event: bool = True,
                 limits: ServerLimits = DEFAULT_LIMITS, enable_prompt_tokens_details: bool = False) -> None:
        self.engine = engine if engine is not None else FakeEngineClient()
        self.metrics = ServerMetrics(names[0], self.engine.max_model_len)
        self.engine.metrics = self.metrics
        self.app = build_app(self.engine, list(names), api_key, shutdown_timeout_s=shutdown_timeout_s,
                             log_requests=False, metrics=self.metrics, limits=limits,
                             enable_prompt_tokens_details=enable_prompt_tokens_details)
        self.api_key = api_key
        self.sock: socket.socket = bind_socket("127.0.0.1", 0)
        self.port: int = self.sock.getsockname()[1]
        self.with_dead_event = with_dead_event
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"openai server :{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or self.api_key or "unused", max_retries=0,
                             timeout=TIMEOUT_S)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=TIMEOUT_S)

    # ---- running -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        async def main() -> int:
            self._loop = asyncio.get_running_loop()
            dead = self.engine.dead_event if self.with_dead_event else None
            self._ready.set()
            return await serve_app(self.app, self.sock, engine_dead=dead, log_level="warning", access_log=False)

        try:
            self.exit_code = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001  (reported by stop())
            self.error = exc
            self._ready.set()

    def start(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(TIMEOUT_S), "the server thread did not start its event loop"
        assert self.error is None, self.error
        return self

    def on_loop(self, fn: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        """Run a coroutine function on the server's event loop and return its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(TIMEOUT_S)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    def wait_stopped(self, timeout_s: float = TIMEOUT_S) -> int:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the server did not stop within {timeout_s} s"
        if self.error is not None:
            raise self.error
        assert self.exit_code is not None
        return self.exit_code

    def stop(self) -> int:
        """Drain as SIGTERM does, and wait for the server to return."""
        if self._thread.is_alive() and self._loop is not None:
            self.call_soon(self.app.state.lifecycle.begin_drain, "test stop")
        return self.wait_stopped()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sse_events(response: httpx.Response) -> list[Any]:
    """The JSON bodies of a server-sent-event stream, then the string "[DONE]"; asserts the framing."""
    events: list[Any] = []
    for block in response.read().decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
