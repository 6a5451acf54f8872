"""The all-to-all half of the modular MoE kernel: move tokens to their experts and the results back.

Each direction is split in two so the kernel can overlap it: ``*_async`` starts the transfer and returns
``(hook, receiver)``. ``hook`` (may be ``None``) completes the receive; under DBO the kernel parks it on
the *other* ubatch, which runs it just before its own send, so the transfer is in flight while the other
ubatch computes. ``receiver`` then hands over the data. Backends whose choreography needs explicit stream
switches (DeepEP's high-throughput mode) yield inside ``*_async``/``receiver`` themselves and return no hook.

A top-k id of ``-1`` routes its row nowhere: the MoE layer gives DP and CUDA-graph padding rows all-``-1``
ids, and every backend must then send nothing for them and return zeros (DeepEP's kernels treat ``-1``
the same way). ``wire`` counts the bytes each direction hands to the real collective, per ubatch, so tests
and benchmarks can check what the buffers cost.

Comm spans on the cuda trace clock (``ubatch/trace.py``): a backend takes ``comm_start()`` right before it
posts a transfer and passes it to ``_through_link``. With a modelled link the link's own span is the
transfer (one comm span per transfer); without one, ``_through_link`` makes a per-ubatch tracing stream
wait for the real collective and records the end there, so the span runs from the post to the
collective's completion on the device. On the cpu clock ``comm_start()`` is ``None`` and nothing changes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, overload

import torch

from ubatch import trace
from ubatch.context import dbo_current_ubatch_id
from ubatch.forward_context import maybe_get_forward_context
from ubatch.modular_moe.comm import Handle, WorkHandle
from ubatch.modular_moe.prepare_finalize.emulated_link import AllHandles, EmulatedLink
from ubatch.modular_moe.types import ExpertTokens, Layout

Hook = Callable[[], None]
PrepareReceiver = Callable[[], tuple[ExpertTokens, Any]]
FinalizeReceiver = Callable[[], torch.Tensor]


class WireCounter:
    """Bytes handed to the real collective, by (direction, ubatch): ``add("dispatch", 0, n)``."""

    def __init__(self) -> None:
        self.bytes: Counter[tuple[str, int]] = Counter()

    def add(self, direction: str, nbytes: int) -> None:
        self.bytes[(direction, dbo_current_ubatch_id())] += nbytes

    def total(self, direction: str | None = None) -> int:
        return sum(n for (d, _), n in self.bytes.items() if direction is None or d == direction)

    def reset(self) -> None:
        self.bytes.clear()


class PrepareFinalize(ABC):
    name: str = "base"
    layout: Layout = "contiguous"
    #: yields per MoE layer per ubatch under DBO (asserted by tests; every ubatch must match)
    dbo_yields_per_layer: int = 2

    def __init__(self, num_experts: int, ep_rank: int = 0, ep_size: int = 1, link: EmulatedLink | None = None) -> None:
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
        self.num_experts = num_experts
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.link = link
        self.wire = WireCounter()

    @abstractmethod
    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> tuple[Hook | None, PrepareReceiver]:
        """Start dispatch of ``hidden [T,H]`` routed by global ``topk_ids [T,K]``."""

    def fp8_dispatch_for(self, hidden_size: int) -> str | None:
        """``None`` when :meth:`prepare_fp8_async` can deliver tokens of ``hidden_size`` in FP8, else why not
        (the kernel then dispatches bf16 and says so once)."""
        return f"{self.name} dispatches the activations' own dtype only"

    def prepare_fp8_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          round_scale: bool) -> tuple[Hook | None, PrepareReceiver]:
        """:meth:`prepare_async`, the tokens quantised to FP8 on the way (masked ``ExpertTokens`` with
        ``hidden_scales``, one per token per 128 columns; powers of two when ``round_scale``)."""
        raise NotImplementedError(f"all2all backend {self.name!r} has no FP8 dispatch")

    @abstractmethod
    def finalize_async(self, expert_output: torch.Tensor, state: Any) -> tuple[Hook | None, FinalizeReceiver]:
        """Start combine of the experts' output; the receiver returns ``[T,H]`` (weights applied)."""

    def comm_start(self) -> Any:
        """A device event before a real transfer is posted, when a cuda-clock trace records and no modelled
        link times it; ``None`` otherwise (the common case: one global read)."""
        return None if self.link is not None else device_start()

    @overload
    def _through_link(self, nbytes: int, inner: Handle, label: str, start: Any = None) -> Handle: ...

    @overload
    def _through_link(self, nbytes: int, inner: None, label: str, start: Any = None) -> Handle | None: ...

    def _through_link(self, nbytes: int, inner: Handle | None, label: str, start: Any = None) -> Handle | None:
        if self.link is None:
            if start is not None and inner is not None:
                record_collective_span(start, inner, f"{label}{dbo_current_ubatch_id()}", nbytes)
            return inner
        return self.link.transfer(nbytes, inner, label=f"{label}{dbo_current_ubatch_id()}")

    def traced_hook(self, start: Any, hook: Hook | None, label: str) -> Hook | None:
        """``hook`` followed by an end event on the stream it runs on, closing a comm span opened by
        ``comm_start`` (DeepEP low-latency and V2: the receive finishes once the data has landed, so the span's
        end is when the hook's kernel did). Without ``start`` the hook is returned as is."""
        if start is None:
            return hook
        track, pid = trace.comm_track(dbo_current_ubatch_id()), trace.current_pid()

        def run() -> None:
            if hook is not None:
                hook()
            rec = trace.active()
            if rec is not None:
                rec.span(label, "comm", track, start, rec.device_stamp(), pid=pid)

        return run

    def device_span(self, start: Any, label: str) -> None:
        """Close a comm span opened by ``comm_start`` with an event on the current stream (kernels that run on
        it, or that it already waits for, e.g. DeepEP with ``async_finish=False``)."""
        rec = trace.active()
        if start is not None and rec is not None:
            ubatch = dbo_current_ubatch_id()
            rec.span(f"{label}{ubatch}", "comm", trace.comm_track(ubatch), start, rec.device_stamp())


