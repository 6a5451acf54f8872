"""The DeepEP V2 adapter (``deepep_v2``) over the CPU ``ElasticBuffer`` stand-in, under the stream sanitizer.

EP equals the dense reference at 2 and 4 ranks, DBO off and on, on prefill steps (``do_cpu_sync``, exact
receive sizes) and decode steps (no CPU sync: worst-case receive tensors whose unwritten rows the stand-in
fills with NaN and out-of-range ids, so an adapter that read them would fail), and with cached handles on
repeated decode steps. Each run proves what ran: the stand-in's buffer type and call count, the yields, how
many dispatches synced with the CPU and how many reused a handle. Then the rules: every removed wait is a
race the sanitizer reports, a handle cannot cross ubatches, a capture never syncs with the CPU, ``auto``
resolves to V2 only where V2 is there, and misuse of the V2 API fails as DeepEP's host asserts do.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import standin_harness
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
)
from standins import deep_ep as v1_standin
from standins import deep_ep_v2 as standin
from ubatch import UBatchConfig, UBatchWrapper, set_forward_context, streams
from ubatch.forward_context import DPMetadata
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.prepare_finalize import (
    AUTO_BACKEND,
    PHASE_AWARE_BACKENDS,
    deepep_v2,
    make_prepare_finalize,
    phase_backends,
)
from ubatch.modular_moe.runtime import MoERuntime
from ubatch.testing import stream_sanitizer
from ubatch.testing.thread_ranks import run_thread_ranks

CALLS_PER_LAYER = 2  # dispatch + combine, per ubatch
YIELDS_PER_LAYER = 2


@pytest.fixture(autouse=True)
def v2_standin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared stand-in stack builds its runtime over the V2 stand-in module (which also exports V1)."""
    monkeypatch.setattr(standin_harness, "standin_deep_ep", standin)


def run_v2(inputs: list[torch.Tensor], dbo: bool, prefill: bool, steps: int = 1, static_routing: bool = False,
           prepare: Callable[[StandinStack], None] | None = None, weights: Any = None) -> list[dict[str, Any]]:
    """Every rank runs ``steps`` steps of the stack on its tokens; per rank the outputs and what the adapter
    counted. ``prefill`` sets the DP vote's ``any_prefill`` (the same on every rank, as the vote makes it)."""
    weights = weights if weights is not None else bf16_weights()
    world = len(inputs)

    def rank_main(rank: int, groups: list[Any]) -> dict[str, Any]:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=world, all2all_backend="deepep_v2", ep_groups=groups,
                                     max_dispatch_tokens_per_rank=CAPACITY)
        model = StandinStack(weights, parallel)
        pf = model.deepep_v2()
        pf.static_routing = static_routing
        for layer in model.moe_layers:
            check_expert_inputs(layer.kernel.experts, EXPERTS // world)
        if prepare is not None:
            prepare(model)
        x = inputs[rank]
        dp = DPMetadata(num_tokens_across_dp=tuple(t.shape[0] for t in inputs), any_prefill=prefill)
        res: dict[str, Any] = {"outs": [], "yields": []}
        wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=60)) if dbo else None
        try:
            for _ in range(steps):
                if wrapper is None:
                    with set_forward_context(dp_metadata=dp):
                        res["outs"].append(model(x))
                else:
                    with set_forward_context(ubatch_slices=standin_harness._slices(x.shape[0], 2), dp_metadata=dp):
                        res["outs"].append(wrapper(x))
                    res["yields"].append(wrapper.last_yield_counts)
        finally:
            if wrapper is not None:
                wrapper.close()
        res.update(pf=pf, buffer_type=type(pf.buffer), calls=pf.buffer._calls, synced=pf.num_cpu_synced_dispatches,
                   cached=pf.num_cached_dispatches)
        return res

    return run_thread_ranks(world, rank_main, num_groups=2, timeout_s=120)


