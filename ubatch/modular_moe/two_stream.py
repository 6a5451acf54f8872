"""The two-stream SBO runtime: one MoE call's combine on an alternate stream, beside compute.

``ubatch.sbo`` decides *which* SBO modes run and how the SMs are split; this module is what the kernel runs
when a two-stream mode (``combine_shared_experts``, ``combine_down_gemm``) is on. It follows SGLang's
``combine_a``/``combine_b`` split (``python/sglang/srt/layers/moe/token_dispatcher/deepep.py``): the
combine is launched on the alternate stream once the main stream says the expert output is ready, the
shared experts (or the rest of the down GEMM) run on the main stream meanwhile, and the two streams join
before the combined output is read.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ubatch import streams
from ubatch.sbo import MIN_BLOCK_M, DeviceProps, SboFlags, compute_overlap_args

if TYPE_CHECKING:
    from ubatch.modular_moe.types import ExpertTokens


@dataclass
class CombineOverlapArgs:
    """What a signal-capable combine consumes (DeepEP LL: ``num_sms``, ``comp_signal``, block_m, threshold)."""

    overlap: bool  # chase the down GEMM through ``signal`` (else start after it)
    stream: streams.Stream
    wait_event: streams.Event
    num_sms: int | None
    signal: torch.Tensor | None = None
    block_m: int = MIN_BLOCK_M
    threshold: int = 0


@dataclass
class DownGemmOverlapArgs:
    """What a signal-capable down GEMM consumes: record ``start_event`` at launch, bump ``signal`` per tile."""

    num_sms: int
    signal: torch.Tensor
    start_event: streams.Event


_alt_streams: dict[str, streams.Stream] = {}
_alt_lock = threading.Lock()


def alt_stream(device: torch.device | str | None = None) -> streams.Stream:
    """One SBO alternate stream per device, shared by layers and ubatches (like SGLang's ``alt_stream``)."""
    dev = streams.resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    with _alt_lock:
        if key not in _alt_streams:
            _alt_streams[key] = streams.new_stream(dev, name="sbo-alt")
        return _alt_streams[key]


@contextlib.contextmanager
def deep_gemm_num_sms(n: int | None) -> Iterator[None]:
    """Cap DeepGEMM at ``n`` SMs inside the block (SGLang's ``configure_deep_gemm_num_sms``).

    Only touches ``deep_gemm`` if an experts backend already imported it, so CPU runs never import it.
    """
    dg = sys.modules.get("deep_gemm")
    if n is None or dg is None or not hasattr(dg, "set_num_sms"):
        yield
        return
    previous = dg.get_num_sms() if hasattr(dg, "get_num_sms") else None
    dg.set_num_sms(n)
    try:
        yield
    finally:
        if previous is not None:
            dg.set_num_sms(previous)


def _accepts_overlap_args(obj: Any) -> bool:
    return callable(getattr(obj, "set_sbo_overlap_args", None))


def static_tokens(tokens: ExpertTokens) -> int:
    """The token dimension the down GEMM tiles over: the masked capacity, or the contiguous row count."""
    return tokens.hidden.shape[1] if tokens.layout == "masked" else tokens.hidden.shape[0]


class TwoStreamCombine:
    """One MoE call's combine on the SBO alternate stream, beside the down GEMM or the shared experts.

    Protocol (SGLang ``combine_a``/``combine_b``): the main stream records ``ready`` -- at the down GEMM's
    start when both the experts and the all-to-all backend speak the tile-signal protocol (they expose
    ``set_sbo_overlap_args``), else after the down GEMM; the alternate stream waits for ``ready`` and
    launches the combine with ``comm_sms`` SMs; the main stream meanwhile computes with the rest; before the
    receive the alternate stream waits for the main one, and after it the main stream waits for the
    alternate one. Tensors crossing streams (the experts' output, the backend's state) stay referenced by
    the kernel until that final join, so the caching allocator cannot recycle them early.

    ``set_sbo_overlap_args(args | None)`` is called on the calling ubatch just before (and cleared just
    after) the experts' ``apply`` / the backend's ``finalize_async``; a backend that yields inside those
    must keep the args per ``dbo_current_ubatch_id()``. No backend in this repository implements it yet.
    """

    def __init__(self, flags: SboFlags, prepare_finalize: Any, experts: Any, tokens: ExpertTokens,
                 device: torch.device) -> None:
        self.flags = flags
        self.pf = prepare_finalize
        self.experts = experts
        args = compute_overlap_args(
            DeviceProps.of(device), flags, all2all_backend=prepare_finalize.name, experts_backend=experts.name,
            num_local_experts=prepare_finalize.num_local_experts, num_tokens=static_tokens(tokens))
        assert args is not None  # flags.two_stream
        self.args = args
        self.main = streams.current_stream(device)
        self.alt = alt_stream(device)
        self.ready = streams.new_event(device)
        self.signal_protocol = (flags.combine_down_gemm and self.args.signal_numel > 0
                                and _accepts_overlap_args(experts) and _accepts_overlap_args(prepare_finalize))
        self.signal = (torch.zeros(self.args.signal_numel, dtype=self.args.signal_dtype, device=device)
                       if self.signal_protocol else None)

    def run_experts(self, apply: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The experts (whose last GEMM is the down GEMM), then mark where the combine may start."""
        cap = self.args.deep_gemm_num_sms if self.signal_protocol else None  # only a chased GEMM shares SMs
        if self.signal_protocol:
            assert self.signal is not None
            self.experts.set_sbo_overlap_args(
                DownGemmOverlapArgs(self.args.compute_sms, self.signal, self.ready))  # it records ``ready``
        try:
            with deep_gemm_num_sms(cap):
                out = apply()
        finally:
            if self.signal_protocol:
                self.experts.set_sbo_overlap_args(None)
        if not self.signal_protocol:
            streams.record(self.ready, self.main)  # no tile signal: start only after the down GEMM
        return out

    def launch_combine(self, finalize: Callable[[], Any]) -> Any:
        """``finalize()`` (the backend's ``finalize_async``) with the alternate stream current."""
        accepts = _accepts_overlap_args(self.pf)
        if accepts:
            self.pf.set_sbo_overlap_args(CombineOverlapArgs(
                self.signal_protocol, self.alt, self.ready, self.args.deepep_num_sms or self.args.comm_sms,
                self.signal, self.args.block_m, self.args.threshold if self.signal_protocol else 0))
        streams.wait(self.ready, self.alt)
        try:
            with streams.stream(self.alt):
                return finalize()
        finally:
            if accepts:
                self.pf.set_sbo_overlap_args(None)

    def run_shared(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The shared experts on the main stream, capped to the compute SMs while the combine flies."""
        with deep_gemm_num_sms(self.args.deep_gemm_num_sms):
            return fn()

    def before_receive(self) -> None:
        streams.wait_stream(self.alt, self.main)

    def after_receive(self) -> None:
        streams.wait_stream(self.main, self.alt)
