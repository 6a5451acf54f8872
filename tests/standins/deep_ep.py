"""CPU stand-in for the part of ``deep_ep.Buffer`` the adapters use (tests only; pass it as ``deep_ep_module``).

Follows DeepEP's Python API (``deep_ep/buffers/legacy.py``, ``deep_ep/utils/event.py``) and the host-side
checks and stream rules of its C++ runtime: dtypes and shapes are checked where DeepEP's ``EP_HOST_ASSERT``s
check them (raising ``RuntimeError`` as DeepEP does), kernels run on the buffer's comm stream under the stream
layer so the sanitizer sees their ordering, and what it cannot model (FP8 high-throughput dispatch, LogFMT,
internode) raises ``NotImplementedError``.

The low-latency dispatch with ``use_fp8=True`` follows ``deep_ep/buffers/legacy.py``'s docstring and the kernel
(``csrc/kernels/legacy/internode_ll.cu``, ``utils.cuh``'s ``calculate_fp8_scales``): each token is cast per 128
columns with ``amax = max(1e-4, max |x|)``, scale ``amax / 448`` (``round_scale``: rounded up to a power of two),
values ``x / scale`` saturated to e4m3; the receiver gets ``(fp8 [E_local, capacity, H], fp32 scales
[E_local, capacity, H / 128])``, the scales column-major in their last two dims (allocated ``[E, H / 128,
capacity]`` and transposed, as ``csrc/legacy/buffer.hpp`` does), or with ``use_ue8m0`` (needs ``round_scale``)
the exponent bytes packed four to an int32, ``[E_local, capacity, H / 512]``; ``hidden % 512 == 0`` is asserted.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from standins.gloo_rows import all_to_all_rows, gather_matrix
from ubatch import streams
from ubatch.context import dbo_current_ubatch_id

__version__ = "2.1.0 (CPU stand-in)"
topk_idx_t = torch.int64
NUM_MAX_NVL_PEERS = 8
NUM_MAX_LOCAL_EXPERTS = 1024
NUM_BUFFER_ALIGNMENT_BYTES = 128
LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # SWITCH_HIDDEN in launch.cuh
LL_MAX_TOPK = 11  # kNumMaxTopK in internode_ll.cu
FP8_MARGIN, FP8_MAX = 1e-4, 448.0  # kFP8Margin, kFinfoAmaxE4M3 (csrc/kernels/legacy/utils.cuh)
HT_RANKS = (2, 4, 8)  # SWITCH_RANKS in launch.cuh


def _require(cond: bool, what: str) -> None:
    """DeepEP's ``EP_HOST_ASSERT``: a ``RuntimeError`` naming the failed condition."""
    if not cond:
        raise RuntimeError(f"DeepEP assertion failed: {what}")


def _check_topk_idx(topk_idx: torch.Tensor, where: str) -> None:
    # DeepEP reads it through ``data_ptr<topk_idx_t>()``, which throws for any other dtype.
    _require(topk_idx.dtype == topk_idx_t,
             f"{where}: topk_idx.scalar_type() == topk_idx_t (torch.int64), got {topk_idx.dtype}")


def cpu_stream(s: streams.Stream) -> streams.NullStream:
    """``s`` as the CPU stream it is: the stand-ins run on CPU tensors, whose streams are ``NullStream``."""
    assert isinstance(s, streams.NullStream), f"the DeepEP stand-ins run on CPU streams, not {s!r}"
    return s


def current_cpu_stream() -> streams.NullStream:
    """This thread's current CPU stream."""
    return cpu_stream(streams.current_stream("cpu"))


