"""SBO over the DeepEP V2 adapter (``deepep_v2``) on its CPU stand-in, under the stream sanitizer.

The adapter's SBO rule (``deepep_v2``'s module docstring): the combine is launched on whatever stream is
current -- the SBO alternate stream in the two-stream mode -- and its ``previous_event``, captured there,
orders DeepEP's comm stream after the expert output; the hook's ``current_stream_wait`` joins the stream that
runs it (the caller's) to the comm stream. Here, at 2 thread ranks, DBO off and on, prefill and decode steps,
each mode V2 runs (``select_sbo_modes`` picks ``dispatch_shared_experts`` off Blackwell and
``combine_shared_experts`` on it) must equal the dense-with-shared-experts reference (and SBO off, bit for bit),
with no race, and the event log of every rank shows the mode ran: which ubatch captured, launched and waited
on which stream, and where the shared experts ran relative to them. Then the waits the rule needs: removing
each is reported; the two joins that carry no data for V2 are not. ``combine_down_gemm`` cannot run on V2 (no
``comp_signal`` in ``ElasticBuffer.combine``): selecting never picks it, and forcing it is refused by name.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import pytest
import torch

import standin_harness
from moe_harness import StackWeights, dense_reference
from standin_harness import LAYERS, LinearShared, StandinStack, assert_bf16_close, bf16_inputs, bf16_weights
from standins import deep_ep_v2 as standin
from test_stream_mutations import without_waits_in
from ubatch import UBatchConfig, UBatchWrapper, set_forward_context, streams
from ubatch.context import dbo_current_ubatch_id
from ubatch.forward_context import DPMetadata
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.two_stream import TwoStreamCombine, alt_stream
from ubatch.sbo import (
    ENV_SHARED_EXPERTS_OUTSIDE,
    SBO_OFF,
    DeviceProps,
    OverlapArgs,
    SboFlags,
    check_sbo_modes,
    compute_overlap_args,
    select_sbo_modes,
)
from ubatch.testing import stream_sanitizer
from ubatch.testing.thread_ranks import run_thread_ranks

D = SboFlags(dispatch_shared_experts=True)
CS = SboFlags(combine_shared_experts=True)
DG = SboFlags(combine_down_gemm=True)
VARIANTS = [SBO_OFF, D, CS]  # SBO off first: every other variant is compared with it bit for bit
HOPPER = DeviceProps("cuda", "H100", (9, 0), 132)
BLACKWELL = DeviceProps("cuda", "B200", (10, 0), 148)

Entry = tuple[str, int, str, int]  # (what, the ubatch whose MoE call it is, the stream then, the ubatch running)


@pytest.fixture(autouse=True)
def v2_standin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared stand-in stack builds its runtime over the V2 stand-in module (which also exports V1)."""
    monkeypatch.setattr(standin_harness, "standin_deep_ep", standin)


# ---- the run and its event log -------------------------------------------------------------------------
def instrument(model: StandinStack, log: list[Entry], main: streams.Stream) -> None:
    """Log, per MoE call, every ``capture()`` (where ``previous_event`` is recorded), every dispatch/combine
    launch, every hook's ``current_stream_wait`` (tagged with the ubatch that launched it: under DBO another
    ubatch runs it) and every shared-experts call, each with the stream current at that moment."""
    alt = alt_stream("cpu")

    def where() -> str:
        s = streams.current_stream("cpu")
        return "main" if s is main else "alt" if s is alt else getattr(s, "name", repr(s))

    def note(what: str, owner: int | None = None) -> None:
        running = dbo_current_ubatch_id()
        log.append((what, running if owner is None else owner, where(), running))

    buf = model.buffer()  # one ElasticBuffer for every layer and ubatch
    capture = buf.capture

    def logged_capture() -> Any:
        note("capture")
        return capture()

    def logged_launch(name: str, launch: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            owner = dbo_current_ubatch_id()
            note(name)
            *outputs, event = launch(*args, **kwargs)
            wait = event.current_stream_wait  # what the adapter hands to the kernel as the hook

            def logged_wait(*a: Any, **kw: Any) -> None:
                note(f"{name}_wait", owner)
                wait(*a, **kw)

            event.current_stream_wait = logged_wait
            return (*outputs, event)
        return call

    buf.capture = logged_capture
    buf.dispatch = logged_launch("dispatch", buf.dispatch)
    buf.combine = logged_launch("combine", buf.combine)
    for layer in model.moe_layers:
        kernel = layer.kernel
        shared = kernel.shared_experts
        assert shared is not None

        def logged_shared(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor] = shared) -> torch.Tensor:
            note("shared")
            return fn(x)

        kernel.shared_experts = logged_shared


