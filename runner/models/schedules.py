"""Which overlap schedule a model's two ubatches follow: ``moe`` (yields only in the MoE kernel) or ``deepseek``.

``moe`` (the default) is vLLM's DBO: each MoE layer yields twice, after sending its dispatch and after
sending its combine, so a ubatch's all-to-all flies while the other ubatch runs its attention or experts.

``deepseek`` is DeepSeek's published two-micro-batch decode pipeline (deepseek-ai/profile-data, README
"Decoding" and ``assets/decode.jpg``), with four compute stages per MoE layer -- SHARED (shared experts),
ATTN-0 (MLA down/up projections after the combine), MLP (routed experts), ATTN-1 (core attention, output
projection, routing gate). Micro-batch 0 runs one stage ahead of micro-batch 1, and the compute stream
sees, per layer::

    SHARED(0) ATTN-0(1) | MLP(0) | ATTN-1(1) SHARED(1) ATTN-0(0) | MLP(1) | ATTN-1(0) ...
    DISPATCH(0) under SHARED(0)+ATTN-0(1), COMBINE(0) under ATTN-1(1),
    DISPATCH(1) under SHARED(1)+ATTN-0(0), COMBINE(1) under ATTN-1(0).

Here it is three yields per MoE layer plus one per step, built from:

- the MoE kernel with the shared experts between the dispatch send and its yield (SBO's
  ``dispatch_shared_experts`` ordering), so SHARED runs while its own dispatch flies;
- one :func:`stage_boundary` inside attention, between ATTN-0 and ATTN-1 (every layer, dense ones too,
  so the count never depends on the layer kind);
- a one-stage offset: ubatch 1 yields once before its first layer, ubatch 0 once after its last.

Receives stay vLLM's recv hooks, parked on the other ubatch: a stage boundary runs the hooks parked on
the yielding ubatch before handing over, so a transfer sent at the end of one ubatch's stage is in
flight during exactly the other ubatch's next stage. SGLang expresses the same pipeline with each
ubatch completing its own receives (``python/sglang/srt/batch_overlap/operations_strategy.py``,
``_compute_moe_deepseek_blog_decode``: five ``YieldOperation`` per layer and ``tbo_delta_stages=2``,
one of its stages being only the combine's receive); the compute order is the same.

When it pays: each dispatch has only SHARED + the other ubatch's ATTN-0 to hide under, each combine the
other's ATTN-1. DeepSeek sizes those windows for its hardware, where the low-latency dispatch sends FP8 and
the combine BF16 (a dispatch about half a combine) and ATTN-1 (core attention over a long cache) is the
longest stage. Where a dispatch is as large as a combine, or SHARED + ATTN-0 is short next to the routed
experts, the ``moe`` schedule hides more: its dispatch flies under the other ubatch's whole attention
(``benchmarks/bench_deepseek_schedule.py`` measures both). That, and one more handoff per layer, is why
``moe`` is the default.

Like SGLang (which picks the strategy by forward mode), ``deepseek`` applies this pipeline to decode
steps only: a step in which any DP rank prefills (``DPMetadata.any_prefill``, the same on every rank)
runs the ``moe`` schedule, which is DeepSeek's prefill profile (shared experts under the combine). Every
decision reads step-level facts only, so both ubatches -- an empty or dummy one included -- hit the same
yields.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from runner.config import DBO_SCHEDULES, ConfigError
from ubatch.context import dbo_current_ubatch_id, dbo_enabled, dbo_maybe_run_recv_hook, dbo_num_ubatches, dbo_yield
from ubatch.forward_context import maybe_get_forward_context
from ubatch.modular_moe.kernel import FusedMoEModularKernel
from ubatch.modular_moe.layer import FusedMoE

DEFAULT_DBO_SCHEDULE = "moe"
# Backends whose receive is a hook the kernel parks on the other ubatch (2 yields per MoE layer). DeepEP's
# high-throughput mode yields inside its own stream choreography instead, which the pipeline cannot place.
_HOOK_YIELDS_PER_LAYER = 2


def check_schedule(name: str, supported: tuple[str, ...] = DBO_SCHEDULES, model: str = "this model") -> str:
    """``name`` if it is a known schedule that ``model`` supports, else a :class:`ConfigError` (a ``ValueError``
    for the ``dbo_schedule`` setting) naming both lists."""
    if name not in DBO_SCHEDULES:
        raise ConfigError("dbo_schedule", f"unknown DBO schedule {name!r}; choose one of {', '.join(DBO_SCHEDULES)}")
    if name not in supported:
        raise ConfigError("dbo_schedule", f"{model} does not support the {name!r} DBO schedule (it supports: "
                                          f"{', '.join(supported)}); 'deepseek' needs MLA attention split into "
                                          "ATTN-0/ATTN-1, i.e. a DeepSeek-V2/V3 model")
    return name


class DBOSchedule:
    """The schedule one model's layers share (set once per model; every layer holds this same object)."""

    def __init__(self, name: str = DEFAULT_DBO_SCHEDULE) -> None:
        self.name = check_schedule(name)

    def staged(self) -> bool:
        """Whether this step runs DeepSeek's staged decode pipeline (read per call: the ubatches of one step
        and every rank get the same answer, since it depends on step-level facts only)."""
        if self.name != "deepseek" or not dbo_enabled():
            return False
        n = dbo_num_ubatches()
        if n != 2:
            raise ValueError(f"the 'deepseek' DBO schedule pipelines exactly 2 micro-batches, got {n} ubatches")
        fc = maybe_get_forward_context()
        return not (fc is not None and fc.dp_metadata is not None and fc.dp_metadata.any_prefill)


