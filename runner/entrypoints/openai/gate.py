"""What every ``/v1`` request passes before its route: the API key (401), then admission (503 while the server
drains after a signal, 500 once the engine is dead). ``/health``, ``/version`` and ``/metrics`` stay open, as in
vLLM. A pure ASGI middleware, so the receive channel reaches the routes unwrapped (``EngineStreams`` reads
``http.disconnect`` from it)."""
from __future__ import annotations

import secrets
from http import HTTPStatus

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from runner.entrypoints.openai.errors import OpenAIError
from runner.entrypoints.openai.lifecycle import ServerLifecycle


class ServerGate:
    def __init__(self, app: ASGIApp, lifecycle: ServerLifecycle, api_key: str | None) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            error = self._refusal(scope)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> OpenAIError | None:
        if self.api_key is not None and scope["method"] != "OPTIONS":
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                          self.api_key.encode()):
                return OpenAIError(HTTPStatus.UNAUTHORIZED,
                                   "Invalid or missing API key: send it as the header 'Authorization: Bearer <key>'")
        try:
            self.lifecycle.check_admission()
        except OpenAIError as exc:
            return exc
        return None