def run_sbo(weights: StackWeights, inputs: list[torch.Tensor], variants: list[SboFlags], dbo: bool, prefill: bool,
            prepare: Callable[[StandinStack], None] | None = None) -> list[list[dict[str, Any]]]:
    """Per rank, per SBO variant: the stack's ``out`` (shared experts on), the ``log`` of :func:`instrument`,
    the DBO ``yields``, the adapter's CPU-synced dispatches and the stand-in's call count."""
    world = len(inputs)

    def rank_main(rank: int, groups: list[Any]) -> list[dict[str, Any]]:
        results = []
        for flags in variants:
            parallel = MoEParallelConfig(ep_rank=rank, ep_size=world, all2all_backend="deepep_v2", ep_groups=groups,
                                         max_dispatch_tokens_per_rank=standin_harness.CAPACITY, sbo=flags)
            model = StandinStack(weights, parallel, shared=True)
            assert all(layer.kernel.sbo == flags for layer in model.moe_layers)
            main = streams.current_stream("cpu")
            log: list[Entry] = []
            instrument(model, log, main)
            if prepare is not None:
                prepare(model)
            x = inputs[rank]
            dp = DPMetadata(num_tokens_across_dp=tuple(t.shape[0] for t in inputs), any_prefill=prefill)
            res: dict[str, Any] = {"log": log, "yields": []}
            if not dbo:
                with set_forward_context(dp_metadata=dp):
                    res["out"] = model(x)
            else:
                wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=60))
                try:
                    with set_forward_context(ubatch_slices=standin_harness._slices(x.shape[0], 2), dp_metadata=dp):
                        res["out"] = wrapper(x)
                    res["yields"] = wrapper.last_yield_counts
                finally:
                    wrapper.close()
            pf = model.deepep_v2()
            res.update(synced=pf.num_cpu_synced_dispatches, calls=model.buffer()._calls,
                       after=streams.current_stream("cpu") is main)
            results.append(res)
        return results

    return run_thread_ranks(world, rank_main, num_groups=2, timeout_s=120)


def dense_with_shared(weights: StackWeights, x: torch.Tensor, rank: int) -> torch.Tensor:
    """Layer by layer, the dense MoE plus the layer's shared expert (``StandinStack(shared=True)``'s), rounded
    where the layer rounds: the MoE output and the shared output each in bf16, summed in bf16, then added to
    ``x`` (rounding the sum of three differently would flip a near-tied routing in the next layer)."""
    for i in range(len(weights.w13)):
        moe = (dense_reference(weights.layer(i), x.float(), rank) - x.float()).to(x.dtype)  # fp32 inside
        x = x + (moe + LinearShared(100 + i)(x))
    return x


def expected_log(flags: SboFlags) -> list[tuple[str, str]]:
    """One MoE call of one ubatch as its log entries (what, stream), in order.

    Every mode: the dispatch's ``previous_event`` is captured and the dispatch launched on the caller's (main)
    stream, and both hooks wait on main. ``dispatch_shared_experts``: the shared experts run between the
    dispatch launch and its wait. Otherwise they run after the combine launch, before its wait; the
    two-stream mode captures the combine's ``previous_event`` and launches it on the SBO alt stream."""
    combine_on = "alt" if flags.two_stream else "main"
    dispatch = [("capture", "main"), ("dispatch", "main")]
    combine = [("capture", combine_on), ("combine", combine_on)]
    if flags.dispatch_shared_experts:
        return dispatch + [("shared", "main"), ("dispatch_wait", "main")] + combine + [("combine_wait", "main")]
    return dispatch + [("dispatch_wait", "main")] + combine + [("shared", "main"), ("combine_wait", "main")]


