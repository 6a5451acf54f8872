"""Real DeepEP backends (``deepep_low_latency``, ``deepep_high_throughput``); imported only when selected.

``deep_ep`` needs CUDA, NVSHMEM and NVLink/RDMA, and at least two GPUs for high-throughput mode; it
cannot be installed on a CPU machine. Selecting these backends without it raises a clear ImportError
instead of falling back to something else.

``deep_ep_module`` hands the adapters a module with DeepEP's API explicitly (the tests pass their CPU
stand-in, ``tests/standins/deep_ep.py``); only the default, the real package, is checked for CUDA. The
adapters check what DeepEP's kernels require of their inputs (bf16 activations, the LL token count being
a multiple of 4 across ranks) up front, so a misconfigured model fails with the setting to change rather
than with an ``EP_HOST_ASSERT`` from inside DeepEP.

For experts that take FP8 activations (DeepGEMM's) the low-latency dispatch runs with ``use_fp8=True``: DeepEP
casts each token per 128 columns on the send side (half the bytes on the wire) and the masked buffer arrives as
values plus fp32 scales, which the experts hand to DeepGEMM's masked GEMM as they are (the kernel chooses,
``FusedMoEModularKernel._fp8_dispatch``). The combine stays bf16.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ubatch.context import (
    dbo_current_ubatch_id,
    dbo_get_previous_event,
    dbo_num_ubatches,
    dbo_switch_to_comm,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)
from ubatch.modular_moe.prepare_finalize.base import (
    FinalizeReceiver,
    Hook,
    PrepareFinalize,
    PrepareReceiver,
    device_start,
)
from ubatch.modular_moe.types import ExpertTokens

FP8_DISPATCH_HIDDEN_MULTIPLE = 512  # DeepEP's low_latency_dispatch: EP_HOST_ASSERT(hidden % 512 == 0) with use_fp8


def import_deep_ep() -> Any:
    """The real ``deep_ep`` package, on a CUDA machine; a clear error otherwise."""
    try:
        import deep_ep
    except ImportError as exc:
        raise ImportError(
            "the DeepEP all2all backends need the 'deep_ep' package (CUDA GPUs; pip install sgl-deep-ep for "
            "the prebuilt wheel, cp312 + CUDA 13 with the torch it pins, or build "
            "https://github.com/deepseek-ai/DeepEP), which is not importable here; choose "
            "--all2all-backend torch_ll, torch_ht or auto_torch instead") from exc
    if not torch.cuda.is_available():
        raise RuntimeError("the DeepEP all2all backends need CUDA GPUs; none is available")
    return deep_ep


def _check_bf16(hidden: torch.Tensor, backend: str) -> None:
    if hidden.dtype != torch.bfloat16:
        raise ValueError(f"{backend}: DeepEP's kernels take bf16 activations, got {hidden.dtype}; run the model in "
                         "bfloat16 (or choose --all2all-backend torch_ll / torch_ht)")


class DeepEPLowLatency(PrepareFinalize):
    """DeepEP LL: sends only, receive in the hook; one handle per ubatch (the RDMA buffer has two slots)."""

    name = "deepep_low_latency"
    layout = "masked"
    dbo_yields_per_layer = 2

    def __init__(self, num_experts: int, ep_rank: int, ep_size: int, groups: Sequence[Any], hidden_size: int,
                 max_dispatch_tokens_per_rank: int, link: Any = None, deep_ep_module: Any = None) -> None:
        super().__init__(num_experts, ep_rank, ep_size, link)
        if (ep_size * max_dispatch_tokens_per_rank) % 4:
            raise ValueError(f"deepep_low_latency: ep_size ({ep_size}) x max_dispatch_tokens_per_rank "
                             f"({max_dispatch_tokens_per_rank}) must be a multiple of 4 (DeepEP's TMA receive layout); "
                             "raise --max-dispatch-tokens-per-rank")
        deep_ep = deep_ep_module if deep_ep_module is not None else import_deep_ep()
        self.capacity = max_dispatch_tokens_per_rank
        rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(self.capacity, hidden_size, ep_size, num_experts)
        self.buffer = deep_ep.Buffer(groups[0], num_nvl_bytes=0, num_rdma_bytes=rdma_bytes, low_latency_mode=True,
                                     num_qps_per_rank=self.num_local_experts)
        self.handles: list[Any] = [None, None]

    def fp8_dispatch_for(self, hidden_size: int) -> str | None:
        if hidden_size % FP8_DISPATCH_HIDDEN_MULTIPLE:
            return (f"DeepEP's FP8 low-latency dispatch needs the hidden size to be a multiple of "
                    f"{FP8_DISPATCH_HIDDEN_MULTIPLE}, got {hidden_size}")
        return None

    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> tuple[Hook | None, PrepareReceiver]:
        return self._dispatch(hidden, topk_weights, topk_ids, use_fp8=False, round_scale=False)

    def prepare_fp8_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          round_scale: bool) -> tuple[Hook | None, PrepareReceiver]:
        """DeepEP quantises each token per 128 columns as it sends (fp32 scales, rounded up to powers of two with
        ``round_scale``) and the receive hands over ``(fp8 [E_local, capacity, H], scales [E_local, capacity,
        H / 128])``, the scales column-major for TMA, as DeepGEMM's masked GEMM reads them."""
        reason = self.fp8_dispatch_for(hidden.shape[-1])
        if reason is not None:
            raise ValueError(f"{self.name}: {reason}")
        return self._dispatch(hidden, topk_weights, topk_ids, use_fp8=True, round_scale=round_scale)

    def _dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, use_fp8: bool,
                  round_scale: bool) -> tuple[Hook | None, PrepareReceiver]:
        if dbo_num_ubatches() > 2:
            raise ValueError("DeepEP low-latency mode holds at most two ubatches in flight (two RDMA buffer slots)")
        if hidden.shape[0] > self.capacity:
            raise ValueError(f"deepep_low_latency: {hidden.shape[0]} tokens exceed "
                             f"num_max_dispatch_tokens_per_rank={self.capacity}")
        _check_bf16(hidden, self.name)
        start = device_start()  # cuda trace clock: send kernel to the receive hook's kernel is the comm span
        recv_x, recv_count, handle, _event, hook = self.buffer.low_latency_dispatch(
            hidden, topk_ids, self.capacity, self.num_experts, use_fp8=use_fp8, round_scale=round_scale,
            async_finish=False, return_recv_hook=True)
        hook = self.traced_hook(start, hook, f"dispatch{dbo_current_ubatch_id()}")
        self.handles[dbo_current_ubatch_id()] = handle
        state = (topk_ids, topk_weights, dbo_current_ubatch_id())
        if use_fp8:
            values, scales = recv_x
            return hook, lambda: (ExpertTokens("masked", values, expert_num_tokens=recv_count,
                                               hidden_scales=scales), state)
        return hook, lambda: (ExpertTokens("masked", recv_x, expert_num_tokens=recv_count), state)

    def finalize_async(self, expert_output: torch.Tensor, state: Any) -> tuple[Hook | None, FinalizeReceiver]:
        topk_ids, topk_weights, ubatch = state
        start = device_start()
        combined, _event, hook = self.buffer.low_latency_combine(
            expert_output, topk_ids, topk_weights, self.handles[ubatch], async_finish=False, return_recv_hook=True)
        return self.traced_hook(start, hook, f"combine{ubatch}"), lambda: combined


