"""What a request passes before its route: the API key (401) on every route but ``/health``, ``/version`` and
``/metrics``, which stay open as in vLLM (vLLM checks ``/v1`` only; here the routes a caller adds, such as
profiling, and the API docs need the key too); a body whose ``Content-Length`` is over the server's limit (413,
before any of it is read); a body that is not ``application/json`` on the routes that read one (415, vLLM's
``validate_json_request``: a web page's cross-site "simple" POST cannot drive the server); then, for ``/v1``
routes, admission (503 while the server drains after a signal, 500 once the engine is dead); and, for generation
routes, a slot among ``--limit-concurrency`` once the whole body has arrived (503 past it; ``limits.RequestSlots``).
A pure ASGI middleware, so the receive channel reaches the routes unwrapped but for the slot's count
(``EngineStreams`` reads ``http.disconnect`` from it)."""
from __future__ import annotations

import secrets
from http import HTTPStatus

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.entrypoints.openai.errors import OpenAIError
from runner.entrypoints.openai.lifecycle import ServerLifecycle
from runner.entrypoints.openai.limits import RequestSlots, declared_too_large, too_large

OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})
# The routes whose POST body is JSON, and which count against --limit-concurrency.
JSON_BODY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})


class ServerGate:
    def __init__(self, app: ASGIApp, lifecycle: ServerLifecycle, api_key: str | None,
                 max_request_bytes: int = 8 << 20, slots: RequestSlots | None = None) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.slots = slots if slots is not None else RequestSlots(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        if scope["path"] not in JSON_BODY_PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        held = False

        async def receive_taking_a_slot() -> Message:
            nonlocal held
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False) and not held:
                self.slots.take()  # raises the 503 into the route, which answers it
                held = True
            return message

        try:
            await self.app(scope, receive_taking_a_slot, send)
        finally:
            if held:
                self.slots.give_back()

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
        if scope["method"] == "POST" and path in JSON_BODY_PATHS:
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                return OpenAIError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                                   "Unsupported Media Type: Only 'application/json' is allowed (the request's "
                                   f"Content-Type is {media_type or 'missing'!r})")
        if path.startswith("/v1"):
            try:
                self.lifecycle.check_admission()
            except OpenAIError as exc:
                return exc
        return None