def check_run(weights: StackWeights, inputs: list[torch.Tensor], results: list[list[dict[str, Any]]],
              variants: list[SboFlags], dbo: bool, prefill: bool) -> None:
    ubatches = 2 if dbo else 1
    for rank, (x, per_variant) in enumerate(zip(inputs, results, strict=True)):
        ref = dense_with_shared(weights, x, rank)
        for flags, res in zip(variants, per_variant, strict=True):
            what = f"rank {rank}, SBO {flags.describe()}, DBO {'on' if dbo else 'off'}"
            assert_bf16_close(res["out"], ref, what)
            assert torch.equal(res["out"], per_variant[0]["out"]), f"{what}: differs from SBO off"
            assert res["yields"] == ([LAYERS * 2] * 2 if dbo else []), f"{what}: yields {res['yields']}"
            assert res["calls"] == LAYERS * ubatches * 2 and res["synced"] == (LAYERS * ubatches if prefill else 0)
            assert res["after"], f"{what}: the step left another stream current"
            for ubatch in range(ubatches):
                mine = [(w, s) for w, u, s, _ in res["log"] if u == ubatch]
                assert mine == expected_log(flags) * LAYERS, f"{what}, ubatch {ubatch}: {mine}"


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
@pytest.mark.parametrize("dbo", [False, True], ids=["dbo_off", "dbo_on"])
def test_sbo_modes_over_v2_equal_dense_and_run_as_the_rule_says(dbo: bool, prefill: bool) -> None:
    weights, inputs = bf16_weights(), bf16_inputs(2)
    with stream_sanitizer.sanitizing() as races:
        results = run_sbo(weights, inputs, VARIANTS, dbo, prefill)
    assert races == [], "\n\n".join(str(e) for e in races[:3])
    check_run(weights, inputs, results, VARIANTS, dbo, prefill)


def test_dbo_interleaves_the_hooks_across_ubatches_in_dispatch_mode() -> None:
    """Under DBO each ubatch's dispatch wait runs in the *other* ubatch (before that one's own dispatch), after
    the shared experts were queued behind the dispatch: the log of a rank, not only of a ubatch, shows it.
    Entries are (what, the ubatch whose call it is, the ubatch running it)."""
    results = run_sbo(bf16_weights(), bf16_inputs(2), [D], dbo=True, prefill=False)
    for per_variant in results:
        log = [(w, u, r) for w, u, _, r in per_variant[0]["log"] if w in ("dispatch", "shared", "dispatch_wait")]
        assert log[:6] == [("dispatch", 0, 0), ("shared", 0, 0), ("dispatch_wait", 0, 1), ("dispatch", 1, 1),
                           ("shared", 1, 1), ("dispatch_wait", 1, 0)], log


# ---- the waits the rule needs --------------------------------------------------------------------------
Prepare = Callable[[StandinStack], None]
Removal = Callable[[list[str]], tuple[ContextManager[Any], Prepare | None]]  # fills the list with what it removed


def _no_hook(method: str) -> Removal:
    """The adapter's ``method`` returns a no-op hook: nothing waits for the comm stream before the read."""
    def removal(removed: list[str]) -> tuple[ContextManager[Any], Prepare]:
        def prepare(model: StandinStack) -> None:
            pf = model.deepep_v2()
            original = getattr(pf, method)

            def without_wait(*args: Any) -> Any:
                _hook, receiver = original(*args)
                removed.append(f"{method} hook")
                return (lambda: None), receiver

            setattr(pf, method, without_wait)
        return contextlib.nullcontext(), prepare
    return removal


def _combine_event_elsewhere(removed: list[str]) -> tuple[ContextManager[Any], Prepare]:
    """The combine's ``previous_event`` is recorded on an unrelated stream, not the one it is launched from."""
    def prepare(model: StandinStack) -> None:
        buf = model.buffer()
        combine = buf.combine
        elsewhere = streams.new_stream("cpu", name="unrelated")

        def stale(*args: Any, **kwargs: Any) -> Any:
            kwargs["previous_event"] = standin.EventHandle(elsewhere)
            removed.append("combine previous_event")
            return combine(*args, **kwargs)

        buf.combine = stale
    return contextlib.nullcontext(), prepare


REMOVED: dict[str, tuple[SboFlags, Removal]] = {
    "alt_waits_expert_output": (CS, lambda removed: (without_waits_in(TwoStreamCombine.launch_combine,
                                                                      skipped=removed), None)),
    "combine_previous_event": (CS, _combine_event_elsewhere),
    "combine_hook_two_stream": (CS, _no_hook("finalize_async")),
    "dispatch_hook_dispatch_mode": (D, _no_hook("prepare_async")),
}


