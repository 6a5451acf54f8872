"""The FastAPI app (``build_app``) and the uvicorn server around it (``run_server``), as vLLM's
``vllm/entrypoints/openai/api_server.py``.

Shutdown. uvicorn's own signal handling stops accepting connections at once and, after shutting down, raises
the captured signal again (the process then dies by SIGTERM, not with status 0). ``DrainingServer`` replaces
it: a signal starts ``ServerLifecycle.begin_drain`` (new requests get 503 on connections still accepted,
running ones finish within ``--shutdown-timeout``, the rest are aborted), and only then is uvicorn told to
exit; ``run_server`` returns 0, or 1 when the engine died, and the caller stops the engine.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.metadata
import logging
import math
import signal
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from types import FrameType
from typing import Any

import uvicorn
import uvloop
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from runner.engine.protocol import EngineClient, EngineDeadError
from runner.entrypoints.openai.cli_args import (
    request_logging,
    served_model_names,
    server_limits,
    uvicorn_access_log,
)
from runner.entrypoints.openai.errors import OpenAIError, redact
from runner.entrypoints.openai.gate import ServerGate
from runner.entrypoints.openai.lifecycle import ServerLifecycle
from runner.entrypoints.openai.limits import ClientLeft, RequestSlots
from runner.entrypoints.openai.metrics import ServerMetrics
from runner.entrypoints.openai.server_limits import DEFAULT_LIMITS, ServerLimits
from runner.entrypoints.openai.serving_chat import OpenAIServingChat
from runner.entrypoints.openai.serving_completion import OpenAIServingCompletion
from runner.entrypoints.openai.serving_models import ServingModels
from runner.entrypoints.openai.sse import RawSend
from runner.entrypoints.openai.tokenization import OpenAIServingTokenization
from runner.entrypoints.openai.uvicorn_internals import header_timeout_protocol

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def build_app(engine_client: EngineClient, served_model_names: list[str], api_key: str | None = None, *,
              shutdown_timeout_s: float = 30.0, log_requests: bool = False, metrics: ServerMetrics | None = None,
              model_root: str | None = None, limits: ServerLimits = DEFAULT_LIMITS,
              enable_prompt_tokens_details: bool = False) -> FastAPI:
    """The server's routes over ``engine_client``. ``metrics``: the sink the engine client reports to (made here
    if not given; ``app.state.metrics``). ``app.state.lifecycle`` drains and stops it.
    ``enable_prompt_tokens_details``: ``usage.prompt_tokens_details.cached_tokens`` in the responses."""
    lifecycle = ServerLifecycle(engine_client, shutdown_timeout_s)
    models = ServingModels(served_model_names, engine_client.max_model_len, model_root)
    metrics = metrics if metrics is not None else ServerMetrics(models.names[0], engine_client.max_model_len)
    tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    completion = OpenAIServingCompletion(engine_client, models, lifecycle, log_requests, limits=limits,
                                         tokenizer_thread=tokenizer_thread,
                                         enable_prompt_tokens_details=enable_prompt_tokens_details)
    chat = OpenAIServingChat(engine_client, models, lifecycle, log_requests, limits=limits,
                             tokenizer_thread=tokenizer_thread,
                             enable_prompt_tokens_details=enable_prompt_tokens_details)
    tokenization = OpenAIServingTokenization(engine_client, models, lifecycle, limits=limits,
                                             tokenizer_thread=tokenizer_thread)

    app = FastAPI(title="ubatch OpenAI-compatible server", version=package_version())
    app.state.lifecycle, app.state.metrics, app.state.models = lifecycle, metrics, models
    app.state.engine_client, app.state.limits, app.state.tokenization = engine_client, limits, tokenization
    app.add_middleware(ServerGate, lifecycle=lifecycle, api_key=api_key, max_request_bytes=limits.max_request_bytes,
                       slots=RequestSlots(limits.limit_concurrency))
    add_error_handlers(app, metrics)

    async def create_completion(raw: Request) -> Response:
        return await completion.create_completion(raw)

    async def create_chat_completion(raw: Request) -> Response:
        return await chat.create_chat_completion(raw)

    # The inference routes are Starlette's routes, registered first so that they serve every POST: they take the
    # raw Request, for which FastAPI's per-request dependency solving and operation telemetry cost about a tenth
    # of a request's CPU and do nothing (with an OpenTelemetry provider configured, FastAPI's HTTP span still
    # names the route; its operation span is not made). FastAPI's declarations of them below only describe them
    # in the OpenAPI schema.
    app.add_route("/v1/completions", create_completion, methods=["POST"], include_in_schema=False)
    app.add_route("/v1/chat/completions", create_chat_completion, methods=["POST"], include_in_schema=False)
    app.post("/v1/completions")(create_completion)
    app.post("/v1/chat/completions")(create_chat_completion)

    @app.get("/v1/models")
    async def show_models() -> JSONResponse:
        return JSONResponse(models.list().model_dump(mode="json"))

    @app.get("/health")
    async def health() -> Response:
        """200 while every rank is alive and the server takes requests; 503 saying why otherwise."""
        reason = lifecycle.dead_error()
        if reason is not None:
            return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, f"The engine is dead: {redact(reason)}").response()
        if lifecycle.draining:
            return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, "The server is shutting down").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": package_version()})

    @app.get("/metrics")
    async def show_metrics() -> Response:
        metrics.on_engine_stats(engine_client.stats())
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    add_reset_prefix_cache_route(app, engine_client, lifecycle)
    return app


def add_reset_prefix_cache_route(app: FastAPI, engine_client: EngineClient, lifecycle: ServerLifecycle) -> None:
    """vLLM's ``POST /reset_prefix_cache``: every DP rank drops the cached KV blocks no request holds, so that the
    next requests compute their whole prompts (benchmarks measure cold caches this way). vLLM serves it only with
    ``VLLM_SERVER_DEV_MODE=1`` and answers 200 whatever the engine did; here it is always served (behind the API
    key when there is one: it changes no output, only how much prompt the next requests compute) and says when a
    rank refused: 200 with an empty body once every rank reset, 409 while requests hold cached blocks (retry
    when they have finished), 500 when the engine is dead or a rank did not answer."""

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        reason = lifecycle.dead_error()
        if reason is not None:
            return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"The engine is dead: {redact(reason)}").response()
        logger.info("Resetting the prefix cache of every DP rank")
        try:
            reset = await engine_client.reset_prefix_cache()
        except EngineDeadError as exc:
            lifecycle.engine_died(str(exc))
            return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"The engine is dead: {redact(str(exc))}").response()
        except TimeoutError as exc:  # a rank did not answer in time (the message names it)
            return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                               f"The prefix cache reset did not complete: {redact(str(exc))}").response()
        if not reset:
            return OpenAIError(HTTPStatus.CONFLICT, "The prefix cache was not reset: running requests hold its blocks "
                               "on some DP rank; retry once they have finished").response()
        return Response(status_code=HTTPStatus.OK)


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error the app answers is OpenAI-shaped: its own (``OpenAIError``), Starlette's and FastAPI's (404,
    405, a schema-declared body's 422 as a 400) and any other exception (500, logged with its traceback). A client
    that left mid-body is counted (``ubatch:client_left_mid_body_total``) and logged as one line at DEBUG: there
    is no one to answer."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = OpenAIError(HTTPStatus(exc.status_code), str(exc.detail), headers=dict(exc.headers or {}))
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return OpenAIError(HTTPStatus.BAD_REQUEST, f"Invalid request: {exc.errors()!s:.500}").response()

    @app.exception_handler(ClientLeft)
    async def client_left(raw: Request, _: ClientLeft) -> Response:
        metrics.left_mid_body.inc()
        logger.debug("A client of %s left before its request was read", raw.url.path)
        return Response(status_code=HTTPStatus.BAD_REQUEST)  # no one reads it

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.error("Request failed", exc_info=exc)
        return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                           f"Internal error: {type(exc).__name__} (details in the server's log)").response()


@functools.cache
def package_version() -> str:
    """ubatch's version: from the installed distribution, else from the package (which imports torch)."""
    try:
        return importlib.metadata.version("ubatch")
    except importlib.metadata.PackageNotFoundError:
        import ubatch

        return ubatch.__version__


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting the drain instead of stopping at once, and not re-raised."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle, handle_signals: bool = True) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.handle_signals = handle_signals  # False: the process that started this one relays them
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A Python signal handler runs between bytecodes of the main thread: hand over to the event loop.
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.lifecycle.begin_drain, signal.Signals(sig).name)


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run an API server's ``main`` to its end on uvloop's event loop, as vLLM's API server does (``uvloop.run``)
    and uvicorn would itself (``loop="auto"``): its loop, handles and transports are compiled, which costs the
    server less CPU per request and per streamed chunk than asyncio's own loop (docs/benchmarks.md)."""
    return uvloop.run(main)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


