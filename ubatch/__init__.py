"""ubatch: dual-batch overlap (DBO) runtime for Mixture-of-Experts inference with DP + EP."""
from ubatch.context import (
    DBOAbortedError,
    DBOError,
    DBOTimeoutError,
    DBOYieldMismatchError,
    UBatchContext,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_get_previous_event,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    make_ubatch_contexts,
)
from ubatch.forward_context import ForwardContext, get_forward_context, set_forward_context
from ubatch.slicing import CommonAttentionMetadata, UBatchSlice, maybe_create_ubatch_slices
from ubatch.wrapper import UBatchConfig, UBatchWrapper

__version__ = "0.1.0"

__all__ = [
    "DBOAbortedError",
    "DBOError",
    "DBOTimeoutError",
    "DBOYieldMismatchError",
    "UBatchContext",
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_get_previous_event",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "dbo_switch_to_comm",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute",
    "dbo_switch_to_compute_sync",
    "dbo_yield",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_yield_and_switch_from_compute_to_comm",
    "make_ubatch_contexts",
    "ForwardContext",
    "get_forward_context",
    "set_forward_context",
    "CommonAttentionMetadata",
    "UBatchSlice",
    "maybe_create_ubatch_slices",
    "UBatchConfig",
    "UBatchWrapper",
]
