"""Single-batch overlap: mode selection, SM partition, and that SBO reorders work without changing results.

The CPU tests run every mode, the two-stream ones included (their streams are NullStreams there), over two
thread ranks with DBO off and on. Every variant is compared with the dense-with-shared-experts reference,
not only with SBO off (every mode ends in the same ``out + shared``, so variant-vs-variant alone could only
fail by crashing), and :func:`check_variants` also asserts that what the variants differ in really ran: the
DBO yields, the emulated link's transfers and bytes, forced zero receives, the stream each combine was
launched on and the one current again when its output was read. What only a GPU can show -- two streams
really running at once -- is in the ``@pytest.mark.cuda`` tests at the end, which run the same checks.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F

from moe_harness import (
    MoEStack,
    StackWeights,
    count_receives,
    dense_reference,
    expected_receives,
    halves,
    link_bytes,
    link_stats,
)
from ubatch import UBatchConfig, UBatchWrapper, set_forward_context, streams, trace
from ubatch.context import dbo_current_ubatch_id
from ubatch.modular_moe.config import MoEParallelConfig, enable_sbo
from ubatch.modular_moe.kernel import FusedMoEModularKernel
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.prepare_finalize.base import PrepareFinalize
from ubatch.modular_moe.two_stream import CombineOverlapArgs, DownGemmOverlapArgs, alt_stream
from ubatch.sbo import (
    ENV_COMM_SMS,
    ENV_SHARED_EXPERTS_OUTSIDE,
    SBO_OFF,
    DeviceProps,
    OverlapArgs,
    SboFlags,
    compute_overlap_args,
    select_sbo_modes,
)
from ubatch.testing.thread_ranks import run_thread_ranks

HOPPER = DeviceProps("cuda", "H100", (9, 0), 132)
BLACKWELL = DeviceProps("cuda", "B200", (10, 0), 148)
CPU = DeviceProps.cpu()

D = SboFlags(dispatch_shared_experts=True)
CS = SboFlags(combine_shared_experts=True)
DG = SboFlags(combine_down_gemm=True)
DG_D = SboFlags(combine_down_gemm=True, dispatch_shared_experts=True)
DG_CS = SboFlags(combine_down_gemm=True, combine_shared_experts=True)


# ---- mode selection ------------------------------------------------------------------------------------
SELECT_CASES = [
    # (enabled, all2all, experts, device, link, env, expected)
    (False, "deepep_low_latency", "deep_gemm", HOPPER, False, {}, SBO_OFF),
    (True, "deepep_low_latency", "deep_gemm", HOPPER, False, {}, DG_D),
    (True, "deepep_low_latency", "triton", HOPPER, False, {}, D),
    (True, "deepep_high_throughput", "deep_gemm", HOPPER, False, {}, D),
    (True, "deepep_low_latency", "deep_gemm", BLACKWELL, False, {}, CS),
    (True, "deepep_high_throughput", "triton", BLACKWELL, False, {}, CS),
    (True, "deepep_low_latency", "deep_gemm", BLACKWELL, False, {ENV_SHARED_EXPERTS_OUTSIDE: "1"}, SBO_OFF),
    (True, "deepep_low_latency", "deep_gemm", HOPPER, False, {ENV_SHARED_EXPERTS_OUTSIDE: "1"}, DG_D),
    (True, "torch_ll", "torch", BLACKWELL, False, {}, D),  # collectives: the NCCL-EP rule
    (True, "auto_torch", "torch", BLACKWELL, False, {}, D),  # the phase-aware torch pair is collectives too
    (True, "torch_ht", "triton", HOPPER, False, {}, D),
    (True, "torch_ll", "torch", CPU, False, {}, D),
    (True, "torch_ht", "torch", CPU, False, {}, D),
    (True, "none", "torch", CPU, False, {}, SBO_OFF),  # nothing on the wire to hide
    (True, "none", "torch", CPU, True, {}, D),  # ... unless the emulated link puts it there
    (True, "none", "torch", BLACKWELL, True, {}, CS),
]


@pytest.mark.parametrize("enabled,a2a,experts,device,link,env,expected", SELECT_CASES,
                         ids=[f"{c[1]}-{c[2]}-{c[3].name}-{'link' if c[4] else ''}{'env' if c[5] else ''}"
                              f"{'' if c[0] else 'off'}-{i}" for i, c in enumerate(SELECT_CASES)])
def test_select_sbo_modes(enabled: bool, a2a: str, experts: str, device: DeviceProps, link: bool,
                          env: dict[str, str], expected: SboFlags) -> None:
    got = select_sbo_modes(enabled, all2all_backend=a2a, experts_backend=experts, device=device,
                           emulate_link=link, env=env)
    assert got == expected, f"{got.describe()} != {expected.describe()}"


def test_flags_properties_and_validation() -> None:
    assert not SBO_OFF.enabled and SBO_OFF.describe() == "off"
    assert D.enabled and not D.two_stream and D.fuse_shared_experts_inside_sbo
    assert CS.two_stream and CS.fuse_shared_experts_inside_sbo
    assert DG.two_stream and not DG.fuse_shared_experts_inside_sbo
    assert DG_D.describe() == "dispatch_shared_experts+combine_down_gemm"
    with pytest.raises(ValueError, match="shared experts run once per layer"):
        SboFlags(combine_shared_experts=True, dispatch_shared_experts=True)


def test_device_props() -> None:
    assert HOPPER.is_cuda and not HOPPER.is_blackwell
    assert BLACKWELL.is_blackwell and DeviceProps("cuda", "RTX", (12, 0), 84).is_blackwell
    assert not CPU.is_cuda and not CPU.is_blackwell
    if not torch.cuda.is_available():
        assert DeviceProps.of() == CPU and DeviceProps.of("cpu") == CPU


# ---- SM partition --------------------------------------------------------------------------------------
ARGS_CASES = [
    # (device, flags, all2all, experts, E_local, T, env, expected)
    (HOPPER, DG, "deepep_low_latency", "deep_gemm", 64, 32, {},  # SGLang's vector
     OverlapArgs(3, 129, 3, 129, 64, torch.int32, 64, 129)),
    (HOPPER, DG_D, "deepep_low_latency", "deep_gemm", 8, 130, {},  # ceil(130/64) = 3 tiles per expert
     OverlapArgs(3, 129, 3, 129, 24, torch.int32, 64, 129)),
    (BLACKWELL, DG_CS, "deepep_low_latency", "deep_gemm", 16, 256, {},  # one uint32 per expert
     OverlapArgs(32, 116, 32, 116, 16, torch.uint32, 64, 116)),
    (BLACKWELL, CS, "deepep_low_latency", "deep_gemm", 16, 256, {}, OverlapArgs(32, 116, 32, 116)),
    (BLACKWELL, CS, "deepep_high_throughput", "triton", 16, 256, {}, OverlapArgs(32, 116, 32, None)),
    (HOPPER, CS, "deepep_high_throughput", "deep_gemm", 16, 256, {},  # DeepEP HT wants an even SM count
     OverlapArgs(3, 128, 4, 128)),
    (HOPPER, CS, "torch_ll", "torch", 16, 256, {}, OverlapArgs(3, 129)),  # NCCL: no DeepEP/DeepGEMM limits
    (HOPPER, CS, "deepep_low_latency", "deep_gemm", 16, 256, {ENV_COMM_SMS: "8"}, OverlapArgs(8, 124, 8, 124)),
    (BLACKWELL, CS, "torch_ll", "triton", 16, 256, {ENV_COMM_SMS: " 20 "}, OverlapArgs(20, 128)),
    (CPU, DG_CS, "torch_ll", "torch", 4, 64, {ENV_COMM_SMS: "8"},  # no SMs to split; the signal still sized
     OverlapArgs(0, 0, None, None, 4, torch.int32, 64, 0)),
    (HOPPER, D, "deepep_low_latency", "deep_gemm", 64, 32, {}, None),  # one stream: nothing reserved
    (HOPPER, SBO_OFF, "deepep_low_latency", "deep_gemm", 64, 32, {}, None),
]


@pytest.mark.parametrize("device,flags,a2a,experts,e_local,tokens,env,expected", ARGS_CASES,
                         ids=[f"{c[0].name}-{c[1].describe()}-{c[2]}-{c[3]}-{i}" for i, c in enumerate(ARGS_CASES)])
def test_compute_overlap_args(device: DeviceProps, flags: SboFlags, a2a: str, experts: str, e_local: int,
                              tokens: int, env: dict[str, str], expected: OverlapArgs | None) -> None:
    got = compute_overlap_args(device, flags, all2all_backend=a2a, experts_backend=experts,
                               num_local_experts=e_local, num_tokens=tokens, env=env)
    assert got == expected


@pytest.mark.parametrize("raw,msg", [("abc", "is not an integer"), ("0", r"must be in \[1, 131\]"),
                                     ("132", r"must be in \[1, 131\] on H100 \(132 SMs\)")])
def test_comm_sms_env_rejects_bad_values(raw: str, msg: str) -> None:
    with pytest.raises(ValueError, match=f"{ENV_COMM_SMS}.*{msg}"):
        compute_overlap_args(HOPPER, CS, env={ENV_COMM_SMS: raw})


def test_comm_sms_env_read_from_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_COMM_SMS, "6")
    args = compute_overlap_args(BLACKWELL, CS)
    assert args is not None and (args.comm_sms, args.compute_sms) == (6, 142)


# ---- carrying the flags on the config ------------------------------------------------------------------
def test_enable_sbo_on_a_config() -> None:
    parallel = MoEParallelConfig(all2all_backend="torch_ll", ep_size=2)
    assert parallel.sbo == SBO_OFF
    assert enable_sbo(parallel, device="cpu") == D  # --enable-single-batch-overlap on CPU
    assert parallel.sbo == D
    assert MoEParallelConfig(sbo=CS).sbo == CS
    with pytest.raises(TypeError, match="must be an SboFlags"):
        MoEParallelConfig(sbo=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be an SboFlags"):
        enable_sbo(parallel, "dispatch")  # type: ignore[arg-type]


# ---- EP with shared experts: SBO on/off identical ------------------------------------------------------
class SharedMLP(torch.nn.Module):
    """A DeepSeek-style shared expert (SiLU-and-mul MLP); ``log`` sees every call (ordering test)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, log: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.gate_up = torch.nn.Parameter(gate_up, requires_grad=False)
        self.down = torch.nn.Parameter(down, requires_grad=False)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.log is not None:
            self.log("shared")
        g, u = (x @ self.gate_up.t()).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.down.t()