class DeepEPHighThroughput(PrepareFinalize):
    """DeepEP HT: explicit stream choreography, ``previous_event`` captured *before* the yield (vLLM #38451)."""

    name = "deepep_high_throughput"
    layout = "contiguous"
    dbo_yields_per_layer = 3

    def __init__(self, num_experts: int, ep_rank: int, ep_size: int, groups: Sequence[Any], hidden_size: int,
                 link: Any = None, num_nvl_bytes: int = 1 << 30, deep_ep_module: Any = None) -> None:
        super().__init__(num_experts, ep_rank, ep_size, link)
        deep_ep = deep_ep_module if deep_ep_module is not None else import_deep_ep()
        self.buffer = deep_ep.Buffer(groups[0], num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=0)
        self.handles: list[Any] = [None] * 2

    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> tuple[Hook | None, PrepareReceiver]:
        _check_bf16(hidden, self.name)  # the dispatch copies any dtype, but the combine reduces bf16 only
        previous_event = dbo_get_previous_event(self.buffer.capture)
        dbo_yield_and_switch_from_compute_to_comm()
        start = device_start()  # on the comm stream; async_finish=False leaves it waiting for DeepEP's kernels
        per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk_ids, self.num_experts, previous_event=previous_event, async_finish=False)
        recv_x, recv_ids, recv_w, _counts, handle, _ = self.buffer.dispatch(
            hidden, topk_idx=topk_ids, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=previous_event, async_finish=False)
        ubatch = dbo_current_ubatch_id()
        self.handles[ubatch] = handle
        self.device_span(start, "dispatch")
        dbo_switch_to_compute_sync()
        return None, lambda: (ExpertTokens("contiguous", recv_x, recv_ids, recv_w), (hidden.shape, ubatch))

    def finalize_async(self, expert_output: torch.Tensor, state: Any) -> tuple[Hook | None, FinalizeReceiver]:
        _shape, ubatch = state
        previous_event = dbo_get_previous_event(self.buffer.capture)
        dbo_yield_and_switch_from_compute_to_comm()
        start = device_start()
        combined, _w, _event = self.buffer.combine(expert_output, self.handles[ubatch],
                                                   previous_event=previous_event, async_finish=False)
        self.device_span(start, "combine")
        dbo_switch_to_compute()

        def receiver() -> torch.Tensor:
            dbo_switch_to_comm()
            dbo_yield_and_switch_from_comm_to_compute()
            return combined

        return None, receiver
