"""GraphRunner: captures FULL decode graphs (with and without DBO) and replays them.

Capture, per size, largest first (smaller graphs then reuse the shared pool's memory): fill the
persistent metadata with padding rows, run the step eagerly ``num_warmups`` times on the capture stream
(Triton/JIT compiles, lazy buffers, the emulated link's clock calibration), then run it once more inside
``torch.cuda.graph``. A DBO step is ``UBatchWrapper.run_ubatched`` inside the capture: the ubatches
launch from the wrapper's worker thread(s) onto the capturing compute stream, the comm streams join the
capture through events, and the captured DAG freezes the interleaving the handoffs produced. So a replay
is buffer copies plus one ``graph.replay()``: no threads, no handoffs, no Python per layer.

Before the first capture cuBLAS is touched on every ubatch worker thread for every stream it may use
(a handle or workspace created inside a capture is illegal or lands in the graph pool): one thread with
the greenlet executor, one per ubatch with the threads executor.

This package sits below the engine: it knows nothing of ``runner``. What a graph needs from the model's
attention -- persistent decode-metadata buffers and a way to make the attention capturable -- is passed
in by the caller (``runner/cuda_graphs.py`` wires the engine's own).
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch

from cudagraph.backends import CudaGraphBackend, GraphBackend, deepep_ll_counter, warm_ubatch_threads
from cudagraph.dispatch import (
    BatchKind, CaptureRuleError, Dispatch, GraphKey, Why, check_deepep_ll_rules, check_replay,
    classify_batch, plan_captures, select_graph,
)
from ubatch import streams
from ubatch.forward_context import ForwardContext, set_forward_context
from ubatch.slicing import CommonAttentionMetadata, UBatchSlice

logger = logging.getLogger("ubatch.cudagraph")


class MetadataBuffers(Protocol):
    """Persistent attention metadata the graphs read (the engine's: ``runner.attention_graph``)."""

    def fill_padding(self, num_tokens: int) -> None:
        """Make rows ``[0, num_tokens)`` padding requests (what a capture runs with)."""

    def views(self, num_tokens: int, ubatch_sizes: Sequence[int]) -> list[Any]:
        """Per-ubatch metadata views over the buffers (one view when not ubatched)."""

    def fill(self, meta: Any, num_tokens: int) -> None:
        """Copy a real step's metadata in before a replay (rows past its requests become padding)."""


MetadataBuffersFactory = Callable[[int], MetadataBuffers]  # called with the largest capture size
CapturableAttention = Callable[[torch.nn.Module], ContextManager[int]]  # yields how many call sites it rerouted


@dataclass
class GraphEntry:
    key: GraphKey
    graph: Any
    output: torch.Tensor  # static: overwritten by the next replay of this graph
    input_ids: torch.Tensor  # the views the graph reads
    positions: torch.Tensor
    metadata: list[Any]


@dataclass
class CaptureReport:
    keys: list[GraphKey]
    seconds: float
    graph_bytes: int

    def summary(self) -> str:
        plain = [k.num_tokens for k in self.keys if not k.ubatched]
        dbo = [k.num_tokens for k in self.keys if k.ubatched]
        return (f"captured {len(self.keys)} CUDA graphs (decode sizes {plain}, DBO sizes {dbo}) in "
                f"{self.seconds:.1f} s using {self.graph_bytes / 2**20:.1f} MiB of graph memory")


class GraphRunner:
    """Owns the capture plan, the persistent metadata buffers, one memory pool and the graphs.

    Per step the runner calls :meth:`padded_num_tokens` (how many tokens to build the step with) and then
    :meth:`try_replay` (the output, or ``NotImplemented`` to run eager). Input ids and positions are the
    runner's own persistent buffers, so a replay copies nothing but the attention metadata.
    """

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, *,
                 metadata_buffers: MetadataBuffersFactory, capturable_attention: CapturableAttention,
                 sizes: Sequence[int], wrapper: Any = None, dbo_decode_threshold: int = 32,
                 keys: Sequence[GraphKey] | None = None, backend: GraphBackend | None = None,
                 num_warmups: int = 2, progress: bool = True, real_token_mask: torch.Tensor | None = None) -> None:
        self.model, self.wrapper = model, wrapper
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
        self.capture_stream = streams.new_stream(self.device, name="graph-capture")
        self.pool: Any = None
        self.graphs: dict[GraphKey, GraphEntry] = {}
        self.stats: collections.Counter[Why] = collections.Counter()
        self.warmed_threads: set[int] = set()

    # ---- capture ---------------------------------------------------------------------------------------
    def capture(self) -> CaptureReport:
        """Capture every planned graph (tqdm bar; one INFO line with sizes, seconds and graph memory).

        Run it before serving: it temporarily reroutes the model's attention functions, so it must not
        overlap an eager step on another thread. With DP every rank captures the same plan in the same
        order, so the collectives inside warm-ups and captures pair up.
        """
        if self.graphs:
            raise RuntimeError("graphs are already captured; call clear() first")
        from tqdm import tqdm

        keys = sorted(self.keys, key=lambda k: k.num_tokens, reverse=True)
        self.backend.synchronize()
        free_before, start = self.backend.free_memory(), time.perf_counter()
        self.pool = self.backend.new_pool()
        if self.wrapper is not None:
            extra = [] if self.device.type != "cuda" else [torch.cuda.current_stream(self.device)]
            self.warmed_threads |= warm_ubatch_threads(self.wrapper, [self.capture_stream,
                                                                       self.wrapper.comm_stream, *extra])
        bar = tqdm(keys, desc="Capturing CUDA graphs", unit="graph", disable=not self.progress, dynamic_ncols=True)
        try:
            with self.capturable_attention(self.model) as rerouted:
                if not rerouted:
                    logger.warning("capturable_attention rerouted no attention call of the model; its own attention "
                                   "must then be capturable")
            for key in bar:
                bar.set_postfix_str(str(key), refresh=False)
                self.graphs[key] = self._capture_one(key)
        except BaseException as exc:
            failed = next((k for k in keys if k not in self.graphs), None)
            self.clear()
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
        report = CaptureReport(sorted(self.graphs), time.perf_counter() - start,
                               max(0, free_before - self.backend.free_memory()))
        logger.info(report.summary())
        return report

    def _capture_one(self, key: GraphKey) -> GraphEntry:
        size = key.num_tokens
        ids, pos = self.input_ids[:size], self.positions[:size]
        ids.zero_()
        pos.zero_()
        if self.real_token_mask is not None:
            self.real_token_mask[:size].fill_(False)  # a capture runs padding rows only
        self.buffers.fill_padding(size)
        metas = self.buffers.views(size, key.ubatch_sizes)
        slices, start = [], 0
        for n in key.ubatch_sizes:
            slices.append(UBatchSlice(slice(start, start + n), slice(start, start + n)))
            start += n

        def step() -> torch.Tensor:
            with self.capturable_attention(self.model):  # Python only: a CUDA replay never re-enters it
                return self._run_eager(key, ids, pos, metas, slices)

        self.backend.synchronize()  # the warm-ups run on the capture stream and read what was just written
        with streams.stream(self.capture_stream):
            for _ in range(self.num_warmups):
                step()
        self.backend.synchronize()
        with deepep_ll_counter(self.model) as ll:
            graph, out = self.backend.capture(step, self.pool, self.capture_stream)
        if ll.num_backends:
            check_deepep_ll_rules(ll.calls, len(key.ubatch_sizes) or 1, ll.num_handles)
        return GraphEntry(key, graph, out, ids, pos, metas)

    def _run_eager(self, key: GraphKey, ids: torch.Tensor, pos: torch.Tensor, metas: list[Any],
                   slices: list[UBatchSlice]) -> torch.Tensor:
        mask = None if self.real_token_mask is None else self.real_token_mask[:ids.shape[0]]
        if key.ubatched:
            fc = ForwardContext(attn_metadata=list(metas), ubatch_slices=slices, real_token_mask=mask)
            out = self.wrapper.run_ubatched(fc, slices, (), {"input_ids": ids, "positions": pos})
            self._join_comm_stream()
            return out
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
        """Drop every graph and the pool (their memory returns to the allocator); capture() may run again."""
        for entry in self.graphs.values():
            self.backend.release(entry.graph)
        self.graphs.clear()
        self.pool = None
        self.backend.synchronize()

    # ---- dispatch and replay ---------------------------------------------------------------------------
    def padded_num_tokens(self, num_tokens: int, is_uniform_decode: bool, decision: Any) -> int:
        """Tokens the step should be built with: the graph's size when one will replay, else DP's count.

        ``decision`` is the runner's :class:`runner.dp.DPDecision`. Padding after DP coordination is
        equivalent to padding before it (bucketing is monotone, so the max of buckets is the bucket of
        the max) and keeps ``runner/dp.py`` unaware of graphs.
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
        if d.key is None:
            logger.debug("eager step: %s (%s)", d.why.value, d.detail)
            return NotImplemented
        entry = self.graphs[d.key]
        self.buffers.fill(meta, d.num_tokens)
        for static, given in ((entry.input_ids, input_ids), (entry.positions, positions)):
            if given.data_ptr() != static.data_ptr():
                static.copy_(given)
        self.backend.replay(entry.graph)
        return entry.output