SharedWeights = list[tuple[torch.Tensor, torch.Tensor]]  # (gate_up [2I, H], down [H, I]) per layer


def shared_weights(layers: int, hidden: int = 16, inter: int = 20, seed: int = 7) -> SharedWeights:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2 * inter, hidden, generator=g) * 0.2, torch.randn(hidden, inter, generator=g) * 0.2)
            for _ in range(layers)]


def SharedMoEStack(weights: StackWeights, shared: SharedWeights, parallel: MoEParallelConfig,
                   log: Callable[[str], None] | None = None) -> MoEStack:
    """The harness stack with one shared expert per layer (``SharedMLP``)."""
    return MoEStack(weights, parallel, shared_experts=[SharedMLP(gu, down, log) for gu, down in shared])


def dense_with_shared(weights: StackWeights, shared: SharedWeights, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
    for i, (gu, down) in enumerate(shared):
        x = dense_reference(weights.layer(i), x, rank) + SharedMLP(gu, down)(x)
    return x


class ProbedPF:
    """Wraps a layer's all-to-all backend and records, per MoE call and ubatch, the current stream at the
    dispatch (the caller's), at the combine's launch (``finalize_async``) and when the combined output is
    read; ``log`` (optional) gets the dispatch start / receive hook / receive / combine start events."""

    def __init__(self, inner: Any, device: torch.device | str, calls: list[dict[str, Any]],
                 log: Callable[..., None] | None = None) -> None:
        self._inner, self._device, self._calls, self._log = inner, device, calls, log
        self._open: dict[int, dict[str, Any]] = {}  # ubatch -> its call between dispatch and combine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _event(self, what: str, ubatch: int | None = None) -> None:
        if self._log is not None:
            self._log(what, ubatch)

    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Any:
        owner = dbo_current_ubatch_id()
        call = {"ubatch": owner, "main": streams.current_stream(self._device)}
        self._calls.append(call)
        self._open[owner] = call
        hook, receiver = self._inner.prepare_async(hidden, topk_weights, topk_ids)
        self._event("dispatch_started")

        def logged_hook() -> None:
            self._event("dispatch_hook", owner)  # runs on the *other* ubatch under DBO
            hook()

        def logged_receiver() -> Any:
            self._event("dispatch_received")
            return receiver()

        return (logged_hook if hook is not None else None), logged_receiver

    def finalize_async(self, expert_output: torch.Tensor, state: Any) -> Any:
        call = self._open.pop(dbo_current_ubatch_id())
        call["combine"] = streams.current_stream(self._device)
        hook, receiver = self._inner.finalize_async(expert_output, state)
        self._event("combine_started")

        def probed_receiver() -> torch.Tensor:
            call["receive"] = streams.current_stream(self._device)
            return receiver()

        return hook, probed_receiver


def probe_streams(model: torch.nn.Module, device: torch.device | str,
                  log: Callable[..., None] | None = None) -> list[dict[str, Any]]:
    """Install a :class:`ProbedPF` on every MoE layer's kernel; returns the list its calls are recorded in."""
    calls: list[dict[str, Any]] = []
    for layer in model.modules():
        if isinstance(layer, FusedMoE):
            kernel = layer.kernel
            # a stand-in: ProbedPF forwards every attribute it does not probe to the backend it wraps
            kernel.prepare_finalize = cast(PrepareFinalize, ProbedPF(kernel.prepare_finalize, device, calls, log))
    return calls


def run_variants(weights: StackWeights, shared: SharedWeights, inputs: list[torch.Tensor],
                 backend: str, variants: list[SboFlags], dbo: bool, device: str = "cpu",
                 emulate_link: str | None = None) -> list[list[dict[str, Any]]]:
    """Per rank, per SBO variant: the stack's ``out``, the DBO ``yields``, what each layer's experts
    ``received`` (per layer and ubatch), the emulated ``link``'s (transfers, bytes), the ``streams`` of every
    MoE call (:class:`ProbedPF`) and the caller's stream ``before``/``after`` the step."""
    world = len(inputs)

    def rank_main(rank: int, groups: list[Any]) -> list[dict[str, Any]]:
        results = []
        for flags in variants:
            parallel = MoEParallelConfig(ep_rank=rank, ep_size=world, all2all_backend=backend, ep_groups=groups,
                                         max_dispatch_tokens_per_rank=32, emulate_link=emulate_link)
            enable_sbo(parallel, flags)
            model = SharedMoEStack(weights, shared, parallel).to(device)
            kernels = [m.kernel for m in model.modules() if isinstance(m, FusedMoE)]
            assert len(kernels) == len(weights.gates) and all(k.sbo == flags for k in kernels)
            received = count_receives([layer for layer in model.layers if isinstance(layer, FusedMoE)])
            calls = probe_streams(model, device)
            x = inputs[rank].to(device)
            res: dict[str, Any] = {"received": received, "streams": calls,
                                   "before": streams.current_stream(device)}
            if not dbo:
                res.update(out=model(x), yields=[])
            else:
                wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=60), device=device)
                try:
                    with set_forward_context(ubatch_slices=halves(x.shape[0])):
                        res["out"] = wrapper(x)
                    res["yields"] = wrapper.last_yield_counts
                finally:
                    wrapper.close()
            streams.synchronize(device)
            res.update(out=res["out"].cpu(), after=streams.current_stream(device),
                       link=link_stats(model.runtime.link()))
            results.append(res)
        return results

    return run_thread_ranks(world, rank_main, num_groups=2, timeout_s=60)


