"""GraphRunner: captures FULL decode graphs (with and without DBO) and replays them.

A size is warmed up eagerly, then captured; a DBO step is ``UBatchWrapper.run_ubatched`` inside the capture, so
a replay is buffer copies plus one ``graph.replay()`` (no threads, no handoffs, no Python per layer). cuBLAS is
touched on every ubatch worker thread before the first capture. Graphs share one pool, are captured largest
first under ``no_grad`` and keep only their outputs; a size that runs out of memory is dropped
(``CaptureReport``). *Heads* -- named functions of the forward's output: the engine's LM head with its greedy pick,
and with its draw -- are captured as more graphs after each forward graph, so a step a head serves replays that
too. What a graph needs from the engine (its attention, its heads) is passed in (this package knows nothing of
``runner``).
Design: docs/design_notes.md, "Model runner", "CUDA graphs and the memory budget".
"""
from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cudagraph.backends import (
    CudaGraphBackend,
    GraphBackend,
    deepep_ll_counter,
    is_out_of_memory,
    warm_ubatch_threads,
)
from cudagraph.dispatch import (
    BatchKind,
    CaptureRuleError,
    Dispatch,
    GraphKey,
    Why,
    check_deepep_ll_rules,
    check_replay,
    classify_batch,
    plan_captures,
    select_graph,
)
from ubatch import streams, trace
from ubatch.forward_context import ForwardContext, set_forward_context
from ubatch.slicing import CommonAttentionMetadata, UBatchSlice

logger = logging.getLogger("ubatch.cudagraph")


class MetadataBuffers(Protocol):
    """Persistent attention metadata the graphs read (the engine's: ``runner.attention.graph``)."""

    def fill_padding(self, num_tokens: int) -> None:
        """Make rows ``[0, num_tokens)`` padding requests (what a capture runs with)."""

    def views(self, num_tokens: int, ubatch_sizes: Sequence[int]) -> list[Any]:
        """Per-ubatch metadata views over the buffers (one view when not ubatched)."""

    def fill(self, meta: Any, num_tokens: int) -> None:
        """Copy a real step's metadata in before a replay (rows past its requests become padding)."""


MetadataBuffersFactory = Callable[[int], MetadataBuffers]  # called with the largest capture size
# Entered around warm-ups and captures; yields how many of the model's attention layers take the graph
# metadata (0: the model's attention must be capturable by itself).
CapturableAttention = Callable[[torch.nn.Module], contextlib.AbstractContextManager[int]]
# Called after every planned size with "this rank captured it"; returns "every DP rank captured it". DP ranks
# must keep the same graphs: a graph replays its collectives, and a peer running eager at that size would
# build a step of another padded size.
CaptureAgreement = Callable[[bool], bool]
# A function of a forward graph's output (every row, padding included) captured as its own graph after it; it
# must be capturable (no host sync) and local to the rank (no collective). Other inputs it reads are the caller's
# persistent buffers, written before a replay as the forward's input ids are.
GraphHead = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class HeadGraph:
    """One head's graph over a forward graph's output, and its own static output (overwritten by its next replay)."""

    graph: Any
    output: torch.Tensor


@dataclass
class GraphEntry:
    key: GraphKey
    graph: Any
    output: torch.Tensor  # static: overwritten by the next replay of this graph
    input_ids: torch.Tensor  # the views the graph reads
    positions: torch.Tensor
    metadata: list[Any]
    heads: dict[str, HeadGraph] = field(default_factory=dict)  # by name, over ``output``, in capture order


