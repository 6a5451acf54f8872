"""UBatchWrapper: runs a model as N ping-ponging micro-batches on persistent threads.

The wrapper is transparent until the forward context carries ``ubatch_slices``: then every tensor argument
whose first dimension is the step's token count is sliced per ubatch, each ubatch runs the model on its own
thread inside its own :class:`UBatchContext`, and the outputs are concatenated back in token order.

Threads are created once and reused (vLLM creates them every step). Each calls ``torch.set_num_threads``
first, because a new Python thread ignores the process setting and oversubscribes the cores.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ubatch import streams
from ubatch.context import (
    EXECUTORS, DBOTimeoutError, DBOYieldMismatchError, UBatchContext, make_ubatch_contexts, run_greenlet_step,
)
from ubatch.forward_context import ForwardContext, maybe_get_forward_context, override_forward_context
from ubatch.slicing import CommonAttentionMetadata, UBatchSlice, split_attn_metadata


@dataclass
class UBatchConfig:
    """``executor="greenlet"`` (default) runs every ubatch as a greenlet on one persistent worker thread:
    a handoff is a stack switch (~0.3 µs here). ``"threads"`` gives each ubatch its own OS thread, as vLLM
    does (~6-40 µs a handoff, depending on how idle the other core is). Both follow the same protocol."""

    num_ubatches: int = 2
    handoff_timeout_s: float = 300.0
    num_threads_per_ubatch: int = 1
    executor: str = "greenlet"

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"unknown ubatch executor {self.executor!r}; choose one of {EXECUTORS}")
        if self.num_ubatches < 2:
            raise ValueError(f"num_ubatches must be >= 2, got {self.num_ubatches}")
        if self.handoff_timeout_s <= 0:
            raise ValueError(f"handoff_timeout_s must be > 0, got {self.handoff_timeout_s}")
        if self.num_threads_per_ubatch < 1:
            raise ValueError(f"num_threads_per_ubatch must be >= 1, got {self.num_threads_per_ubatch}")


class _Worker:
    """One persistent ubatch thread; ``submit`` hands it a job, ``None`` stops it."""

    def __init__(self, index: int, num_threads: int) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._job: Callable[[], None] | None = None
        self.busy = False
        self.thread = threading.Thread(target=self._loop, args=(num_threads,), name=f"ubatch-{index}", daemon=True)
        self.thread.start()

    def _loop(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            if job is None:
                return
            job()  # the job clears ``busy`` itself, before it reports done (see UBatchWrapper._make_job)

    def submit(self, job: Callable[[], None] | None) -> None:
        self.busy = job is not None
        self._job = job
        self._go.release()


class _WorkerPool:
    def __init__(self, size: int, num_threads: int) -> None:
        self.num_threads = num_threads
        self.workers = [_Worker(i, num_threads) for i in range(size)]

    def replace_stuck(self) -> None:
        """A worker still inside a job after its step gave up is stuck (e.g. in a dead collective): replace it."""
        for i, w in enumerate(self.workers):
            if w.busy:
                self.workers[i] = _Worker(i, self.num_threads)

    def close(self) -> None:
        for w in self.workers:
            if not w.busy:
                w.submit(None)
        for w in self.workers:
            if not w.busy:
                w.thread.join(timeout=5)
        self.workers = []


def _split_attn_metadata(meta: Any, slices: Sequence[UBatchSlice]) -> list[Any]:
    """A list is taken as already split (one builder per ubatch); common metadata is split here."""
    if isinstance(meta, (list, tuple)):
        if len(meta) != len(slices):
            raise ValueError(f"got {len(meta)} per-ubatch attention metadata for {len(slices)} ubatches")
        return list(meta)
    if isinstance(meta, CommonAttentionMetadata):
        return split_attn_metadata(list(slices), meta)
    return [meta] * len(slices)


def _slice_arg(value: Any, num_tokens: int, token_slice: slice) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == num_tokens:
        return value[token_slice]
    return value


def merge_ubatch_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate per-ubatch outputs in token order: a tensor, or a tuple/list of tensors (or ``None``s)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, (tuple, list)):
        merged = [merge_ubatch_outputs([o[i] for o in outputs]) for i in range(len(first))]
        return type(first)(merged)
    if first is None and all(o is None for o in outputs):
        return None
    raise TypeError(f"cannot merge ubatch outputs of type {type(first).__name__}; return tensors or tuples of tensors")


class UBatchWrapper:
    """Wrap ``runnable`` so that steps whose forward context carries ``ubatch_slices`` run ubatched."""

    def __init__(self, runnable: Callable[..., Any], config: UBatchConfig | None = None,
                 device: torch.device | str | None = None) -> None:
        self.runnable = runnable
        self.config = config or UBatchConfig()
        self.device = streams.resolve_device(device)
        self.comm_stream = streams.new_stream(self.device, name="comm")
        pool_size = 1 if self.config.executor == "greenlet" else self.config.num_ubatches
        self._pool = _WorkerPool(pool_size, self.config.num_threads_per_ubatch)
        self._finalizer = weakref.finalize(self, self._pool.close)
        self._lock = threading.Lock()
        self.num_ubatched_steps = 0
        self.last_yield_counts: list[int] = []
        # Hook for CUDA-graph capture/replay: called as graph_runner(wrapper, ubatch_slices, args, kwargs) and
        # returns the output, or NotImplemented to fall back to the eager ubatched path.
        self.graph_runner: Callable[..., Any] | None = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the wrapper lacks: delegate to the runnable itself (never to runnable.model).
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(name)
        return getattr(runnable, name)

    def unwrap(self) -> Callable[..., Any]:
        return self.runnable

    def close(self) -> None:
        self._finalizer()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fc = maybe_get_forward_context()
        if fc is None or not fc.ubatch_slices:
            return self.runnable(*args, **kwargs)
        slices = list(fc.ubatch_slices)
        if self.graph_runner is not None:
            out = self.graph_runner(self, slices, args, kwargs)
            if out is not NotImplemented:
                return out
        return self.run_ubatched(fc, slices, args, kwargs)

    def run_ubatched(self, fc: ForwardContext, slices: list[UBatchSlice], args: Sequence[Any],
                     kwargs: dict[str, Any]) -> Any:
        """One ubatched step; also what a CUDA-graph capture runs inside ``torch.cuda.graph``."""
        n = self.config.num_ubatches
        if len(slices) != n:
            raise ValueError(f"forward context has {len(slices)} ubatch slices but the wrapper runs {n} ubatches")
        num_tokens = slices[-1].token_slice.stop
        metas = _split_attn_metadata(fc.attn_metadata, slices)
        forward_contexts = [
            dataclasses.replace(fc, attn_metadata=metas[i], ubatch_slice=slices[i], ubatch_id=i, extra=dict(fc.extra))
            for i in range(n)
        ]
        compute_stream = streams.current_stream(self.device)
        with self._lock:  # one step at a time per wrapper: the workers are shared
            contexts = make_ubatch_contexts(n, compute_stream, self.comm_stream, forward_contexts,
                                            self.config.handoff_timeout_s, self.config.executor)
            results: list[Any] = [None] * n
            bodies = []
            for i, ctx in enumerate(contexts):
                sl = slices[i].token_slice
                a = tuple(_slice_arg(v, num_tokens, sl) for v in args)
                kw = {k: _slice_arg(v, num_tokens, sl) for k, v in kwargs.items()}
                bodies.append(self._make_body(ctx, a, kw, results))
            step = contexts[0].step
            with override_forward_context(None):
                self._launch(contexts, bodies)
                finished = step.wait_done(self.config.handoff_timeout_s)
            if not finished or step.error is not None:
                self._pool.replace_stuck()
            if step.error is not None:
                raise step.error.with_traceback(step.error.__traceback__)
            if not finished:
                err = DBOTimeoutError(step.stall_message(self.config.handoff_timeout_s))
                step.fail(-1, err)  # a stuck ubatch that wakes up later unwinds instead of running on
                raise err
            self.last_yield_counts = list(step.yield_counts)
            if len(set(step.yield_counts)) > 1:
                raise DBOYieldMismatchError(
                    f"ubatches yielded a different number of times in one step: {step.yield_counts} (by ubatch id); "
                    "every ubatch must hit the same yields or a GPU capture deadlocks")
            self.num_ubatched_steps += 1
        return merge_ubatch_outputs(results)

    def _launch(self, contexts: list[UBatchContext], bodies: list[Callable[[], None]]) -> None:
        step = contexts[0].step
        if self.config.executor == "greenlet":
            worker = self._pool.workers[0]

            def drive() -> None:
                try:
                    run_greenlet_step(contexts, bodies)
                finally:
                    worker.busy = False  # before the step reports done: the caller may submit right after
                    step.mark_all_done()

            worker.submit(drive)
            return
        for worker, body in zip(self._pool.workers, bodies):
            worker.submit(self._thread_job(worker, step, body))
        contexts[0].start()

    @staticmethod
    def _thread_job(worker: _Worker, step: Any, body: Callable[[], None]) -> Callable[[], None]:
        def job() -> None:
            try:
                body()
            finally:
                worker.busy = False  # before mark_done: the caller may submit the next step right after
                step.mark_done()

        return job

    def _make_body(self, ctx: UBatchContext, args: tuple[Any, ...], kwargs: dict[str, Any],
                   results: list[Any]) -> Callable[[], None]:
        runnable = self.runnable
        # Autograd modes are thread-local in torch: carry the caller's into the ubatch worker.
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def body() -> None:
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    with override_forward_context(ctx.forward_context):
                        with ctx:
                            results[ctx.id] = runnable(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
                ctx.step.fail(ctx.id, exc)

        return body