def rank_inputs(sizes: list[int], hidden: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) for n in sizes]


def check_streams(calls: list[dict[str, Any]], flags: SboFlags, device: torch.device | str, layers: int,
                  dbo: bool) -> None:
    """One recorded call per layer and ubatch; a two-stream mode launched its combine on the SBO alternate
    stream (and the caller's stream is not that one), any other mode on the caller's stream; in every mode
    the caller's stream is current again when the combined output is read."""
    alt = alt_stream(device)
    assert sorted(c["ubatch"] for c in calls) == sorted(list(range(2 if dbo else 1)) * layers), calls
    for c in calls:
        assert "combine" in c and "receive" in c, f"a MoE call never combined or never read its output: {c}"
        assert c["receive"] == c["main"], f"{flags.describe()}: the caller's stream was not restored: {c}"
        if flags.two_stream:
            assert c["combine"] == alt and c["main"] != alt, f"{flags.describe()}: combine not on the alt stream: {c}"
        else:
            assert c["combine"] == c["main"], f"{flags.describe()}: combine left the caller's stream: {c}"


def check_variants(weights: StackWeights, shared: SharedWeights, inputs: list[torch.Tensor],
                   results: list[list[dict[str, Any]]], variants: list[SboFlags], dbo: bool,
                   device: str = "cpu", link: bool = False, rel_tol: float = 1e-5) -> None:
    """Every variant equals the dense-with-shared reference (on CPU also SBO off, bit for bit), and what the
    variants differ in was active: the yields under DBO, the link's traffic, the forced receives, the streams.

    ``rel_tol`` bounds the error relative to the output's magnitude: 1e-5 is fp32 summation order; a stream
    race (a combine read before it landed) is wrong by O(1), so a GPU tolerance of 1e-4 still catches it.
    """
    layers, ubatches = len(weights.gates), 2 if dbo else 1
    sizes = [x.shape[0] for x in inputs]
    expected_rx = None if weights.routes is None else expected_receives(weights.routes, sizes,
                                                                        weights.gates[0].shape[0], dbo)
    for rank, (x, per_variant) in enumerate(zip(inputs, results, strict=True)):
        ref = dense_with_shared(weights, shared, x, rank)
        for flags, res in zip(variants, per_variant, strict=True):
            what = f"rank {rank}, SBO {flags.describe()}"
            err = (res["out"] - ref).abs().max().item() if ref.numel() else 0.0
            assert err <= rel_tol * ref.abs().max().item(), f"{what}: max error {err} vs the dense reference"
            if device == "cpu":
                assert torch.equal(res["out"], per_variant[0]["out"]), f"{what}: differs from SBO off"
            assert res["yields"] == ([layers * 2] * 2 if dbo else []), f"{what}: yields {res['yields']}"
            if link:  # both directions of every layer and ubatch went over the modelled wire
                expected_link = (2 * layers * ubatches, link_bytes(x.shape[0], weights.top_k, x.shape[1], layers))
                assert res["link"] == expected_link, f"{what}: link {res['link']}, expected {expected_link}"
            else:
                assert res["link"] is None
            if expected_rx is not None:
                assert res["received"] == expected_rx[rank], f"{what}: received {res['received']}"
            check_streams(res["streams"], flags, device, layers, dbo)
            assert res["after"] == res["before"], f"{what}: the step left another stream current"