def stage_boundary() -> None:
    """End a pipeline stage: complete the receives parked on this ubatch, then hand over (no-op outside DBO).

    Running the parked hooks first is what puts the other ubatch's transfer under exactly this stage:
    it was sent when the other ubatch last yielded, and it is complete by the time that ubatch resumes.
    """
    if dbo_enabled():
        dbo_maybe_run_recv_hook()
        dbo_yield()


def pipeline_prologue() -> None:
    """Ubatch 1 lets ubatch 0 run one stage ahead (its first stage boundary, with nothing of its own)."""
    if dbo_current_ubatch_id() == 1:
        stage_boundary()


def pipeline_epilogue() -> None:
    """Ubatch 0's matching extra boundary after its last layer, so both ubatches yield equally often."""
    if dbo_current_ubatch_id() == 0:
        stage_boundary()


class ScheduledFusedMoE(FusedMoE):
    """A FusedMoE whose kernel runs the shared experts under the dispatch on the staged pipeline's steps.

    On other steps it is the plain FusedMoE (the configured SBO modes). Same weights, same routing and the
    same sum ``routed + shared``, so the output is identical whichever kernel ran.
    """

    def __init__(self, *args: Any, schedule: DBOSchedule, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.schedule = schedule
        self._staged_kernels: dict[str, FusedMoEModularKernel] = {}

    def kernel_for(self, backend: str) -> FusedMoEModularKernel:
        base = super().kernel_for(backend)
        if not self.schedule.staged():
            return base
        kernel = self._staged_kernels.get(backend)
        if kernel is None:
            pf = base.prepare_finalize
            if pf.dbo_yields_per_layer != _HOOK_YIELDS_PER_LAYER:
                raise ValueError(f"the 'deepseek' DBO schedule needs an all-to-all whose receive is a hook "
                                 f"(torch_ll, torch_ht, deepep_low_latency, none); {pf.name!r} yields "
                                 f"{pf.dbo_yields_per_layer} times per layer inside its own choreography")
            sbo = replace(base.sbo, dispatch_shared_experts=True, combine_shared_experts=False)
            kernel = FusedMoEModularKernel(pf, base.experts, base.shared_experts, sbo=sbo)
            self._staged_kernels[backend] = kernel
        return kernel