class Config:
    """``deep_ep.Config``: SMs and chunk sizes of the high-throughput kernels."""

    def __init__(self, num_sms: int, num_max_nvl_chunked_send_tokens: int, num_max_nvl_chunked_recv_tokens: int,
                 num_max_rdma_chunked_send_tokens: int, num_max_rdma_chunked_recv_tokens: int) -> None:
        _require(num_sms >= 0, "num_sms >= 0")
        _require(0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens,
                 "0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens")
        _require(num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0,
                 "num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens


class EventHandle:
    """``deep_ep.EventHandle``: an event recorded on ``stream`` (default: the current stream) at creation."""

    def __init__(self, stream: streams.Stream | None = None) -> None:
        self.event = streams.new_event("cpu")
        streams.record(self.event, stream if stream is not None else current_cpu_stream())

    def current_stream_wait(self) -> None:
        streams.wait(self.event)


class EventOverlap:
    """``deep_ep.EventOverlap`` (``deep_ep/utils/event.py``)."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], None] | None = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        assert self.event is not None
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            self.hook_after_wait()
            self.hook_after_wait = None
        if release_handle:
            self.event = None

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()


class Handle(tuple):
    """A DeepEP handle (a plain tuple in DeepEP), tagged with the call and the DBO ubatch that made it."""

    kind: str
    ubatch: int
    call: int
    topk_idx: torch.Tensor  # low-latency dispatch handles only (passed as ``extra``)

    def __new__(cls, items: Sequence[Any], kind: str, call: int, **extra: Any) -> Handle:
        obj = super().__new__(cls, items)
        obj.kind, obj.ubatch, obj.call = kind, dbo_current_ubatch_id(), call
        obj.__dict__.update(extra)
        return obj


def _check_same_ubatch(handle: Any, where: str) -> None:
    if not isinstance(handle, Handle):
        return
    ubatch = dbo_current_ubatch_id()
    if handle.ubatch != ubatch:
        raise RuntimeError(
            f"DeepEP stand-in: {where} got the handle of call #{handle.call}, made by DBO ubatch {handle.ubatch}, "
            f"in ubatch {ubatch}: a handle describes one dispatch's routing, reusing it for another ubatch's "
            "tokens combines the wrong rows (silently, on hardware)")


def ll_layout_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """``LowLatencyLayout::total_bytes`` (csrc/legacy/config.hpp): two send, two receive, two signal buffers."""
    num_scales = hidden // 128
    _require(num_scales * 4 <= hidden, "num_scales * sizeof(float) <= hidden")
    per_dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    per_combine_msg = num_scales * 4 + hidden * 2
    send = max(num_max_dispatch_tokens_per_rank * per_dispatch_msg,
               num_experts * num_max_dispatch_tokens_per_rank * per_combine_msg)
    recv = max(num_experts * num_max_dispatch_tokens_per_rank * per_dispatch_msg,
               num_experts * num_max_dispatch_tokens_per_rank * per_combine_msg)
    signal = -(-num_experts * 4 // 128) * 128
    return 2 * send + 2 * recv + 2 * signal


def _fp8_message(x: torch.Tensor, round_scale: bool) -> torch.Tensor:
    """Each bf16 token as the FP8 kernel sends it, ``[T, H + 4 * H / 128]`` bytes: e4m3 values, then fp32 scales."""
    t, h = x.shape
    groups = x.float().view(t, h // 128, 128)
    amax = groups.abs().amax(dim=-1).clamp(min=FP8_MARGIN)
    if round_scale:  # fast_log2_ceil / fast_pow2: the scale rounded up to a power of two
        scale_inv = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
        values = groups * (1.0 / scale_inv).unsqueeze(-1)
    else:
        scale_inv = amax * (1.0 / FP8_MAX)
        values = groups * (FP8_MAX / amax).unsqueeze(-1)
    q = values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(t, h)  # __NV_SATFINITE
    return torch.cat([q.view(torch.uint8), scale_inv.contiguous().view(torch.uint8)], dim=1)


def _fp8_unpack(msg: torch.Tensor, hidden: int, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A received FP8 message -> (values, scales in the receive layout: fp32, or four exponent bytes per int32)."""
    values = msg[:, :hidden].contiguous().view(torch.float8_e4m3fn)
    scales = msg[:, hidden:].contiguous().view(torch.float32)
    if not use_ue8m0:
        return values, scales
    exponents = (scales.view(torch.int32) >> 23).to(torch.uint8)  # extract_required_scale_format<true>
    return values, exponents.contiguous().view(torch.int32)


class _LLSlot:
    """One of the two halves of the LL buffer: the bytes results are returned in, and who owns them now."""

    def __init__(self) -> None:
        self.area: torch.Tensor | None = None
        self.owner = -1

    def view(self, shape: tuple[int, ...]) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        if self.area is None or self.area.numel() < numel:
            self.area = torch.empty(numel, dtype=torch.bfloat16)
        return self.area[:numel].view(shape)


class Buffer:
    """``deep_ep.Buffer`` on CPU: intranode high-throughput and low-latency kernels over gloo."""

    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None) -> None:
        if group is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        r = self.group_size
        _require(num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0, "num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0")
        _require(num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0, "num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0")
        _require(0 <= self.rank < r, "0 <= rank < num_ranks")
        _require(r < NUM_MAX_NVL_PEERS or r % NUM_MAX_NVL_PEERS == 0,
                 "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0")
        if low_latency_mode or r > NUM_MAX_NVL_PEERS:
            assert num_qps_per_rank > 0
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        self.num_qps_per_rank = num_qps_per_rank
        self._comm = cpu_stream(streams.new_stream("cpu", name=f"deep_ep-comm(rank {self.rank})"))
        self._calls = 0
        self._ll_idx = 0
        self._ll_slots = (_LLSlot(), _LLSlot())
        self._ll_pending: int | None = None  # call number whose receive hook has not run yet
        self.runtime = self  # ``buffer.runtime`` exists in DeepEP; nothing here reaches into it

    # ---- static API ----------------------------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (``Buffer.capture``), to pass as ``previous_event``."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        num_bytes = ll_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        return ((num_bytes + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES) * NUM_BUFFER_ALIGNMENT_BYTES

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        table = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128)}
        assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *table[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        table = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128)}
        assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *table[num_ranks])

    def get_comm_stream(self) -> streams.Stream:
        return self._comm

    # ---- stream rules of the high-throughput kernels ---------------------------------------------------
    @contextlib.contextmanager
    def _on_comm_stream(self, previous_event: EventOverlap | None, async_finish: bool,
                        allocate_on_comm_stream: bool) -> Iterator[dict[str, Any]]:
        """The comm stream waits for ``previous_event`` (else the current stream), runs the kernel, then
        either an event is recorded on it (``async_finish``) or the current stream waits for it."""
        if allocate_on_comm_stream:
            _require(previous_event is not None and async_finish, "previous_event.has_value() and async")
        compute = current_cpu_stream()
        handle = getattr(previous_event, "event", None)
        if handle is not None:
            streams.wait(handle.event, self._comm)
        else:
            self._comm.wait_stream(compute)
        out: dict[str, Any] = {"event": None}
        with streams.stream(self._comm):
            yield out
        if async_finish:
            out["event"] = EventHandle(self._comm)
        else:
            compute.wait_stream(self._comm)

    def _next_call(self) -> int:
        self._calls += 1
        return self._calls

    # ---- high throughput (intranode) -----------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        _require(topk_idx.dim() == 2, "topk_idx.dim() == 2")
        _require(topk_idx.is_contiguous(), "topk_idx.is_contiguous()")
        _require(num_experts > 0, "num_experts > 0")
        _check_topk_idx(topk_idx, "get_dispatch_layout")
        r = self.group_size
        _require(num_experts % r == 0, "num_experts % num_ranks == 0")
        with self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream) as launch:
            num_tokens = topk_idx.shape[0]
            routed = topk_idx >= 0
            per_expert = torch.bincount(topk_idx[routed], minlength=num_experts).to(torch.int32)
            dest = torch.where(routed, topk_idx // (num_experts // r), torch.full_like(topk_idx, r))
            in_rank = torch.zeros(num_tokens, r + 1, dtype=torch.bool)
            in_rank.scatter_(1, dest, True)
            is_token_in_rank = in_rank[:, :r].contiguous()
            per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
        return per_rank, None, per_expert, is_token_in_rank, EventOverlap(launch["event"])

    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], handle: tuple | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None, num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple[Any, ...]:
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if self.group_size > NUM_MAX_NVL_PEERS:
            raise NotImplementedError("DeepEP stand-in: internode dispatch (more than 8 ranks) is not modelled")
        if isinstance(x, tuple):
            raise NotImplementedError("DeepEP stand-in: FP8 (tuple) dispatch input is not modelled")
        r, me = self.group_size, self.rank
        _require(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        cached = handle is not None
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            _check_same_ubatch(handle, "dispatch")
            (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
             send_head) = handle
            _require(rank_prefix_matrix.dtype == torch.int32,
                     "cached_rank_prefix_matrix->scalar_type() == torch::kInt32")
        else:
            assert num_tokens_per_rank is not None and is_token_in_rank is not None
            assert num_tokens_per_expert is not None
            _require(num_tokens_per_expert.dtype == torch.int32,
                     "num_tokens_per_expert->scalar_type() == torch::kInt32")
            _require(num_tokens_per_rank.dtype == torch.int32, "num_tokens_per_rank->scalar_type() == torch::kInt32")
            _require(num_tokens_per_expert.dim() == 1 and num_tokens_per_expert.shape[0] % r == 0,
                     "num_tokens_per_expert->size(0) % num_ranks == 0")
            _require(num_tokens_per_expert.shape[0] // r <= NUM_MAX_LOCAL_EXPERTS,
                     "num_tokens_per_expert->size(0) / num_ranks <= NUM_MAX_LOCAL_EXPERTS")
            _require(tuple(num_tokens_per_rank.shape) == (r,), "num_tokens_per_rank->size(0) == num_ranks")
        assert is_token_in_rank is not None
        _require(is_token_in_rank.dtype == torch.bool, "is_token_in_rank.scalar_type() == torch::kBool")
        _require(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        _require((x.shape[1] * x.element_size()) % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        _require(is_token_in_rank.dim() == 2 and is_token_in_rank.is_contiguous()
                 and tuple(is_token_in_rank.shape) == (x.shape[0], r),
                 "is_token_in_rank is contiguous [num_tokens, num_ranks]")
        _require((topk_idx is None) == (topk_weights is None), "topk_idx.has_value() == topk_weights.has_value()")
        num_topk = 0
        if topk_idx is not None:
            assert topk_weights is not None and num_tokens_per_expert is not None
            num_topk = topk_idx.shape[1]
            _require(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx->dim() == 2 and is_contiguous()")
            _require(topk_weights.dim() == 2 and topk_weights.is_contiguous(),
                     "topk_weights->dim() == 2 and is_contiguous()")
            _require(topk_idx.shape[0] == x.shape[0] == topk_weights.shape[0],
                     "num_tokens == topk_idx->size(0) == topk_weights->size(0)")
            _require(num_topk == topk_weights.shape[1], "num_topk == topk_weights->size(1)")
            _require(topk_weights.dtype == torch.float32, "topk_weights->scalar_type() == torch::kFloat32")
            _check_topk_idx(topk_idx, "dispatch")
        if num_worst_tokens > 0:
            _require(topk_idx is not None, "topk_idx.has_value() (num_worst_tokens > 0)")
        num_channels = config.num_sms // 2
        hidden_bytes = x.shape[1] * x.element_size()
        _require(r * r * 4 + 4 * num_channels * r * 4 + num_channels * r * config.num_max_nvl_chunked_recv_tokens
                 * (hidden_bytes + 4 + num_topk * 8 + num_topk * 4) <= self.num_nvl_bytes,
                 "the intranode dispatch buffers fit in num_nvl_bytes")
        call = self._next_call()
        with self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream) as launch:
            counts = gather_matrix(self.group, is_token_in_rank.sum(dim=0))  # [src, dst]
            send_index = [is_token_in_rank[:, d].nonzero().squeeze(1) for d in range(r)]
            recv_counts = counts[:, me].tolist()
            recv_x = torch.cat(all_to_all_rows(self.group, [x.index_select(0, i) for i in send_index], recv_counts))
            recv_src_idx = torch.cat(all_to_all_rows(
                self.group, [i.to(torch.int32).unsqueeze(1) for i in send_index], recv_counts)).squeeze(1)
            recv_topk_idx = recv_topk_weights = None
            per_expert_list: list[int] = []
            if cached:
                pass  # the layout comes from the handle: only the tokens move
            elif topk_idx is not None:
                assert topk_weights is not None and num_tokens_per_expert is not None
                e_loc = num_tokens_per_expert.shape[0] // r
                local_ids, local_w = [], []
                for d, idx in enumerate(send_index):
                    ids = topk_idx.index_select(0, idx)
                    mine = (ids >= d * e_loc) & (ids < (d + 1) * e_loc)
                    local_ids.append(torch.where(mine, ids - d * e_loc, torch.full_like(ids, -1)))
                    zero = torch.zeros((), dtype=torch.float32)
                    local_w.append(torch.where(mine, topk_weights.index_select(0, idx), zero))
                recv_topk_idx = torch.cat(all_to_all_rows(self.group, local_ids, recv_counts))
                recv_topk_weights = torch.cat(all_to_all_rows(self.group, local_w, recv_counts))
                got = torch.bincount(recv_topk_idx[recv_topk_idx >= 0], minlength=e_loc).tolist()
                per_expert_list = [-(-n // expert_alignment) * expert_alignment for n in got]
            if not cached:
                rank_prefix_matrix = counts.cumsum(dim=0).to(torch.int32)
                channel_prefix_matrix = self._channel_prefix(is_token_in_rank, num_channels)
                recv_channel_prefix_matrix = self._recv_channel_prefix(channel_prefix_matrix, rank_prefix_matrix,
                                                                       num_channels)
                send_head = torch.full((x.shape[0], r), -1, dtype=torch.int32)
                for d, idx in enumerate(send_index):
                    send_head[idx, d] = torch.arange(idx.numel(), dtype=torch.int32)
        if cached:
            return recv_x, None, None, None, None, EventOverlap(launch["event"])
        handle = Handle((rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                         is_token_in_rank, send_head), "high_throughput", call, num_tokens=x.shape[0])
        return recv_x, recv_topk_idx, recv_topk_weights, per_expert_list, handle, EventOverlap(launch["event"])

    @staticmethod
    def _channel_prefix(is_token_in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
        """``[num_ranks, num_channels]``: per destination, tokens sent up to the end of each channel (tokens
        split into contiguous channel ranges, as ``get_channel_task_range``)."""
        num_tokens = is_token_in_rank.shape[0]
        per_channel = -(-num_tokens // num_channels) if num_tokens else 0
        ends = torch.tensor([min((c + 1) * per_channel, num_tokens) for c in range(num_channels)], dtype=torch.int64)
        prefix = torch.cat([torch.zeros(1, is_token_in_rank.shape[1], dtype=torch.int64),
                            is_token_in_rank.to(torch.int64).cumsum(dim=0)])
        return prefix.index_select(0, ends).t().contiguous().to(torch.int32)

    def _recv_channel_prefix(self, channel_prefix_matrix: torch.Tensor, rank_prefix_matrix: torch.Tensor,
                             num_channels: int) -> torch.Tensor:
        """``[num_ranks, num_channels]``: where each source's channels start in this rank's receive buffer."""
        theirs = gather_matrix(self.group, channel_prefix_matrix[:, :].reshape(-1)).view(
            self.group_size, self.group_size, num_channels)[:, self.rank]  # [src, channel]: prefix towards me
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), rank_prefix_matrix[:-1, self.rank].to(torch.int64)])
        shifted = torch.cat([torch.zeros(self.group_size, 1, dtype=torch.int64), theirs[:, :-1]], dim=1)
        return (starts.unsqueeze(1) + shifted).to(torch.int32)

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None,
                bias: Any = None, config: Config | None = None, previous_event: EventOverlap | None = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        config = self.get_combine_config(self.group_size) if config is None else config
        if self.group_size > NUM_MAX_NVL_PEERS:
            raise NotImplementedError("DeepEP stand-in: internode combine (more than 8 ranks) is not modelled")
        _check_same_ubatch(handle, "combine")
        rank_prefix_matrix, _, channel_prefix_matrix, src_idx, is_recv_token_in_rank, send_head = handle
        r, me = self.group_size, self.rank
        bias_0, bias_1 = (bias, None) if isinstance(bias, torch.Tensor) else (bias or (None, None))
        _require(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        _require(src_idx.dim() == 1 and src_idx.dtype == torch.int32, "src_idx is 1-D torch::kInt32")
        _require(send_head.dim() == 2 and send_head.dtype == torch.int32, "send_head is 2-D torch::kInt32")
        _require(rank_prefix_matrix.dtype == torch.int32 and tuple(rank_prefix_matrix.shape) == (r, r),
                 "rank_prefix_matrix is [num_ranks, num_ranks] torch::kInt32")
        _require(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        _require(src_idx.shape[0] == x.shape[0], f"src_idx.size(0) == num_tokens ({src_idx.shape[0]} vs x "
                                                 f"{tuple(x.shape)}: expert output of another dispatch?)")
        _require(send_head.shape[1] == r, "send_head.size(1) == num_ranks")
        _require((x.shape[1] * x.element_size()) % 16 == 0, "(hidden * x.element_size()) % sizeof(int4) == 0")
        _require(r in HT_RANKS, f"intranode combine supports {HT_RANKS} ranks (SWITCH_RANKS), got {r}")
        _require(x.dtype == torch.bfloat16,
                 f"intranode combine supports CUDA_R_16BF only (SWITCH_TYPES), got {x.dtype}")
        num_recv = send_head.shape[0]
        self._next_call()
        if topk_weights is not None:
            _require(topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.shape[0] == x.shape[0]
                     and topk_weights.dtype == torch.float32,
                     "topk_weights is contiguous [num_tokens, k] torch::kFloat32")
        for b in (bias_0, bias_1):
            if b is not None:
                _require(b.dim() == 2 and b.is_contiguous() and b.dtype == x.dtype
                         and tuple(b.shape) == (num_recv, x.shape[1]),
                         "bias is contiguous [num_recv_tokens, hidden] of x's dtype")
        with self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream) as launch:
            offsets = [0] + rank_prefix_matrix[:, me].tolist()
            from_src = [slice(offsets[s], offsets[s + 1]) for s in range(r)]
            back_counts = is_recv_token_in_rank.sum(dim=0).tolist()
            rows = all_to_all_rows(self.group, [x[s] for s in from_src], back_counts)
            origin = all_to_all_rows(self.group, [src_idx[s].to(torch.int64) for s in from_src], back_counts)
            out = torch.zeros(num_recv, x.shape[1], dtype=torch.float32)
            for part, idx in zip(rows, origin, strict=True):
                out.index_add_(0, idx, part.float())
            for b in (bias_0, bias_1):
                if b is not None:
                    out += b.float()
            combined = out.to(x.dtype)
            recv_topk_weights = None
            if topk_weights is not None:
                w_rows = all_to_all_rows(self.group, [topk_weights[s] for s in from_src], back_counts)
                recv_topk_weights = torch.zeros(num_recv, topk_weights.shape[1], dtype=torch.float32)
                for part, idx in zip(w_rows, origin, strict=True):
                    recv_topk_weights.index_add_(0, idx, part)
        return combined, recv_topk_weights, EventOverlap(launch["event"])

    # ---- low latency -----------------------------------------------------------------------------------
    def _ll_begin(self, what: str) -> tuple[int, _LLSlot]:
        """Claim the next slot for an LL call; refuse while an earlier receive hook is pending."""
        _require(self.low_latency_mode, "low_latency_mode")
        if self._ll_pending is not None:
            raise RuntimeError(
                f"DeepEP stand-in: {what} issued while the receive hook of LL call #{self._ll_pending} has not run; "
                f"this call's send phase cleans the signalling buffer of slot {self._ll_idx ^ 1}, which that pending "
                "receive polls (on hardware it hangs or reads garbage): run the hook before the next LL call")
        call = self._next_call()
        slot = self._ll_slots[self._ll_idx]
        slot.owner = call
        self._ll_idx ^= 1
        return call, slot

    def _ll_finish(self, call: int, slot: _LLSlot, receive: Callable[[], None], async_finish: bool,
                   return_recv_hook: bool, launch_stream: streams.Stream
                   ) -> tuple[EventHandle | None, Callable[[], None] | None]:
        """Run (or hand out as the hook) the receive phase on ``launch_stream``, then the stream rules."""
        def recv_phase() -> None:
            if slot.owner != call:
                raise RuntimeError(f"DeepEP stand-in: LL call #{call}'s buffer slot was taken by call #{slot.owner} "
                                   "before its receive ran: its data is overwritten")
            with streams.stream(launch_stream):
                receive()

        if not return_recv_hook:
            recv_phase()
            if async_finish:
                return EventHandle(launch_stream), None
            current_cpu_stream().wait_stream(launch_stream)
            return None, None
        self._ll_pending = call

        def hook() -> None:
            if self._ll_pending != call:
                raise RuntimeError(f"DeepEP stand-in: the receive hook of LL call #{call} ran twice (or after a "
                                   "later call); each hook must run exactly once")
            self._ll_pending = None
            recv_phase()

        return None, hook

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> tuple[Any, torch.Tensor, tuple, EventOverlap, Callable | None]:
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2
        _require(self.low_latency_mode, "low_latency_mode")
        _require(x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16,
                 f"x.dim() == 2 and x.is_contiguous() and x.scalar_type() == torch::kBFloat16 (got {x.dtype})")
        _require(x.shape[1] % 8 == 0 and x.shape[1] % 128 == 0,
                 "x.size(1) % sizeof(int4) == 0 and x.size(1) % 128 == 0")
        _require(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx.dim() == 2 and topk_idx.is_contiguous()")
        _require(x.shape[0] == topk_idx.shape[0] and x.shape[0] <= num_max_dispatch_tokens_per_rank,
                 f"x.size(0) == topk_idx.size(0) and x.size(0) <= num_max_dispatch_tokens_per_rank "
                 f"({x.shape[0]}, {topk_idx.shape[0]}, {num_max_dispatch_tokens_per_rank})")
        _check_topk_idx(topk_idx, "low_latency_dispatch")
        r, me = self.group_size, self.rank
        _require(num_experts % r == 0, "num_experts % num_ranks == 0")
        if cumulative_local_expert_recv_stats is not None:
            _require(cumulative_local_expert_recv_stats.dtype == torch.int32
                     and tuple(cumulative_local_expert_recv_stats.shape) == (num_experts // r,),
                     "cumulative_local_expert_recv_stats is [num_local_experts] torch::kInt")
        hidden, num_topk, e_loc = x.shape[1], topk_idx.shape[1], num_experts // r
        _require(hidden in LL_HIDDEN_SIZES, f"Unsupported hidden {hidden} (SWITCH_HIDDEN: {LL_HIDDEN_SIZES})")
        _require(num_topk <= LL_MAX_TOPK, f"num_topk <= kNumMaxTopK ({num_topk} > {LL_MAX_TOPK})")
        _require((r * num_max_dispatch_tokens_per_rank) % 4 == 0,
                 "(num_ranks * num_max_dispatch_tokens_per_rank) % 4 == 0: "
                 "TMA requires the number of tokens to be multiple of 4")
        _require(ll_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, r, num_experts) <= self.num_rdma_bytes,
                 "layout.total_bytes <= num_rdma_bytes")
        _require(not (async_finish and return_recv_hook), "not (async and return_recv_hook)")
        if use_fp8:
            _require(hidden % 512 == 0, f"hidden % 512 == 0 (FP8 dispatch), got {hidden}")
        if use_ue8m0:
            _require(round_scale, "round_scale (UE8M0 SF requires `round_scale=True`)")
        call, slot = self._ll_begin("low_latency_dispatch")
        compute = current_cpu_stream()
        launch_stream = compute if return_recv_hook else self._comm
        if not return_recv_hook:
            launch_stream.wait_stream(compute)
        capacity = r * num_max_dispatch_tokens_per_rank
        recv_x = slot.view((e_loc, capacity, hidden)) if not use_fp8 else \
            torch.empty((e_loc, capacity, hidden), dtype=torch.float8_e4m3fn)
        recv_scales = None
        if use_fp8:  # column-major scales: allocated [E, groups, capacity], handed over transposed
            groups, dtype = (hidden // 512, torch.int32) if use_ue8m0 else (hidden // 128, torch.float32)
            recv_scales = torch.empty((e_loc, groups, capacity), dtype=dtype).transpose(1, 2)
        recv_count = torch.empty(e_loc, dtype=torch.int32)
        src_info = torch.empty(e_loc, capacity, dtype=torch.int32)
        layout_range = torch.empty(e_loc, r, dtype=torch.int64)
        with streams.stream(launch_stream):  # send phase: every (token, expert) pair to the expert's rank
            token_of, expert_of = (topk_idx >= 0).nonzero(as_tuple=True)
            expert_ids = topk_idx[token_of, expert_of]
            dest = expert_ids // e_loc
            picks = [(dest == d).nonzero().squeeze(1) for d in range(r)]
            sent = x if not use_fp8 else _fp8_message(x, round_scale)  # bf16 rows, or fp8 bytes + fp32 scales
            rows = all_to_all_rows(self.group, [sent.index_select(0, token_of.index_select(0, p)) for p in picks])
            pairs = [torch.stack([token_of.index_select(0, p), expert_ids.index_select(0, p)], 1) for p in picks]
            meta = all_to_all_rows(self.group, pairs, [t.shape[0] for t in rows])

        def receive() -> None:  # pack per local expert: source ranks in order, each source's tokens in order
            recv_count.zero_()
            for s, (part, m) in enumerate(zip(rows, meta, strict=True)):
                local = m[:, 1] - me * e_loc
                for e in range(e_loc):
                    sel = (local == e).nonzero().squeeze(1)
                    n, begin = sel.numel(), int(recv_count[e])
                    got = part.index_select(0, sel)
                    if recv_scales is None:
                        recv_x[e, begin:begin + n] = got
                    else:
                        values, scales = _fp8_unpack(got, hidden, use_ue8m0)
                        recv_x[e, begin:begin + n] = values
                        recv_scales[e, begin:begin + n] = scales
                    src_info[e, begin:begin + n] = m.index_select(0, sel)[:, 0].to(torch.int32)
                    layout_range[e, s] = n | (begin << 32)  # pack2<int, int64_t>(num_recv_tokens, begin)
                    recv_count[e] += n

        event, hook = self._ll_finish(call, slot, receive, async_finish, return_recv_hook, launch_stream)
        handle = Handle((src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts),
                        "low_latency", call, topk_idx=topk_idx.clone())
        tensors = (x, topk_idx, recv_x, recv_scales, recv_count, src_info, layout_range,
                   cumulative_local_expert_recv_stats)
        out = (recv_x, recv_scales) if recv_scales is not None else recv_x
        return out, recv_count, handle, EventOverlap(event, tensors if async_finish else None), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, EventOverlap, Callable | None]:
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2
        r, me = self.group_size, self.rank
        e_loc = num_experts // r
        _require(self.low_latency_mode, "low_latency_mode")
        _require(x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16,
                 f"x.dim() == 3 and x.is_contiguous() and x.scalar_type() == torch::kBFloat16 (got {x.dtype}, "
                 f"contiguous={x.is_contiguous()})")
        _require(x.shape[0] == e_loc and x.shape[1] == r * num_max_dispatch_tokens_per_rank,
                 "x is [num_experts / num_ranks, num_ranks * num_max_dispatch_tokens_per_rank, hidden]")
        _require(x.shape[2] % 8 == 0 and x.shape[2] % 128 == 0,
                 "x.size(2) % sizeof(int4) == 0 and x.size(2) % 128 == 0")
        _require(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx.dim() == 2 and topk_idx.is_contiguous()")
        _require(tuple(topk_idx.shape) == tuple(topk_weights.shape), "topk_idx and topk_weights have one shape")
        _check_topk_idx(topk_idx, "low_latency_combine")
        _require(topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32,
                 "topk_weights is contiguous 2-D torch::kFloat32")
        _require(topk_weights.shape[0] <= num_max_dispatch_tokens_per_rank,
                 "topk_weights.size(0) <= num_max_dispatch_tokens_per_rank")
        _require(src_info.dim() == 2 and src_info.dtype == torch.int32 and src_info.shape[0] == x.shape[0],
                 "src_info is 2-D torch::kInt32 with x.size(0) rows")
        _require(layout_range.dtype == torch.int64 and tuple(layout_range.shape) == (e_loc, r),
                 "layout_range is [num_local_experts, num_ranks] torch::kInt64")
        _require(x.shape[2] in LL_HIDDEN_SIZES, f"Unsupported hidden {x.shape[2]} (SWITCH_HIDDEN)")
        _require(ll_layout_bytes(num_max_dispatch_tokens_per_rank, x.shape[2], r, num_experts) <= self.num_rdma_bytes,
                 "layout.total_bytes <= num_rdma_bytes")
        _require(not (async_finish and return_recv_hook), "not (async and return_recv_hook)")
        if use_logfmt or zero_copy:
            raise NotImplementedError("DeepEP stand-in: LogFMT and zero-copy LL combine are not modelled")
        _check_same_ubatch(handle, "low_latency_combine")
        if isinstance(handle, Handle) and not torch.equal(handle.topk_idx, topk_idx):
            raise RuntimeError(f"DeepEP stand-in: low_latency_combine's topk_idx is not the one LL dispatch call "
                               f"#{handle.call} routed with: the handle belongs to another dispatch")
        num_tokens = topk_weights.shape[0]
        if out is not None:
            _require(out.dim() == 2 and out.is_contiguous() and tuple(out.shape) == (num_tokens, x.shape[2])
                     and out.dtype == x.dtype, "out is contiguous [num_combined_tokens, hidden] of x's dtype")
        call, slot = self._ll_begin("low_latency_combine")
        compute = current_cpu_stream()
        launch_stream = compute if return_recv_hook else self._comm
        if not return_recv_hook:
            launch_stream.wait_stream(compute)
        combined = out if out is not None else slot.view((num_tokens, x.shape[2]))
        with streams.stream(launch_stream):  # send phase: each expert's rows back to their home rank
            back_rows: list[list[torch.Tensor]] = [[] for _ in range(r)]
            back_meta: list[list[torch.Tensor]] = [[] for _ in range(r)]
            for e in range(e_loc):
                for s in range(r):
                    packed = int(layout_range[e, s])
                    n, begin = packed & 0xFFFFFFFF, packed >> 32
                    back_rows[s].append(x[e, begin:begin + n])
                    tokens = src_info[e, begin:begin + n].to(torch.int64)
                    back_meta[s].append(torch.stack([tokens, torch.full_like(tokens, me * e_loc + e)], 1))
            rows = all_to_all_rows(self.group, [torch.cat(b) for b in back_rows])
            meta = all_to_all_rows(self.group, [torch.cat(m) for m in back_meta], [t.shape[0] for t in rows])

        def receive() -> None:  # weighted sum over each token's experts, in fp32, written as bf16
            acc = torch.zeros(num_tokens, x.shape[2], dtype=torch.float32)
            for part, m in zip(rows, meta, strict=True):
                tokens, experts = m[:, 0], m[:, 1]
                k = (topk_idx.index_select(0, tokens) == experts.unsqueeze(1)).to(torch.int64).argmax(dim=1)
                w = topk_weights[tokens, k]
                acc.index_add_(0, tokens, part.float() * w.unsqueeze(1))
            combined.copy_(acc)

        event, hook = self._ll_finish(call, slot, receive, async_finish, return_recv_hook, launch_stream)
        tensors = (x, topk_idx, topk_weights, src_info, layout_range, combined)
        return combined, EventOverlap(event, tensors if async_finish else None), hook
