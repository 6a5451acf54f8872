"""Single-batch overlap: mode selection, SM partition, and that SBO reorders work without changing results.

The CPU tests run every mode, the two-stream ones included (their streams are NullStreams there), over two
thread ranks with DBO off and on. What only a GPU can show -- two streams really running at once -- is in
the ``@pytest.mark.cuda`` tests at the end (outputs equal to SBO off; the combine launched on the alt stream).
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from moe_harness import StackWeights, dense_reference, halves
from ubatch import UBatchConfig, UBatchWrapper, set_forward_context, streams, trace
from ubatch.context import dbo_current_ubatch_id
from ubatch.distributed import run_thread_ranks
from ubatch.modular_moe.config import MoEParallelConfig, enable_sbo
from ubatch.modular_moe.kernel import FusedMoEModularKernel
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.runtime import MoERuntime
from ubatch.modular_moe.two_stream import CombineOverlapArgs, DownGemmOverlapArgs, alt_stream
from ubatch.sbo import (
    ENV_COMM_SMS, ENV_SHARED_EXPERTS_OUTSIDE, SBO_OFF, DeviceProps, OverlapArgs, SboFlags, compute_overlap_args,
    select_sbo_modes,
)

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


class SharedMoEStack(torch.nn.Module):
    """``x = x + (routed MoE + shared expert)(x)`` per layer, this rank's share of the experts."""

    def __init__(self, weights: StackWeights, shared: SharedWeights,
                 parallel: MoEParallelConfig, log: Callable[[str], None] | None = None) -> None:
        super().__init__()
        experts, _, hidden = weights.w13[0].shape
        inter = weights.w2[0].shape[-1]
        self.gates = torch.nn.ParameterList([torch.nn.Parameter(g, requires_grad=False) for g in weights.gates])
        self.layers = torch.nn.ModuleList()
        runtime = MoERuntime(parallel)
        for w13, w2, (gu, down) in zip(weights.w13, weights.w2, shared):
            layer = FusedMoE(experts, weights.top_k, hidden, inter, runtime=runtime,
                             shared_experts=SharedMLP(gu, down, log))
            layer.load_fused_experts(w13, w2)
            self.layers.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for gate, layer in zip(self.gates, self.layers):
            x = x + layer(x, x.float() @ gate.t().float())
        return x


def dense_with_shared(weights: StackWeights, shared: SharedWeights,
                      x: torch.Tensor) -> torch.Tensor:
    for i, (gu, down) in enumerate(shared):
        one = StackWeights(weights.gates[i:i + 1], weights.w13[i:i + 1], weights.w2[i:i + 1], weights.top_k)
        x = dense_reference(one, x) + SharedMLP(gu, down)(x)
    return x


def run_variants(weights: StackWeights, shared: SharedWeights, inputs: list[torch.Tensor],
                 backend: str, variants: list[SboFlags], dbo: bool, device: str = "cpu",
                 emulate_link: str | None = None) -> list[list[dict[str, Any]]]:
    """Per rank, per SBO variant: the stack's output and the DBO yield counts."""
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
            x = inputs[rank].to(device)
            if not dbo:
                results.append({"out": model(x).cpu(), "yields": []})
                continue
            wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=60), device=device)
            try:
                with set_forward_context(ubatch_slices=halves(x.shape[0])):
                    out = wrapper(x)
                streams.synchronize(device)
                results.append({"out": out.cpu(), "yields": wrapper.last_yield_counts})
            finally:
                wrapper.close()
        return results

    return run_thread_ranks(world, rank_main, num_groups=2, timeout_s=60)


def rank_inputs(sizes: list[int], hidden: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) for n in sizes]