CPU_VARIANTS = [SBO_OFF, D, CS, DG, DG_D, DG_CS]
LINK = "latency_us=20,gbps=100"


@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
@pytest.mark.parametrize("backend", ["torch_ll", "torch_ht"])
def test_sbo_on_off_identical_over_two_ranks(backend: str, dbo: bool) -> None:
    weights = StackWeights.random(layers=2)
    shared = shared_weights(2)
    inputs = rank_inputs([7, 10])
    results = run_variants(weights, shared, inputs, backend, CPU_VARIANTS, dbo, emulate_link=LINK)
    check_variants(weights, shared, inputs, results, CPU_VARIANTS, dbo, link=True)


def test_sbo_with_uneven_routing_and_an_empty_ubatch() -> None:
    """Forced routes over 2 ranks x 4 experts: first-half tokens (ubatch 0) go to experts 0 and 3 (rank 0),
    second-half tokens to 5 and 6 (rank 1). halves(1) leaves rank 1's *first* ubatch empty, so in ubatch 0
    rank 1 sends nothing and receives nothing, and in ubatch 1 rank 0 receives nothing."""
    sizes = [6, 1]
    routes = [[torch.tensor([[0, 3]] * halves(n)[0].num_tokens + [[5, 6]] * halves(n)[1].num_tokens,
                            dtype=torch.int64).view(n, 2) for n in sizes]]
    weights = StackWeights.random(layers=1, seed=3, routes=routes)
    shared = shared_weights(1)
    inputs = rank_inputs(sizes, seed=4)
    variants = [SBO_OFF, D, DG_CS]
    for backend in ("torch_ll", "torch_ht"):
        results = run_variants(weights, shared, inputs, backend, variants, dbo=True)
        check_variants(weights, shared, inputs, results, variants, dbo=True)  # receives == the routing table's
        assert [res["received"] for res in results[0]] == [{(0, 0): 2 * 3, (0, 1): 0}] * len(variants)
        assert [res["received"] for res in results[1]] == [{(0, 0): 0, (0, 1): 2 * (3 + 1)}] * len(variants)


