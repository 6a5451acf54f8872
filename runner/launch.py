"""Process bootstrap: join a ``torchrun`` world, or spawn and supervise one process per DP rank.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set) :func:`init_distributed`
joins the default group. Otherwise :func:`launch` is the built-in spawner: it starts ``nprocs`` children with
the ``spawn`` start method (``fork`` after torch has started threads can deadlock), each joins a gloo/NCCL
world through a ``TCPStore`` that the parent hosts on a free 127.0.0.1 port (no race on picking a port), runs
``fn(*args)`` and sends its result back over a pipe.

The parent supervises. A child that dies (non-zero exit or a signal) is named — "rank 1 exited with signal
SIGKILL" — the others are terminated (SIGTERM, then SIGKILL after ``grace_s``) and :class:`RankFailedError` is
raised, so a dead peer never leaves the survivors hanging in a collective until the timeout. Each child
catches its own exception, prints it prefixed with its rank and exits non-zero.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(RuntimeError):
    """The ranks could not be started or did not all finish; the message says which and why."""


class RankFailedError(LaunchError):
    """One or more spawned ranks died; ``failures`` is ``[(rank, description), ...]``, root cause first."""

    def __init__(self, failures: list[tuple[int, str]]) -> None:
        self.failures = failures
        super().__init__("; ".join(f"rank {r} {d}" for r, d in failures))


def torchrun_env_present() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV)


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def check_gpus(backend: str, ranks_on_this_host: int) -> None:
    """NCCL needs one GPU per rank; two ranks on one GPU fail deep inside NCCL init, so say it up front."""
    if backend != "nccl":
        return
    import torch

    n = torch.cuda.device_count()
    if n < ranks_on_this_host:
        raise LaunchError(f"{ranks_on_this_host} ranks on this host need {ranks_on_this_host} GPUs with NCCL, found "
                           f"{n}; lower --data-parallel-size, or run on CPU (CUDA_VISIBLE_DEVICES= , gloo)")


def _set_cuda_device(local_rank: int) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def init_distributed(timeout_s: float = 120.0, backend: str | None = None) -> tuple[int, int]:
    """Join the default group from torchrun's environment (no-op if already joined); returns (rank, world)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        missing = [k for k in TORCHRUN_ENV if k not in os.environ]
        if missing:
            raise RuntimeError(f"cannot join a torch.distributed world: {', '.join(missing)} not set; launch with "
                               "torchrun, or use the built-in spawner (--data-parallel-size N / runner.launch.launch)")
        backend = backend or default_backend()
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


def _child_main(fn: Callable[..., Any], args: Sequence[Any], rank: int, world_size: int, store_port: int,
                timeout_s: float, backend: str, num_threads: int, conn: Connection) -> None:
    """Body of one spawned rank: join the world, run ``fn``, send ``("ok", result)`` or ``("error", text)``."""
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(num_threads)
        if backend == "nccl":
            _set_cuda_device(rank)
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=dist.PrefixStore("ubatch", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        result = fn(*args)
        # Plain pickle, not the Pipe's ForkingPickler: torch's reductions would hand tensors over as
        # shared-memory handles that die with this process (os._exit below) before the parent reads them.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:  # noqa: BLE001 - report every failure, including KeyboardInterrupt
        failed_at = time.time()
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
        sys.stderr.flush()
        try:
            conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}", failed_at)))
        except (OSError, ValueError):
            pass
    finally:
        conn.close()
    # os._exit: skip interpreter teardown, which can hang on a process group whose peers are gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, timeout_s: float = 120.0,
           backend: str | None = None, num_threads: int = 1, grace_s: float = 5.0,
           start_method: str = "spawn") -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` spawned ranks of one torch.distributed world; results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function; in a script, guard the call with
    ``if __name__ == "__main__":``). ``timeout_s`` bounds every collective; children get
    ``OMP_NUM_THREADS=num_threads`` so ranks sharing a machine do not oversubscribe it.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    import torch.distributed as dist

    backend = backend or default_backend()
    check_gpus(backend, nprocs)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    ctx = mp.get_context(start_method)
    procs: list[Any] = []
    conns: list[Connection] = []
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                            "LOCAL_WORLD_SIZE")}
    try:
        for rank in range(nprocs):
            # The environment is inherited at start(): OpenMP reads OMP_NUM_THREADS when torch is imported,
            # which under spawn happens while unpickling ``fn``, before any code of ours runs in the child.
            os.environ.update(OMP_NUM_THREADS=str(num_threads), RANK=str(rank), WORLD_SIZE=str(nprocs),
                              LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs))
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child_main, name=f"ubatch-rank-{rank}",
                            args=(fn, tuple(args), rank, nprocs, store.port, timeout_s, backend, num_threads,
                                  child_conn))
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)
    except BaseException:
        _terminate(procs, grace_s)
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        return _supervise(procs, conns, grace_s)
    finally:
        _terminate(procs, grace_s)
        for c in conns:
            c.close()
        del store


def _supervise(procs: list[Any], conns: list[Connection], grace_s: float) -> list[Any]:
    n = len(procs)
    results: list[Any] = [None] * n
    messages: list[tuple[str, Any] | None] = [None] * n
    failures: list[tuple[int, str]] = []
    failed_at: dict[int, float] = {}  # when each failure happened: the earliest is the likely root cause
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
        failed_at[rank] = msg[2] if msg and msg[0] == "error" else time.time()
        if p.exitcode != 0:
            detail = f": {msg[1]}" if msg and msg[0] == "error" else ""
            failures.append((rank, describe_exit(p.exitcode) + detail))
        elif msg is None or msg[0] == "eof":
            failures.append((rank, "exited with code 0 without sending a result"))
        elif msg[0] == "error":
            failures.append((rank, f"failed: {msg[1]}"))
        else:
            results[rank] = msg[1]

    while len(done) < n and not failures:
        pending = [r for r in range(n) if r not in done]
        waitables: dict[Any, tuple[str, int]] = {procs[r].sentinel: ("exit", r) for r in pending}
        waitables.update({conns[r]: ("msg", r) for r in pending if messages[r] is None})
        ready = wait(list(waitables), timeout=1.0)
        exited = []
        for obj in ready:
            kind, rank = waitables[obj]
            if kind == "msg":
                receive(rank)
            else:
                exited.append(rank)
        for rank in exited:
            reap(rank)
    if failures:
        # Peers of a dead rank usually fail a moment later on the closed connection: collect those briefly, then
        # put deaths by signal first (they send no report), then the others by when they failed.
        deadline = time.monotonic() + min(grace_s, 1.0)
        while time.monotonic() < deadline and len(done) < n:
            for rank in range(n):
                if rank not in done and procs[rank].exitcode is not None:
                    reap(rank)
            time.sleep(0.05)
        failures.sort(key=lambda f: (0 if (procs[f[0]].exitcode or 0) < 0 else 1, failed_at[f[0]]))
        raise RankFailedError(failures)
    return results


def _terminate(procs: list[Any], grace_s: float) -> None:
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(1.0)
