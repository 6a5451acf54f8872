"""Per-step state the model reads without it being threaded through every call (vLLM's ForwardContext).

The context is thread-local: the caller sets it for the whole batch, and each ubatch gets its own view
(its split attention metadata and slice). vLLM keeps one module global and rewrites it at every resume; a
thread-local needs no rewriting and cannot leak one ubatch's metadata into another.

Every field is typed. Step-level facts agreed across data-parallel ranks travel as one
:class:`DPMetadata` (vLLM's ``dp_metadata``), never as string keys, so a backend that sizes its buffers
from them reads a field the type checker knows about.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ubatch.slicing import UBatchSlice

_local = threading.local()


@dataclass(frozen=True)
class DPMetadata:
    """What every DP rank agreed about this step in the DP vote: the same values on every rank.

    ``num_tokens_across_dp``: each rank's own (unpadded) token count. ``step_token_bound``: the most tokens
    any rank runs this step, which fixed-size all-to-all buffers may be sized by (``None``: use the
    configured capacity, e.g. while a CUDA graph is captured). ``ubatch_token_bounds``: for a ubatched
    step, the max over ranks of each ubatch's token count (padding included), so ubatch ``i`` is sized by
    its own bound, never by the whole step's. ``num_real_tokens``: this rank's unpadded count (rows at or
    past it are DP or graph padding, routed nowhere). ``any_prefill``: some rank runs a prefill or mixed
    batch (a phase-aware all-to-all then picks its high-throughput layout on every rank). All known on the
    CPU, so using them costs no device sync.
    """

    num_tokens_across_dp: tuple[int, ...]
    step_token_bound: int | None = None
    ubatch_token_bounds: tuple[int, ...] | None = None
    num_real_tokens: int | None = None
    any_prefill: bool = False

    def __post_init__(self) -> None:
        if not self.num_tokens_across_dp or any(n < 0 for n in self.num_tokens_across_dp):
            raise ValueError(f"num_tokens_across_dp must be non-empty and >= 0, got {self.num_tokens_across_dp}")
        if self.step_token_bound is not None and self.step_token_bound < 0:
            raise ValueError(f"step_token_bound must be >= 0, got {self.step_token_bound}")
        if self.ubatch_token_bounds is not None and any(n < 0 for n in self.ubatch_token_bounds):
            raise ValueError(f"ubatch_token_bounds must be >= 0, got {self.ubatch_token_bounds}")
        if self.num_real_tokens is not None and self.num_real_tokens < 0:
            raise ValueError(f"num_real_tokens must be >= 0, got {self.num_real_tokens}")

    @property
    def max_tokens_across_dp(self) -> int:
        return max(self.num_tokens_across_dp)

    def token_bound(self, ubatch_id: int | None) -> int | None:
        """The token bound buffers of ``ubatch_id`` may be sized by (``None``: not ubatched, the whole step);
        ``None`` when no bound was agreed (use the configured capacity)."""
        if ubatch_id is None or self.ubatch_token_bounds is None:
            return self.step_token_bound
        if not 0 <= ubatch_id < len(self.ubatch_token_bounds):
            raise ValueError(f"ubatch {ubatch_id} has no token bound: the DP vote agreed "
                             f"{len(self.ubatch_token_bounds)} ubatches")
        return self.ubatch_token_bounds[ubatch_id]


@dataclass
class ForwardContext:
    # The caller's attention metadata, opaque here (object, not a type of ours: each attention backend builds and
    # reads its own): the wrapper splits a CommonAttentionMetadata per ubatch and hands a list out one per ubatch.
    attn_metadata: object = None
    ubatch_slices: list[UBatchSlice] | None = None
    ubatch_slice: UBatchSlice | None = None  # set inside a ubatch: this ubatch's slice
    ubatch_id: int | None = None  # set inside a ubatch
    dp_metadata: DPMetadata | None = None
    trace_rank: int | None = None  # the DP rank a trace files this step's spans under (None: 0)
    # [num_tokens] bool on the device, True for real rows: padding rows are routed to no expert. A device
    # tensor (not a count) so a CUDA graph reads it from a persistent buffer; sliced per ubatch.
    real_token_mask: torch.Tensor | None = None


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("no forward context is set on this thread; run the model inside set_forward_context(...)")
    return ctx


def maybe_get_forward_context() -> ForwardContext | None:
    return getattr(_local, "ctx", None)


def set_thread_forward_context(ctx: ForwardContext | None) -> None:
    """Install ``ctx`` for this thread without restoring anything (a ubatch resuming after a handoff)."""
    _local.ctx = ctx


@contextlib.contextmanager
def override_forward_context(ctx: ForwardContext | None) -> Iterator[None]:
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = previous


@contextlib.contextmanager
def set_forward_context(attn_metadata: object = None, ubatch_slices: list[UBatchSlice] | None = None, *,
                        dp_metadata: DPMetadata | None = None, trace_rank: int | None = None,
                        real_token_mask: torch.Tensor | None = None) -> Iterator[ForwardContext]:
    """Set the forward context for this thread for the duration of the block (nests; restores on exit)."""
    ctx = ForwardContext(attn_metadata=attn_metadata, ubatch_slices=ubatch_slices, dp_metadata=dp_metadata,
                         trace_rank=trace_rank, real_token_mask=real_token_mask)
    with override_forward_context(ctx):
        yield ctx
