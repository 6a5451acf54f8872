"""Which overlap schedule a model's two ubatches follow: ``moe`` (yields only in the MoE kernel) or ``deepseek``.

``moe`` (the default) is vLLM's DBO: two yields per MoE layer, after the dispatch send and the combine send.
``deepseek`` is DeepSeek's decode pipeline (deepseek-ai/profile-data, README "Decoding"): stages SHARED, ATTN-0,
MLP, ATTN-1 with ubatch 1 one stage behind ubatch 0, built from the MoE kernel (shared experts between the
dispatch send and its yield), one :func:`stage_boundary` inside attention and a one-stage offset; prefill steps
run ``moe``. Why ``moe`` is the default: docs/design_notes.md, "Models".
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