@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
def test_sbo_with_emulated_link_single_rank(dbo: bool) -> None:
    weights = StackWeights.random(layers=1)
    shared = shared_weights(1)
    variants = [SBO_OFF, D, CS]
    inputs = rank_inputs([8])
    results = run_variants(weights, shared, inputs, "none", variants, dbo, emulate_link="latency_us=100,gbps=100")
    check_variants(weights, shared, inputs, results, variants, dbo, link=True)


# ---- ordering: in dispatch mode the shared experts run inside the dispatch's flight ---------------------
def run_logged(backend: str, flags: SboFlags, dbo: bool) -> list[dict[str, Any]]:
    """One layer over two ranks with an instrumented backend; returns each rank's event log and streams."""
    weights = StackWeights.random(layers=1)
    shared = shared_weights(1)
    inputs = rank_inputs([6, 5])

    def rank_main(rank: int, groups: list[Any]) -> dict[str, Any]:
        log: list[tuple[str, int]] = []

        def record(what: str, ubatch: int | None = None) -> None:
            log.append((what, dbo_current_ubatch_id() if ubatch is None else ubatch))

        parallel = MoEParallelConfig(ep_rank=rank, ep_size=2, all2all_backend=backend, ep_groups=groups,
                                     max_dispatch_tokens_per_rank=32)
        enable_sbo(parallel, flags)
        model = SharedMoEStack(weights, shared, parallel, log=record)
        calls = probe_streams(model, "cpu", log=record)
        before = streams.current_stream("cpu")
        if dbo:
            wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=60))
            try:
                with set_forward_context(ubatch_slices=halves(inputs[rank].shape[0])):
                    wrapper(inputs[rank])
            finally:
                wrapper.close()
        else:
            model(inputs[rank])
        return {"log": log, "calls": calls, "stream_after": streams.current_stream("cpu"), "stream_before": before}

    return run_thread_ranks(2, rank_main, num_groups=2, timeout_s=60)


