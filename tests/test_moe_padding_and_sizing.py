"""Padding rows route nowhere; torch_ll sizes each ubatch by its own bound; torch_ht hides its dispatch.

Each test runs the MoE stack of ``moe_harness`` over gloo thread ranks and compares against the same stack
on the unpadded batch (or the dense reference), and also checks that the feature under test was active:
padding rows really were there, the bytes really shrank, the dispatch really was in flight.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from moe_harness import MoEStack, StackWeights, dense_reference, halves
from ubatch import UBatchConfig, UBatchSlice, UBatchWrapper, set_forward_context, trace
from ubatch.forward_context import DPMetadata
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.experts.torch_experts import TorchExperts
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.prepare_finalize.base import WireCounter
from ubatch.slicing import padded_ubatch_slices
from ubatch.testing.thread_ranks import run_thread_ranks
from ubatch.trace_metrics import spans_from_chrome

REL_TOL = 1e-5


def first_layer_wire(model: MoEStack) -> WireCounter:
    """The bytes the first MoE layer's all-to-all put on the wire, by direction and ubatch."""
    layer = model.layers[0]
    assert isinstance(layer, FusedMoE)
    return layer.kernel.prepare_finalize.wire


def _inputs(sizes: list[int], hidden: int = 16, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) for n in sizes]


class ExpertLoad:
    """Counts the rows each local expert computes, per rank (wraps the torch experts)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: dict[int, torch.Tensor] = {}
        original = TorchExperts.apply

        def counting(experts: TorchExperts, tokens: Any, w13: torch.Tensor, w2: torch.Tensor,
                     extras: Any = None) -> torch.Tensor:
            import threading

            rank = int(threading.current_thread().name.split("-")[-1]) if "rank-" in threading.current_thread().name \
                else self._rank_of_worker()
            if tokens.layout == "masked":
                c = tokens.expert_num_tokens.to(torch.int64)
            else:
                c = torch.stack([(tokens.topk_ids == e).sum() for e in range(w13.shape[0])])
            self.counts[rank] = self.counts.get(rank, torch.zeros_like(c)) + c
            return original(experts, tokens, w13, w2, extras)

        monkeypatch.setattr(TorchExperts, "apply", counting)

    @staticmethod
    def _rank_of_worker() -> int:
        from ubatch.forward_context import maybe_get_forward_context

        fc = maybe_get_forward_context()
        return int(fc.trace_rank or 0) if fc is not None else 0


def _run(weights: StackWeights, rows: list[torch.Tensor], real: list[int], backend: str, dbo: bool,
         link: str | None = "latency_us=1,gbps=1000") -> list[dict[str, Any]]:
    """Each rank runs ``rows[r]``, of which the first ``real[r]`` are real; returns output, link and wire bytes."""
    world = len(rows)
    across = tuple(real)

    def rank_main(rank: int, groups: list[Any]) -> dict[str, Any]:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=world, all2all_backend=backend, ep_groups=groups,
                                     max_dispatch_tokens_per_rank=64, emulate_link=link)
        model = MoEStack(weights, parallel)
        x = rows[rank]
        mask = torch.arange(x.shape[0]) < real[rank] if x.shape[0] != real[rank] else None
        dp = DPMetadata(across, num_real_tokens=real[rank])
        slices = padded_ubatch_slices([real[rank]] if real[rank] else [], x.shape[0]) if dbo else None
        runner: Any = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=60)) if dbo else model
        try:
            with set_forward_context(ubatch_slices=slices, dp_metadata=dp, real_token_mask=mask, trace_rank=rank):
                out = runner(x)
        finally:
            if dbo:
                runner.close()
        wire = first_layer_wire(model)
        link_obj = model.runtime.link()
        return {"out": out, "link_bytes": link_obj.total_bytes if link_obj else 0,
                "wire": wire.total("dispatch"), "yields": runner.last_yield_counts if dbo else []}

    return run_thread_ranks(world, rank_main, num_groups=2, timeout_s=60)


@pytest.mark.parametrize("backend", ["torch_ll", "torch_ht"])
@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
def test_padding_rows_send_nothing_and_change_nothing(backend: str, dbo: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    weights = StackWeights.random(layers=2)
    real = [5, 9]
    xs = _inputs(real)
    padding = _inputs([6, 2], seed=99)  # what DP padding to 11 rows adds (any values: they must not matter)
    padded = [torch.cat([x, p]) for x, p in zip(xs, padding, strict=True)]

    load = ExpertLoad(monkeypatch)
    plain = _run(weights, xs, real, backend, dbo)
    plain_load = {r: c.clone() for r, c in load.counts.items()}
    load.counts.clear()
    masked = _run(weights, padded, real, backend, dbo)

    for r, n in enumerate(real):
        torch.testing.assert_close(masked[r]["out"][:n], plain[r]["out"], rtol=0, atol=REL_TOL)
        ref = dense_reference(weights, xs[r])
        assert (masked[r]["out"][:n] - ref).abs().max() <= REL_TOL * ref.abs().max()
        assert masked[r]["link_bytes"] == plain[r]["link_bytes"] > 0  # the modelled wire carried real rows only
        assert torch.equal(load.counts[r], plain_load[r])  # every expert computed exactly the real rows
        if backend == "torch_ht":  # the real collective carried the same bytes
            assert masked[r]["wire"] == plain[r]["wire"]
        if dbo:
            assert masked[r]["yields"] == [4, 4]
    assert sum(int(c.sum()) for c in load.counts.values()) == sum(real) * weights.top_k * len(weights.gates)


def test_an_idle_rank_runs_padding_only_ubatches() -> None:
    """SGLang's rule: the idle rank joins the ubatched step with one padding row per ubatch."""
    weights = StackWeights.random(layers=2)
    real = [0, 8]
    rows = [_inputs([2], seed=7)[0], _inputs([8])[0]]
    results = _run(weights, rows, real, "torch_ll", dbo=True)
    assert results[0]["yields"] == results[1]["yields"] == [4, 4]
    assert results[0]["link_bytes"] == 0
    ref = dense_reference(weights, rows[1])
    assert (results[1]["out"] - ref).abs().max() <= REL_TOL * ref.abs().max()


