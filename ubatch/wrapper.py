"""UBatchWrapper: runs a model as N ping-ponging micro-batches on a persistent executor.

Transparent until the forward context carries ``ubatch_slices``: then the token arguments are sliced per
ubatch (after checking the slices cover them exactly), each ubatch runs in its own :class:`UBatchContext`, and
the outputs are concatenated in token order. ``split_dim="tokens"`` is the runner's flat layout;
``"batch"`` slices a batch-first model such as a transformers ``forward`` (run with ``use_cache=False``). The
executor (greenlets on one worker thread by default, or a thread per ubatch) is created once and reused.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch import streams, trace
from ubatch.context import (
    DBOTimeoutError,
    DBOYieldMismatchError,
    UBatchContext,
    check_protocol_settings,
    make_ubatch_contexts,
    run_greenlet_step,
)
from ubatch.forward_context import ForwardContext, maybe_get_forward_context, override_forward_context
from ubatch.slicing import CommonAttentionMetadata, UBatchSlice, split_attn_metadata

SPLIT_DIMS = ("tokens", "batch")
# split_dim -> (the UBatchSlice field that cuts dim 0, what one row of dim 0 is called, plural)
_SPLIT_FIELDS = {"tokens": ("token_slice", "token", "tokens"), "batch": ("request_slice", "batch row", "batch rows")}


@dataclass
class UBatchConfig:
    """``executor="greenlet"`` (default) runs every ubatch as a greenlet on one persistent worker thread, so
    a handoff is a stack switch; ``"threads"`` gives each ubatch its own OS thread, as vLLM does. Both follow
    the same protocol; their handoff costs are compared in docs/benchmarks.md ("Handoff cost").

    ``max_stuck_workers``: how many workers a wrapper may abandon to user code that never returned (a
    handoff timeout replaces the stuck worker so the next step can run); past it, steps are refused.

    ``split_dim``: which dimension the ubatch slices cut (module doc): ``"tokens"`` (flat ``[T, ...]``
    arguments, ``UBatchSlice.token_slice``) or ``"batch"`` (batch-first ``[B, ...]`` arguments,
    ``UBatchSlice.request_slice``).
    """

    num_ubatches: int = 2
    handoff_timeout_s: float = 300.0
    num_threads_per_ubatch: int = 1
    executor: str = "greenlet"
    max_stuck_workers: int = 4
    split_dim: str = "tokens"

    def __post_init__(self) -> None:
        check_protocol_settings(self.num_ubatches, self.executor, self.handoff_timeout_s)
        if self.split_dim not in SPLIT_DIMS:
            raise ValueError(f"split_dim must be one of {', '.join(SPLIT_DIMS)}, got {self.split_dim!r}")
        if self.num_threads_per_ubatch < 1:
            raise ValueError(f"num_threads_per_ubatch must be >= 1, got {self.num_threads_per_ubatch}")
        if self.max_stuck_workers < 0:
            raise ValueError(f"max_stuck_workers must be >= 0, got {self.max_stuck_workers}")


class _Worker:
    """One persistent worker thread (all ubatches as greenlets, or one ubatch); ``submit`` hands it a job,
    ``None`` stops it."""

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
            job = None  # idle workers hold nothing: the last step's outputs (e.g. in a CUDA graph's pool) can be freed

    def submit(self, job: Callable[[], None] | None) -> None:
        self.busy = job is not None
        self._job = job
        self._go.release()


class WrapperClosedError(RuntimeError):
    """The wrapper was used after ``close()``: its workers are gone."""


class StuckWorkersError(RuntimeError):
    """Too many workers were abandoned to user code that never returned; the wrapper refuses more steps."""


class _WorkerPool:
    def __init__(self, size: int, num_threads: int, max_stuck: int) -> None:
        self.num_threads = num_threads
        self.max_stuck = max_stuck
        self.workers = [_Worker(i, num_threads) for i in range(size)]
        self.stuck: list[_Worker] = []  # replaced after a timeout; still inside a job, or idle and unused

    def replace_stuck(self) -> None:
        """A worker still inside a job after its step gave up is stuck (e.g. in a dead collective): replace it.

        The stuck thread cannot be killed; it is kept in ``stuck`` so ``close()`` can stop it if it ever
        returns and report it if it does not, and so the number abandoned stays bounded.
        """
        for i, w in enumerate(self.workers):
            if w.busy:
                self.stuck.append(w)
                self.workers[i] = _Worker(i, self.num_threads)

    def check_usable(self) -> None:
        self.stuck = [w for w in self.stuck if not self._stop_if_idle(w)]
        if len(self.stuck) > self.max_stuck:
            names = ", ".join(w.thread.name for w in self.stuck)
            raise StuckWorkersError(
                f"{len(self.stuck)} ubatch workers ({names}) are stuck in model code that never returned after a "
                f"handoff timeout, more than max_stuck_workers={self.max_stuck}; close this wrapper and find what "
                "the stuck ubatch waits for (a collective whose peer died?)")

    @staticmethod
    def _stop_if_idle(worker: _Worker) -> bool:
        if worker.busy:
            return False
        worker.submit(None)
        worker.thread.join(timeout=5)
        return True

    def close(self) -> None:
        everyone = self.workers + self.stuck
        idle = [w for w in everyone if not w.busy]
        for w in idle:
            w.submit(None)
        for w in idle:
            w.thread.join(timeout=5)
        still = [w for w in everyone if w.busy]
        if still:
            warnings.warn(f"UBatchWrapper closed with {len(still)} worker thread(s) still stuck in model code "
                          f"({', '.join(w.thread.name for w in still)}); they exit when that code returns",
                          RuntimeWarning, stacklevel=3)
        self.workers = []
        self.stuck = []


def _split_attn_metadata(meta: Any, slices: Sequence[UBatchSlice]) -> list[Any]:
    """A list is taken as already split (one builder per ubatch); common metadata is split here."""
    if isinstance(meta, (list, tuple)):
        if len(meta) != len(slices):
            raise ValueError(f"got {len(meta)} per-ubatch attention metadata for {len(slices)} ubatches")
        return list(meta)
    if isinstance(meta, CommonAttentionMetadata):
        return split_attn_metadata(list(slices), meta)
    return [meta] * len(slices)


def _batch_split_metadata(fc: ForwardContext, n: int) -> list[Any]:
    """Per-ubatch attention metadata of a batch split: none (the model masks its own attention) or a list
    already split by the caller. Token-level step data cannot be cut by sequences, so it is refused."""
    if fc.real_token_mask is not None:
        raise ValueError("split_dim='batch' cannot slice real_token_mask (one entry per flat token row); mark "
                         "padding with the model's own attention mask and leave real_token_mask unset")
    meta = fc.attn_metadata
    if meta is None:
        return [None] * n
    if isinstance(meta, (list, tuple)) and len(meta) == n:
        return list(meta)
    raise ValueError(f"split_dim='batch' takes no attention metadata or a list of {n} per-ubatch ones, got "
                     f"{type(meta).__name__}; token-level metadata belongs to split_dim='tokens'")


def _slice_arg(value: Any, num_tokens: int, token_slice: slice) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == num_tokens:
        return value[token_slice]
    return value


def check_ubatch_slices(slices: Sequence[UBatchSlice], args: Sequence[Any], kwargs: dict[str, Any],
                        split_dim: str = "tokens") -> int:
    """The row count the slices cover, after checking they partition the sliced arguments' rows exactly.

    Rows are tokens (``split_dim="tokens"``, the slices' ``token_slice``) or sequences of a batch-first
    input (``"batch"``, their ``request_slice``). Slices must be contiguous from row 0, in order, without
    gaps or overlaps; and at least one tensor argument must have exactly that many rows (those are the
    arguments that get sliced). A caller that pads its inputs passes the padded tensors, so the slices
    cover the padded size. Raises ``ValueError`` naming the numbers otherwise.
    """
    field, unit, units = _SPLIT_FIELDS[split_dim]
    expected_start = 0
    for i, sl in enumerate(slices):
        t = getattr(sl, field)
        if t.step not in (None, 1):
            raise ValueError(f"ubatch slice {i} has {unit} step {t.step}; {unit} slices must be contiguous")
        if t.start != expected_start:
            kind = "a gap" if t.start > expected_start else "an overlap"
            raise ValueError(f"ubatch slice {i} starts at {unit} {t.start} but the previous one ends at "
                             f"{expected_start}: {kind} would {'drop' if t.start > expected_start else 'duplicate'} "
                             f"{units}; {unit} slices must be contiguous, in order and start at 0")
        if t.stop < t.start:
            raise ValueError(f"ubatch slice {i} ends at {unit} {t.stop}, before its start {t.start}")
        expected_start = t.stop
    num_rows = expected_start
    rows = [v.shape[0] for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0]
    if num_rows not in rows:
        raise ValueError(f"the ubatch slices cover {num_rows} {units} but no tensor argument has {num_rows} rows "
                         f"(first dimensions: {rows}); pad the inputs to the slices' size, or build the slices for "
                         f"the inputs' {unit} count")
    return num_rows


def batch_ubatch_slices(batch_size: int, num_ubatches: int = 2) -> list[UBatchSlice]:
    """Slices for ``split_dim="batch"``: the sequences of a batch-first input in ``num_ubatches`` contiguous,
    near-equal parts (the first ones one larger when it does not divide). Only ``request_slice`` is read in
    that mode; ``token_slice`` repeats it. Every ubatch gets at least one sequence."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < num_ubatches:
        raise ValueError(f"a batch of {batch_size!r} sequences cannot be split into {num_ubatches} ubatches of at "
                         "least one sequence each")
    base, extra = divmod(batch_size, num_ubatches)
    bounds = [0]
    for i in range(num_ubatches):
        bounds.append(bounds[-1] + base + (i < extra))
    return [UBatchSlice(slice(a, b), slice(a, b)) for a, b in itertools.pairwise(bounds)]


def merge_ubatch_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate per-ubatch outputs along dim 0 (token or batch order): a tensor, a tuple/list of them, or
    a dataclass of them (transformers' ``ModelOutput``: field by field; ``None`` fields stay ``None``)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise TypeError("cannot merge 0-dim ubatch outputs (a per-ubatch scalar such as a loss): concatenation "
                            "needs a dim 0; compute it from the merged outputs instead")
        return torch.cat(list(outputs), dim=0)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        merged = {f.name: merge_ubatch_outputs([getattr(o, f.name) for o in outputs])
                  for f in dataclasses.fields(first) if f.init}
        return type(first)(**merged)
    if isinstance(first, (tuple, list)):
        merged_items = [merge_ubatch_outputs([o[i] for o in outputs]) for i in range(len(first))]
        return type(first)(merged_items)
    if first is None and all(o is None for o in outputs):
        return None
    if type(first).__name__.endswith("Cache"):
        raise TypeError(f"cannot merge the ubatches' {type(first).__name__} objects into one KV cache: each ubatch "
                        "built its own; run the ubatched forward with use_cache=False")
    raise TypeError(f"cannot merge ubatch outputs of type {type(first).__name__}; return tensors or tuples of tensors")


class UBatchWrapper:
    """Wrap ``runnable`` so that steps whose forward context carries ``ubatch_slices`` run ubatched."""

    def __init__(self, runnable: Callable[..., Any], config: UBatchConfig | None = None,
                 device: torch.device | str | None = None) -> None:
        self.runnable = runnable
        self.config = config or UBatchConfig()
        # No device given: the model's own (its parameters'), so a CPU model gets CPU streams on a GPU machine.
        self.device = streams.resolve_device(device if device is not None else streams.device_of(runnable))
        self.comm_stream = streams.new_stream(self.device, name="comm")
        pool_size = 1 if self.config.executor == "greenlet" else self.config.num_ubatches
        self._pool = _WorkerPool(pool_size, self.config.num_threads_per_ubatch, self.config.max_stuck_workers)
        self._finalizer = weakref.finalize(self, self._pool.close)
        self._lock = threading.Lock()
        self.num_ubatched_steps = 0
        self.last_yield_counts: list[int] = []

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the wrapper lacks: delegate to the runnable itself (never to runnable.model).
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(name)
        return getattr(runnable, name)

    def unwrap(self) -> Callable[..., Any]:
        return self.runnable

    def close(self) -> None:
        """Stop the workers (idempotent); a worker stuck in model code is reported with a RuntimeWarning."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise WrapperClosedError("this UBatchWrapper was closed; create a new one to run more steps")
        fc = maybe_get_forward_context()
        if fc is None or not fc.ubatch_slices:
            return self.runnable(*args, **kwargs)
        return self.run_ubatched(fc, list(fc.ubatch_slices), args, kwargs)

    def run_ubatched(self, fc: ForwardContext, slices: list[UBatchSlice], args: Sequence[Any],
                     kwargs: dict[str, Any]) -> Any:
        """One ubatched step; also what a CUDA-graph capture runs inside ``torch.cuda.graph``."""
        if self.closed:
            raise WrapperClosedError("this UBatchWrapper was closed; create a new one to run more steps")
        n = self.config.num_ubatches
        if len(slices) != n:
            raise ValueError(f"forward context has {len(slices)} ubatch slices but the wrapper runs {n} ubatches")
        with self._lock:  # one step at a time per wrapper: the workers are shared
            with trace.region("ubatch_setup", "step", track="step"):
                self._pool.check_usable()
                contexts, bodies, results = self._prepare_step(fc, slices, args, kwargs)
            step = contexts[0].step
            rec = trace.active()
            with override_forward_context(None):
                launched_at = time.perf_counter()
                self._launch(contexts, bodies)
                finished = step.wait_done(self.config.handoff_timeout_s)
            if rec is not None and finished:  # the worker's wake-up and the caller's, as step phases
                rec.span("ubatch_wake", "step", "step", launched_at, step.first_resume_at or launched_at)
                rec.span("ubatch_join", "step", "step", step.done_at, time.perf_counter())
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
        with trace.region("ubatch_merge", "step", track="step"):
            return merge_ubatch_outputs(results)

    def _prepare_step(self, fc: ForwardContext, slices: list[UBatchSlice], args: Sequence[Any],
                      kwargs: dict[str, Any]) -> tuple[list[UBatchContext], list[Callable[[], None]], list[Any]]:
        """Per-ubatch forward contexts, protocol contexts and bodies (each with its slice of the arguments)."""
        n = self.config.num_ubatches
        split_dim = self.config.split_dim
        num_rows = check_ubatch_slices(slices, args, kwargs, split_dim)
        row_slices = [getattr(sl, _SPLIT_FIELDS[split_dim][0]) for sl in slices]
        if split_dim == "tokens":
            metas = _split_attn_metadata(fc.attn_metadata, slices)
            masks = [_slice_arg(fc.real_token_mask, num_rows, t) for t in row_slices]
        else:
            metas, masks = _batch_split_metadata(fc, n), [None] * n
        forward_contexts = [
            dataclasses.replace(fc, attn_metadata=metas[i], ubatch_slice=slices[i], ubatch_id=i,
                                real_token_mask=masks[i])
            for i in range(n)
        ]
        contexts = make_ubatch_contexts(n, streams.current_stream(self.device), self.comm_stream, forward_contexts,
                                        self.config.handoff_timeout_s, self.config.executor)
        results: list[Any] = [None] * n
        bodies = []
        for ctx, rows in zip(contexts, row_slices, strict=True):
            a = tuple(_slice_arg(v, num_rows, rows) for v in args)
            kw = {k: _slice_arg(v, num_rows, rows) for k, v in kwargs.items()}
            bodies.append(self._make_body(ctx, a, kw, results))
        return contexts, bodies, results

    def _launch(self, contexts: list[UBatchContext], bodies: list[Callable[[], None]]) -> None:
        step = contexts[0].step
        if self.config.executor == "greenlet":
            worker = self._pool.workers[0]
            # The greenlets share the worker thread and its thread-local autograd mode: each body enters the
            # caller's mode, and one that returns first restores what it found, so the thread holds the same mode
            # around them all and a ubatch still running after another has returned keeps it.
            inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

            def drive() -> None:
                try:
                    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                        run_greenlet_step(contexts, bodies)
                finally:
                    worker.busy = False  # before the step reports done: the caller may submit right after
                    step.mark_all_done()

            worker.submit(drive)
            return
        for worker, body in zip(self._pool.workers, bodies, strict=True):  # one worker per ubatch
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
                with (torch.inference_mode(inference), torch.set_grad_enabled(grad),
                      override_forward_context(ctx.forward_context), ctx):
                    results[ctx.id] = runnable(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
                ctx.step.fail(ctx.id, exc)

        return body