@dataclass
class CaptureReport:
    """What ``capture()`` did: graphs kept, time, device memory the graphs hold, and what ran out of memory.

    ``bytes_by_key``: device memory each size's capture took from the driver (warm-ups and capture of that size,
    measured with everything synchronised; captures go largest first, so a smaller graph mostly reuses the
    shared pool's blocks and adds little). ``graph_bytes`` is the whole capture's figure. Both are 0 on a
    backend that reports no device memory (the eager stand-in).
    """

    keys: list[GraphKey]
    seconds: float
    graph_bytes: int
    bytes_by_key: dict[GraphKey, int] = field(default_factory=dict)
    dropped: list[GraphKey] = field(default_factory=list)  # planned, not kept: out of memory (on some DP rank)
    first_oom: GraphKey | None = None  # the first size that ran out of memory here (None: a DP peer's did)

    def summary(self) -> str:
        plain = [k.num_tokens for k in self.keys if not k.ubatched]
        dbo = [k.num_tokens for k in self.keys if k.ubatched]
        return (f"captured {len(self.keys)} CUDA graphs (decode sizes {plain}, DBO sizes {dbo}) in "
                f"{self.seconds:.1f} s using {self.graph_bytes / 2**20:.1f} MiB of graph memory")

    def memory_table(self) -> list[tuple[str, int]]:
        """``(graph, bytes)`` per captured size, in capture order (largest first), for a benchmark to print."""
        return [(str(k), b) for k, b in self.bytes_by_key.items() if k in self.keys]

    def dropped_message(self) -> str | None:
        """The warning naming the sizes dropped, or ``None`` when every planned size was captured."""
        if not self.dropped:
            return None
        sizes = ", ".join(str(k.num_tokens) for k in sorted(self.dropped, reverse=True))
        cause = (f"out of memory capturing {_describe(self.first_oom)}" if self.first_oom is not None
                 else "another DP rank ran out of memory capturing")
        if not self.keys:
            return f"CUDA graphs: {cause}; dropped sizes {sizes}; no graph is left, every step runs eager"
        largest = max(k.num_tokens for k in self.keys)
        above = max(k.num_tokens for k in self.dropped) > largest
        tail = (f"batches above {largest} run eager" if above else
                "their batches pad to the next captured size")
        return f"CUDA graphs: {cause}; dropped sizes {sizes}; {tail}"


def _describe(key: GraphKey) -> str:
    return f"{key.num_tokens} (DBO {'+'.join(map(str, key.ubatch_sizes))})" if key.ubatched else str(key.num_tokens)


class _WarmupOutOfMemory(RuntimeError):
    """An eager warm-up ran out of memory while DP peers may have collectives of that step in flight."""