def position(log: list[tuple[str, int]], what: str, ubatch: int) -> int:
    hits = [i for i, entry in enumerate(log) if entry == (what, ubatch)]
    assert len(hits) == 1, f"expected one {what!r} of ubatch {ubatch} in {log}"
    return hits[0]


@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
@pytest.mark.parametrize("backend", ["torch_ll", "torch_ht"])
def test_dispatch_mode_runs_shared_experts_between_dispatch_start_and_receive(backend: str, dbo: bool) -> None:
    with trace.recording() as rec:
        sbo_runs = run_logged(backend, D, dbo)
    off_runs = run_logged(backend, SBO_OFF, dbo)
    for ubatch in ((0, 1) if dbo else (0,)):
        for run in sbo_runs:
            log = run["log"]
            order = [position(log, "dispatch_started", ubatch), position(log, "shared", ubatch)]
            if backend == "torch_ll":  # hook-shaped: the receive hook comes after the shared experts
                order.append(position(log, "dispatch_hook", ubatch))
            order += [position(log, "dispatch_received", ubatch), position(log, "combine_started", ubatch)]
            assert order == sorted(order), f"ubatch {ubatch}: {log}"
        for run in off_runs:  # without SBO they wait for the combine: the test can tell the difference
            log = run["log"]
            assert position(log, "combine_started", ubatch) < position(log, "shared", ubatch), log
    spans = [s for s in rec.spans if s.name == "shared_experts"]
    assert spans and all(s.args["overlaps"] == "dispatch" for s in spans)


@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
@pytest.mark.parametrize("flags", [CS, DG_D], ids=lambda f: f.describe())
def test_two_stream_modes_launch_the_combine_on_the_alt_stream(flags: SboFlags, dbo: bool) -> None:
    """Structural on CPU: ``finalize_async`` sees the SBO alt stream current, and the caller's stream comes back."""
    for run in run_logged("torch_ll", flags, dbo):
        check_streams(run["calls"], flags, "cpu", 1, dbo)
        assert run["stream_after"] is run["stream_before"]
    for run in run_logged("torch_ll", SBO_OFF, dbo):
        check_streams(run["calls"], SBO_OFF, "cpu", 1, dbo)


