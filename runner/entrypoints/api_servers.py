"""``serve --api-server-count N`` (vLLM's flag): N API-server processes on one port in front of the same ranks.

One process's event loop tokenizes, detokenizes and writes every streamed token; N of them spread that CPU.
This process (the parent) binds the listening socket once, starts the ranks (``mp_client.EngineProcesses``) and
N API-server processes that inherit the socket (``api_server_proc.py``: the kernel hands each new connection to
one of them, which serves that request end to end with its own engine client, ``client_index`` i of N), and
supervises all:

- **Ready.** Each API server reports once its client has every rank's ``Ready``; the parent logs when all have.
- **Signals.** The API servers ignore SIGINT/SIGTERM/SIGHUP (a signal to the whole process group reaches the
  parent alone); the parent tells each to drain (a second signal: to abort now, as with one process). Once all
  have exited, the ranks are told to leave their loops and are stopped; the exit status is 0.
- **Faults.** A rank failing (named by the launcher) is told to every API server, which fails its requests in
  flight with a 500 naming it and exits 1; an API server exiting unasked is named in the parent's error and the
  others are failed with that message. The parent then exits 1, leaving no process behind.
- **Metrics.** prometheus_client's multiprocess mode over a private ``PROMETHEUS_MULTIPROC_DIR`` (removed at
  exit): ``/metrics`` on any front end sums the request counters and histograms of all; the engine's gauges
  come from the stats every rank sends to every client.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from runner.config import RunnerConfig
from runner.engine.mp_client import EngineProcesses, EngineSockets
from runner.entrypoints.api_server_proc import SIGNALS, ApiServerSpec, api_server_main

if TYPE_CHECKING:
    from runner.distributed.launch import RankSupervisor

logger = logging.getLogger("runner.entrypoints.openai.api_servers")

# How long the API servers may take to exit once told that the engine died (their 500s, then their exit).
DEAD_EXIT_S = 30.0


def serve_api_servers(cfg: RunnerConfig, args: argparse.Namespace, tokenizer: Any, generation_config: Any,
                      max_logprobs: int) -> int:
    """Run the ranks and ``args.api_server_count`` API servers until a signal (drain; 0) or a failure (1)."""
    import zmq

    from runner.distributed.launch import environ_set
    from runner.entrypoints.openai.api_server import bind_socket

    count = args.api_server_count
    sock = bind_socket(args.host, args.port)  # before the ranks load: a busy port fails in a second, not minutes
    sockets = EngineSockets.create(cfg.data_parallel_size, count)
    metrics_dir = tempfile.mkdtemp(prefix="ubatch-prometheus-")
    signals = _Signals()
    ranks = EngineProcesses(sockets, owns_ranks=True)  # the parent's: it starts, watches and stops the ranks
    servers = _ApiServers()
    failure: str | None = None
    try:
        with signals:
            ranks.connect(zmq.Context(), None)
            ranks.start(cfg, "the server")
            assert ranks.supervisor is not None
            with environ_set({"PROMETHEUS_MULTIPROC_DIR": metrics_dir}):
                for i in range(count):
                    servers.start(ApiServerSpec(i, count, server_flags(args), cfg, tokenizer, generation_config,
                                                max_logprobs, sockets, os.getpid()), sock)
            failure = _supervise(servers, ranks.supervisor, signals, sock, args.shutdown_timeout)
            # every API server is gone: the ranks leave their loops after their wave, then are stopped
            ranks.close(graceful=failure is None, wait_s=args.shutdown_timeout + 30.0)
    finally:
        servers.close()
        ranks.close(graceful=False)
        sock.close()
        sockets.remove()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if failure is not None:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0


def server_flags(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed flags without the parser objects the CLI keeps in them (``subparser``): what can travel."""
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if not isinstance(v, argparse.ArgumentParser)})


