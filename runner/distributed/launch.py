"""Process bootstrap: join a ``torchrun`` world, or spawn and supervise one process per DP rank.

Under ``torchrun`` the rendezvous and network are the user's. Otherwise :func:`launch` spawns the ranks
(``spawn``: ``fork`` after torch has started threads can deadlock), which meet through a private ``FileStore``
on loopback (``rendezvous.py``), and supervises them so that a failure is named and no rank outlives the
launch: a dead or silent rank (``liveness.py``) is named and the others terminated, signals to the parent end
every rank, and a rank's exception reaches the parent with its traceback (:class:`RankFailedError`).
Design: docs/design_notes.md, "Distributed: DP agreement, launcher, faults".
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from runner.distributed.device import backend_for, resolve_device_type
from runner.distributed.liveness import (
    BEAT_INTERVAL_S,
    STALE_S,
    describe_silence,
    die_with_parent,
    new_board,
    process_state,
    silence,
    start_heartbeat,
)
from runner.distributed.rendezvous import PrivateRendezvous, join_store, loopback_env

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(RuntimeError):
    """The ranks could not be started or did not all finish; the message says which and why."""


def join_ranks(ranks: Sequence[int]) -> str:
    """``[1]`` -> "rank 1"; ``[0, 1, 2]`` -> "rank 0, rank 1 and rank 2"."""
    names = [f"rank {r}" for r in ranks]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


class RankFailedError(LaunchError):
    """One or more spawned ranks failed; ``failures`` is ``[(rank, description), ...]``, likely cause first.

    Ranks that failed the same way are named together ("rank 0 and rank 1 exited with code 1: ..."), so N
    ranks hitting one bad checkpoint give one line. ``tracebacks`` maps a rank to its traceback text.
    """

    def __init__(self, failures: list[tuple[int, str]], tracebacks: dict[int, str] | None = None) -> None:
        self.failures = failures
        self.tracebacks = tracebacks or {}
        groups: dict[str, list[int]] = {}
        for rank, detail in failures:
            groups.setdefault(detail, []).append(rank)
        super().__init__("; ".join(f"{join_ranks(sorted(ranks))} {detail}" for detail, ranks in groups.items()))


class LaunchInterrupted(KeyboardInterrupt):
    """The launching process got SIGINT, SIGTERM or SIGHUP; every rank still running was stopped first.

    A ``KeyboardInterrupt``: a request to stop must not be swallowed by an ``except Exception`` on its way
    out, and code that catches Ctrl-C keeps working. ``signum`` is the signal, ``stopped`` the ranks ended.
    """

    def __init__(self, signum: int, stopped: Sequence[int] = ()) -> None:
        self.signum = signum
        self.stopped = list(stopped)
        name = _signal_name(signum)
        super().__init__(f"interrupted by {name}: stopped {join_ranks(self.stopped)}" if self.stopped
                         else f"interrupted by {name}")

    def __str__(self) -> str:
        return str(self.args[0])


def torchrun_env_present() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV)


def default_backend(device: str = "auto") -> str:
    """NCCL for ranks on CUDA, gloo for ranks on the CPU; ``device`` is the ``--device`` setting."""
    return backend_for(resolve_device_type(device))


def check_gpus(backend: str, ranks_on_this_host: int) -> None:
    """NCCL needs one GPU per rank; two ranks on one GPU fail deep inside NCCL init, so say it up front."""
    if backend != "nccl":
        return
    import torch

    n = torch.cuda.device_count()
    if n < ranks_on_this_host:
        raise LaunchError(f"{ranks_on_this_host} ranks on this host need {ranks_on_this_host} GPUs with NCCL, found "
                          f"{n}; lower --data-parallel-size, or run the ranks on the CPU over gloo with --device cpu "
                          f"(LLM(..., device='cpu'))")


def _set_cuda_device(local_rank: int) -> None:
    """Give an NCCL rank its own GPU (called only for ranks whose backend is NCCL, never with --device cpu)."""
    import torch

    torch.cuda.set_device(local_rank % torch.cuda.device_count())


def init_distributed(timeout_s: float = 120.0, backend: str | None = None, device: str = "auto") -> tuple[int, int]:
    """Join the default group from torchrun's environment (no-op if already joined); returns (rank, world).

    ``device`` (``--device``) picks the backend when ``backend`` is not given: NCCL on CUDA, gloo on the CPU.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        missing = [k for k in TORCHRUN_ENV if k not in os.environ]
        if missing:
            raise RuntimeError(f"cannot join a torch.distributed world: {', '.join(missing)} not set; launch with "
                               "torchrun, or use the built-in spawner "
                               "(--data-parallel-size N / runner.distributed.launch.launch)")
        backend = backend or default_backend(device)
        if backend == "nccl":
            check_gpus(backend, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            _set_cuda_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        return f"exited with signal {_signal_name(-exitcode)}"
    return f"exited with code {exitcode}"


def describe_exception(exc: BaseException) -> str:
    """``Type: message``, or the type alone when the message is empty (never a blank error)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _child_main(payload: bytes, rank: int, world_size: int, store_path: str, timeout_s: float, backend: str,
                num_threads: int, conn: Connection, board: Any, parent_pid: int, print_traceback: bool,
                parent_handles_signals: bool = False) -> None:
    """Body of one spawned rank: tie its life to the parent, beat, join the world, run ``fn``, send
    ``("ok", result)`` or ``("error", text, when, traceback)``."""
    code = 0
    try:
        if parent_handles_signals:  # SIGKILL (or the parent's death) still ends the rank
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
        die_with_parent(parent_pid)
        start_heartbeat(board, rank, parent_pid)
        fn, args = pickle.loads(payload)  # imports fn's modules (torch...) with the heartbeat already running
        import torch
        import torch.distributed as dist

        torch.set_num_threads(num_threads)
        if backend == "nccl":
            _set_cuda_device(rank)
        store = join_store(store_path, world_size, timeout_s)
        dist.init_process_group(backend, store=dist.PrefixStore("ubatch", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        result = fn(*args)
        # Plain pickle, not the Pipe's ForkingPickler: torch's reductions would hand tensors over as
        # shared-memory handles that die with this process (os._exit below) before the parent reads them.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:  # noqa: BLE001 - report every failure, including KeyboardInterrupt
        failed_at = time.monotonic()
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if print_traceback:
            sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
            sys.stderr.flush()
        with contextlib.suppress(OSError, ValueError):  # the parent is gone: nobody to report to
            conn.send_bytes(pickle.dumps(("error", describe_exception(exc), failed_at, text)))
    finally:
        conn.close()
    # os._exit: skip interpreter teardown, which can hang on a process group whose peers are gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ParentSignals:
    """While armed, SIGINT, SIGTERM and SIGHUP raise :class:`LaunchInterrupted` in the main thread (:func:`launch`,
    and the CLI around the rank processes of its engine client).

    Disarmed (while the ranks are being stopped) a signal is only remembered in ``pending``, so a second
    Ctrl-C cannot cut the clean-up short. Only handlers still at Python's defaults are replaced (an ignored
    SIGHUP under ``nohup`` stays ignored), and only from the main thread, the one place signals are handled.
    """

    def __init__(self) -> None:
        self.saved: dict[int, Any] = {}
        self.armed = False
        self.pending: int | None = None

    def __enter__(self) -> ParentSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
                if sig is None:
                    continue
                default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
                if signal.getsignal(sig) is default:
                    self.saved[sig] = signal.signal(sig, self._handle)
        self.armed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pending is None:
            self.pending = signum
        if self.armed:
            self.armed = False
            raise LaunchInterrupted(signum)

    def __exit__(self, *exc: object) -> None:
        self.armed = False
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def environ_set(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in os.environ for the block (a spawned child inherits the environment at start())."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, timeout_s: float = 120.0,
           device: str = "auto", backend: str | None = None, num_threads: int = 1, grace_s: float = 5.0,
           start_method: str = "spawn", child_tracebacks: bool = True,
           silence_s: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` spawned ranks of one torch.distributed world; results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function; in a script, guard the call with
    ``if __name__ == "__main__":``). ``timeout_s`` bounds every collective and the rendezvous; a rank with
    no heartbeat for ``silence_s`` (default ``timeout_s``) is declared silent. Children get
    ``OMP_NUM_THREADS=num_threads`` so ranks sharing a machine do not oversubscribe it. ``device``
    (``--device``: auto, cuda, cpu) picks the backend unless ``backend`` is given: NCCL for CUDA, which needs a
    GPU per rank (checked here, before any rank starts), gloo for the CPU. ``fn`` must put its own work on
    the same device (the engine does, from ``RunnerConfig.device``). Raises :class:`RankFailedError` naming
    the failed ranks, or :class:`LaunchInterrupted` on SIGINT/SIGTERM/SIGHUP.
    """
    group = RankGroup(fn, nprocs, args, timeout_s=timeout_s, device=device, backend=backend,
                      num_threads=num_threads, grace_s=grace_s, start_method=start_method,
                      child_tracebacks=child_tracebacks, silence_s=silence_s)
    interrupted: int | None = None
    stopped: list[int] = []
    results: list[Any] = []
    guard = ParentSignals()
    with guard:
        try:
            group.start()
            results = group.supervise()
        except KeyboardInterrupt as exc:  # LaunchInterrupted from our handlers, or a Ctrl-C we did not handle
            interrupted = getattr(exc, "signum", signal.SIGINT)
        finally:
            guard.armed = False
            stopped = group.close()
    interrupted = interrupted if interrupted is not None else guard.pending
    if interrupted is not None:
        raise LaunchInterrupted(interrupted, stopped)
    return results