# ---- the signal protocol, with backends that speak it ---------------------------------------------------
class _Capable:
    """Mixin: records every ``set_sbo_overlap_args`` call."""

    def set_sbo_overlap_args(self, args: Any) -> None:
        self.calls.append(args)  # type: ignore[attr-defined]


def test_signal_protocol_hands_matching_args_to_gemm_and_combine() -> None:
    from ubatch.modular_moe.experts.torch_experts import TorchExperts
    from ubatch.modular_moe.prepare_finalize.none import NoAllToAll

    calls: list[Any] = []
    order: list[str] = []

    class Experts(_Capable, TorchExperts):
        def apply(self, tokens: Any, w13: torch.Tensor, w2: torch.Tensor, extras: Any = None) -> torch.Tensor:
            order.append("apply")
            return super().apply(tokens, w13, w2, extras)

    class PF(_Capable, NoAllToAll):
        def finalize_async(self, expert_output: torch.Tensor, state: Any) -> Any:
            order.append("finalize")
            return super().finalize_async(expert_output, state)

    experts, pf = Experts(), PF(num_experts=4)
    experts.calls = pf.calls = calls  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    hidden = torch.randn(5, 8, generator=g)
    topk_w, topk_ids = torch.full((5, 2), 0.5), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    plain = FusedMoEModularKernel(NoAllToAll(4), TorchExperts())(hidden, w13, w2, topk_w, topk_ids)
    out = FusedMoEModularKernel(pf, experts, sbo=DG)(hidden, w13, w2, topk_w, topk_ids)
    assert torch.equal(out, plain)
    down, none1, combine, none2 = calls
    assert none1 is None and none2 is None and order == ["apply", "finalize"]
    assert isinstance(down, DownGemmOverlapArgs) and isinstance(combine, CombineOverlapArgs)
    assert combine.overlap and combine.signal is down.signal and combine.wait_event is down.start_event
    assert down.signal.dtype == torch.int32 and down.signal.numel() == 4  # 4 local experts x ceil(5/64) tiles
    assert combine.stream is alt_stream("cpu")


# ---- GPU: the two-stream modes with real streams -------------------------------------------------------
GPU_VARIANTS = [SBO_OFF, D, CS, DG_CS]


@pytest.mark.cuda
@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
def test_cuda_two_stream_modes_equal_dense_single_rank_emulated_link(dbo: bool) -> None:
    """The GPU twin of ``test_sbo_with_emulated_link_single_rank``: the same checks with real streams and a
    real link delay (a wait kernel on the GPU's global timer), so a combine read before it landed would be O(1) off."""
    weights = StackWeights.random(layers=2)
    shared = shared_weights(2)
    inputs = rank_inputs([16])
    results = run_variants(weights, shared, inputs, "none", GPU_VARIANTS, dbo, device="cuda",
                           emulate_link="latency_us=200,gbps=1")
    check_variants(weights, shared, inputs, results, GPU_VARIANTS, dbo, device="cuda", link=True, rel_tol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
@pytest.mark.parametrize("backend", ["torch_ll", "torch_ht"])
def test_cuda_two_stream_modes_equal_dense_two_ranks(backend: str, dbo: bool) -> None:
    """Two thread ranks on one GPU (gloo moves CUDA tensors). ``check_variants`` asserts the CUDA stream each
    combine was launched on (the SBO alt stream in the two-stream modes, never the caller's) and that the
    caller's stream is current again when the output is read; the CPU twin is
    ``test_sbo_on_off_identical_over_two_ranks``."""
    weights = StackWeights.random(layers=2)
    shared = shared_weights(2)
    inputs = rank_inputs([9, 12])
    results = run_variants(weights, shared, inputs, backend, GPU_VARIANTS, dbo, device="cuda")
    check_variants(weights, shared, inputs, results, GPU_VARIANTS, dbo, device="cuda", rel_tol=1e-4)


@pytest.mark.cuda
def test_cuda_alt_stream_is_a_separate_stream_and_rejoins() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    alt = alt_stream(device)
    assert isinstance(alt, torch.cuda.Stream) and alt != torch.cuda.current_stream(device)
    assert alt_stream(device) is alt
    props = DeviceProps.of(device)
    args = compute_overlap_args(props, CS)
    assert args is not None and args.comm_sms + args.compute_sms == props.sm_count