def test_padded_slices_and_padding_only_attention_metadata() -> None:
    from ubatch.slicing import CommonAttentionMetadata, split_attn_metadata

    # 3 real tokens (requests of 2 and 1) padded to 10: the cut at 5 leaves ubatch 1 with padding only
    sl = padded_ubatch_slices([2, 1], 10)
    assert sl == [UBatchSlice(slice(0, 2), slice(0, 5)), UBatchSlice(slice(2, 2), slice(5, 10))]
    common = CommonAttentionMetadata.from_lens([2, 1], [2, 1], num_tokens_padded=10)
    first, second = split_attn_metadata(sl, common)
    assert first.num_reqs == 2 and second.num_reqs == 0
    assert second.query_start_loc_cpu.tolist() == [0] and second.slot_mapping.shape == (5,)
    assert padded_ubatch_slices([], 2) == [UBatchSlice(slice(0, 0), slice(0, 1)), UBatchSlice(slice(0, 0), slice(1, 2))]
    # a real boundary inside a request: both ubatches hold a part of it
    assert padded_ubatch_slices([6], 8, split_point=[4]) == [UBatchSlice(slice(0, 1), slice(0, 4)),
                                                             UBatchSlice(slice(0, 1), slice(4, 8))]
    with pytest.raises(ValueError, match="leave a ubatch without a single row"):
        padded_ubatch_slices([1], 1)
    with pytest.raises(ValueError, match="num_tokens_padded=2 is smaller than the 3 scheduled tokens"):
        padded_ubatch_slices([3], 2)


def test_padding_mask_must_match_the_rows() -> None:
    weights = StackWeights.random(layers=1)
    model = MoEStack(weights, MoEParallelConfig())
    with (
        set_forward_context(real_token_mask=torch.ones(3, dtype=torch.bool)),
        pytest.raises(ValueError, match=r"real_token_mask has shape \(3,\) but this MoE call routes 4 rows"),
    ):
        model(torch.randn(4, 16))