async def run_server(args: argparse.Namespace, engine_client: EngineClient, *,
                     engine_dead: asyncio.Event | None = None, metrics: ServerMetrics | None = None,
                     sock: socket.socket | None = None,
                     configure_app: Callable[[FastAPI], None] | None = None, handle_signals: bool = True,
                     max_logprobs: int = ServerLimits.max_logprobs) -> int:
    """Serve ``engine_client`` with the flags of ``cli_args.add_server_args`` (``args.model`` too) until
    SIGTERM/SIGINT (then drain; returns 0) or the engine dies (returns 1); see ``serve_app``.
    ``configure_app``: adds routes the engine client offers beyond ``EngineClient`` (profiling); they need the
    API key like ``/v1``. ``handle_signals=False``: signals are left alone (an API server of several, which the
    parent tells to drain). ``max_logprobs``: ``--max-logprobs``, resolved against the vocabulary."""
    _log_to_stderr()
    app = build_app(engine_client, served_model_names(args), args.api_key, shutdown_timeout_s=args.shutdown_timeout,
                    log_requests=request_logging(args), metrics=metrics,
                    model_root=str(args.model), limits=server_limits(args, max_logprobs),
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    if configure_app is not None:
        configure_app(app)
    sock = sock if sock is not None else bind_socket(args.host, args.port)
    return await serve_app(app, sock, engine_dead=engine_dead, log_level=args.uvicorn_log_level,
                           access_log=uvicorn_access_log(args), handle_signals=handle_signals)


async def serve_app(app: FastAPI, sock: socket.socket, *, engine_dead: asyncio.Event | None = None,
                    log_level: str = "info", access_log: bool = True, handle_signals: bool = True) -> int:
    """Run ``app`` (from ``build_app``) under uvicorn on the bound ``sock`` until its lifecycle says to stop:
    after a drain (SIGTERM/SIGINT, or ``app.state.lifecycle.begin_drain``; returns 0) or once the engine died
    (returns 1). ``engine_dead``: set by the engine client when a rank dies (``engine_client.dead_error`` says
    which); the server then fails the running requests with 500 and stops."""
    lifecycle: ServerLifecycle = app.state.lifecycle
    engine_client: EngineClient = app.state.engine_client
    limits: ServerLimits = app.state.limits
    host, port = sock.getsockname()[:2]
    protocol = header_timeout_protocol(limits.header_timeout_s, limits.body_timeout_s)  # checks uvicorn first
    config = uvicorn.Config(RawSend(app), log_level=log_level, lifespan="off", timeout_graceful_shutdown=10,
                            access_log=access_log, http=protocol,
                            timeout_keep_alive=int(math.ceil(limits.timeout_keep_alive_s)),
                            limit_concurrency=None)  # the gate limits generation requests (limits.RequestSlots)
    server = DrainingServer(config, lifecycle, handle_signals)

    async def exit_when_told() -> None:
        await lifecycle.should_exit.wait()
        server.should_exit = True

    async def watch_engine(event: asyncio.Event) -> None:
        await event.wait()
        lifecycle.engine_died(engine_client.dead_error or "the engine client reported the engine dead")

    watchers = [asyncio.create_task(exit_when_told(), name="exit when told")]
    if engine_dead is not None:
        watchers.append(asyncio.create_task(watch_engine(engine_dead), name="watch engine"))
    names = ", ".join(m.id for m in app.state.models.list().data)
    logger.info("Serving %s on http://%s:%d", names, f"[{host}]" if ":" in host else host, port)
    try:
        await server.serve(sockets=[sock])
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        sock.close()
        app.state.tokenization.shutdown()  # the tokenizer thread the routes share
    logger.info("Server stopped (exit status %d)", lifecycle.exit_code)
    return lifecycle.exit_code


def _log_to_stderr() -> None:
    """This package's INFO logs on stderr, unless the application configured logging (as vLLM's loggers)."""
    package = logging.getLogger("runner.entrypoints.openai")
    if not package.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)
