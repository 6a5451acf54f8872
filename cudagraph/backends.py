"""Graph backends and the capture-time helpers that have to run on the right thread or object.

``CudaGraphBackend`` is the real thing; ``EagerReplayBackend`` is a CPU test double whose "replay" re-runs
the captured step, so the manager's plumbing (buffers, metadata views, attention routing, dispatch) is
tested without a GPU. ``warm_ubatch_threads`` touches cuBLAS on the ubatch worker threads before a capture;
``deepep_ll_counter`` counts DeepEP low-latency calls so their capture rules can be checked.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from ubatch import streams
from ubatch.forward_context import ForwardContext
from ubatch.slicing import UBatchSlice


class GraphBackend(Protocol):
    """What the manager needs from a graph implementation (CUDA, or the eager test double below).

    ``capture`` either returns ``(graph, static output)`` or raises with nothing left behind: no capture
    still running on ``stream``, no half-captured graph holding pool memory, the calling thread's current
    stream as it was. The manager relies on that to drop a size that ran out of memory and go on.
    """

    def new_pool(self) -> Any: ...
    def capture(self, fn: Callable[[], torch.Tensor], pool: Any, stream: Any) -> tuple[Any, torch.Tensor]: ...
    def replay(self, graph: Any) -> None: ...
    def release(self, graph: Any) -> None: ...
    def synchronize(self) -> None: ...
    def free_memory(self) -> int: ...


#: Messages of CUDA/cuBLAS failures that mean "out of device memory" without torch's OutOfMemoryError type
#: (a cudaMalloc inside a library, or the capture's end reporting the error the allocation left behind).
_OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation")


class CaptureStateError(RuntimeError):
    """A failed capture could not be undone (a stream is still capturing): never a size to drop and go on."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` -- or an exception it was raised from or during -- is a device out-of-memory error.

    The chain is walked because an OOM raised inside ``torch.cuda.graph`` can surface as a different error
    from the capture's end (a stream forked into the capture was left unjoined by the aborted step), with the
    ``torch.cuda.OutOfMemoryError`` as its context.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, CaptureStateError):
            return False
        if isinstance(current, torch.cuda.OutOfMemoryError):
            return True
        if isinstance(current, RuntimeError) and any(m in str(current) for m in _OOM_MESSAGES):
            return True
        current = current.__cause__ or current.__context__
    return False


class CudaGraphBackend:
    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        body_error: list[BaseException] = []
        try:
            # The outer stream guard restores this thread's stream even when the capture's end raises:
            # torch.cuda.graph.__exit__ calls capture_end() before it leaves its own stream context.
            with torch.cuda.stream(stream), torch.cuda.graph(graph, pool=pool, stream=stream):
                try:
                    out = fn()
                except BaseException as exc:
                    body_error.append(exc)
                    raise
        except BaseException as exc:
            self._abandon(graph, pool, stream, end_failed=not body_error or exc is not body_error[0])
            raise
        return graph, out

    @staticmethod
    def _abandon(graph: Any, pool: Any, stream: Any, end_failed: bool) -> None:
        """Undo a capture that raised: its graph's pool reference and, if the capture's end itself failed, the
        allocator's routing into the pool (torch skips ``endAllocateToPool`` when ``cudaStreamEndCapture``
        errors, and a later capture into the same pool would then be refused as "already recording")."""
        if end_failed:
            end_routing = getattr(torch._C, "_cuda_endAllocateToPool", None)
            if end_routing is not None:
                with contextlib.suppress(RuntimeError):  # already ended: the capture got that far
                    end_routing(stream.device.index, pool)
        with contextlib.suppress(RuntimeError):
            graph.reset()
        with torch.cuda.stream(stream):
            if torch.cuda.is_current_stream_capturing():
                raise CaptureStateError(f"a failed CUDA graph capture left {stream} capturing; the process cannot "
                                   "capture or run further work on it (run with --enforce-eager)")

    def replay(self, graph: Any) -> None:
        graph.replay()

    def release(self, graph: Any) -> None:
        graph.reset()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def free_memory(self) -> int:
        return torch.cuda.mem_get_info()[0]


