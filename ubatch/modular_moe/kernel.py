"""FusedMoEModularKernel: prepare (dispatch) -> experts -> finalize (combine), with the DBO yields.

The yield placement is what makes two ubatches overlap: each ubatch starts its all-to-all, parks the
receive half on the other ubatch and yields; the other ubatch runs that receive just before its own send.
So while A's tokens are on the wire, B computes. The shared experts run while the combine flies.

Single-batch overlap (``ubatch.sbo``, composable with DBO) only moves work between those points, never a
yield: ``dispatch_shared_experts`` runs the shared experts between the dispatch send and its receive hook
(instead of beside the combine); the two-stream modes launch the combine on the SBO alternate stream
(``ubatch.modular_moe.two_stream``).

Invariant: every ubatch hits exactly the same yields whatever its data, including a rank that receives
no tokens (the experts step simply has nothing to do), or a GPU capture deadlocks.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ubatch import trace
from ubatch.context import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
)
from ubatch.log_once import log_once
from ubatch.modular_moe.experts.base import ExpertWeight, MoEExperts
from ubatch.modular_moe.prepare_finalize.base import Hook, PrepareFinalize
from ubatch.modular_moe.two_stream import TwoStreamCombine
from ubatch.modular_moe.types import ExpertMLPExtras
from ubatch.sbo import SBO_OFF, SboFlags, check_sbo_modes

_logger = logging.getLogger(__name__)


def _complete(hook: Hook | None) -> None:
    """Under DBO hand the receive to the next ubatch and yield; outside DBO receive inline."""
    if hook is None:
        return
    if dbo_enabled():
        dbo_register_recv_hook(hook)
        dbo_yield()
    else:
        hook()


class FusedMoEModularKernel:
    def __init__(self, prepare_finalize: PrepareFinalize, experts: MoEExperts,
                 shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 sbo: SboFlags | None = None) -> None:
        if prepare_finalize.layout not in experts.supported_layouts:
            raise ValueError(f"experts backend {experts.name!r} cannot consume the {prepare_finalize.layout!r} layout "
                             f"produced by all2all backend {prepare_finalize.name!r}")
        self.sbo = sbo if sbo is not None else SBO_OFF  # a config-level choice: identical for every ubatch
        check_sbo_modes(self.sbo, prepare_finalize.name)  # the backend this kernel really uses (auto resolved)
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.shared_experts = shared_experts

    def __call__(self, hidden: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        pf = self.prepare_finalize
        self.experts.check_extras(extras)
        sbo = self.sbo
        rec = trace.active()
        t0 = time.perf_counter() if rec is not None else 0.0

        dbo_maybe_run_recv_hook()  # the other ubatch's pending receive goes ahead of our send
        with trace.region("dispatch_send", "a2a"):
            if self._fp8_dispatch(hidden.shape[-1]):
                round_scale = self.experts.wants_power_of_two_scales(hidden.device)
                hook, receive_tokens = pf.prepare_fp8_async(hidden, topk_weights, topk_ids, round_scale)
            else:
                hook, receive_tokens = pf.prepare_async(hidden, topk_weights, topk_ids)
        shared = None
        if self.shared_experts is not None and sbo.dispatch_shared_experts:
            shared = self._shared(hidden, rec, "dispatch", None)  # our dispatch is in flight, unreceived
        _complete(hook)
        tokens, state = receive_tokens()

        two = TwoStreamCombine(sbo, pf, self.experts, tokens, hidden.device) if sbo.two_stream else None
        t1 = rec.mark() if rec is not None else 0.0  # host and (cuda clock) device time
        if two is None:
            expert_out = self.experts.run(tokens, w13, w2, extras)
        else:
            expert_out = two.run_experts(lambda: self.experts.run(tokens, w13, w2, extras))
        if rec is not None:
            rec.span("experts", "compute", dbo_current_ubatch_id(), t1, rec.mark(), phase="E")

        dbo_maybe_run_recv_hook()
        with trace.region("combine_send", "a2a"):
            if two is None:
                hook, receive_output = pf.finalize_async(expert_out, state)
            else:
                hook, receive_output = two.launch_combine(lambda: pf.finalize_async(expert_out, state))
        if self.shared_experts is not None and shared is None:
            shared = self._shared(hidden, rec, "combine", two)
        if two is not None:
            two.before_receive()
        _complete(hook)
        if two is not None:
            two.after_receive()
        out = receive_output()
        if rec is not None:
            rec.instant("moe_done", "moe", dbo_current_ubatch_id(), since=t0)
        return out if shared is None else out + shared

    def _fp8_dispatch(self, hidden_size: int) -> bool:
        """Whether the dispatch quantises to FP8: the experts take FP8 activations and the all-to-all can send
        them (DeepEP low-latency into DeepGEMM); the choice and its reason are logged once per pairing."""
        if not self.experts.accepts_fp8_activations:
            return False
        pf = self.prepare_finalize
        reason = pf.fp8_dispatch_for(hidden_size)
        if reason is None:
            log_once(_logger, logging.INFO, f"{pf.name} -> {self.experts.name} experts: FP8 dispatch (tokens "
                                            "quantised per 128 columns on the way, handed to the GEMM as they are)")
            return True
        log_once(_logger, logging.INFO, f"{pf.name} -> {self.experts.name} experts: bf16 dispatch, the experts "
                                        f"quantise the tokens ({reason})")
        return False

    def _shared(self, hidden: torch.Tensor, rec: trace.TraceRecorder | None, overlaps: str,
                two: TwoStreamCombine | None) -> torch.Tensor:
        """The shared experts, recorded as compute that overlaps the dispatch or the combine."""
        assert self.shared_experts is not None
        t = rec.mark() if rec is not None else 0.0
        fn = self.shared_experts
        shared = fn(hidden) if two is None else two.run_shared(lambda: fn(hidden))
        if rec is not None:
            rec.span("shared_experts", "compute", dbo_current_ubatch_id(), t, rec.mark(), phase="S",
                     overlaps=overlaps)
        return shared
