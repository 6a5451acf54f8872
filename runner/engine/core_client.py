"""The engine clients of the offline front ends and the one place that picks one (vLLM V1's ``core_client.py``:
``EngineCoreClient.make_client``).

The client family:
- :class:`~runner.engine.inproc_client.InprocClient`: an ``EngineCore`` and its model runner in this process,
  stepped in the calling thread (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, an injected runner, or one rank of a
  world someone else launched);
- :class:`~runner.engine.mp_client.MPClient`, the engine-core processes (one per DP rank) behind ZeroMQ, with its
  two I/O flavours: :class:`~runner.engine.sync_client.SyncMPClient` (the offline ``LLM`` and the CLI, by
  default, as vLLM's ``LLM`` runs its core in a background process) and
  :class:`~runner.engine.async_client.AsyncMPClient` (the server's).

The offline clients implement ``runner.engine.engine_core_client.EngineCoreClient``.
"""
from __future__ import annotations

import os

from runner.config import RunnerConfig
from runner.core.runner_protocol import ModelRunnerProtocol
from runner.engine.engine_core_client import EngineCoreClient

# vLLM's switch: the engine core in a background process (1, the default) or in this one (0).
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def multiprocessing_enabled() -> bool:
    """``VLLM_ENABLE_V1_MULTIPROCESSING``: 1 (the default) runs the engine core in a process of its own, 0 in
    this one; anything else is refused naming it."""
    value = os.environ.get(MULTIPROCESSING_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{MULTIPROCESSING_ENV}={value!r} must be 0 or 1")
    return value == "1"


def make_client(cfg: RunnerConfig, *, runner: ModelRunnerProtocol | None = None,
                world: tuple[int, int] | None = None, rank_tracebacks: bool = True) -> EngineCoreClient:
    """The engine client for ``cfg``, chosen here only:

    - ``runner`` given (a test's stand-in, a benchmark's runner): that runner, in process;
    - ``world`` = (rank, size) of a world someone else launched (SPMD): this rank's runner, in process;
    - one DP rank and ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the runner in process;
    - otherwise the engine-core processes, one per DP rank (``data_parallel_size > 1`` in a plain process has
      no in-process form). ``rank_tracebacks=False`` keeps a failed rank's traceback off stderr.
    """
    from runner.engine.inproc_client import InprocClient

    if runner is not None:
        return InprocClient(cfg, runner)
    if world is not None or (cfg.data_parallel_size == 1 and not multiprocessing_enabled()):
        from runner.worker.model_runner import ModelRunner

        rank, size = world if world is not None else (0, 1)
        return InprocClient(cfg, ModelRunner(cfg, rank, size))
    from runner.engine.sync_client import SyncMPClient

    return SyncMPClient(cfg, rank_tracebacks=rank_tracebacks)
