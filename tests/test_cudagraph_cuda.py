"""CUDA graphs on one GPU: replay equals eager (DBO and plain graphs, with and without the emulated link),
a replay makes zero ubatch handoffs, repeated capture/clear with the threads executor does not leak, and
torch_ll over NCCL (one rank) captures with and without DBO. Skipped without a GPU (tests/conftest.py).

The replay-equals-eager check is ``check_replay_equals_eager`` from tests/test_cudagraph_dispatch.py, which
also runs it in CPU CI on the eager stand-in backend (``test_replay_equals_eager_on_the_eager_stand_in``).

Not run under ``TORCH_CUDA_SANITIZER=1``: torch's CUDA sanitizer takes every kernel launched inside a capture as
executed there and then, and sees nothing of what a replay reads or writes, so on graph tests it reports
accesses of a program that never runs (a captured read "racing" the next size's buffer fill) and checks none
of the real one. The capture path's stream order is checked instead by the project's own sanitizer on
tests/test_cudagraph_dispatch.py and tests/test_graph_memory.py (``--stream-sanitizer``), where the fills,
warm-ups and capture of each size all run on the capture stream after it waited for the caller's stream."""
from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

import runner.worker.cuda_graphs as manager
from cudagraph import GraphKey, Why, token_split
from step_numerics import prefixed
from test_cudagraph_dispatch import (
    REPLAY_SIZES,
    DecodeBatches,
    check_both_kinds_replay,
    check_replay_equals_eager,
    make_runner,
)
from ubatch.context import UBatchContext

pytestmark = [pytest.mark.cuda, pytest.mark.triton_compiled,  # Triton compiled for CUDA tensors (conftest)
              pytest.mark.skipif(os.environ.get("TORCH_CUDA_SANITIZER", "") not in ("", "0"),
                                 reason="torch's CUDA sanitizer models captured launches as executed (module doc)")]

LINK = "latency_us=20,gbps=100"
GPU: dict[str, Any] = dict(experts_backend="triton", dtype="float32", max_num_seqs=16, dbo_decode_token_threshold=4,
                           max_model_len=128, block_size=16, num_kv_blocks=16 * 8)


def captured(link: str | None, dbo: bool = True, executor: str = "greenlet", cost_model: str = "off"):
    runner = make_runner(executor, emulate_link=link, enable_dbo=dbo, dbo_cost_model=cost_model, **GPU)
    batches = DecodeBatches(runner, num_reqs=GPU["max_num_seqs"])  # one request per token of the largest graph
    graph_runner = manager.maybe_make_graph_runner(runner)  # the real entry point: captures here
    assert graph_runner is not None
    return runner, batches, graph_runner


@pytest.mark.parametrize("link", [None, LINK], ids=["none", "emulated"])
@pytest.mark.parametrize("dbo", [True, False], ids=["dbo", "no-dbo"])
def test_replay_equals_eager(link: str | None, dbo: bool) -> None:
    runner, batches, gr = captured(link, dbo)
    try:
        assert max(REPLAY_SIZES) == GPU["max_num_seqs"]
        check_replay_equals_eager(runner, batches, gr, dbo, link, tol=2e-3)
    finally:
        gr.clear()
        runner.close()


def test_both_kinds_replay() -> None:
    """The measured cost model's plan: a plain and a DBO graph at every size that may ubatch, each replaying
    what its eager step computes (the CPU run is ``test_the_measured_cost_models_plan_replays_both_kinds...``)."""
    runner, batches, gr = captured(LINK, cost_model="measured")
    try:
        assert {k for k in gr.graphs if k.num_tokens == GPU["max_num_seqs"]} == {
            GraphKey(GPU["max_num_seqs"]), GraphKey(GPU["max_num_seqs"], token_split(GPU["max_num_seqs"], 2))}
        check_both_kinds_replay(runner, batches, gr, tol=2e-3)
    finally:
        gr.clear()
        runner.close()


def test_a_dbo_replay_makes_no_handoffs(monkeypatch: pytest.MonkeyPatch) -> None:
    runner, batches, gr = captured(LINK)
    try:
        yields = {"n": 0}
        original = UBatchContext.yield_

        def counting(self: UBatchContext) -> None:
            yields["n"] += 1
            original(self)

        monkeypatch.setattr(UBatchContext, "yield_", counting)
        steps = runner.wrapper.num_ubatched_steps
        batches.step(8, gr)
        torch.cuda.synchronize()
        assert gr.stats[Why.REPLAY] == 1
        assert yields["n"] == 0 and runner.wrapper.num_ubatched_steps == steps
        batches.step(8)  # the same step eager: the counter does see handoffs
        assert yields["n"] > 0 and runner.wrapper.num_ubatched_steps == steps + 1
    finally:
        gr.clear()
        runner.close()


