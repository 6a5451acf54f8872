"""What a request passes before its route: the API key (401) on every route but ``/health``, ``/version`` and
``/metrics``, which stay open as in vLLM (vLLM checks ``/v1`` only; here the routes a caller adds, such as
profiling, and the API docs need the key too); a body whose ``Content-Length`` is over the server's limit (413,
before any of it is read); then, for ``/v1`` routes, admission (503 while the server drains after a signal, 500
once the engine is dead). A pure ASGI middleware, so the receive channel reaches the routes unwrapped
(``EngineStreams`` reads ``http.disconnect`` from it)."""
from __future__ import annotations

import secrets
from http import HTTPStatus

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from runner.entrypoints.openai.errors import OpenAIError
from runner.entrypoints.openai.lifecycle import ServerLifecycle
from runner.entrypoints.openai.limits import declared_too_large, too_large

OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


class ServerGate:
    def __init__(self, app: ASGIApp, lifecycle: ServerLifecycle, api_key: str | None,
                 max_request_bytes: int = 8 << 20) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> OpenAIError | None:
        path, headers = scope["path"], Headers(scope=scope)
        if self.api_key is not None and path not in OPEN_PATHS and scope["method"] != "OPTIONS":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                          self.api_key.encode()):
                return OpenAIError(HTTPStatus.UNAUTHORIZED,
                                   "Invalid or missing API key: send it as the header 'Authorization: Bearer <key>'")
        if declared_too_large(headers.get("content-length"), self.max_request_bytes):
            return too_large(self.max_request_bytes)
        if path.startswith("/v1"):
            try:
                self.lifecycle.check_admission()
            except OpenAIError as exc:
                return exc
        return None
