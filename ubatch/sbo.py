"""Single-batch overlap (SBO): hide one MoE layer's all-to-all behind that same batch's compute.

Modes (SGLang's ``--enable-single-batch-overlap``): ``dispatch_shared_experts`` (shared experts while the
dispatch flies; one stream, works anywhere), ``combine_shared_experts`` (two streams, SMs reserved for the
combine) and ``combine_down_gemm`` (the combine chases the down GEMM on a signal). This file holds the pure
decisions (which modes, how many SMs); the stream runtime is ``ubatch.modular_moe.two_stream``.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ubatch import streams

ENV_COMM_SMS = "UBATCH_SBO_COMM_SMS"  # SGLang: SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS
ENV_SHARED_EXPERTS_OUTSIDE = "UBATCH_SBO_SHARED_EXPERTS_OUTSIDE"  # SGLang: ..._OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO
HOPPER_COMM_SMS = 3  # LL combine-send needs very few SMs on Hopper
BLACKWELL_COMM_SMS = 32  # Blackwell has SMs to spare, and its combine is faster with more
MIN_BLOCK_M = 64  # WGMMA block_m: the Hopper down GEMM signals once per 64-row tile per expert

# torch.distributed all-to-alls (NCCL on GPU, gloo on CPU): they can neither be confined to a few SMs nor
# chase a tile signal, so like SGLang's NCCL-EP backend they use the one-stream dispatch overlap everywhere.
# "auto_torch" names the phase-aware torch pair; "auto" is kept here as before (it is that pair unless DeepEP V2
# is installed).
_COLLECTIVE_BACKENDS = ("torch_ll", "torch_ht", "auto_torch", "auto")
# The one all-to-all whose combine chases the down GEMM's tile signal (DeepEP V1 LL's ``comp_signal``).
_COMBINE_SIGNAL_BACKENDS = ("deepep_low_latency",)
# DeepEP V2 (``ElasticBuffer``): one stream or two, like V1 HT, but its ``combine`` takes no ``comp_signal``,
# so ``combine_down_gemm`` -- DeepEP's tile-chasing combine -- cannot run on it and is refused, not degraded.
_NO_DOWN_GEMM_BACKENDS = ("deepep_v2",)


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
    def cpu(cls) -> DeviceProps:
        return cls("cpu", "cpu")

    @classmethod
    def of(cls, device: torch.device | str | None = None) -> DeviceProps:
        """Properties of a real device (``None``: the accelerator if any, else the CPU)."""
        dev = streams.resolve_device(device)
        if dev.type != "cuda":
            return cls.cpu()
        return _cuda_props(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.cache
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
      whose kernels speak the tile-signal protocol (SGLang also allows flashinfer_cutedsl, absent here;
      ``torch._grouped_mm``, behind the ``grouped_mm`` experts, has no tile signal).
    - ``deepep_v2`` follows V1 HT: ``dispatch_shared_experts`` off Blackwell, ``combine_shared_experts`` on it,
      never ``combine_down_gemm`` (:func:`check_sbo_modes` refuses it when forced). ``auto`` counts as a
      collective backend here (it may resolve to ``deepep_v2`` at run time, which runs that mode too).

    ``experts_backend`` matters only when it is ``deep_gemm``; ``auto`` never resolves to it, so an unresolved
    ``auto`` gives the same modes as the backend it becomes.
    """
    env = os.environ if env is None else env
    if not enable_single_batch_overlap or (all2all_backend == "none" and not emulate_link):
        return SBO_OFF
    dispatch_shared = all2all_backend in _COLLECTIVE_BACKENDS or not device.is_blackwell
    combine_shared = device.is_cuda and not dispatch_shared and not _env_flag(env, ENV_SHARED_EXPERTS_OUTSIDE)
    down_gemm = (device.is_cuda and not device.is_blackwell and all2all_backend in _COMBINE_SIGNAL_BACKENDS
                 and experts_backend == "deep_gemm")
    return SboFlags(combine_down_gemm=down_gemm, combine_shared_experts=combine_shared,
                    dispatch_shared_experts=dispatch_shared)


def check_sbo_modes(flags: SboFlags, all2all_backend: str) -> None:
    """Refuse a forced mode the backend cannot run; the MoE kernel checks the backend it really uses (``auto``
    resolved) when it is built, before any dispatch.

    ``combine_down_gemm`` on ``deepep_v2``: ``ElasticBuffer.combine`` has no ``comp_signal`` to chase the down
    GEMM. (Forced on the torch backends it stays the combine-after-the-down-GEMM the CPU tests drive.)
    """
    if flags.combine_down_gemm and all2all_backend in _NO_DOWN_GEMM_BACKENDS:
        raise ValueError(f"SBO mode combine_down_gemm cannot run on all2all backend {all2all_backend!r}: its combine "
                         "takes no comp_signal to chase the down GEMM; use dispatch_shared_experts or "
                         "combine_shared_experts")


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
    ``None`` when DeepGEMM is not the experts backend (the ``grouped_mm``, ``triton`` and ``torch`` experts
    take no SM cap: their kernels may use the combine's SMs). ``signal_numel == 0``: no down-GEMM signal.
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