def check_expert_inputs(experts: Any, num_local_experts: int) -> None:
    """Fail if the experts are handed a row the dispatch never wrote: an id outside ``[-1, E_local)`` (a real
    kernel would index past its weights) or a routed row that is not finite (the stand-in's NaN garbage)."""
    apply = experts.apply

    def checked(tokens: Any, w13: torch.Tensor, w2: torch.Tensor, extras: Any = None) -> torch.Tensor:
        ids = tokens.topk_ids
        assert bool(((ids >= -1) & (ids < num_local_experts)).all()), f"expert ids out of range: {ids.unique()}"
        routed = (ids >= 0).any(dim=1)
        assert bool(tokens.hidden[routed].float().isfinite().all()), "a routed row was never written"
        assert bool(tokens.topk_weights[ids >= 0].isfinite().all()), "a routed weight was never written"
        return apply(tokens, w13, w2, extras)

    experts.apply = checked


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dbo", [False, True], ids=["dbo_off", "dbo_on"])
@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
def test_v2_equals_dense_under_the_sanitizer(prefill: bool, dbo: bool, world: int) -> None:
    weights, inputs = bf16_weights(), bf16_inputs(world)
    with stream_sanitizer.sanitizing() as races:
        results = run_v2(inputs, dbo, prefill, weights=weights)
    assert races == [], "\n\n".join(str(e) for e in races[:3])
    ubatches = 2 if dbo else 1
    for rank, res in enumerate(results):
        assert res["buffer_type"] is standin.ElasticBuffer
        assert res["calls"] == LAYERS * ubatches * CALLS_PER_LAYER
        assert res["synced"] == (LAYERS * ubatches if prefill else 0)
        assert res["cached"] == 0
        assert res["yields"] == ([[LAYERS * YIELDS_PER_LAYER] * 2] if dbo else [])
        assert_bf16_close(res["outs"][0], dense_reference(weights, inputs[rank], rank), f"rank {rank}")


@pytest.mark.parametrize("dbo", [False, True], ids=["dbo_off", "dbo_on"])
def test_cached_handles_on_repeated_decode_steps(dbo: bool) -> None:
    """With static routing the second decode step re-dispatches every (layer, ubatch) with the first step's
    handle (no layout work, no CPU sync), and still equals dense."""
    weights, inputs = bf16_weights(), bf16_inputs(2)
    with stream_sanitizer.sanitizing() as races:
        results = run_v2(inputs, dbo, prefill=False, steps=2, static_routing=True, weights=weights)
    assert races == [], "\n\n".join(str(e) for e in races[:3])
    ubatches = 2 if dbo else 1
    for rank, res in enumerate(results):
        assert res["cached"] == LAYERS * ubatches and res["synced"] == 0
        assert res["calls"] == 2 * LAYERS * ubatches * CALLS_PER_LAYER
        ref = dense_reference(weights, inputs[rank], rank)
        for step, out in enumerate(res["outs"]):
            assert_bf16_close(out, ref, f"rank {rank} step {step}")


def test_a_cached_handle_with_other_routing_fails_the_step() -> None:
    """Static routing is a promise: a step whose routing differs at the same shape trips the device assert."""
    weights = bf16_weights()
    first, second = bf16_inputs(2, seed=1), bf16_inputs(2, seed=2)

    def rank_main(rank: int, groups: list[Any]) -> None:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=2, all2all_backend="deepep_v2", ep_groups=groups,
                                     max_dispatch_tokens_per_rank=CAPACITY)
        model = StandinStack(weights, parallel)
        model.deepep_v2().static_routing = True
        with set_forward_context():
            model(first[rank])
        with pytest.raises(RuntimeError, match="routing differs from the cached handle"), set_forward_context():
            model(second[rank])

    run_thread_ranks(2, rank_main, num_groups=2, timeout_s=60)