@pytest.mark.parametrize("head", ["greedy", "draw", "top_k", "top_p"])
@pytest.mark.parametrize("dbo", [False, True], ids=["plain", "dbo"])
def test_decode_samples_in_the_head_graphs_as_eager(dbo: bool, head: str) -> None:
    """The engine's own graphs: each decode step replays its forward graph and then that graph's head (the LM head
    with the greedy pick, or with each row's draw by its temperature, maybe after top-k and top-p or after top-p
    alone, for rows greedy or drawing); the tokens equal an eager runner's (on CPU, the eager stand-in:
    test_graph_head.py). Both draw with the fused kernel (``fused_draw.py``), as the fused tails' default has it on
    CUDA."""
    from graph_replays import record_replays
    from runner.sampling_params import SamplingParams
    from test_graph_head import DECODE_STEPS, GREEDY, NUM_REQS, generate

    def drawing(i: int) -> SamplingParams:
        if head == "draw":
            return SamplingParams(temperature=0.5 + 0.25 * i, seed=i)
        if head == "top_p":
            return SamplingParams(temperature=0.5 + 0.25 * i, seed=i, top_p=0.5 + 0.05 * i)
        return SamplingParams(temperature=0.5 + 0.25 * i, seed=i, top_k=1 + 9 * i, top_p=0.95)

    params = [GREEDY] * NUM_REQS if head == "greedy" else [GREEDY, *(drawing(i) for i in range(NUM_REQS - 1))]
    eager = make_runner(enable_dbo=dbo, enforce_eager=True, **GPU)
    try:
        assert eager.graph_runner is None
        want = generate(eager, params)
    finally:
        eager.close()
    runner = make_runner(enable_dbo=dbo, **GPU)
    try:
        assert runner.graph_runner is not None  # captured by the runner itself, the heads with each size
        assert runner.sampler.fused_draw and eager.sampler.fused_draw  # the fused tails' auto: the kernel draws
        replays = record_replays(runner.graph_runner)
        assert generate(runner, params) == want
        assert len(replays.forward) == DECODE_STEPS and replays.heads == {head: replays.forward}
    finally:
        runner.close()


def test_capture_clear_cycles_with_threads_do_not_leak() -> None:
    runner = make_runner("threads", emulate_link=LINK, **GPU)
    try:
        batches = DecodeBatches(runner)
        gr = manager.make_graph_runner(runner, sizes=[2, 8], progress=False)
        allocated = []
        for _ in range(4):
            gr.capture()
            assert len(gr.warmed_threads) == 2
            batches.step(8, gr)
            gr.clear()
            gc.collect()
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
        assert allocated[1] == allocated[2] == allocated[3], allocated  # the first cycle may warm caches
    finally:
        runner.close()


def test_a_ladder_holds_little_more_than_its_outputs_after_capture() -> None:
    """Captured without autograd, the graphs (forwards and their heads) keep only their static outputs allocated:
    the pool's other blocks are free for the next (smaller) capture to reuse. With grad enabled each output kept
    its step's saved activations, so graph memory grew with every size of the ladder (and leaked per
    capture/clear cycle)."""
    runner = make_runner("greenlet", **GPU)
    try:
        gr = manager.make_graph_runner(runner, progress=False)  # the default ladder up to max_num_seqs=16
        gr.capture()  # the first cycle creates cuBLAS workspaces and Triton's caches
        gr.clear()
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        report = gr.capture()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        kept = [t for e in gr.graphs.values() for t in (e.output, *(h.output for h in e.heads.values()))]
        outputs = sum(-(-t.numel() * t.element_size() // 512) * 512 for t in kept)  # forwards' and heads' outputs
        assert len(report.bytes_by_key) == len(gr.graphs) and not report.dropped
        assert held <= outputs + 64 * 1024, (held, outputs, report.memory_table())
        gr.clear()
    finally:
        runner.close()


def test_torch_ll_over_nccl_is_capturable_with_and_without_dbo() -> None:
    import torch.distributed as dist

    from ubatch import UBatchSlice, UBatchWrapper, set_forward_context
    from ubatch.distributed import new_ep_groups
    from ubatch.forward_context import ForwardContext
    from ubatch.modular_moe.config import MoEParallelConfig
    from ubatch.modular_moe.layer import FusedMoE

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel = MoEParallelConfig(all2all_backend="torch_ll", experts_backend="triton", ep_groups=new_ep_groups(2),
                                     max_dispatch_tokens_per_rank=32)
        layer = FusedMoE(8, 2, 64, 32, parallel=parallel).cuda()
        g = torch.Generator(device="cuda").manual_seed(0)
        for w in (layer.w13_weight, layer.w2_weight):
            w.copy_(torch.randn(w.shape, generator=g, device="cuda") * 0.1)
        x, logits = torch.randn(16, 64, device="cuda", generator=g), torch.randn(16, 8, device="cuda", generator=g)
        wrapper = UBatchWrapper(layer)
        slices = [UBatchSlice(slice(0, 8), slice(0, 8)), UBatchSlice(slice(8, 16), slice(8, 16))]

        def plain() -> torch.Tensor:
            return layer(x, logits)

        def dbo() -> torch.Tensor:
            return wrapper.run_ubatched(ForwardContext(ubatch_slices=slices), slices, (x, logits), {})

        for fn in (plain, dbo):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
                fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            x.copy_(torch.randn(16, 64, device="cuda", generator=g))
            graph.replay()
            with set_forward_context():
                ref = layer(x, logits)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4, msg=prefixed(fn.__name__))
        wrapper.close()
    finally:
        dist.destroy_process_group()
