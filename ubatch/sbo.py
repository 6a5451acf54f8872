"""Single-batch overlap (SBO): hide one MoE layer's all-to-all behind that same batch's compute.

DBO needs two micro-batches to have something to overlap; SBO does not split the batch. It overlaps a
layer's communication with compute of the *same* tokens that does not depend on it (SGLang
``--enable-single-batch-overlap``; seeds/000 §4, reference/sglang_tbo_sbo.md §5). Three modes:

- ``dispatch_shared_experts`` (one stream): start the dispatch, run the shared experts while it is on the
  wire, only then run its receive hook. Works anywhere, CPU included, because the dispatch's in-flight
  time needs no compute units (RDMA posts, a NIC, the emulated link).
- ``combine_shared_experts`` (two streams): the combine runs on an alternate stream with a few SMs
  reserved for it while the shared experts run on the main stream with the rest.
- ``combine_down_gemm`` (two streams + a signal): the combine chases the down GEMM tile by tile; the GEMM
  bumps a per-(expert, block_m tile) signal the combine kernel spins on (DeepGEMM masked GEMM with overlap
  args + DeepEP LL combine with ``comp_signal``).

The two-stream modes only pay off on a GPU, where kernels on two streams really run at once and the SMs
can be partitioned. On CPU their streams are :class:`ubatch.streams.NullStream` and every record/wait is
a no-op, so the same code runs (and is tested) without changing a single result.

This file holds the pure decisions (which modes, how many SMs; table-tested with fake device properties)
and the small stream/event runtime the kernel calls (:class:`TwoStreamCombine`).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch

from ubatch import streams

if TYPE_CHECKING:
    from ubatch.modular_moe.config import MoEParallelConfig
    from ubatch.modular_moe.types import ExpertTokens

ENV_COMM_SMS = "UBATCH_SBO_COMM_SMS"  # SGLang: SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS
ENV_SHARED_EXPERTS_OUTSIDE = "UBATCH_SBO_SHARED_EXPERTS_OUTSIDE"  # SGLang: ..._OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO
HOPPER_COMM_SMS = 3  # LL combine-send needs very few SMs on Hopper
BLACKWELL_COMM_SMS = 32  # Blackwell has SMs to spare, and its combine is faster with more
MIN_BLOCK_M = 64  # WGMMA block_m: the Hopper down GEMM signals once per 64-row tile per expert
SBO_EXTRA_KEY = "sbo"  # where a MoEParallelConfig carries its SboFlags (``parallel.extra["sbo"]``)

# torch.distributed all-to-alls (NCCL on GPU, gloo on CPU): they can neither be confined to a few SMs nor
# chase a tile signal, so like SGLang's NCCL-EP backend they use the one-stream dispatch overlap everywhere.
_COLLECTIVE_BACKENDS = ("torch_ll", "torch_ht")


@dataclass(frozen=True)
class DeviceProps:
    """The few device facts SBO decides on; a plain dataclass so tests can fake a Hopper or a Blackwell."""

    kind: str  # "cuda" or "cpu"
    name: str = ""
    capability: tuple[int, int] = (0, 0)
    sm_count: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def is_blackwell(self) -> bool:
        """sm100 and later (SGLang's ``is_blackwell``): enough SMs to give the combine its own 32."""
        return self.is_cuda and self.capability[0] >= 10

    @classmethod
    def cpu(cls) -> "DeviceProps":
        return cls("cpu", "cpu")

    @classmethod
    def of(cls, device: torch.device | str | None = None) -> "DeviceProps":
        """Properties of a real device (``None``: the accelerator if any, else the CPU)."""
        dev = streams.resolve_device(device)
        if dev.type != "cuda":
            return cls.cpu()
        return _cuda_props(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_props(index: int) -> DeviceProps:
    p = torch.cuda.get_device_properties(index)
    return DeviceProps("cuda", p.name, (p.major, p.minor), p.multi_processor_count)


@dataclass(frozen=True)
class SboFlags:
    """Which SBO modes a layer uses. All off is plain execution (shared experts while the combine flies)."""

    combine_down_gemm: bool = False
    combine_shared_experts: bool = False
    dispatch_shared_experts: bool = False

    def __post_init__(self) -> None:
        if self.combine_shared_experts and self.dispatch_shared_experts:
            raise ValueError("the shared experts run once per layer: enable combine_shared_experts or "
                             "dispatch_shared_experts, not both")

    @property
    def enabled(self) -> bool:
        return self.combine_down_gemm or self.combine_shared_experts or self.dispatch_shared_experts

    @property
    def two_stream(self) -> bool:
        """The combine goes to the SBO alternate stream (and the SM partition applies)."""
        return self.combine_down_gemm or self.combine_shared_experts

    @property
    def fuse_shared_experts_inside_sbo(self) -> bool:
        return self.combine_shared_experts or self.dispatch_shared_experts

    def describe(self) -> str:
        on = [n for n in ("dispatch_shared_experts", "combine_shared_experts", "combine_down_gemm") if getattr(self, n)]
        return "+".join(on) if on else "off"


SBO_OFF = SboFlags()


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def select_sbo_modes(enable_single_batch_overlap: bool, *, all2all_backend: str, experts_backend: str,
                     device: DeviceProps, emulate_link: bool = False,
                     env: Mapping[str, str] | None = None) -> SboFlags:
    """The modes ``--enable-single-batch-overlap`` turns on for these backends on this device.

    SGLang's rules (``SboFlags`` @0ac832c3), mapped onto this project's backends:
    - nothing to hide (``none`` backend, no emulated link): all off;
    - ``dispatch_shared_experts``: torch.distributed backends (SGLang's NCCL-EP case), or any non-Blackwell
      device (Hopper, and the CPU);
    - ``combine_shared_experts``: a GPU, not the dispatch mode (so Blackwell with DeepEP), unless
      ``UBATCH_SBO_SHARED_EXPERTS_OUTSIDE`` keeps the shared experts out of SBO;
    - ``combine_down_gemm``: a non-Blackwell GPU with DeepEP low-latency + DeepGEMM experts, the only pair
      whose kernels speak the tile-signal protocol (SGLang also allows flashinfer_cutedsl, absent here).
    """
    env = os.environ if env is None else env
    if not enable_single_batch_overlap or (all2all_backend == "none" and not emulate_link):
        return SBO_OFF
    dispatch_shared = all2all_backend in _COLLECTIVE_BACKENDS or not device.is_blackwell
    combine_shared = device.is_cuda and not dispatch_shared and not _env_flag(env, ENV_SHARED_EXPERTS_OUTSIDE)
    down_gemm = (device.is_cuda and not device.is_blackwell and all2all_backend == "deepep_low_latency"
                 and experts_backend == "deep_gemm")
    return SboFlags(combine_down_gemm=down_gemm, combine_shared_experts=combine_shared,
                    dispatch_shared_experts=dispatch_shared)


def comm_sm_count(device: DeviceProps, env: Mapping[str, str] | None = None) -> int:
    """SMs reserved for the combine: ``UBATCH_SBO_COMM_SMS``, else 32 on Blackwell, 3 before; 0 on CPU."""
    if not device.is_cuda:
        return 0
    env = os.environ if env is None else env
    raw = env.get(ENV_COMM_SMS, "").strip()
    if not raw:
        return BLACKWELL_COMM_SMS if device.is_blackwell else HOPPER_COMM_SMS
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_COMM_SMS}={raw!r} is not an integer SM count") from None
    if not 1 <= n < device.sm_count:
        raise ValueError(f"{ENV_COMM_SMS}={n} must be in [1, {device.sm_count - 1}] on {device.name or 'this GPU'} "
                         f"({device.sm_count} SMs): the combine needs at least one SM and the compute too")
    return n


@dataclass(frozen=True)
class OverlapArgs:
    """The SM partition and signal shape of one two-stream SBO call (SGLang's ``compute_overlap_args``).

    ``deepep_num_sms``: the SM count to hand DeepEP (LL: the combine's ``num_sms``; HT: the class-wide
    ``Buffer.set_num_sms``, which must be even) -- ``None`` when DeepEP is not the backend.
    ``deep_gemm_num_sms``: the ``deep_gemm.set_num_sms`` cap for the compute running beside the combine --
    ``None`` when DeepGEMM is not the experts backend. ``signal_numel == 0``: no down-GEMM signal.
    """

    comm_sms: int
    compute_sms: int
    deepep_num_sms: int | None = None
    deep_gemm_num_sms: int | None = None
    signal_numel: int = 0
    signal_dtype: torch.dtype | None = None
    block_m: int = MIN_BLOCK_M
    threshold: int = 0  # the combine sends a tile once its signal reaches this (compute SMs that write it)


def compute_overlap_args(device: DeviceProps, flags: SboFlags, *, all2all_backend: str = "none",
                         experts_backend: str = "torch", num_local_experts: int = 0, num_tokens: int = 0,
                         env: Mapping[str, str] | None = None) -> OverlapArgs | None:
    """How to split the SMs between combine and compute; ``None`` when no two-stream mode is on.

    ``num_tokens`` is the static token dimension of the experts' buffer (``T_static``: the masked layout's
    per-expert capacity), which sizes the Hopper signal: one int32 per (local expert, 64-row tile). On
    Blackwell the GEMM signals once per expert (uint32). Vector (SGLang's test): Hopper, 132 SMs, 64 local
    experts, 32 tokens -> comm 3, compute 129, signal int32 x 64.
    """
    if not flags.two_stream:
        return None
    comm = comm_sm_count(device, env)
    deepep: int | None = None
    if device.is_cuda and all2all_backend == "deepep_low_latency":
        deepep = comm
    elif device.is_cuda and all2all_backend == "deepep_high_throughput":
        deepep = comm + comm % 2  # Buffer.set_num_sms asserts an even count
    compute = device.sm_count - (deepep if deepep is not None else comm)
    deep_gemm = compute if device.is_cuda and experts_backend == "deep_gemm" else None
    if not flags.combine_down_gemm:
        return OverlapArgs(comm, compute, deepep, deep_gemm)
    if device.is_blackwell:
        numel, dtype = num_local_experts, torch.uint32
    else:
        numel, dtype = num_local_experts * math.ceil(num_tokens / MIN_BLOCK_M), torch.int32
    return OverlapArgs(comm, compute, deepep, deep_gemm, numel, dtype, MIN_BLOCK_M, threshold=compute)


# ---- carrying the flags on a config --------------------------------------------------------------------
def enable_sbo(parallel: "MoEParallelConfig", flags: SboFlags | None = None,
               device: torch.device | str | None = None) -> SboFlags:
    """Turn SBO on for every layer built from ``parallel``; returns the flags stored.

    ``flags=None`` is ``--enable-single-batch-overlap``: the modes are chosen by :func:`select_sbo_modes`
    for ``parallel``'s backends on ``device`` (default: the accelerator, else CPU). Pass ``SboFlags(...)``
    to force modes (e.g. the two-stream ones on CPU, where they run as no-ops).
    """
    if flags is None:
        flags = select_sbo_modes(True, all2all_backend=parallel.all2all_backend,
                                 experts_backend=parallel.experts_backend, device=DeviceProps.of(device),
                                 emulate_link=parallel.emulate_link is not None)
    if not isinstance(flags, SboFlags):
        raise TypeError(f"SBO flags must be an SboFlags, got {type(flags).__name__}")
    parallel.extra[SBO_EXTRA_KEY] = flags
    return flags


def sbo_flags(parallel: "MoEParallelConfig") -> SboFlags:
    """The flags ``parallel`` carries (all off unless :func:`enable_sbo` or ``extra={"sbo": ...}`` set them)."""
    flags = parallel.extra.get(SBO_EXTRA_KEY, SBO_OFF)
    if not isinstance(flags, SboFlags):
        raise TypeError(f"MoEParallelConfig.extra[{SBO_EXTRA_KEY!r}] must be an SboFlags, got {type(flags).__name__}")
    return flags


def apply_sbo(model: torch.nn.Module, flags: SboFlags | None = None) -> int:
    """Set the SBO flags of every FusedMoE kernel in ``model`` (``None``: each layer's config flags).

    Needed while ``FusedMoE`` does not pass ``sbo_flags(self.parallel)`` to its kernel itself. Builds the
    kernels, so call it where the EP process groups exist (on the rank). Returns the number of layers set.
    """
    from ubatch.modular_moe.layer import FusedMoE  # local: layer -> kernel -> this module

    count = 0
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.kernel.sbo = flags if flags is not None else sbo_flags(module.parallel)
            count += 1
    return count


# ---- runtime: the two-stream combine -------------------------------------------------------------------
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


def static_tokens(tokens: "ExpertTokens") -> int:
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

    def __init__(self, flags: SboFlags, prepare_finalize: Any, experts: Any, tokens: "ExpertTokens",
                 device: torch.device) -> None:
        self.flags = flags
        self.pf = prepare_finalize
        self.experts = experts
        self.args = compute_overlap_args(
            DeviceProps.of(device), flags, all2all_backend=prepare_finalize.name, experts_backend=experts.name,
            num_local_experts=prepare_finalize.num_local_experts, num_tokens=static_tokens(tokens))
        assert self.args is not None  # flags.two_stream
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
        self.alt.wait_stream(self.main)

    def after_receive(self) -> None:
        self.main.wait_stream(self.alt)