# ---- removed waits are races ---------------------------------------------------------------------------
def _drop_wait(direction: str) -> Callable[[StandinStack], None]:
    """Make the adapter's ``direction`` hook a no-op: the kernel still yields, but nothing waits for DeepEP's
    comm stream before the received tensors are read."""
    def prepare(model: StandinStack) -> None:
        pf = model.deepep_v2()
        method = "prepare_async" if direction == "dispatch" else "finalize_async"
        original = getattr(pf, method)

        def without_wait(*args: Any) -> Any:
            _hook, receiver = original(*args)
            return (lambda: None), receiver

        shadow_method(pf, method, without_wait)
    return prepare


def _stale_previous_event(model: StandinStack) -> None:
    """``previous_event`` recorded on an unrelated stream: the comm stream no longer waits for the inputs."""
    pf = model.deepep_v2()
    elsewhere = streams.new_stream("cpu", name="unrelated")
    pf.buffer.capture = lambda: standin.EventHandle(elsewhere)


@pytest.mark.parametrize("removed", ["dispatch", "combine", "previous_event"])
@pytest.mark.parametrize("dbo", [False, True], ids=["dbo_off", "dbo_on"])
def test_each_removed_wait_is_reported(removed: str, dbo: bool) -> None:
    prepare = _stale_previous_event if removed == "previous_event" else _drop_wait(removed)
    # a sanitizer that raises also reports; the races list is the check
    with stream_sanitizer.sanitizing() as races, contextlib.suppress(Exception):
        run_v2(bf16_inputs(2), dbo, prefill=False, prepare=prepare)
    assert races, f"removing the {removed} wait went unreported"
    assert all("deep_ep-v2-comm" in str(e) for e in races), str(races[0])


# ---- the adapter's rules -------------------------------------------------------------------------------
def test_a_handle_used_by_another_ubatch_raises() -> None:
    def hand_ubatch0_state_to_all(model: StandinStack) -> None:
        pf = model.deepep_v2()
        states: dict[int, Any] = {}
        finalize = pf.finalize_async

        def finalize_with_ubatch0(out: torch.Tensor, state: Any) -> Any:
            states.setdefault(state.ubatch, state)
            return finalize(out, states[0])

        shadow_method(pf, "finalize_async", finalize_with_ubatch0)

    with pytest.raises(RuntimeError, match="ubatch 1 combines with the dispatch state of ubatch 0"):
        run_v2(bf16_inputs(2), dbo=True, prefill=False, prepare=hand_ubatch0_state_to_all)