class GraphRunner:
    """Owns the capture plan, the persistent metadata buffers, one memory pool and the graphs.

    Per step the runner calls :meth:`padded_num_tokens` (how many tokens to build the step with) and then
    :meth:`try_replay` (the output, or ``NotImplemented`` to run eager); after a replay, :meth:`replay_head` gives
    a head's result for the same rows with one more graph launch. Input ids and positions are the
    runner's own persistent buffers, so a replay copies nothing but the attention metadata.
    """

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, *,
                 metadata_buffers: MetadataBuffersFactory, capturable_attention: CapturableAttention,
                 sizes: Sequence[int], wrapper: Any = None, dbo_decode_threshold: int = 32,
                 keys: Sequence[GraphKey] | None = None, backend: GraphBackend | None = None,
                 num_warmups: int = 2, progress: bool = True, real_token_mask: torch.Tensor | None = None,
                 agree: CaptureAgreement | None = None, capture_stream: streams.Stream | None = None,
                 heads: Mapping[str, GraphHead] | None = None) -> None:
        self.model, self.wrapper = model, wrapper
        self.heads = dict(heads or {})
        self.agree = agree
        self.input_ids, self.positions = input_ids, positions
        # The caller's persistent [max_tokens] bool buffer marking real rows: captured graphs read it, so the
        # caller refills it before every replay and padding rows stay routed nowhere (see FusedMoE).
        self.real_token_mask = real_token_mask
        self.device = input_ids.device
        self.num_ubatches = wrapper.config.num_ubatches if wrapper is not None else 2
        self.keys = list(keys) if keys is not None else plan_captures(
            sizes, dbo_enabled=wrapper is not None, decode_threshold=dbo_decode_threshold,
            num_ubatches=self.num_ubatches)
        if any(k.ubatched for k in self.keys) and wrapper is None:
            raise ValueError("DBO graphs need a UBatchWrapper (run with --enable-dbo)")
        largest = max(k.num_tokens for k in self.keys)
        if largest > input_ids.shape[0]:
            raise ValueError(f"capture size {largest} exceeds the {input_ids.shape[0]}-token input buffers")
        self.buffers = metadata_buffers(largest)
        self.capturable_attention = capturable_attention
        self.backend: GraphBackend = backend or CudaGraphBackend()
        self.num_warmups, self.progress = num_warmups, progress
        # Reused by every capture (and handed on by the caller to a later runner of the same model): torch keeps a
        # cuBLAS workspace per (thread's handle, stream) for the life of the process.
        self.capture_stream = capture_stream if capture_stream is not None else \
            streams.new_stream(self.device, name="graph-capture")
        self.pool: Any = None
        self.graphs: dict[GraphKey, GraphEntry] = {}
        self.stats: collections.Counter[Why] = collections.Counter()
        self.last_replay: GraphEntry | None = None  # the graph the latest try_replay replayed (None: eager)
        self.num_head_replays: collections.Counter[str] = collections.Counter()  # by head name
        self.warmed_threads: set[int] = set()
        self.report: CaptureReport | None = None  # the last capture's (graph memory per size, sizes dropped)

    # ---- capture ---------------------------------------------------------------------------------------
    def capture(self) -> CaptureReport:
        """Capture every planned graph that fits (tqdm bar; one INFO line with sizes, seconds and graph memory).

        Run it before serving, not beside an eager step on another thread: it refills the input and metadata
        buffers that steps use. With DP every rank captures the same plan in the same
        order, so the collectives inside warm-ups and captures pair up, and ``agree`` settles after each size
        whether every rank kept it.

        A size that runs out of device memory is dropped, never fatal: the half-captured graph is released,
        the smaller sizes are still tried (they reuse the pool's blocks), and one warning names the sizes
        dropped. Any other failure clears every graph and raises. Everything runs without autograd: a graph
        captured with grad enabled would keep each step's saved activations alive in the pool (and the KV
        cache's in-place writes would chain them from one capture to the next).
        """
        if self.graphs:
            raise RuntimeError("graphs are already captured; call clear() first")
        from tqdm import tqdm

        keys = sorted(self.keys, key=lambda k: k.num_tokens, reverse=True)
        self.backend.synchronize()
        free_before, start = self.backend.free_memory(), time.perf_counter()
        self.pool = self.backend.new_pool()
        report = CaptureReport([], 0.0, 0)
        bar = tqdm(keys, desc="Capturing CUDA graphs", unit="graph", disable=not self.progress, dynamic_ncols=True)
        try:
            with torch.no_grad():
                self._warm_threads()
                with self.capturable_attention(self.model) as graph_layers:
                    if not graph_layers:
                        logger.warning("no attention layer of the model takes the graphs' decode metadata; its "
                                       "own attention must then be capturable")
                for key in bar:
                    bar.set_postfix_str(str(key), refresh=False)
                    self._capture_or_drop(key, report)
        except BaseException as exc:
            failed = next((k for k in keys if k not in self.graphs and k not in report.dropped), None)
            self.clear()
            if isinstance(exc, _WarmupOutOfMemory):
                raise RuntimeError(str(exc)) from exc.__cause__
            if isinstance(exc, RuntimeError) and not isinstance(exc, CaptureRuleError) and failed is not None:
                raise RuntimeError(
                    f"capturing the CUDA graph for {failed} failed: {exc}. The step is not capturable: look for "
                    "a host sync (.item(), .tolist(), nonzero, bincount on CUDA), a pageable host-to-device "
                    "copy (torch.tensor(..., device='cuda')) or a handle created lazily; --enforce-eager "
                    "skips graphs") from exc
            raise
        finally:
            bar.close()
        self.backend.synchronize()
        # Later work on the caller's stream (buffer refills, replays) comes after the capture stream's warm-ups.
        streams.wait_stream(streams.current_stream(self.device), self.capture_stream)
        report.keys = sorted(self.graphs)
        report.seconds = time.perf_counter() - start
        report.graph_bytes = max(0, free_before - self.backend.free_memory())
        message = report.dropped_message()
        if message is not None:
            logger.warning(message)
        logger.info(report.summary())
        self.report = report
        return report

    def _warm_threads(self) -> None:
        if self.wrapper is None:
            return
        extra = [] if self.device.type != "cuda" else [torch.cuda.current_stream(self.device)]
        self.warmed_threads |= warm_ubatch_threads(self.wrapper, [self.capture_stream, self.wrapper.comm_stream,
                                                                   *extra])

    def _capture_or_drop(self, key: GraphKey, report: CaptureReport) -> None:
        """Capture ``key``; on out of memory drop it (and, with DP, drop it on every rank) instead of failing."""
        self.backend.synchronize()
        before = self.backend.free_memory()
        entry, oom = None, None
        try:
            entry = self._capture_one(key)
        except BaseException as exc:
            if not is_out_of_memory(exc) or isinstance(exc, _WarmupOutOfMemory):
                raise
            oom = exc
        # agree() is a collective every DP rank must reach, so it is called before entry is looked at
        if self.agree is not None and not self.agree(entry is not None) and entry is not None:
            self._release(entry)  # a DP peer ran out of memory at this size: keep the plans identical
            entry = None
        self.backend.synchronize()
        if entry is not None:
            self.graphs[key] = entry
            report.bytes_by_key[key] = max(0, before - self.backend.free_memory())
            return
        report.dropped.append(key)
        if oom is not None:
            logger.debug("out of memory capturing %s: %s", key, oom)
            if report.first_oom is None:
                report.first_oom = key
        self._warm_threads()  # a failed DBO step may have replaced a worker thread: warm it before the next capture

    def _capture_one(self, key: GraphKey) -> GraphEntry:
        size = key.num_tokens
        ids, pos = self.input_ids[:size], self.positions[:size]
        metas = self.buffers.views(size, key.ubatch_sizes)
        slices, start = [], 0
        for n in key.ubatch_sizes:
            slices.append(UBatchSlice(slice(start, start + n), slice(start, start + n)))
            start += n

        def step() -> torch.Tensor:
            # Python only: a CUDA replay never re-enters it (the eager stand-in's replay does, hence no_grad here)
            with torch.no_grad(), self.capturable_attention(self.model):
                return self._run_eager(key, ids, pos, metas, slices)

        caller = streams.current_stream(self.device)
        with streams.stream(self.capture_stream):
            # The fills, the warm-ups and the capture all run on the capture stream, after whatever the caller's
            # stream last did to these buffers: the previous size's capture read them on this stream too.
            streams.wait_stream(self.capture_stream, caller)
            ids.zero_()
            pos.zero_()
            if self.real_token_mask is not None:
                self.real_token_mask[:size].fill_(False)  # a capture runs padding rows only
            self.buffers.fill_padding(size)
            try:
                for _ in range(self.num_warmups):
                    step()
            except BaseException as exc:
                if self.agree is not None and is_out_of_memory(exc):
                    raise _WarmupOutOfMemory(
                        f"out of memory in an eager warm-up of the CUDA graph for {key}: its collectives ran on "
                        "the DP peers, which cannot be unwound, so this size cannot be dropped on every rank; "
                        "lower --gpu-memory-utilization, --max-num-seqs or --cuda-graph-sizes") from exc
                raise
        self.backend.synchronize()
        with deepep_ll_counter(self.model) as ll:
            graph, out = self.backend.capture(step, self.pool, self.capture_stream)
        if ll.num_backends:
            try:
                check_deepep_ll_rules(ll.calls, len(key.ubatch_sizes) or 1, ll.num_handles)
            except CaptureRuleError:
                self.backend.release(graph)
                raise
        entry = GraphEntry(key, graph, out, ids, pos, metas)
        try:
            for name, head in self.heads.items():
                entry.heads[name] = self._capture_head(head, out)
        except BaseException:
            self._release(entry)  # the size is dropped (out of memory) or the capture fails whole
            raise
        return entry

    def _capture_head(self, head: GraphHead, output: torch.Tensor) -> HeadGraph:
        """``head``'s graph over a forward graph's static ``output``: warmed up and captured on the capture
        stream, after the forward's capture. The warm-ups read whatever ``output`` and the head's other buffers
        hold (a CUDA capture computes nothing): a head must take any values, as the greedy pick does (a
        non-finite row is marked)."""

        def run() -> torch.Tensor:
            with torch.no_grad():
                return head(output)

        with streams.stream(self.capture_stream):
            for _ in range(self.num_warmups):
                run()
        self.backend.synchronize()
        return HeadGraph(*self.backend.capture(run, self.pool, self.capture_stream))

    def _run_eager(self, key: GraphKey, ids: torch.Tensor, pos: torch.Tensor, metas: list[Any],
                   slices: list[UBatchSlice]) -> torch.Tensor:
        mask = None if self.real_token_mask is None else self.real_token_mask[:ids.shape[0]]
        if key.ubatched:
            fc = ForwardContext(attn_metadata=list(metas), ubatch_slices=slices, real_token_mask=mask)
            try:
                return self.wrapper.run_ubatched(fc, slices, (), {"input_ids": ids, "positions": pos})
            finally:  # also after a failure (out of memory mid-step): an unjoined fork fails the capture's end
                self._join_comm_stream()
        with set_forward_context(attn_metadata=metas[0], real_token_mask=mask):
            return self.model(input_ids=ids, positions=pos)

    def _join_comm_stream(self) -> None:
        """Every stream forked into a capture must join back before it ends: wait on the comm stream if it
        took part (a backend that never switched to it left it outside the capture: nothing to join)."""
        comm = self.wrapper.comm_stream
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return
        with torch.cuda.stream(comm):
            joined = torch.cuda.is_current_stream_capturing()
        if joined:
            torch.cuda.current_stream().wait_stream(comm)

    def clear(self) -> None:
        """Drop every graph, its static output and the pool, so their memory returns to the allocator.

        What capture() made and clear() keeps, on purpose: the capture stream (one per runner, reused by the
        next capture: a new stream per capture would get a new cuBLAS workspace per worker thread, which torch
        keeps per (handle, stream) for the life of the process) and the persistent metadata buffers.
        """
        entries = list(self.graphs.values())
        self.graphs.clear()  # the entries hold the static outputs and metadata views
        self.last_replay = None
        for entry in entries:
            self._release(entry)
        del entries
        self.pool = None
        self.report = None
        self.backend.synchronize()

    def _release(self, entry: GraphEntry) -> None:
        """Release an entry's graphs (its heads' first, the last captured first: they read the forward's output)."""
        for head in reversed(entry.heads.values()):
            self.backend.release(head.graph)
        self.backend.release(entry.graph)

    # ---- dispatch and replay ---------------------------------------------------------------------------
    def padded_num_tokens(self, num_tokens: int, is_uniform_decode: bool, decision: Any) -> int:
        """Tokens the step should be built with: the graph's size when one will replay, else DP's count.

        ``decision`` is the runner's :class:`runner.distributed.dp.DPDecision`. Padding after DP coordination is
        equivalent to padding before it (bucketing is monotone, so the max of buckets is the bucket of
        the max) and keeps ``runner/distributed/dp.py`` unaware of graphs.
        """
        kind = BatchKind.UNIFORM_DECODE if is_uniform_decode else (BatchKind.DUMMY if num_tokens == 0
                                                                   else BatchKind.MIXED)
        min_real = min(decision.num_tokens_across_dp) if decision.should_ubatch else None
        return select_graph(kind, decision.num_tokens_padded, decision.should_ubatch, self.graphs,
                            min_real_tokens=min_real, num_ubatches=self.num_ubatches).num_tokens

    def dispatch(self, meta: Any, slices: Sequence[UBatchSlice] | None, num_tokens: int) -> Dispatch:
        """The decision for a step already built with ``num_tokens`` tokens (kind read from its metadata)."""
        if not isinstance(meta, CommonAttentionMetadata):
            return Dispatch(None, num_tokens, Why.MIXED, "no common attention metadata to refill the graph from")
        kind = classify_batch(meta.num_reqs, meta.num_actual_tokens, meta.max_query_len)
        d = select_graph(kind, num_tokens, bool(slices), self.graphs, num_ubatches=self.num_ubatches)
        if d.key is not None:
            d = check_replay(d.key, num_tokens, [s.num_tokens for s in slices] if slices else None) or d
        return d

    def try_replay(self, meta: Any, slices: Sequence[UBatchSlice] | None, input_ids: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor | Any:
        """Replay the graph for this step, or return ``NotImplemented`` (the caller runs eager).

        The returned tensor is the graph's static output: valid until the next replay of the same graph
        (stream order makes reads enqueued before that replay safe).
        """
        d = self.dispatch(meta, slices, input_ids.shape[0])
        self.stats[d.why] += 1
        self.last_replay = None
        if d.key is None:
            logger.debug("eager step: %s (%s)", d.why.value, d.detail)
            return NotImplemented
        entry = self.graphs[d.key]
        self.buffers.fill(meta, d.num_tokens)
        for static, given in ((entry.input_ids, input_ids), (entry.positions, positions)):
            if given.data_ptr() != static.data_ptr():
                static.copy_(given)
        with trace.compute_span("graph_replay", "G"):  # one span per replay (a captured graph records none inside)
            self.backend.replay(entry.graph)
        self.last_replay = entry
        return entry.output

    @property
    def last_replayed(self) -> bool:
        """Whether the latest :meth:`try_replay` replayed a graph (the DBO cost model reads it)."""
        return self.last_replay is not None

    def head_ready(self, name: str) -> bool:
        """Whether :meth:`replay_head` can serve the step just replayed with head ``name`` (the latest
        :meth:`try_replay` replayed a graph, and that size has the head)."""
        return self.last_replay is not None and name in self.last_replay.heads

    def replay_head(self, name: str) -> torch.Tensor:
        """Head ``name``'s result over the rows of the graph replayed last (every row of its size: the caller takes
        its real rows), by one more graph launch. Static: valid until the next replay of that size's head."""
        entry = self.last_replay
        head = None if entry is None else entry.heads.get(name)
        if head is None:
            raise RuntimeError(f"replay_head: the latest step replayed no graph with a {name!r} head (check "
                               f"head_ready; heads captured: {sorted(self.heads)})")
        with trace.compute_span(f"head_replay_{name}", "G"):
            self.backend.replay(head.graph)
        self.num_head_replays[name] += 1
        return head.output