def _supervise(servers: _ApiServers, ranks: RankSupervisor, signals: _Signals, sock: socket.socket,
               shutdown_timeout_s: float) -> str | None:
    """Until every API server has exited: relay signals and failures; the first failure, or None."""
    from runner.distributed.launch import describe_exit

    host, port = sock.getsockname()[:2]
    failure: str | None = None
    draining = False
    ready: set[int] = set()
    while servers.alive():
        for obj in wait(servers.waitables(), timeout=0.2):
            index, kind = servers.which(obj)
            if kind == "message":
                message = servers.receive(index)
                if message is not None and message[0] == "ready":
                    ready.add(index)
                    if len(ready) == servers.count:
                        logger.info("Serving on http://%s:%d with %d API server processes",
                                    f"[{host}]" if ":" in host else host, port, servers.count)
            else:
                code = servers.reap(index)
                if failure is None and (code != 0 or not draining):
                    failure = f"API server {index} (pid {servers.pid(index)}) {describe_exit(code)}"
                    servers.tell_all(("dead", failure))
        if failure is None and ranks.error is not None:
            failure = ranks.error
            servers.tell_all(("dead", failure))
        for signum in signals.take():
            if len(ready) < servers.count and failure is None:  # still loading: nothing to drain, stop now
                failure = f"interrupted by {signal.Signals(signum).name} while the engine was starting"
                servers.kill_after(0.0)
                break
            draining = True
            servers.tell_all(("drain", signal.Signals(signum).name))
        if failure is not None and not servers.deadline_set:
            servers.kill_after(DEAD_EXIT_S if not draining else shutdown_timeout_s + DEAD_EXIT_S)
        servers.kill_overdue()
    return failure


class _ApiServers:
    """The spawned API-server processes and the pipe to each (messages both ways)."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.done: set[int] = set()
        self.deadline_set = False
        self._kill_at: float | None = None

    @property
    def count(self) -> int:
        return len(self.procs)

    def start(self, spec: ApiServerSpec, sock: socket.socket) -> None:
        parent_conn, child_conn = self.ctx.Pipe()
        p = self.ctx.Process(target=api_server_main, name=f"ubatch-api-server-{spec.index}",
                             args=(spec, sock, child_conn))
        try:
            p.start()
        finally:
            child_conn.close()
        self.procs.append(p)
        self.conns.append(parent_conn)
        logger.info("API server %d pid %d", spec.index, p.pid)

    def pid(self, index: int) -> int:
        return int(self.procs[index].pid)

    def alive(self) -> bool:
        return len(self.done) < len(self.procs)

    def waitables(self) -> list[Any]:
        live = [i for i in range(len(self.procs)) if i not in self.done]
        return [self.procs[i].sentinel for i in live] + [self.conns[i] for i in live]

    def which(self, obj: Any) -> tuple[int, str]:
        for i, p in enumerate(self.procs):
            if obj is self.conns[i]:
                return i, "message"
            if obj == p.sentinel:
                return i, "exit"
        raise ValueError(f"unknown waitable {obj!r}")

    def receive(self, index: int) -> tuple[Any, ...] | None:
        try:
            message: tuple[Any, ...] = self.conns[index].recv()
            return message
        except (EOFError, OSError):
            return None  # it is exiting: its sentinel says how

    def reap(self, index: int) -> int | None:
        self.procs[index].join(5.0)
        self.done.add(index)
        return self.procs[index].exitcode

    def tell_all(self, message: tuple[str, str]) -> None:
        for i, conn in enumerate(self.conns):
            if i not in self.done:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(message)

    def kill_after(self, seconds: float) -> None:
        self.deadline_set = True
        self._kill_at = time.monotonic() + seconds

    def kill_overdue(self) -> None:
        if self._kill_at is not None and time.monotonic() > self._kill_at:
            for i, p in enumerate(self.procs):
                if i not in self.done and p.is_alive():
                    logger.error("API server %d (pid %d) did not exit in time: killing it", i, p.pid)
                    p.kill()

    def close(self) -> None:
        """Stop any API server still running (SIGTERM is ignored by them: SIGKILL) and close the pipes."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5.0)
        for conn in self.conns:
            conn.close()


class _Signals:
    """While entered, SIGINT/SIGTERM/SIGHUP are queued for the supervisor loop (``take``) instead of raising."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.saved: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for sig in SIGNALS:
            self.saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.pending.append(signum)

    def take(self) -> list[int]:
        taken, self.pending = self.pending, []
        return taken

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