class EagerReplayBackend:
    """Test/debug double: "replay" re-runs the captured callable and copies into the static output.

    It exercises everything but the graph itself (buffers, metadata views, attention routing, dispatch),
    so the plumbing is tested on CPU. It is *not* a graph: a replay still runs Python and hands off.
    """

    def new_pool(self) -> Any:
        return None

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
        with streams.stream(stream):  # a capture runs on the capture stream, as ``torch.cuda.graph(stream=)``
            out = fn()
        streams.synchronize("cpu")  # a real capture executes nothing: what this double ran is not left in flight
        return (fn, out), out

    def replay(self, graph: Any) -> None:
        fn, out = graph
        out.copy_(fn())

    def release(self, graph: Any) -> None:
        return None

    def synchronize(self) -> None:
        streams.synchronize("cpu")  # a device-wide sync, as the CUDA backend's: the stream sanitizer orders on it

    def free_memory(self) -> int:
        return 0


def warm_ubatch_threads(wrapper: Any, stream_list: Sequence[Any]) -> set[int]:
    """Touch cuBLAS (handle + workspace) on every ubatch worker thread for every stream in ``stream_list``.

    Runs a tiny job through the wrapper's own ubatched path (swapping ``runnable`` for one step) so it
    lands on exactly the threads that will launch during capture. Returns their thread ids.
    """
    seen: set[int] = set()
    device = wrapper.device

    def warm(*_: Any, **__: Any) -> torch.Tensor:
        seen.add(threading.get_ident())
        if device.type == "cuda":
            for s in stream_list:
                with torch.cuda.stream(s):
                    torch.cuda.current_blas_handle()
                    a = torch.ones(16, 16, device=device)
                    a @ a  # cuBLAS
                    b = a.bfloat16()
                    torch.nn.functional.linear(b, b, b[0])  # cuBLASLt (bias epilogue) and its workspace
        return torch.zeros(1, device=device)

    n = wrapper.config.num_ubatches
    slices = [UBatchSlice(slice(i, i + 1), slice(i, i + 1)) for i in range(n)]
    original, wrapper.runnable = wrapper.runnable, warm
    try:
        tokens = torch.zeros(n, device=device)  # one row per ubatch: what the slices cover
        wrapper.run_ubatched(ForwardContext(ubatch_slices=slices), slices, (tokens,), {})
    finally:
        wrapper.runnable = original
    return seen


class _LLCounter:
    def __init__(self, num_backends: int, num_handles: int) -> None:
        self.num_backends, self.num_handles, self.calls = num_backends, num_handles, 0


@contextlib.contextmanager
def deepep_ll_counter(model: torch.nn.Module) -> Iterator[_LLCounter]:
    """Count DeepEP low-latency dispatch/combine calls made inside the block (for the capture rules)."""
    pfs: dict[int, Any] = {}  # the DeepEP low-latency prepare-finalize objects, by id
    for m in model.modules():
        pf = getattr(getattr(m, "kernel", None), "prepare_finalize", None)
        if getattr(pf, "name", None) == "deepep_low_latency":
            pfs[id(pf)] = pf
    counter = _LLCounter(len(pfs), min((len(pf.handles) for pf in pfs.values()), default=0))
    patched = []
    for pf in pfs.values():
        for name in ("low_latency_dispatch", "low_latency_combine"):
            had_own = name in vars(pf.buffer)
            original = getattr(pf.buffer, name)

            def counted(*args: Any, _fn: Any = original, **kwargs: Any) -> Any:
                counter.calls += 1
                return _fn(*args, **kwargs)

            setattr(pf.buffer, name, counted)
            patched.append((pf.buffer, name, had_own, original))
    try:
        yield counter
    finally:
        for buf, name, had_own, original in patched:
            if had_own:
                setattr(buf, name, original)
            else:
                delattr(buf, name)