_MAIN_LOCK = threading.Lock()


@contextlib.contextmanager
def _main_hidden(hide: bool) -> Iterator[None]:
    """While a rank is spawned, show multiprocessing a ``__main__`` without a file or module name, so that the
    child does not run the user's script again: a rank whose function lives in an importable package (the engine
    cores) needs nothing from it, and a script that builds an ``LLM`` at its top level, without the
    ``if __name__ == "__main__"`` guard, then works as vLLM's default does. Only for the start call; nothing else
    in this process reads ``__main__`` meanwhile but the spawn's preparation data."""
    if not hide:
        yield
        return
    with _MAIN_LOCK:
        real = sys.modules["__main__"]
        stub = types.ModuleType("__main__")
        stub.__spec__ = None
        sys.modules["__main__"] = stub
        try:
            yield
        finally:
            sys.modules["__main__"] = real


class RankGroup:
    """``nprocs`` spawned ranks of one world, started and supervised by the caller (:func:`launch` is the
    blocking form). A server starts them, supervises them from a thread (``supervise(stop)``) while it serves,
    and stops them with :meth:`close`; the ranks still die with this process if it is killed outright.

    ``parent_handles_signals``: the ranks ignore SIGINT, SIGTERM and SIGHUP, so a Ctrl-C that the terminal sends
    to the whole process group, or a SIGTERM to the group (``kill -- -PGID``, a service manager), reaches only
    the parent, which decides how to stop them (the server drains first); :meth:`close` then ends any rank still
    running with SIGKILL after its grace period, and the ranks die with the parent if it is killed.
    """

    def __init__(self, fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, timeout_s: float = 120.0,
                 device: str = "auto", backend: str | None = None, num_threads: int = 1, grace_s: float = 5.0,
                 start_method: str = "spawn", child_tracebacks: bool = True, silence_s: float | None = None,
                 parent_handles_signals: bool = False, import_main: bool = True) -> None:
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        self.nprocs = nprocs
        self.timeout_s, self.grace_s, self.num_threads = timeout_s, grace_s, num_threads
        self.silence_s = timeout_s if silence_s is None else silence_s
        self.backend = backend or default_backend(device)
        check_gpus(self.backend, nprocs)
        self.payload = pickle.dumps((fn, tuple(args)))  # fails here, in the parent, if fn or args cannot travel
        self.ctx = mp.get_context(start_method)
        self.board = new_board(self.ctx, nprocs)
        self.child_tracebacks, self.parent_handles_signals = child_tracebacks, parent_handles_signals
        self.import_main = import_main
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.started: list[float] = []
        self.rdzv = PrivateRendezvous()
        self._closed = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> None:
        # OpenMP reads OMP_NUM_THREADS when torch is imported, which under spawn may happen while the
        # child imports the parent's main module, before any code of ours runs there: hence the environment.
        common = {"OMP_NUM_THREADS": str(self.num_threads), **loopback_env()}
        for rank in range(self.nprocs):
            parent_conn, child_conn = self.ctx.Pipe(duplex=False)
            # typeshed types get_context(str) as BaseContext; every concrete context has Process
            p = self.ctx.Process(target=_child_main, name=f"ubatch-rank-{rank}",  # type: ignore[attr-defined]
                                 args=(self.payload, rank, self.nprocs, self.rdzv.store_path, self.timeout_s,
                                       self.backend, self.num_threads, child_conn, self.board, os.getpid(),
                                       self.child_tracebacks, self.parent_handles_signals))
            self.procs.append(p)  # before start(): a signal arriving during start() still finds it to stop
            self.conns.append(parent_conn)
            with environ_set({**common, "RANK": str(rank), "WORLD_SIZE": str(self.nprocs), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(self.nprocs)}), _main_hidden(not self.import_main):
                p.start()
            child_conn.close()
            self.started.append(time.monotonic())

    def supervise(self, stop: threading.Event | None = None) -> list[Any]:
        """Wait until every rank returned (their results, in rank order), one failed or fell silent
        (:class:`RankFailedError`), or ``stop`` is set (the results so far; ranks still running are left to
        :meth:`close`)."""
        return _supervise(self.procs, self.conns, self.board, self.started, self.silence_s, self.grace_s, stop)

    def watch(self, stop: threading.Event, expected_exit: Callable[[], bool], what: str) -> LaunchError | None:
        """:meth:`supervise` for a supervising thread of a long-lived engine: the failure that ended it, as a
        :class:`LaunchError` naming the rank(s) (the launcher's words), or None where it ended as asked (``stop``
        set, or ``expected_exit()`` true: the ranks were told to leave). Ranks that all return on their own
        while ``what`` is still running are a failure too; nothing raised here is lost in the thread."""
        try:
            self.supervise(stop)
        except LaunchError as exc:
            return exc
        except BaseException as exc:  # noqa: BLE001 - reported, never lost in a thread
            return LaunchError(f"the rank supervisor failed: {type(exc).__name__}: {exc}")
        if stop.is_set() or expected_exit():
            return None
        return LaunchError(f"every rank exited while {what} was running")

    def close(self, grace_s: float | None = None) -> list[int]:
        """Stop every rank still running (SIGTERM, then SIGKILL after ``grace_s``) and remove the rendezvous
        directory; returns the ranks that had to be stopped. Idempotent."""
        if self._closed:
            return []
        self._closed = True
        stopped = _terminate(self.procs, self.grace_s if grace_s is None else grace_s)
        for c in self.conns:
            c.close()
        self.rdzv.close()
        return stopped