# ---- torch_ll: each ubatch sized by its own bound ----------------------------------------------------------
def test_each_ubatch_buffer_is_sized_by_its_own_bound() -> None:
    weights = StackWeights.random(layers=1)
    e, h = weights.w13[0].shape[0], weights.w13[0].shape[2]
    sizes = [12, 10]  # rank 0 is the largest: whole-step bound 12, ubatch bounds (6, 6)

    def rank_main(rank: int, groups: list[Any]) -> dict[str, Any]:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=2, all2all_backend="torch_ll", ep_groups=groups,
                                     max_dispatch_tokens_per_rank=64)
        model = MoEStack(weights, parallel)
        x = _inputs(sizes)[rank]
        pad = torch.cat([x, torch.zeros(12 - x.shape[0], x.shape[1])])
        wire = first_layer_wire(model)
        mask = torch.arange(12) < x.shape[0]
        with set_forward_context(dp_metadata=DPMetadata(tuple(sizes), step_token_bound=12)):
            model(x)
        whole = dict(wire.bytes)
        wire.reset()
        wrapper = UBatchWrapper(model)
        try:
            dp = DPMetadata(tuple(sizes), step_token_bound=12, ubatch_token_bounds=(6, 6), num_real_tokens=x.shape[0])
            with set_forward_context(ubatch_slices=halves(12), dp_metadata=dp, real_token_mask=mask):
                out = wrapper(pad)
        finally:
            wrapper.close()
        return {"whole": whole, "dbo": dict(wire.bytes), "out": out[: x.shape[0]], "x": x}

    counts_bytes = e * 8  # the int64 per-expert counts that travel with every dispatch
    for res in run_thread_ranks(2, rank_main, num_groups=2):
        assert res["whole"][("dispatch", 0)] == e * 12 * h * 4 + counts_bytes
        assert res["dbo"][("dispatch", 0)] == res["dbo"][("dispatch", 1)] == e * 6 * h * 4 + counts_bytes
        for direction in ("dispatch", "combine"):  # two ubatches move what the whole step moves, not twice it
            dbo = res["dbo"][(direction, 0)] + res["dbo"][(direction, 1)]
            assert dbo <= 1.1 * res["whole"][(direction, 0)]
        ref = dense_reference(weights, res["x"])
        assert (res["out"] - ref).abs().max() <= REL_TOL * ref.abs().max()


def test_a_ubatch_bound_smaller_than_its_tokens_raises() -> None:
    weights = StackWeights.random(layers=1)

    def rank_main(rank: int, groups: list[Any]) -> None:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=2, all2all_backend="torch_ll", ep_groups=groups,
                                     max_dispatch_tokens_per_rank=64)
        model = MoEStack(weights, parallel)
        wrapper = UBatchWrapper(model, UBatchConfig(handoff_timeout_s=10))
        try:
            with set_forward_context(ubatch_slices=halves(8), dp_metadata=DPMetadata((8, 8), step_token_bound=8,
                                                                                     ubatch_token_bounds=(3, 4))):
                wrapper(torch.randn(8, 16))
        finally:
            wrapper.close()

    with pytest.raises(ValueError, match="4 tokens exceed ubatch 0's agreed token bound 3"):
        run_thread_ranks(2, rank_main, num_groups=2)


# ---- torch_ht: the dispatch flies while the other ubatch computes ------------------------------------------
def test_ht_dispatch_is_in_flight_during_the_other_ubatchs_compute() -> None:
    """Trace a DBO step over 2 ranks: after each ubatch posts its dispatch, the *other* ubatch computes, and
    only then does a receive hook wait for the transfer, before the posting ubatch computes again. So the
    transfer is in flight across that compute whatever the link's speed, and the step equals the dense one.
    The order of spans is asserted, not their lengths: a rank thread lagging on a loaded machine moves the
    spans, not their order."""
    weights = StackWeights.random(layers=2)
    xs = _inputs([8, 8])
    rec = trace.TraceRecorder()
    with trace.recording(rec):
        results = _run(weights, xs, [8, 8], "torch_ht", dbo=True, link="latency_us=2000,gbps=1")
    for r in range(2):
        ref = dense_reference(weights, xs[r])
        assert (results[r]["out"] - ref).abs().max() <= REL_TOL * ref.abs().max()
    data = trace.to_chrome_trace(rec)
    for pid in (0, 1):
        _, spans = spans_from_chrome(data, pid)
        compute_starts = {u: sorted(s.start for s in spans if s.cat == "compute" and s.track == f"ubatch{u}")
                          for u in (0, 1)}
        hooks = [(s.start, s.end) for s in spans if s.cat == "hook"]
        dispatches = [s for s in spans if s.cat == "comm" and s.name.startswith("dispatch")]
        assert len(dispatches) == 4  # 2 layers x 2 ubatches
        for d in dispatches:
            own = trace.ubatch_of_track(d.track)
            assert own is not None, d.track
            own_next = min((t for t in compute_starts[own] if t >= d.start), default=float("inf"))
            between = [t for t in compute_starts[1 - own] if d.start <= t < own_next]
            assert between, f"{d.name} on rank {pid}: ubatch {1 - own} did not compute while it was in flight"
            assert any(between[0] <= a and b <= own_next for a, b in hooks), \
                f"{d.name} on rank {pid}: no receive hook waited for it after ubatch {1 - own} computed"