@pytest.mark.parametrize("dbo", [False, True], ids=["dbo_off", "dbo_on"])
@pytest.mark.parametrize("removed", list(REMOVED))
def test_each_wait_the_sbo_rule_needs_is_reported(removed: str, dbo: bool) -> None:
    flags, removal = REMOVED[removed]
    skipped: list[str] = []
    without, prepare = removal(skipped)
    # a sanitizer that raises also reports; the races list is the check
    with without, stream_sanitizer.sanitizing() as races, contextlib.suppress(Exception):
        run_sbo(bf16_weights(), bf16_inputs(2), [flags], dbo, prefill=False, prepare=prepare)
    assert skipped, f"removing {removed} removed nothing: the run never took that edge"
    assert races, f"removing {removed} under SBO {flags.describe()} went unreported"
    assert all("stream-order race" in str(e) and "deep_ep-v2-comm" in str(e) for e in races), str(races[0])


@pytest.mark.parametrize("dbo", [False, True], ids=["dbo_off", "dbo_on"])
@pytest.mark.parametrize("function", [TwoStreamCombine.after_receive, TwoStreamCombine.before_receive],
                         ids=["after_receive", "before_receive"])
def test_the_stream_joins_v2_does_not_need_are_not_races(function: Callable[..., Any], dbo: bool) -> None:
    """V2's combine writes its output on the comm stream and the hook joins main to that stream directly, so
    main waiting for the alt stream (``after_receive``, a data edge for V1 LL) carries no data here; the alt
    stream waiting for main (``before_receive``) never does. Removing either must not be reported."""
    with without_waits_in(function) as skipped, stream_sanitizer.sanitizing() as races:
        run_sbo(bf16_weights(), bf16_inputs(2), [CS], dbo, prefill=False)
    assert skipped, f"{function.__qualname__} issued no wait"
    assert races == [], str(races[0])


# ---- which modes V2 runs -------------------------------------------------------------------------------
@pytest.mark.parametrize("device,experts,env,expected", [
    (HOPPER, "deep_gemm", {}, D),  # never combine_down_gemm: no comp_signal
    (HOPPER, "triton", {}, D),
    (BLACKWELL, "deep_gemm", {}, CS),
    (BLACKWELL, "triton", {ENV_SHARED_EXPERTS_OUTSIDE: "1"}, SBO_OFF),
    (DeviceProps.cpu(), "torch", {}, D),
], ids=["hopper-deep_gemm", "hopper-triton", "blackwell", "blackwell-shared-outside", "cpu"])
def test_select_sbo_modes_for_v2(device: DeviceProps, experts: str, env: dict[str, str], expected: SboFlags) -> None:
    got = select_sbo_modes(True, all2all_backend="deepep_v2", experts_backend=experts, device=device, env=env)
    assert got == expected, f"{got.describe()} != {expected.describe()}"
    assert select_sbo_modes(False, all2all_backend="deepep_v2", experts_backend=experts, device=device) == SBO_OFF


def test_two_stream_sm_partition_gives_v2_no_deepep_sm_count() -> None:
    """V2's combine keeps its handle's SM count; the reservation only caps DeepGEMM beside it."""
    args = compute_overlap_args(BLACKWELL, CS, all2all_backend="deepep_v2", experts_backend="deep_gemm",
                                num_local_experts=16, num_tokens=256)
    assert args == OverlapArgs(32, 116, None, 116)


def test_check_sbo_modes_refuses_down_gemm_on_v2_only() -> None:
    for flags in (DG, SboFlags(combine_down_gemm=True, dispatch_shared_experts=True),
                  SboFlags(combine_down_gemm=True, combine_shared_experts=True)):
        with pytest.raises(ValueError, match="combine_down_gemm cannot run on all2all backend 'deepep_v2'.*comp_sig"):
            check_sbo_modes(flags, "deepep_v2")
        check_sbo_modes(flags, "deepep_low_latency")  # the tile-signal backend
    for flags in VARIANTS:
        check_sbo_modes(flags, "deepep_v2")


@pytest.mark.parametrize("dbo", [False, True], ids=["dbo_off", "dbo_on"])
def test_forced_down_gemm_over_v2_is_refused_by_name(dbo: bool) -> None:
    """Forced past ``select_sbo_modes`` (``SboFlags`` on the config), the first MoE call refuses it on every
    rank alike (no rank is left waiting in a collective)."""
    with pytest.raises(ValueError, match="combine_down_gemm cannot run on all2all backend 'deepep_v2'"):
        run_sbo(bf16_weights(), bf16_inputs(2), [DG], dbo, prefill=False)
