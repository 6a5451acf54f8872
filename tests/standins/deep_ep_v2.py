"""CPU stand-in for DeepEP V2's ``deep_ep.ElasticBuffer`` (tests only; pass it as ``deep_ep_module``).

Follows ``deep_ep/buffers/elastic.py`` (the copy the tests check the signature against is
``tests/data/deep_ep_elastic.py.txt``) and the host-side checks and stream rules of its C++ runtime
(``csrc/elastic/buffer.hpp``): dtypes and shapes as its ``EP_HOST_ASSERT``s, the comm stream's prologue and
epilogue under the stream layer, worst-case row counts without a CPU sync. It also exports the V1 ``Buffer``,
as the real package does; what it cannot model raises ``NotImplementedError``.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from standins import deep_ep as v1
from standins.gloo_rows import all_to_all_rows
from ubatch import streams
from ubatch.context import dbo_current_ubatch_id

__version__ = "2.1.0 (CPU stand-in, V2)"
topk_idx_t = torch.int64
Buffer = v1.Buffer  # the V1 API still ships, as ``deep_ep/buffers/legacy.py``
EventHandle = v1.EventHandle  # ``deep_ep._C.EventHandle``: records on the current (or given) stream when made
ELASTIC_BUFFER_ALIGNMENT = 2 << 20  # ``get_elastic_buffer_alignment()``: 2 MB
NUM_DEVICE_SMS = 132  # what ``get_theoretical_num_sms`` may use at most (an H100)
_GARBAGE_EXPERT = 1 << 20  # what an unwritten ``recv_topk_idx`` row holds here: no valid local expert id
_require = v1._require


class EventOverlap(v1.EventOverlap):
    """``deep_ep.EventOverlap`` of V2 (``deep_ep/utils/event.py``): adds ``register_hook_after_wait``."""

    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        assert self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`"
        self.hook_after_wait = hook_after_wait


_COMM_STREAMS: dict[tuple[int, int], streams.NullStream] = {}


def _global_comm_stream(rank: int, world: int) -> streams.NullStream:
    """One comm stream per rank, shared by all of its buffers, as DeepEP's static ``get_global_comm_stream``."""
    key = (rank, world)
    if key not in _COMM_STREAMS:
        _COMM_STREAMS[key] = v1.cpu_stream(streams.new_stream("cpu", name=f"deep_ep-v2-comm(rank {rank})"))
    return _COMM_STREAMS[key]


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def buffer_bytes(num_max_tokens_per_rank: int, hidden: int, num_topk: int, num_ranks: int,
                 use_fp8_dispatch: bool) -> int:
    """The stand-in's layout (direct mode): a send and ``num_ranks`` receive slots of every token for dispatch,
    ``num_ranks + min(num_ranks, num_topk)`` for combine; ``num_topk == 0`` sizes for 32 as DeepEP does."""
    _require(num_max_tokens_per_rank > 0 and hidden > 0, "num_max_tokens_per_rank > 0 and hidden > 0")
    num_topk = 32 if num_topk == 0 else num_topk
    elem = 1 if use_fp8_dispatch else 2
    dispatch_token = _align(hidden * elem + (-(-hidden // 32) * 4 if use_fp8_dispatch else 0) + num_topk * 12 + 16, 16)
    combine_token = _align(hidden * 2 + num_topk * 4 + 16, 16)
    dispatch = dispatch_token * num_max_tokens_per_rank * (1 + num_ranks)
    combine = combine_token * num_max_tokens_per_rank * (num_ranks + min(num_ranks, num_topk))
    return _align(max(dispatch, combine), ELASTIC_BUFFER_ALIGNMENT)


class EPHandle:
    """``deep_ep.EPHandle`` (non-expand mode): the attributes DeepEP's own handle has, plus stand-in tags."""

    def __init__(self, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int, num_sms: int,
                 topk_idx: torch.Tensor, num_recv_tokens: int, num_recv_tokens_per_expert_list: list,
                 psum_num_recv_tokens_per_scaleup_rank: torch.Tensor, psum_num_recv_tokens_per_expert: torch.Tensor,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor, owner: ElasticBuffer,
                 call: int) -> None:
        self.do_expand = False
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = 0
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = None
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.owner, self.call, self.ubatch = owner, call, dbo_current_ubatch_id()


class ElasticBuffer:
    """``deep_ep.ElasticBuffer`` on CPU: intranode (direct-mode) dispatch and combine over gloo."""

    def __init__(self, group: Any, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        self.group, self.rank_idx, self.num_ranks = group, group.rank(), group.size()
        if num_cpu_bytes:
            raise NotImplementedError("DeepEP V2 stand-in: CPU buffers (Engram storage) are not modelled")
        if deterministic:
            raise NotImplementedError("DeepEP V2 stand-in: deterministic dispatch is not modelled")
        self.deterministic = deterministic
        self.allow_hybrid_mode, self.allow_multiple_reduction = allow_hybrid_mode, allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        if num_bytes is None:
            num_bytes = buffer_bytes(num_max_tokens_per_rank, hidden, num_topk, self.num_ranks, use_fp8_dispatch)
        _require(num_bytes > 0 and num_bytes % ELASTIC_BUFFER_ALIGNMENT == 0,
                 "num_buffer_bytes > 0 and num_buffer_bytes % symmetric::kNumAlignmentBytes == 0")
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_allocated_qps = num_allocated_qps or (65 if allow_hybrid_mode else 17)
        self.explicitly_destroy = explicitly_destroy
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks  # one NVLink domain
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, self.num_ranks
        self._comm = _global_comm_stream(self.rank_idx, self.num_ranks)
        self._calls = 0
        self.runtime = self

    # ---- static API ----------------------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group: Any, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        return buffer_bytes(num_max_tokens_per_rank, hidden, num_topk, group.size(), use_fp8_dispatch)

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current stream, to pass as ``previous_event`` (an ``EventHandle`` in V2)."""
        return EventHandle()

    def get_comm_stream(self) -> streams.Stream:
        return self._comm

    def get_physical_domain_size(self) -> tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """Even, at least 4, at most the device's SMs: a fixed stand-in of DeepEP's bandwidth model (which the
        real buffer memoizes per instance; this arithmetic is cheap enough to recompute)."""
        assert num_scaleout_topk == 0
        _require(num_experts % self.num_ranks == 0, "num_experts % num_groups == 0")
        return min(NUM_DEVICE_SMS, _align(max(4, 2 * self.num_ranks + num_topk), 2))

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9)
        return min(num_qps, self.num_allocated_qps)

    # ---- stream rules (``stream_control_prologue`` / ``stream_control_epilogue``) -----------------------
    def _prologue(self, previous_event: EventHandle | None, allocate_on_comm_stream: bool) -> streams.NullStream:
        if previous_event is not None and not isinstance(previous_event, EventHandle):
            raise TypeError(f"previous_event must be a deep_ep EventHandle (ElasticBuffer.capture()), got "
                            f"{type(previous_event).__name__}: V2 takes the bare event, not an EventOverlap")
        compute = v1.current_cpu_stream()
        if previous_event is not None:
            _require(allocate_on_comm_stream, "allocate_on_comm_stream (previous_event.has_value())")
            streams.wait(previous_event.event, self._comm)
        else:
            _require(compute is not self._comm, "s_0.id() != s_1.id(): the caller is on the comm stream")
            self._comm.wait_stream(compute)
        return compute

    def _epilogue(self, compute: streams.NullStream, async_with_compute_stream: bool,
                  tensors: tuple) -> EventOverlap:
        if async_with_compute_stream:
            return EventOverlap(EventHandle(self._comm), tensors)
        _require(compute is not self._comm, "s_0.id() != s_1.id(): the caller is on the comm stream")
        compute.wait_stream(self._comm)
        return EventOverlap(None)

    def _check_handle(self, handle: Any, where: str) -> EPHandle:
        if not isinstance(handle, EPHandle):
            raise TypeError(f"{where}: handle must be the EPHandle a dispatch returned, got {type(handle).__name__}")
        if handle.owner is not self:
            raise RuntimeError(f"DeepEP V2 stand-in: {where} got a handle made by another ElasticBuffer (call "
                               f"#{handle.call}); its metadata indexes that buffer's layout")
        ubatch = dbo_current_ubatch_id()
        if handle.ubatch != ubatch:
            raise RuntimeError(
                f"DeepEP V2 stand-in: {where} got the handle of dispatch #{handle.call}, made by DBO ubatch "
                f"{handle.ubatch}, in ubatch {ubatch}: a handle describes one dispatch's routing, reusing it for "
                "another ubatch's tokens moves the wrong rows (silently, on hardware)")
        return handle

    # ---- dispatch ----------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: EventHandle | None = None,
                 previous_event_before_epilogue: EventHandle | None = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: EPHandle | None = None, do_handle_copy: bool = True, do_cpu_sync: bool | None = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False
                 ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:
        if isinstance(x, tuple):
            raise NotImplementedError("DeepEP V2 stand-in: FP8 (tuple) dispatch input is not modelled")
        if do_expand:
            raise NotImplementedError("DeepEP V2 stand-in: the expanded layout (do_expand) is not modelled")
        _require(not do_zero_padding or do_expand, "not do_zero_padding or do_expand")
        if previous_event_before_epilogue is not None:
            raise NotImplementedError("DeepEP V2 stand-in: previous_event_before_epilogue is not modelled")
        if handle is not None:
            assert topk_idx is None
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
            self._check_handle(handle, "cached dispatch")
            topk_idx = handle.topk_idx
            num_max_tokens_per_rank = handle.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
                else num_max_tokens_per_rank
            num_experts = handle.num_experts if num_experts is None else num_experts
            expert_alignment = handle.expert_alignment if expert_alignment is None else expert_alignment
            do_cpu_sync = False
            assert (num_experts, expert_alignment, num_max_tokens_per_rank) == \
                (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
        assert topk_idx is not None, "topk_idx is required without a cached handle"
        assert num_experts is not None, "num_experts is required without a cached handle"
        num_topk = topk_idx.shape[1]
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms
        num_qps = self.get_theoretical_num_qps(num_sms) if num_qps == 0 else num_qps
        assert num_qps <= self.num_allocated_qps, "Allocated QPs are not enough"
        num_max_tokens_per_rank = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
            else num_max_tokens_per_rank
        expert_alignment = 1 if expert_alignment is None else expert_alignment
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        r, me = self.num_ranks, self.rank_idx

        _require(num_sms > 0, "num_sms > 0")
        _require(x.dim() == 2, "t.dim() == kNumDims (x is [num_tokens, hidden])")
        num_tokens, hidden = x.shape
        _require(x.is_contiguous(), "x.is_cuda() and x.is_contiguous()")
        _require((hidden * x.element_size()) % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        _require(num_tokens <= num_max_tokens_per_rank,
                 f"num_tokens <= num_max_tokens_per_rank ({num_tokens} > {num_max_tokens_per_rank})")
        _require(topk_idx.dim() == 2 and topk_idx.shape[0] == num_tokens, "num_tokens == topk_idx.size(0)")
        _require(topk_idx.dtype == topk_idx_t,
                 f"topk_idx.scalar_type() == topk_idx_t (torch.int64), got {topk_idx.dtype}")
        _require(topk_idx.is_contiguous(), "topk_idx.is_cuda() and topk_idx.is_contiguous()")
        if topk_weights is not None:
            _require(topk_weights.dim() == 2 and topk_weights.shape[0] == num_tokens,
                     "num_tokens == topk_weights.size(0)")
            _require(topk_weights.is_contiguous(), "topk_weights->is_cuda() and topk_weights->is_contiguous()")
            _require(topk_weights.dtype == torch.float32,
                     f"topk_weights->data_ptr<float>(): topk_weights is torch.float32, got {topk_weights.dtype}")
        if cumulative_local_expert_recv_stats is not None:
            raise NotImplementedError("DeepEP V2 stand-in: cumulative_local_expert_recv_stats is not modelled")
        _require(num_experts % r == 0, "num_experts % nccl_context->num_ranks == 0")
        if handle is not None:
            _require(tuple(handle.dst_buffer_slot_idx.shape) == (num_tokens, num_topk),
                     f"num_tokens == num_tokens__ and num_topk == num_topk_ (cached handle of "
                     f"{tuple(handle.dst_buffer_slot_idx.shape)}, x has {num_tokens} tokens)")
        _require(buffer_bytes(num_max_tokens_per_rank, hidden, num_topk, r, False) <= self.num_bytes,
                 "get_dispatch_buffer_size(...) <= num_buffer_bytes")
        self._calls += 1
        call, e_loc = self._calls, num_experts // r

        compute = self._prologue(previous_event, allocate_on_comm_stream)
        with streams.stream(self._comm):
            dest_of = torch.where(topk_idx >= 0, topk_idx // e_loc, torch.full_like(topk_idx, -1))
            send_index = [(dest_of == d).any(dim=1).nonzero().squeeze(1) for d in range(r)]
            recv_counts = None if handle is None else _recv_counts(handle)
            rows = all_to_all_rows(self.group, [x.index_select(0, i) for i in send_index], recv_counts)
            counts = [int(t.shape[0]) for t in rows]
            local_ids = []
            for d, i in enumerate(send_index):
                ids = topk_idx.index_select(0, i)
                mine = (ids >= d * e_loc) & (ids < (d + 1) * e_loc)
                local_ids.append(torch.where(mine, ids - d * e_loc, torch.full_like(ids, -1)))
            got_ids = torch.cat(all_to_all_rows(self.group, local_ids, counts))
            got_w = None
            if topk_weights is not None:  # the whole top-k row travels, as in DeepEP's reference
                got_w = torch.cat(all_to_all_rows(self.group, [topk_weights.index_select(0, i)
                                                               for i in send_index], counts))
            num_recv = sum(counts)
            if handle is not None:
                alloc = handle.num_recv_tokens
            else:
                alloc = num_recv if do_cpu_sync else num_max_tokens_per_rank * r
            recv_x = torch.empty(alloc, hidden, dtype=x.dtype)
            recv_topk_idx = torch.full((alloc, num_topk), _GARBAGE_EXPERT, dtype=topk_idx_t)
            recv_x[:num_recv] = torch.cat(rows)
            recv_x[num_recv:] = float("nan")
            recv_topk_idx[:num_recv] = got_ids
            recv_topk_weights = None
            if got_w is not None:
                recv_topk_weights = torch.full((alloc, num_topk), float("nan"), dtype=torch.float32)
                recv_topk_weights[:num_recv] = got_w
            if handle is None:
                src = all_to_all_rows(self.group, [(i + me * num_max_tokens_per_rank).to(torch.int32).unsqueeze(1)
                                                   for i in send_index], counts)
                recv_src_metadata = torch.full((alloc, num_topk + 2), -7, dtype=torch.int32)
                recv_src_metadata[:num_recv, 0] = torch.cat(src).squeeze(1)
                recv_src_metadata[:num_recv, 1:] = -1
                psum_rank = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
                per_expert = torch.bincount(got_ids[got_ids >= 0], minlength=e_loc).tolist()
                aligned = [_align(n, expert_alignment) for n in per_expert]
                psum_expert = torch.tensor(aligned, dtype=torch.int32).cumsum(0).to(torch.int32)
                slots = torch.full((num_tokens, num_topk), -1, dtype=torch.int32)
                for i in send_index:
                    slots[i] = torch.arange(i.numel(), dtype=torch.int32).unsqueeze(1)
                handle = EPHandle(num_experts, expert_alignment, num_max_tokens_per_rank, num_sms,
                                  topk_idx.clone() if do_handle_copy else topk_idx, alloc,
                                  aligned if do_cpu_sync else [], psum_rank, psum_expert, recv_src_metadata, slots,
                                  self, call)
        event = self._epilogue(compute, async_with_compute_stream,
                               (x, topk_idx, topk_weights, recv_x, recv_topk_idx, recv_topk_weights))
        return recv_x, recv_topk_idx, recv_topk_weights, handle, event

    # ---- combine -----------------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: EventHandle | None = None,
                previous_event_before_epilogue: EventHandle | None = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        self._check_handle(handle, "combine")
        num_sms = handle.num_sms if num_sms == 0 else num_sms
        num_qps = self.get_theoretical_num_qps(num_sms) if num_qps == 0 else num_qps
        assert num_qps <= self.num_allocated_qps, "Allocated QPs are not enough"
        if topk_weights is not None:
            raise NotImplementedError("DeepEP V2 stand-in: combine's topk_weights reduction is not modelled")
        if previous_event_before_epilogue is not None:
            raise NotImplementedError("DeepEP V2 stand-in: previous_event_before_epilogue is not modelled")
        bias_0, bias_1 = (bias, None) if isinstance(bias, torch.Tensor) else (bias or (None, None))
        _require(num_sms > 0, "num_sms > 0")
        _require(x.dim() == 2, "t.dim() == kNumDims (x is [num_tokens, hidden])")
        _require(x.is_contiguous(), "x.is_cuda() and x.is_contiguous()")
        _require(x.dtype == torch.bfloat16, f"x.scalar_type() == torch::kBFloat16, got {x.dtype}")
        _require((x.shape[1] * x.element_size()) % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        num_combined, num_topk = handle.topk_idx.shape
        _require(num_combined <= handle.num_max_tokens_per_rank, "num_combined_tokens <= num_max_tokens_per_rank")
        _require(handle.recv_src_metadata.shape[0] == x.shape[0],
                 f"num_reduced_tokens == num_tokens (x has {x.shape[0]} rows, the dispatch received "
                 f"{handle.recv_src_metadata.shape[0]}: expert output of another dispatch?)")
        hidden = x.shape[1]
        for b in (bias_0, bias_1):
            if b is not None:
                _require(b.dim() == 2 and b.is_contiguous() and b.dtype == x.dtype
                         and tuple(b.shape) == (num_combined, hidden),
                         "bias is contiguous [num_combined_tokens, hidden] of x's dtype")
        r, me = self.num_ranks, self.rank_idx
        self._calls += 1
        compute = self._prologue(previous_event, allocate_on_comm_stream)
        with streams.stream(self._comm):
            bounds = [0] + handle.psum_num_recv_tokens_per_scaleup_rank.tolist()
            parts = [x[bounds[s]:bounds[s + 1]] for s in range(r)]
            origin = [handle.recv_src_metadata[bounds[s]:bounds[s + 1], 0].to(torch.int64) for s in range(r)]
            back = all_to_all_rows(self.group, parts)
            counts = [int(t.shape[0]) for t in back]
            back_idx = all_to_all_rows(self.group, origin, counts)
            acc = torch.zeros(num_combined, hidden, dtype=torch.float32)
            for part, idx in zip(back, back_idx, strict=True):
                acc.index_add_(0, idx - me * handle.num_max_tokens_per_rank, part.float())
            for b in (bias_0, bias_1):
                if b is not None:
                    acc += b.float()
            combined = acc.to(x.dtype)
        event = self._epilogue(compute, async_with_compute_stream, (x, combined))
        return combined, None, event


def _recv_counts(handle: EPHandle) -> list[int]:
    """Rows received from each source rank, from a handle's inclusive prefix sum (known on the CPU here)."""
    psum = [0] + handle.psum_num_recv_tokens_per_scaleup_rank.tolist()
    return [b - a for a, b in itertools.pairwise(psum)]
