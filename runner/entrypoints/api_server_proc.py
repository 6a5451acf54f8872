"""One API server of several (``serve --api-server-count N``; the parent is ``runner/entrypoints/api_servers.py``).

It attaches an engine client to the ranks the parent started (``client_index`` i of N), serves HTTP on the
listening socket it inherited, ignores signals (the parent relays them) and follows the parent's orders from a
pipe: drain, or fail every request because the engine (a rank, or another API server) died.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from runner.config import RunnerConfig
from runner.engine.mp_client import EngineSockets

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class ApiServerSpec:
    """What API server ``index`` of ``count`` needs (pickled into its spawned process)."""

    index: int
    count: int
    args: argparse.Namespace
    cfg: RunnerConfig
    tokenizer: Any
    generation_config: Any
    max_logprobs: int
    sockets: EngineSockets
    parent_pid: int


def api_server_main(spec: ApiServerSpec, sock: socket.socket, conn: Connection) -> None:
    """The body of API server ``spec.index``: an engine client attached to the ranks, the HTTP server on the
    inherited socket, and the parent's orders (drain, engine dead) from ``conn``. Exits with the server's
    status."""
    from runner.distributed.launch import describe_exception
    from runner.distributed.liveness import die_with_parent
    from runner.entrypoints.openai.api_server import run_loop
    from runner.entrypoints.server_setup import log_to_stderr

    for sig in SIGNALS:  # the parent decides when to drain
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(spec.parent_pid)
    log_to_stderr()
    try:
        code = run_loop(_serve_attached(spec, sock, conn))
    except Exception as exc:  # noqa: BLE001 - one line naming this API server; the parent names it too
        print(f"error: API server {spec.index}: {describe_exception(exc)}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve_attached(spec: ApiServerSpec, sock: socket.socket, conn: Connection) -> int:
    from runner.core.engine_core import tune_gc
    from runner.engine.async_llm import MPEngineClient
    from runner.entrypoints.openai.api_server import run_server
    from runner.entrypoints.openai.cli_args import served_model_names
    from runner.entrypoints.openai.metrics import ServerMetrics
    from runner.entrypoints.server_setup import add_routes

    args, gc = spec.args, spec.generation_config
    dead = asyncio.Event()
    client = MPEngineClient(spec.cfg, tokenizer=spec.tokenizer, default_params=gc.sampling_defaults,
                            generation_config=gc, max_queued_requests=args.max_queued_requests,
                            on_dead=lambda message: dead.set(), sockets=spec.sockets, client_index=spec.index)
    orders = _ParentOrders(conn, client)
    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), orders.read)
    try:
        await client.start()
        if orders.drain_asked:  # told to stop while the ranks were loading
            return 0
        tune_gc()
        metrics = ServerMetrics(served_model_names(args)[0], client.max_model_len, api_server=spec.index)
        client.metrics = metrics
        conn.send(("ready", os.getpid()))

        def configure(app: Any) -> None:
            add_routes(app, args.profile_dir)
            orders.lifecycle = app.state.lifecycle
            if orders.drain_asked:  # told to stop between the ranks' Ready and now
                orders.lifecycle.begin_drain(orders.drain_why)

        code = await run_server(args, client, engine_dead=dead, metrics=metrics, sock=sock, configure_app=configure,
                                handle_signals=False, max_logprobs=spec.max_logprobs)
        if client.dead_error is not None:
            print(f"error: API server {spec.index}: {client.dead_error}", file=sys.stderr)
            code = code or 1
        return code
    finally:
        loop.remove_reader(conn.fileno())
        if client.dead_error is None:
            await client.shutdown(args.shutdown_timeout + 30.0)
        else:
            await client.close()


class _ParentOrders:
    """The parent's messages to an API server: ``("drain", why)`` (a signal reached the parent) and
    ``("dead", message)`` (a rank or another API server failed)."""

    def __init__(self, conn: Connection, client: Any) -> None:
        self.conn, self.client = conn, client
        self.lifecycle: Any = None  # the server's, once it runs
        self.drain_asked = False
        self.drain_why = ""

    def read(self) -> None:
        try:
            kind, text = self.conn.recv()
        except (EOFError, OSError):  # the parent is gone; PR_SET_PDEATHSIG ends this process
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            return
        if kind == "drain":
            self.drain_asked, self.drain_why = True, text
            if self.lifecycle is not None:
                self.lifecycle.begin_drain(text)
        elif kind == "dead":
            self.client.engine_failed(text)