def test_a_capture_never_syncs_with_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill-voted step inside a (stand-in) capture still dispatches without a CPU sync; a cached handle
    inside a capture is refused."""
    monkeypatch.setattr(deepep_v2, "_capturing", lambda: True)
    for res in run_v2(bf16_inputs(2), dbo=True, prefill=True):
        assert res["synced"] == 0 and res["calls"] == LAYERS * 2 * CALLS_PER_LAYER
    monkeypatch.setattr(deepep_v2, "_capturing", lambda: False)

    def capture_on_second_step(model: StandinStack) -> None:
        pf = model.deepep_v2()
        prepare = pf.prepare_async
        seen = {"n": 0}

        def maybe_capturing(*args: Any) -> Any:
            seen["n"] += 1
            monkeypatch.setattr(deepep_v2, "_capturing", lambda: seen["n"] > LAYERS)
            return prepare(*args)

        shadow_method(pf, "prepare_async", maybe_capturing)

    with pytest.raises(RuntimeError, match="cached handle inside a CUDA-graph capture"):
        run_v2(bf16_inputs(2), dbo=False, prefill=False, steps=2, static_routing=True,
               prepare=capture_on_second_step)


def test_too_many_tokens_and_fp32_are_refused_up_front() -> None:
    def body(rank: int, groups: list[Any]) -> None:
        pf = make_prepare_finalize("deepep_v2", num_experts=EXPERTS, hidden_size=HIDDEN, ep_rank=rank, ep_size=2,
                                   groups=groups, max_dispatch_tokens_per_rank=4, deep_ep_module=standin)
        x = torch.randn(5, HIDDEN).bfloat16()
        ids = torch.zeros(5, 2, dtype=torch.int64)
        with pytest.raises(ValueError, match="5 tokens exceed num_max_tokens_per_rank=4"):
            pf.prepare_async(x, torch.ones(5, 2), ids)
        with pytest.raises(ValueError, match="bf16 activations, got torch.float32"):
            pf.prepare_async(x[:4].float(), torch.ones(4, 2), ids[:4])

    run_thread_ranks(2, body, num_groups=1, timeout_s=60)


# ---- auto --------------------------------------------------------------------------------------------
def test_auto_is_v2_where_v2_is_there_and_names_the_rest() -> None:
    assert phase_backends(AUTO_BACKEND, deep_ep_module=standin) == ("deepep_v2", "deepep_v2")
    assert phase_backends(AUTO_BACKEND, deep_ep_module=v1_standin) == ("torch_ht", "torch_ll")  # V1 only: torch
    assert phase_backends("auto_deepep_v1") == ("deepep_high_throughput", "deepep_low_latency")
    assert phase_backends("auto_torch") == PHASE_AWARE_BACKENDS["auto_torch"] == ("torch_ht", "torch_ll")
    assert phase_backends("deepep_v2") is None
    runtime = MoERuntime(MoEParallelConfig(all2all_backend="auto"), deep_ep_module=standin)
    assert runtime.default_backend == runtime.backend_for_step() == "deepep_v2"


def test_auto_without_deep_ep_is_torch_and_deepep_v2_is_an_error() -> None:
    deepep_v2.deep_ep_v2_status.cache_clear()
    available, why = deepep_v2.deep_ep_v2_status()
    if available:
        pytest.skip(f"the real DeepEP V2 is usable here ({why})")
    assert phase_backends(AUTO_BACKEND) == ("torch_ht", "torch_ll")
    with pytest.raises(ImportError, match="deep_ep"):
        make_prepare_finalize("deepep_v2", num_experts=EXPERTS, hidden_size=HIDDEN, groups=[object()])


# ---- the stand-in follows V2's host asserts ------------------------------------------------------------
def on_two_ranks(body: Callable[[int, Any], Any]) -> list[Any]:
    return run_thread_ranks(2, lambda rank, groups: body(rank, groups[0]), num_groups=1, timeout_s=60)


def buffer_and_routing(rank: int, group: Any, tokens: int = 4) -> tuple[standin.ElasticBuffer, torch.Tensor,
                                                                          torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    buf = standin.ElasticBuffer(group, num_max_tokens_per_rank=CAPACITY, hidden=HIDDEN, num_topk=2)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    topk = torch.stack([torch.randperm(EXPERTS, generator=g)[:2] for _ in range(tokens)])
    return buf, x, topk, torch.rand(tokens, 2, generator=g)


def test_host_asserts_of_dispatch_and_combine() -> None:
    def body(rank: int, group: Any) -> None:
        buf, x, topk, w = buffer_and_routing(rank, group)
        with pytest.raises(RuntimeError, match="topk_idx_t .torch.int64., got torch.int32"):
            buf.dispatch(x, topk_idx=topk.int(), topk_weights=w, num_experts=EXPERTS)
        with pytest.raises(RuntimeError, match="topk_weights is torch.float32, got torch.float64"):
            buf.dispatch(x, topk_idx=topk, topk_weights=w.double(), num_experts=EXPERTS)
        with pytest.raises(RuntimeError, match="allocate_on_comm_stream"):
            buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=EXPERTS, previous_event=buf.capture())
        with pytest.raises(TypeError, match="not an EventOverlap"):
            buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=EXPERTS,
                         previous_event=standin.EventOverlap(buf.capture()),  # type: ignore[arg-type]  # the refused type
                         allocate_on_comm_stream=True)
        recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=EXPERTS)
        with pytest.raises(AssertionError, match="Cannot do CPU sync with cached handle"):
            buf.dispatch(x, handle=handle, do_cpu_sync=True)
        with pytest.raises(RuntimeError, match="kBFloat16, got torch.float32"):
            buf.combine(recv_x.float(), handle)
        with pytest.raises(RuntimeError, match="num_reduced_tokens == num_tokens"):
            buf.combine(recv_x[1:].contiguous(), handle)

    on_two_ranks(body)


def test_without_cpu_sync_only_the_counted_rows_are_written() -> None:
    """``do_cpu_sync=False``: worst-case rows; the handle's prefix sum counts the written ones, the rest is
    garbage; the same rows as the synced dispatch, and the cached dispatch returns them again."""
    def body(rank: int, group: Any) -> None:
        buf, x, topk, w = buffer_and_routing(rank, group)
        exact_x, exact_ids, exact_w, exact_handle, _ = buf.dispatch(x, topk_idx=topk, topk_weights=w,
                                                                    num_experts=EXPERTS)
        assert exact_handle.num_recv_tokens_per_expert_list  # filled with the CPU sync only
        big_x, big_ids, big_w, handle, _ = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=EXPERTS,
                                                        do_cpu_sync=False)
        n = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
        assert exact_ids is not None and exact_w is not None and big_ids is not None and big_w is not None
        assert n == exact_x.shape[0] and big_x.shape[0] == CAPACITY * 2 and handle.num_recv_tokens_per_expert_list == []
        assert torch.equal(big_x[:n], exact_x) and torch.equal(big_ids[:n], exact_ids)
        assert torch.equal(big_w[:n], exact_w)
        assert bool(big_x[n:].float().isnan().all()) and bool((big_ids[n:] >= EXPERTS).all())
        again, again_ids, _, same, _ = buf.dispatch(x * 2, handle=handle)
        assert same is handle and torch.equal(again[:n], exact_x * 2) and again_ids is not None
        assert torch.equal(again_ids[:n], exact_ids)

    on_two_ranks(body)


def test_minus_one_routes_send_nothing_and_combine_to_zero() -> None:
    def body(rank: int, group: Any) -> tuple[int, int, bool]:
        buf, x, topk, w = buffer_and_routing(rank, group)
        topk[0] = -1  # token 0 goes nowhere
        recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=EXPERTS)
        combined, _, _ = buf.combine(recv_x, handle)
        dest = torch.where(topk >= 0, topk // (EXPERTS // 2), torch.full_like(topk, -1))
        sends = sum(int((dest == d).any(dim=1).sum()) for d in range(2))  # (token, rank) pairs, none for token 0
        return recv_x.shape[0], sends, bool((combined[0] == 0).all())

    results = on_two_ranks(body)
    assert all(zero for _, _, zero in results)
    assert sum(rows for rows, _, _ in results) == sum(sends for _, sends, _ in results)


def test_async_dispatch_needs_current_stream_wait() -> None:
    """With ``async_with_compute_stream`` the compute stream does not wait: reading before the event's
    ``current_stream_wait()`` is a race the sanitizer reports."""
    def body(rank: int, group: Any) -> None:
        buf, x, topk, w = buffer_and_routing(rank, group)
        recv_x, *_, event = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=EXPERTS,
                                         previous_event=buf.capture(), allocate_on_comm_stream=True,
                                         async_with_compute_stream=True)
        if rank == 0:
            event.current_stream_wait()
        recv_x.sum()

    with stream_sanitizer.sanitizing() as races:
        on_two_ranks(body)
    assert len(races) == 1 and "deep_ep-v2-comm(rank 1)" in str(races[0]) and "read by sum" in str(races[0])
