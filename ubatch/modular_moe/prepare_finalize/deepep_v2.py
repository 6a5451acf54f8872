"""DeepEP V2 backend (``deepep_v2``) over ``deep_ep.ElasticBuffer``; imported only when selected.

One ``ElasticBuffer`` for every layer and ubatch (V2 runs every buffer's kernels on one comm stream), each
handle bound to the ubatch that dispatched it; DBO yields between a launch and ``event.current_stream_wait()``.
``do_cpu_sync`` only on eager prefill steps, masking unwritten rows on the device otherwise; cached handles
(``static_routing``) are opt-in and checked on the device; SBO as V1's high-throughput mode, with
``combine_down_gemm`` refused (no ``comp_signal``). Tested over ``tests/standins/deep_ep_v2.py`` under the
stream sanitizer. Design: docs/design_notes.md, "MoE layer and the DBO runtime".
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.context import dbo_current_ubatch_id
from ubatch.forward_context import maybe_get_forward_context
from ubatch.modular_moe.prepare_finalize.base import (
    FinalizeReceiver,
    Hook,
    PrepareFinalize,
    PrepareReceiver,
    device_start,
)
from ubatch.modular_moe.prepare_finalize.deepep import _check_bf16, import_deep_ep
from ubatch.modular_moe.types import ExpertTokens

INSTALL_HINT = ("pip install sgl-deep-ep (prebuilt DeepEP V2, cp312 + CUDA 13; 0.1.0-0.1.2 pin torch 2.13.0, "
                "0.1.2.post1 pins torch 2.14.1), or build github.com/deepseek-ai/DeepEP from source")


def import_deep_ep_v2() -> Any:
    """The real ``deep_ep`` with ``ElasticBuffer`` (DeepEP V2), on a CUDA machine; a clear error otherwise."""
    deep_ep = import_deep_ep()
    if not hasattr(deep_ep, "ElasticBuffer"):
        raise ImportError(f"deep_ep {getattr(deep_ep, '__version__', '?')} has no ElasticBuffer (DeepEP V2): "
                          f"{INSTALL_HINT}; or choose --all2all-backend deepep_low_latency / "
                          "deepep_high_throughput / auto_deepep_v1 for the V1 API")
    return deep_ep


@functools.lru_cache(maxsize=1)
def deep_ep_v2_status() -> tuple[bool, str]:
    """Whether the real DeepEP V2 can run here, and why (for ``auto``'s one-line log).

    Not installed, or installed without what it needs (the wheel raises ``ImportError`` when torch's CUDA
    or the GPU is missing): ``(False, reason)``. Any other error while importing a present ``deep_ep`` is a
    broken install and propagates; ``auto`` does not paper over it. Asked once per process (``auto`` asks
    every step, and a failed import is not cached by Python).
    """
    try:
        import deep_ep
    except ImportError as exc:
        return False, f"deep_ep is not importable ({exc})"
    if not hasattr(deep_ep, "ElasticBuffer"):
        return False, f"deep_ep {getattr(deep_ep, '__version__', '?')} has no ElasticBuffer (V1 only)"
    if not torch.cuda.is_available():
        return False, "deep_ep V2 is installed but no CUDA device is available"
    return True, f"deep_ep {getattr(deep_ep, '__version__', '?')} with ElasticBuffer and CUDA"


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on this thread's current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _prefill_step() -> bool:
    """This step's DP vote agreed that some rank runs a prefill (the same answer on every rank)."""
    fc = maybe_get_forward_context()
    return fc is not None and fc.dp_metadata is not None and fc.dp_metadata.any_prefill


@dataclass
class _V2State:
    """What the combine of one dispatch needs: its handle, the ubatch that owns it, and the token count."""

    handle: Any
    ubatch: int
    num_tokens: int


class DeepEPV2(PrepareFinalize):
    """DeepEP V2 ``ElasticBuffer`` dispatch/combine; see the module docstring for its rules."""

    name = "deepep_v2"
    layout = "contiguous"
    dbo_yields_per_layer = 2

    def __init__(self, num_experts: int, ep_rank: int, ep_size: int, groups: Sequence[Any], hidden_size: int,
                 max_dispatch_tokens_per_rank: int, link: Any = None, deep_ep_module: Any = None,
                 num_topk: int = 0, static_routing: bool = False) -> None:
        """``num_topk`` sizes the buffer (0: DeepEP sizes it for up to 32); ``static_routing`` turns on the
        cached-handle re-dispatch described in the module docstring."""
        super().__init__(num_experts, ep_rank, ep_size, link)
        if max_dispatch_tokens_per_rank <= 0:
            raise ValueError(f"deepep_v2: max_dispatch_tokens_per_rank must be positive, got "
                             f"{max_dispatch_tokens_per_rank}")
        deep_ep = deep_ep_module if deep_ep_module is not None else import_deep_ep_v2()
        if not hasattr(deep_ep, "ElasticBuffer"):
            raise ImportError(f"deepep_v2: the deep_ep module given has no ElasticBuffer; {INSTALL_HINT}")
        self.capacity = max_dispatch_tokens_per_rank
        self.topk_idx_t = deep_ep.topk_idx_t
        self.buffer = deep_ep.ElasticBuffer(groups[0], num_max_tokens_per_rank=self.capacity, hidden=hidden_size,
                                            num_topk=num_topk, use_fp8_dispatch=False)
        self.static_routing = static_routing
        self._num_sms: dict[int, int] = {}
        self._cache: dict[tuple[int, int], Any] = {}  # (ubatch, n-th dispatch of the step) -> handle
        self._step_fc: dict[int, Any] = {}  # ubatch -> the forward context of the step being numbered
        self._step_calls: dict[int, int] = {}
        self.num_cached_dispatches = 0
        self.num_cpu_synced_dispatches = 0

    def num_sms(self, num_topk: int) -> int:
        """DeepEP V2's analytic SM count (``get_theoretical_num_sms``), once per top-k."""
        if num_topk not in self._num_sms:
            self._num_sms[num_topk] = self.buffer.get_theoretical_num_sms(self.num_experts, num_topk)
        return self._num_sms[num_topk]

    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> tuple[Hook | None, PrepareReceiver]:
        _check_bf16(hidden, self.name)
        if hidden.shape[0] > self.capacity:
            raise ValueError(f"deepep_v2: {hidden.shape[0]} tokens exceed num_max_tokens_per_rank={self.capacity}; "
                             "raise --max-dispatch-tokens-per-rank to the most tokens a rank runs per (micro)batch")
        ubatch = dbo_current_ubatch_id()
        topk_idx = topk_ids.to(self.topk_idx_t).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        capturing = _capturing()
        slot, cached = self._cached_handle(ubatch, topk_idx)
        if capturing and cached is not None:
            raise RuntimeError("deepep_v2: a cached handle inside a CUDA-graph capture would freeze its receive "
                               "counts into the graph; capture with static_routing off")
        cpu_sync = cached is None and _prefill_step() and not capturing
        start = device_start()
        previous_event = self.buffer.capture()
        if cached is None:
            recv_x, recv_topk_idx, recv_topk_weights, handle, event = self.buffer.dispatch(
                hidden, topk_idx=topk_idx, topk_weights=weights, num_experts=self.num_experts,
                num_max_tokens_per_rank=self.capacity, expert_alignment=1, num_sms=self.num_sms(topk_idx.shape[1]),
                previous_event=previous_event, async_with_compute_stream=True, allocate_on_comm_stream=True,
                do_cpu_sync=cpu_sync)
            if slot is not None:
                self._cache[slot] = handle
        else:
            torch._assert_async((topk_idx == cached.topk_idx).all(),
                                "deepep_v2 static_routing: this dispatch's routing differs from the cached handle's")
            recv_x, recv_topk_idx, recv_topk_weights, handle, event = self.buffer.dispatch(
                hidden, topk_weights=weights, num_sms=self.num_sms(topk_idx.shape[1]), previous_event=previous_event,
                async_with_compute_stream=True, allocate_on_comm_stream=True, handle=cached, do_cpu_sync=False)
            self.num_cached_dispatches += 1
        self.num_cpu_synced_dispatches += int(cpu_sync)
        hook = self.traced_hook(start, event.current_stream_wait, f"dispatch{ubatch}")
        state = _V2State(handle, ubatch, hidden.shape[0])

        def receive() -> tuple[ExpertTokens, Any]:
            ids, w = recv_topk_idx, recv_topk_weights
            if not cpu_sync:  # rows past the received count were never written: route them nowhere
                written = handle.psum_num_recv_tokens_per_scaleup_rank[-1]
                valid = (torch.arange(recv_x.shape[0], device=recv_x.device) < written).unsqueeze(1)
                ids = torch.where(valid, ids, torch.full_like(ids, -1))
                w = torch.where(valid, w, torch.zeros_like(w))
            return ExpertTokens("contiguous", recv_x, ids, w), state

        return hook, receive

    def finalize_async(self, expert_output: torch.Tensor, state: Any) -> tuple[Hook | None, FinalizeReceiver]:
        ubatch = dbo_current_ubatch_id()
        if not isinstance(state, _V2State) or state.ubatch != ubatch:
            owner = getattr(state, "ubatch", None)
            raise RuntimeError(f"deepep_v2: ubatch {ubatch} combines with the dispatch state of ubatch {owner}; "
                               "each handle belongs to the ubatch that dispatched it")
        start = device_start()
        previous_event = self.buffer.capture()
        combined, _combined_weights, event = self.buffer.combine(
            expert_output.contiguous(), state.handle, num_sms=state.handle.num_sms, previous_event=previous_event,
            async_with_compute_stream=True, allocate_on_comm_stream=True)
        return self.traced_hook(start, event.current_stream_wait, f"combine{ubatch}"), lambda: combined

    # ---- cached handles (static_routing) -----------------------------------------------------------------
    def _cached_handle(self, ubatch: int, topk_idx: torch.Tensor) -> tuple[tuple[int, int] | None, Any]:
        """``(slot, handle)``: this dispatch's (ubatch, number within the step) when routing is static, and the
        handle of the same slot in an earlier step if its shape matches (the CPU knows both); a ``None`` handle
        means a fresh dispatch."""
        if not self.static_routing:
            return None, None
        fc = maybe_get_forward_context()
        if fc is None:
            raise ValueError("deepep_v2 static_routing numbers the dispatches of a step by its forward context; "
                             "run the model inside set_forward_context()")
        if self._step_fc.get(ubatch) is not fc:  # a new step: restart the numbering (the old fc is kept alive)
            self._step_fc[ubatch], self._step_calls[ubatch] = fc, 0
        slot = (ubatch, self._step_calls[ubatch])
        self._step_calls[ubatch] += 1
        cached = self._cache.get(slot)
        if cached is None or tuple(cached.topk_idx.shape) != tuple(topk_idx.shape):
            return slot, None
        return slot, cached