def device_start() -> Any:
    """A device event on the current stream when a cuda-clock trace records, else ``None``."""
    rec = trace.active()
    return rec.device_stamp() if rec is not None else None


def record_collective_span(start: Any, inner: Handle, label: str, nbytes: int) -> None:
    """The comm span of a posted collective: an end event on this ubatch's tracing stream after it waited for
    the collective (``work.wait()`` with that stream current makes the stream, not the host, wait)."""
    rec = trace.active()
    if rec is None:
        return
    track = trace.comm_track(dbo_current_ubatch_id())
    with rec.on_stream(rec.side_stream(track)):
        _device_wait(inner)
        end = rec.device_stamp()
    rec.span(label, "comm", track, start, end, bytes=nbytes)


def _device_wait(handle: Handle) -> None:
    """Make the current stream wait for ``handle``'s collectives without the host-side trace regions."""
    if isinstance(handle, AllHandles):
        for h in handle.handles:
            _device_wait(h)
    elif isinstance(handle, WorkHandle):
        handle.work.wait()
    else:
        handle.wait()


def real_rows(num_rows: int) -> int:
    """How many of this (micro)batch's ``num_rows`` rows are real, not padding (from CPU-side step metadata).

    Known only when the step carries ``DPMetadata.num_real_tokens`` (the engine's steps do); otherwise,
    e.g. inside a CUDA-graph capture, every row counts.
    """
    fc = maybe_get_forward_context()
    if fc is None or fc.dp_metadata is None or fc.dp_metadata.num_real_tokens is None:
        return num_rows
    start = fc.ubatch_slice.token_slice.start if fc.ubatch_slice is not None else 0
    return max(0, min(num_rows, fc.dp_metadata.num_real_tokens - start))


def routed_bytes(hidden: torch.Tensor, top_k: int) -> int:
    """Bytes the emulated link charges per direction for ``hidden [T,H]``: every routed copy of a real row.

    This models the wide-EP regime (almost every expert is remote) and needs no device sync, so it works
    unchanged inside a CUDA graph and is identical for every backend and world size. Padding rows are
    routed nowhere and cost nothing.
    """
    return real_rows(hidden.shape[0]) * top_k * hidden.shape[-1] * hidden.element_size()


def pick_group(groups: Sequence[Any]) -> Any:
    """Each ubatch issues its collectives on its own group, so ranks never pair up different ubatches."""
    ubatch = dbo_current_ubatch_id()
    if ubatch >= len(groups):
        raise ValueError(f"ubatch {ubatch} has no process group: {len(groups)} EP groups were given; "
                         "create one EP group per ubatch")
    return groups[ubatch]
