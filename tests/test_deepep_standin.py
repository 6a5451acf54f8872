"""The DeepEP adapters over the CPU DeepEP stand-in (``tests/standins/deep_ep.py``), under the stream sanitizer.

EP equals the dense reference for the low-latency and high-throughput adapters at 2 and 4 ranks, DBO off and
on, with no stream-order race; each run also proves the stand-in served it (buffer type, call count) and
that DBO yielded as often as the backend claims. Then misuse of DeepEP's API fails the way it would on a GPU:
int32 ``topk_idx``, fp32 activations, a third LL result held, an LL call with a receive still pending, a
handle reused across ubatches, an unawaited ``async_finish`` event.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from moe_harness import dense_reference, shadow_method
from standin_harness import (
    CAPACITY,
    EXPERTS,
    HIDDEN,
    LAYERS,
    StandinStack,
    assert_bf16_close,
    bf16_inputs,
    bf16_weights,
    run_standin_ep,
)
from standins import deep_ep as standin
from ubatch import streams
from ubatch.modular_moe.prepare_finalize import make_prepare_finalize
from ubatch.modular_moe.prepare_finalize.deepep import DeepEPLowLatency
from ubatch.testing import stream_sanitizer
from ubatch.testing.thread_ranks import run_thread_ranks

BACKENDS = ("deepep_low_latency", "deepep_high_throughput")
CALLS_PER_LAYER = 2  # dispatch + combine, per ubatch, for both modes


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dbo", [False, True], ids=["dbo_off", "dbo_on"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_deepep_adapter_equals_dense_under_the_sanitizer(backend: str, dbo: bool, world: int) -> None:
    weights, inputs = bf16_weights(), bf16_inputs(world)
    with stream_sanitizer.sanitizing() as races:
        results = run_standin_ep(weights, inputs, backend, dbo)
    assert races == [], "\n\n".join(str(e) for e in races[:3])
    ubatches = 2 if dbo else 1
    for rank, res in enumerate(results):
        assert res["buffer_type"] is standin.Buffer
        assert res["calls"] == LAYERS * ubatches * CALLS_PER_LAYER
        assert res["yields"] == ([LAYERS * res["per_layer"]] * 2 if dbo else [])
        assert res["per_layer"] == (2 if backend == "deepep_low_latency" else 3)
        assert_bf16_close(res["out"], dense_reference(weights, inputs[rank], rank), f"{backend} rank {rank}")


# ---- misuse fails as on hardware -----------------------------------------------------------------------
def on_two_ranks(body: Callable[[int, Any], Any]) -> list[Any]:
    """``body(rank, group)`` on two thread ranks sharing a gloo group (both must make the same DeepEP calls)."""
    return run_thread_ranks(2, lambda rank, groups: body(rank, groups[0]), num_groups=1, timeout_s=60)


def ll_buffer(group: Any) -> standin.Buffer:
    nbytes = standin.Buffer.get_low_latency_rdma_size_hint(CAPACITY, HIDDEN, group.size(), EXPERTS)
    return standin.Buffer(group, num_rdma_bytes=nbytes, low_latency_mode=True, num_qps_per_rank=EXPERTS // 2)


def routing(rank: int, tokens: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    topk = torch.stack([torch.randperm(EXPERTS, generator=g)[:2] for _ in range(tokens)])
    return x, topk


def test_int32_topk_idx_raises_in_every_entry_point() -> None:
    def body(rank: int, group: Any) -> list[str]:
        x, topk = routing(rank)
        messages = []
        ht = standin.Buffer(group, num_nvl_bytes=1 << 30)
        for call in (lambda: ht.get_dispatch_layout(topk.int(), EXPERTS),
                     lambda: ll_buffer(group).low_latency_dispatch(x, topk.int(), CAPACITY, EXPERTS, use_fp8=False)):
            with pytest.raises(RuntimeError, match="topk_idx_t") as info:
                call()
            messages.append(str(info.value))
        return messages

    for messages in on_two_ranks(body):
        assert len(messages) == 2 and all("torch.int32" in m for m in messages)


def test_low_latency_takes_bf16_of_a_supported_hidden_size_only() -> None:
    def body(rank: int, group: Any) -> None:
        x, topk = routing(rank)
        buf = ll_buffer(group)
        with pytest.raises(RuntimeError, match="kBFloat16"):
            buf.low_latency_dispatch(x.float(), topk, CAPACITY, EXPERTS, use_fp8=False)
        small = standin.Buffer(group, num_rdma_bytes=1 << 26, low_latency_mode=True, num_qps_per_rank=4)
        with pytest.raises(RuntimeError, match="Unsupported hidden 256"):
            small.low_latency_dispatch(x[:, :256].contiguous(), topk, CAPACITY, EXPERTS, use_fp8=False)

    on_two_ranks(body)


def test_adapters_check_what_deepep_requires_up_front() -> None:
    def body(rank: int, group: Any) -> None:
        with pytest.raises(ValueError, match="multiple of 4"):
            DeepEPLowLatency(EXPERTS, rank, 2, [group], HIDDEN, 7, deep_ep_module=standin)
        ll = make_prepare_finalize("deepep_low_latency", num_experts=EXPERTS, hidden_size=HIDDEN, ep_rank=rank,
                                   ep_size=2, groups=[group], max_dispatch_tokens_per_rank=CAPACITY,
                                   deep_ep_module=standin)
        x, topk = routing(rank)
        with pytest.raises(ValueError, match="bf16 activations, got torch.float32"):
            ll.prepare_async(x.float(), torch.ones(4, 2), topk)

    on_two_ranks(body)


def test_the_real_backends_still_need_the_real_package() -> None:
    with pytest.raises(ImportError, match="deep_ep"):
        make_prepare_finalize("deepep_high_throughput", num_experts=EXPERTS, hidden_size=HIDDEN, groups=[object()])


def test_a_third_ll_result_overwrites_the_first() -> None:
    """Two buffer slots: the third LL call's results land where the first call's still are."""
    def body(rank: int, group: Any) -> tuple[bool, bool, bool]:
        buf = ll_buffer(group)
        results = []
        topk = torch.tensor([[0, EXPERTS // 2]] * 4)  # every token to local expert 0 of both ranks
        for call in range(3):
            x, _ = routing(rank, seed=call)  # different tokens per call
            recv_x, count, _, _, _ = buf.low_latency_dispatch(x, topk, CAPACITY, EXPERTS, use_fp8=False)
            n = int(count[0])
            results.append((recv_x, n, recv_x[0, :n].clone()))
        (first, n_first, first_rows), _, (third, n_third, third_rows) = results
        rows = min(n_first, n_third)
        assert rows == 8  # 4 tokens from each of the 2 ranks
        return (first.data_ptr() == third.data_ptr() != results[1][0].data_ptr(),
                torch.equal(first[0, :rows], third_rows[:rows]),
                not torch.equal(first[0, :rows], first_rows[:rows]))

    for aliased, now_third, no_longer_first in on_two_ranks(body):
        assert aliased and now_third and no_longer_first


def test_an_ll_call_while_a_receive_hook_is_pending_raises() -> None:
    def body(rank: int, group: Any) -> None:
        buf = ll_buffer(group)
        x, topk = routing(rank)
        _, _, _, _, hook = buf.low_latency_dispatch(x, topk, CAPACITY, EXPERTS, use_fp8=False, return_recv_hook=True)
        assert hook is not None
        with pytest.raises(RuntimeError, match="receive hook of LL call #1 has not run"):
            buf.low_latency_dispatch(x, topk, CAPACITY, EXPERTS, use_fp8=False, return_recv_hook=True)
        hook()
        with pytest.raises(RuntimeError, match="ran twice"):
            hook()

    on_two_ranks(body)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_handle_reused_across_ubatches_raises(backend: str) -> None:
    """A buggy adapter that combines ubatch 1 with ubatch 0's handle: the stand-in refuses (DeepEP would
    combine the wrong rows without a word)."""
    def reuse_ubatch0_handle(model: StandinStack) -> None:
        pf = model.deepep()
        finalize = pf.finalize_async
        shadow_method(pf, "finalize_async", lambda out, state: finalize(out, (*state[:-1], 0)))

    with pytest.raises(RuntimeError, match="made by DBO ubatch 0, in ubatch 1"):
        run_standin_ep(bf16_weights(), bf16_inputs(2), backend, dbo=True, prepare=reuse_ubatch0_handle)


def test_low_latency_adapter_refuses_a_third_ubatch() -> None:
    with pytest.raises(ValueError, match="at most two ubatches in flight"):
        run_standin_ep(bf16_weights(), bf16_inputs(2, base_tokens=9), "deepep_low_latency", dbo=True, num_ubatches=3)


@pytest.mark.parametrize("wait", [False, True], ids=["no_wait", "current_stream_wait"])
def test_async_finish_leaves_the_wait_to_the_caller(wait: bool) -> None:
    """With ``async_finish`` the current stream does not wait for DeepEP's comm stream: reading the received
    tokens before ``event.current_stream_wait()`` is a race the sanitizer reports."""
    def body(rank: int, group: Any) -> None:
        buf = standin.Buffer(group, num_nvl_bytes=1 << 30)
        x, topk = routing(rank)
        weights = torch.ones(4, 2)
        before = buf.capture()  # after every input was written: the comm stream waits for this event only
        per_rank, _, per_expert, in_rank, layout_done = buf.get_dispatch_layout(
            topk, EXPERTS, previous_event=before, async_finish=True, allocate_on_comm_stream=True)
        recv_x, *_, done = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                        num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights,
                                        previous_event=layout_done, async_finish=True)
        if wait:
            done.current_stream_wait()
        recv_x.sum()

    with stream_sanitizer.sanitizing() as races:
        on_two_ranks(body)
    if wait:
        assert races == []
    else:
        assert len(races) == 2 and all("deep_ep-comm" in str(e) and "read by sum" in str(e) for e in races)


def test_allocate_on_comm_stream_needs_previous_event_and_async_finish() -> None:
    def body(rank: int, group: Any) -> None:
        _, topk = routing(rank)
        buf = standin.Buffer(group, num_nvl_bytes=1 << 30)
        with pytest.raises(RuntimeError, match="previous_event.has_value\\(\\) and async"):
            buf.get_dispatch_layout(topk, EXPERTS, allocate_on_comm_stream=True)

    on_two_ranks(body)


def test_high_throughput_combine_reduces_bf16_only() -> None:
    def body(rank: int, group: Any) -> None:
        buf = standin.Buffer(group, num_nvl_bytes=1 << 30)
        x, topk = routing(rank)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, EXPERTS)
        recv_x, _, _, _, handle, _ = buf.dispatch(x.float(), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=topk,
                                                  topk_weights=torch.ones(4, 2))
        with pytest.raises(RuntimeError, match="CUDA_R_16BF"):
            buf.combine(recv_x, handle)

    on_two_ranks(body)


def test_stand_in_streams_are_null_streams_named_per_rank() -> None:
    def body(rank: int, group: Any) -> str:
        stream = standin.Buffer(group, num_nvl_bytes=1 << 30).get_comm_stream()
        assert isinstance(stream, streams.NullStream)
        return stream.name

    assert on_two_ranks(body) == ["deep_ep-comm(rank 0)", "deep_ep-comm(rank 1)"]


def test_cached_dispatch_and_weighted_combine_follow_the_handle() -> None:
    """``dispatch(x, handle=...)`` reuses the first dispatch's layout; ``combine`` sums each token's rows over
    the ranks it went to (no weights) and, given ``topk_weights``, sums those too."""
    def body(rank: int, group: Any) -> None:
        buf = standin.Buffer(group, num_nvl_bytes=1 << 30)
        x, topk = routing(rank)
        weights = torch.rand(4, 2)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, EXPERTS)
        recv_x, recv_ids, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk, topk_weights=weights)
        assert sum(counts) == int((recv_ids >= 0).sum())  # every received (token, local expert) pair counted
        again, none_ids, _, _, no_handle, _ = buf.dispatch(x * 2, handle=handle)
        assert none_ids is None and no_handle is None and torch.equal(again, recv_x * 2)
        combined, summed_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        copies = in_rank.sum(dim=1, keepdim=True).to(torch.float32)  # ranks each token went to
        assert torch.equal(combined, (x.float() * copies).to(torch.bfloat16))
        assert summed_w is not None
        assert torch.allclose(summed_w, weights)  # each rank kept the weights of its own experts only

    on_two_ranks(body)


def test_rdma_size_hint_is_what_low_latency_needs() -> None:
    def body(rank: int, group: Any) -> None:
        hint = standin.Buffer.get_low_latency_rdma_size_hint(CAPACITY, HIDDEN, 2, EXPERTS)
        assert hint % 128 == 0
        x, topk = routing(rank)
        short = standin.Buffer(group, num_rdma_bytes=hint - 256, low_latency_mode=True, num_qps_per_rank=4)
        with pytest.raises(RuntimeError, match="layout.total_bytes <= num_rdma_bytes"):
            short.low_latency_dispatch(x, topk, CAPACITY, EXPERTS, use_fp8=False)
        enough = standin.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=4)
        enough.low_latency_dispatch(x, topk, CAPACITY, EXPERTS, use_fp8=False)

    on_two_ranks(body)