class RankSupervisor:
    """A long-lived engine's rank supervisor: a daemon thread over :meth:`RankGroup.watch`. The first failure is
    kept (``error``: the launcher's one line; ``tracebacks``: by rank) and handed to ``on_failure`` from the
    thread; ``expected_exit()`` true means the ranks were told to leave. One supervisor serves every engine client
    and the multi-API-server parent."""

    def __init__(self, group: RankGroup, what: str, expected_exit: Callable[[], bool] = lambda: False,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.group = group
        self.error: str | None = None
        self.tracebacks: dict[int, str] = {}
        self._what, self._expected_exit, self._on_failure = what, expected_exit, on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ubatch-rank-supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failure = self.group.watch(self._stop, self._expected_exit, self._what)
        if failure is None:
            return
        if isinstance(failure, RankFailedError):
            self.tracebacks = failure.tracebacks
        self.error = str(failure)
        if self._on_failure is not None:
            self._on_failure(self.error)

    def stop(self) -> None:
        """Stop watching (the ranks are being stopped on purpose) and wait for the thread. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


def _supervise(procs: list[Any], conns: list[Connection], board: Any, started: list[float], silence_s: float,
               grace_s: float, stop: threading.Event | None = None) -> list[Any]:
    n = len(procs)
    results: list[Any] = [None] * n
    messages: list[tuple[Any, ...] | None] = [None] * n
    failures: list[tuple[int, str]] = []
    failed_at: dict[int, float] = {}  # when each failure happened: the earliest is the likely root cause
    silent: set[int] = set()
    done: set[int] = set()

    def receive(rank: int) -> None:
        if messages[rank] is None and conns[rank].poll():
            try:
                messages[rank] = pickle.loads(conns[rank].recv_bytes())
            except (EOFError, OSError):
                messages[rank] = ("eof", None)  # died before sending: its exit status tells why

    def reap(rank: int) -> None:
        p = procs[rank]
        p.join()
        receive(rank)
        done.add(rank)
        msg = messages[rank]
        failed_at[rank] = msg[2] if msg and msg[0] == "error" else time.monotonic()
        if p.exitcode != 0:
            detail = f": {msg[1]}" if msg and msg[0] == "error" else ""
            failures.append((rank, describe_exit(p.exitcode) + detail))
        elif msg is None or msg[0] == "eof":
            failures.append((rank, "exited with code 0 without sending a result"))
        elif msg[0] == "error":
            failures.append((rank, f"failed: {msg[1]}"))
        else:
            results[rank] = msg[1]

    def check_silence(limit: float) -> None:
        now = time.monotonic()
        for rank in range(n):
            if rank in done or rank in silent or procs[rank].exitcode is not None:
                continue
            quiet = silence(board, rank, started[rank], now)
            if quiet > limit:
                silent.add(rank)
                failed_at[rank] = now - quiet
                failures.append((rank, describe_silence(board, rank, procs[rank].pid, started[rank], now)))

    while len(done) < n and not failures and not (stop is not None and stop.is_set()):
        pending = [r for r in range(n) if r not in done]
        waitables: dict[Any, tuple[str, int]] = {procs[r].sentinel: ("exit", r) for r in pending}
        waitables.update({conns[r]: ("msg", r) for r in pending if messages[r] is None})
        ready = wait(list(waitables), timeout=BEAT_INTERVAL_S)
        exited = []
        for obj in ready:
            kind, rank = waitables[obj]
            if kind == "msg":
                receive(rank)
            else:
                exited.append(rank)
        for rank in exited:
            reap(rank)
        if not failures:
            check_silence(silence_s)
    if failures:
        # Peers of a failed rank usually fail a moment later on the closed connection: collect those briefly.
        # A rank still running but silent by then is the likely cause (it stopped; its peers timed out
        # waiting for it). Order: silent ranks, deaths by signal (they send no report), then by failure time.
        deadline = time.monotonic() + min(grace_s, 1.0)
        while time.monotonic() < deadline and len(done) < n:
            for rank in range(n):
                if rank not in done and rank not in silent and procs[rank].exitcode is not None:
                    reap(rank)
            time.sleep(0.05)
        check_silence(STALE_S)
        failures.sort(key=lambda f: (0 if f[0] in silent else 1 if (procs[f[0]].exitcode or 0) < 0 else 2,
                                     failed_at[f[0]]))
        tracebacks = {r: m[3] for r, m in enumerate(messages) if m and m[0] == "error" and len(m) > 3}
        raise RankFailedError(failures, tracebacks)
    return results


def _terminate(procs: list[Any], grace_s: float) -> list[int]:
    """Stop every rank still running (SIGTERM, then SIGKILL after ``grace_s``); returns the ranks stopped."""
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        procs[r].terminate()
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[r].pid, signal.SIGCONT)  # a stopped rank acts on its SIGTERM only once continued
    deadline = time.monotonic() + grace_s
    for r in alive:
        procs[r].join(max(0.0, deadline - time.monotonic()))
    for r in alive:
        if procs[r].is_alive():
            procs[r].kill()
            procs[r].join(5.0)
        if procs[r].is_alive():
            print(f"warning: rank {r} (pid {procs[r].pid}) still exists 5 s after SIGKILL (process state "
                  f"{process_state(procs[r].pid)!r}); it may be blocked in the kernel", file=sys.stderr)
    return alive