def assert_variants_identical(results: list[list[dict[str, Any]]], variants: list[SboFlags],
                              exact: bool = True) -> None:
    """Every variant equals the first (SBO off): bit for bit on CPU; on GPU within 1e-5, which still
    catches any stream race (a combine read before it landed is wrong by O(1), not by rounding)."""
    for rank, per_variant in enumerate(results):
        base = per_variant[0]
        for flags, res in zip(variants[1:], per_variant[1:]):
            what = f"rank {rank}: SBO {flags.describe()} changed the output"
            if exact:
                assert torch.equal(res["out"], base["out"]), what
            else:
                torch.testing.assert_close(res["out"], base["out"], rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
            assert res["yields"] == base["yields"], f"rank {rank}: SBO {flags.describe()} changed the yields"


CPU_VARIANTS = [SBO_OFF, D, CS, DG, DG_D, DG_CS]


@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
@pytest.mark.parametrize("backend", ["torch_ll", "torch_ht"])
def test_sbo_on_off_identical_over_two_ranks(backend: str, dbo: bool) -> None:
    weights = StackWeights.random(layers=2)
    shared = shared_weights(2)
    inputs = rank_inputs([7, 10])
    results = run_variants(weights, shared, inputs, backend, CPU_VARIANTS, dbo)
    assert_variants_identical(results, CPU_VARIANTS)
    for x, per_variant in zip(inputs, results):  # and SBO off itself is right
        ref = dense_with_shared(weights, shared, x)
        assert (per_variant[0]["out"] - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        if dbo:
            per_layer = {"torch_ll": 2, "torch_ht": 3}[backend]
            assert per_variant[0]["yields"] == [2 * per_layer] * 2


def test_sbo_with_uneven_routing_and_an_empty_ubatch() -> None:
    weights = StackWeights.random(layers=1, skew_to_expert0=True, seed=3)
    shared = shared_weights(1)
    inputs = rank_inputs([6, 1], seed=4)  # rank 1's second ubatch is empty under DBO
    variants = [SBO_OFF, D, DG_CS]
    for backend in ("torch_ll", "torch_ht"):
        assert_variants_identical(run_variants(weights, shared, inputs, backend, variants, dbo=True), variants)


def test_sbo_with_emulated_link_single_rank() -> None:
    weights = StackWeights.random(layers=1)
    shared = shared_weights(1)
    variants = [SBO_OFF, D, CS]
    for dbo in (False, True):
        results = run_variants(weights, shared, rank_inputs([8]), "none", variants, dbo,
                               emulate_link="latency_us=100,gbps=100")
        assert_variants_identical(results, variants)


# ---- ordering: in dispatch mode the shared experts run inside the dispatch's flight ---------------------
class RecordingPF:
    """Wraps a backend: logs dispatch start / receive hook / receive / combine start and the current stream."""

    def __init__(self, inner: Any, log: Callable[[str], None], streams_seen: list[Any]) -> None:
        self._inner, self._log, self._streams_seen = inner, log, streams_seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Any:
        hook, receiver = self._inner.prepare_async(hidden, topk_weights, topk_ids)
        owner = dbo_current_ubatch_id()
        self._log("dispatch_started")

        def logged_hook() -> None:
            self._log("dispatch_hook", owner)  # runs on the *other* ubatch under DBO
            hook()

        def logged_receiver() -> Any:
            self._log("dispatch_received")
            return receiver()

        return (logged_hook if hook is not None else None), logged_receiver

    def finalize_async(self, expert_output: torch.Tensor, state: Any) -> Any:
        self._streams_seen.append(streams.current_stream(expert_output.device))
        out = self._inner.finalize_async(expert_output, state)
        self._log("combine_started")
        return out


def run_logged(backend: str, flags: SboFlags, dbo: bool) -> list[dict[str, Any]]:
    """One layer over two ranks with an instrumented backend; returns each rank's event log."""
    weights = StackWeights.random(layers=1)
    shared = shared_weights(1)
    inputs = rank_inputs([6, 5])

    def rank_main(rank: int, groups: list[Any]) -> dict[str, Any]:
        log: list[tuple[str, int]] = []
        seen: list[Any] = []

        def record(what: str, ubatch: int | None = None) -> None:
            log.append((what, dbo_current_ubatch_id() if ubatch is None else ubatch))

        parallel = MoEParallelConfig(ep_rank=rank, ep_size=2, all2all_backend=backend, ep_groups=groups,
                                     max_dispatch_tokens_per_rank=32)
        model = SharedMoEStack(weights, shared, parallel, log=record)
        layer = model.layers[0]
        k = layer.kernel
        layer._kernel = FusedMoEModularKernel(RecordingPF(k.prepare_finalize, record, seen), k.experts,
                                              k.shared_experts, sbo=flags)
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
        return {"log": log, "finalize_streams": seen, "stream_after": streams.current_stream("cpu"),
                "stream_before": before}

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
        assert run["finalize_streams"] and all(s is alt_stream("cpu") for s in run["finalize_streams"])
        assert run["stream_after"] is run["stream_before"]
    for run in run_logged("torch_ll", SBO_OFF, dbo):
        assert all(s is not alt_stream("cpu") for s in run["finalize_streams"])


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
        def apply(self, tokens: Any, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
            order.append("apply")
            return super().apply(tokens, w13, w2)

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
def test_cuda_two_stream_modes_equal_sbo_off_single_rank_emulated_link(dbo: bool) -> None:
    weights = StackWeights.random(layers=2)
    shared = shared_weights(2)
    results = run_variants(weights, shared, rank_inputs([16]), "none", GPU_VARIANTS, dbo, device="cuda",
                           emulate_link="latency_us=200,gbps=1")
    assert_variants_identical(results, GPU_VARIANTS, exact=False)


@pytest.mark.cuda
@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
@pytest.mark.parametrize("backend", ["torch_ll", "torch_ht"])
def test_cuda_two_stream_modes_equal_sbo_off_two_ranks(backend: str, dbo: bool) -> None:
    """Two thread ranks on one GPU (gloo moves CUDA tensors); the combine really runs on the alt stream."""
    weights = StackWeights.random(layers=2)
    shared = shared_weights(2)
    results = run_variants(weights, shared, rank_inputs([9, 12]), backend, GPU_VARIANTS, dbo, device="cuda")
    assert_variants_identical(results, GPU_VARIANTS, exact=False)


@pytest.mark.cuda
def test_cuda_alt_stream_is_a_separate_stream_and_rejoins() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    alt = alt_stream(device)
    assert isinstance(alt, torch.cuda.Stream) and alt != torch.cuda.current_stream(device)
    assert alt_stream(device) is alt
    props = DeviceProps.of(device)
    args = compute_overlap_args(props, CS)
    assert args is not None and args.comm_sms + args.compute_sms == props.sm_count
