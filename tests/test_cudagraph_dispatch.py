"""CUDA-graph logic that needs no GPU: capture sizes, padding, dispatch rules, capture rules, and the
manager's plumbing run end to end on CPU with the eager replay double (buffers, per-ubatch metadata views,
attention routing), compared against the eager runner.

:func:`check_replay_equals_eager` is shared with tests/test_cudagraph_cuda.py: the CPU run here, on the eager
stand-in, is the same check the GPU runs with real graphs, so the GPU run is never its first run."""
from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import runner.worker.cuda_graphs as manager
from cudagraph import (
    BatchKind,
    CaptureRuleError,
    GraphKey,
    Why,
    capture_blocker,
    check_deepep_ll_rules,
    check_replay,
    classify_batch,
    default_capture_sizes,
    pad_to_capture_size,
    parse_cuda_graph_sizes,
    plan_captures,
    resolve_capture_sizes,
    select_graph,
    token_split,
)
from cudagraph.backends import EagerReplayBackend, GraphBackend, deepep_ll_counter
from moe_harness import shadow_method
from runner import attention as eager_attention
from runner.attention import graph as ga
from runner.attention.kv_cache import build_attention_metadata
from runner.config import RunnerConfig
from runner.distributed.dp import local_decision
from step_numerics import assert_bit_equal, assert_steps_close, prefixed
from ubatch.context import UBatchContext
from ubatch.forward_context import set_forward_context
from ubatch.log_once import forget_logged
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.prepare_finalize.emulated_link import EmulatedLink
from ubatch.slicing import maybe_create_ubatch_slices
from ubatch.wrapper import UBatchConfig, UBatchWrapper

REPO = Path(__file__).resolve().parents[1]
UD, MIXED, DUMMY = BatchKind.UNIFORM_DECODE, BatchKind.MIXED, BatchKind.DUMMY


# ---- sizes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_size, expected", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (40, [1, 2, 4, 8, 16, 24, 32, 40]),
])
def test_default_ladder(max_size: int, expected: list[int]) -> None:
    assert default_capture_sizes(max_size) == expected


def test_default_ladder_steps_by_16_past_256() -> None:
    sizes = default_capture_sizes(300)
    assert sizes[-5:] == [248, 256, 272, 288, 300] and sizes[:5] == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("text, expected", [
    ("1,2,4", [1, 2, 4]), ("4 2 2 1", [1, 2, 4]), (" 8, 1 ,2 ", [1, 2, 8]), ("16", [1, 2, 4, 8, 16]),
])
def test_parse_cuda_graph_sizes(text: str, expected: list[int]) -> None:
    assert parse_cuda_graph_sizes(text) == expected


@pytest.mark.parametrize("text, named", [("1,2,x", "'x'"), ("1,0", "0"), ("-3", "-3"), ("", "no sizes"),
                                         ("2,1.5", "'1.5'")])
def test_parse_cuda_graph_sizes_names_the_bad_value(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        parse_cuda_graph_sizes(text)


def test_resolve_capture_sizes_clips_to_what_a_step_holds(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_capture_sizes(None, max_num_seqs=20, max_num_batched_tokens=512) == [1, 2, 4, 8, 16, 20]
    assert resolve_capture_sizes(None, max_num_seqs=64, max_num_batched_tokens=10) == [1, 2, 4, 8, 10]
    with caplog.at_level(logging.WARNING, logger="ubatch.cudagraph"):
        assert resolve_capture_sizes([4, 64, 1, 4], max_num_seqs=16, max_num_batched_tokens=512) == [1, 4]
    assert "dropping CUDA graph sizes [64]" in caplog.text
    assert resolve_capture_sizes("1,2", max_num_seqs=16, max_num_batched_tokens=512) == [1, 2]
    with pytest.raises(ValueError, match="every size exceeds"):
        resolve_capture_sizes([32, 64], max_num_seqs=16, max_num_batched_tokens=512)


@pytest.mark.parametrize("n, padded", [(0, None), (1, 1), (3, 4), (4, 4), (5, 8), (17, 24), (32, 32), (33, None)])
def test_pad_to_capture_size(n: int, padded: int | None) -> None:
    assert pad_to_capture_size(n, [1, 2, 4, 8, 16, 24, 32]) == padded


# ---- descriptors and plan ------------------------------------------------------------------------------
@pytest.mark.parametrize("reqs, tokens, max_q, kind", [
    (0, 1, 0, DUMMY), (4, 4, 1, UD), (1, 1, 1, UD), (4, 7, 4, MIXED), (3, 3, 2, MIXED)])
def test_classify_batch(reqs: int, tokens: int, max_q: int, kind: BatchKind) -> None:
    assert classify_batch(reqs, tokens, max_q) is kind


@pytest.mark.parametrize("n, u, split", [(8, 2, (4, 4)), (9, 2, (4, 5)), (9, 3, (3, 3, 3)), (10, 3, (3, 3, 4))])
def test_token_split_matches_the_runner_slicing(n: int, u: int, split: tuple[int, ...]) -> None:
    assert token_split(n, u) == split
    real = max(1, n - 1)
    _, padded = maybe_create_ubatch_slices(True, [1] * real, n, real, u)
    assert padded is not None
    assert tuple(s.num_tokens for s in padded) == split


def test_plan_one_graph_per_shape() -> None:
    plain = plan_captures([1, 2, 4, 8], dbo_enabled=False, decode_threshold=4)
    assert plain == [GraphKey(1), GraphKey(2), GraphKey(4), GraphKey(8)]
    dbo = plan_captures([1, 2, 4, 8], dbo_enabled=True, decode_threshold=4)
    # threshold - 1 is added so that 3 decode tokens (which do not ubatch) do not pad into a DBO-only graph
    assert dbo == [GraphKey(1), GraphKey(2), GraphKey(3), GraphKey(4, (2, 2)), GraphKey(8, (4, 4))]
    assert plan_captures([1, 2], dbo_enabled=True, decode_threshold=1) == [GraphKey(1), GraphKey(2, (1, 1))]
    assert plan_captures([1, 2], dbo_enabled=True, decode_threshold=32) == [GraphKey(1), GraphKey(2)]


def test_plan_holds_both_kinds_where_the_cost_model_may_choose_either() -> None:
    """With the measured cost model every size that may ubatch has a plain and a DBO graph (no threshold - 1
    graph is needed: a batch below the threshold pads into a plain graph); sizes below the threshold, where
    the thresholds alone say no, stay plain only."""
    keys = plan_captures([1, 2, 4, 8], dbo_enabled=True, decode_threshold=4, both_kinds=True)
    assert keys == [GraphKey(1), GraphKey(2), GraphKey(4), GraphKey(4, (2, 2)), GraphKey(8), GraphKey(8, (4, 4))]
    assert plan_captures([1, 2], dbo_enabled=False, decode_threshold=1, both_kinds=True) == [GraphKey(1), GraphKey(2)]
    for n, ubatch in [(3, False), (4, False), (4, True), (5, False), (8, True)]:  # every choice replays
        d = select_graph(UD, n, ubatch, keys)
        assert d.replay and d.key is not None and d.key.ubatched is ubatch, (n, ubatch, d)


# ---- dispatch rules ------------------------------------------------------------------------------------
LADDER = plan_captures([1, 2, 4, 8, 16, 24, 32, 40, 48], dbo_enabled=True, decode_threshold=32)
PLAIN_ONLY = plan_captures([8, 16], dbo_enabled=False, decode_threshold=32)


@pytest.mark.parametrize("kind, n, ubatch, captured, min_real, why, key, padded", [
    (UD, 5, False, LADDER, None, Why.REPLAY, GraphKey(8), 8),
    (UD, 28, False, LADDER, None, Why.REPLAY, GraphKey(31), 31),  # just below the DBO threshold
    (UD, 33, True, LADDER, None, Why.REPLAY, GraphKey(40, (20, 20)), 40),
    (UD, 40, True, LADDER, 21, Why.REPLAY, GraphKey(40, (20, 20)), 40),
    (MIXED, 8, False, LADDER, None, Why.MIXED, None, 8),  # vLLM #25625: never a decode graph for a mixed batch
    (MIXED, 40, True, LADDER, None, Why.MIXED, None, 40),
    (DUMMY, 1, False, LADDER, None, Why.DUMMY, None, 1),
    (UD, 49, True, LADDER, None, Why.TOO_LARGE, None, 49),
    (UD, 3, False, [], None, Why.TOO_LARGE, None, 3),
    (UD, 33, False, LADDER, None, Why.DBO_ONLY, None, 33),  # DP aborted ubatching: eager, not a DBO graph
    (UD, 8, True, PLAIN_ONLY, None, Why.NO_DBO_GRAPH, None, 8),
    (UD, 32, True, LADDER, 16, Why.LAST_UBATCH_EMPTY, None, 32),  # another DP rank has only 16 real tokens
])
def test_select_graph(kind: BatchKind, n: int, ubatch: bool, captured: list[GraphKey], min_real: int | None,
                      why: Why, key: GraphKey | None, padded: int) -> None:
    d = select_graph(kind, n, ubatch, captured, min_real_tokens=min_real)
    assert (d.why, d.key, d.num_tokens, d.replay) == (why, key, padded, key is not None)
    assert d.detail


def test_select_graph_disabled() -> None:
    d = select_graph(UD, 8, False, LADDER, enabled=False)
    assert (d.why, d.key, d.num_tokens) == (Why.DISABLED, None, 8)


@pytest.mark.parametrize("key, n, sizes, why", [
    (GraphKey(8), 8, None, None),
    (GraphKey(8, (4, 4)), 8, (4, 4), None),
    (GraphKey(8), 7, None, Why.NOT_PADDED),
    (GraphKey(24, (12, 12)), 24, (10, 14), Why.SPLIT_MISMATCH),  # --ubatch-split balanced cut elsewhere
    (GraphKey(8), 8, (4, 4), Why.SPLIT_MISMATCH),
    (GraphKey(8, (4, 4)), 8, None, Why.SPLIT_MISMATCH),
])
def test_check_replay(key: GraphKey, n: int, sizes: tuple[int, ...] | None, why: Why | None) -> None:
    d = check_replay(key, n, sizes)
    assert (d.why if d else None) is why and (d is None or d.key is None)


@pytest.mark.parametrize("a2a, experts, blocked", [
    ("none", "triton", False), ("torch_ll", "triton", False), ("deepep_low_latency", "deep_gemm", False),
    ("torch_ht", "triton", True), ("deepep_high_throughput", "triton", True), ("none", "torch", True)])
def test_capture_blocker(a2a: str, experts: str, blocked: bool) -> None:
    assert (capture_blocker(a2a, experts) is not None) is blocked


@pytest.mark.parametrize("calls, ubatches, handles, error", [
    (8, 2, 2, None), (4, 1, 2, None), (0, 2, 2, None), (7, 2, 2, "odd"), (8, 3, 3, "at most 2"),
    (8, 2, 1, "one dispatch handle per ubatch")])
def test_deepep_ll_capture_rules(calls: int, ubatches: int, handles: int, error: str | None) -> None:
    if error is None:
        check_deepep_ll_rules(calls, ubatches, handles)
    else:
        with pytest.raises(CaptureRuleError, match=error):
            check_deepep_ll_rules(calls, ubatches, handles)


def test_deepep_ll_counter_counts_and_restores() -> None:
    class Buffer:
        def low_latency_dispatch(self, x: int) -> int:
            return x + 1

        def low_latency_combine(self, x: int) -> int:
            return x - 1

    class Layer(torch.nn.Module):  # what the counter looks for: a module whose kernel has a prepare_finalize
        def __init__(self) -> None:
            super().__init__()
            self.kernel = SimpleNamespace(prepare_finalize=pf)

    pf = SimpleNamespace(name="deepep_low_latency", buffer=Buffer(), handles=[None, None])
    layer = Layer()
    model = torch.nn.Sequential(layer, torch.nn.Linear(2, 2))
    with deepep_ll_counter(model) as ll:
        assert pf.buffer.low_latency_dispatch(1) == 2 and pf.buffer.low_latency_combine(1) == 0
        pf.buffer.low_latency_dispatch(5)
    assert (ll.num_backends, ll.num_handles, ll.calls) == (1, 2, 3)
    assert "low_latency_dispatch" not in vars(pf.buffer)  # the class method is back


# ---- capturable attention vs the eager backend -----------------------------------------------------------
def _decode_case(kv_shape: tuple[int, ...], n: int, padded: int, bs: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 40
    cache = torch.randn((num_blocks + 1, bs, *kv_shape), generator=g)
    ctx = torch.randint(1, 20, (n,), generator=g).tolist()
    blocks = [list(range(i * 6, i * 6 + 6)) for i in range(n)]
    meta = build_attention_metadata(ctx, [1] * n, blocks, bs, num_padded_tokens=padded)
    buffers = ga.DecodeMetadataBuffers(16, 8, bs, null_block=num_blocks, device="cpu")
    buffers.fill(meta, padded)
    return cache, meta, buffers


def test_graph_attention_equals_eager_on_real_rows_and_is_finite_on_padding() -> None:
    cache, meta, buffers = _decode_case((2, 2, 8), n=5, padded=8)
    q = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(1))
    ref = eager_attention.paged_attention(q, cache, meta, 0.3)
    out = ga.graph_paged_attention(q, cache, buffers.views(8)[0], 0.3)
    torch.testing.assert_close(out[:5], ref[:5], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all()
    halves = [ga.graph_paged_attention(q[a:b], cache, m, 0.3)
              for (a, b), m in zip([(0, 4), (4, 8)], buffers.views(8, (4, 4)), strict=True)]
    torch.testing.assert_close(torch.cat(halves), out, rtol=0, atol=0)


def test_graph_mla_attention_equals_eager() -> None:
    lat, rope, heads, dn, dv = 16, 4, 2, 8, 8
    cache, meta, buffers = _decode_case((lat + rope,), n=3, padded=4)
    g = torch.Generator().manual_seed(2)
    q_nope, q_rope = torch.randn(4, heads, dn, generator=g), torch.randn(4, heads, rope, generator=g)
    w_uk, w_uv = torch.randn(heads, dn, lat, generator=g), torch.randn(heads, dv, lat, generator=g)
    ref = eager_attention.paged_mla_attention(q_nope, q_rope, cache, meta, 0.2, w_uk, w_uv)
    out = ga.graph_paged_mla_attention(q_nope, q_rope, cache, buffers.views(4)[0], 0.2, w_uk, w_uv)
    torch.testing.assert_close(out[:3], ref[:3], rtol=1e-5, atol=1e-5)


def test_padding_tokens_write_into_the_null_block_only() -> None:
    cache, meta, buffers = _decode_case((2, 2, 8), n=3, padded=6)
    before = cache.clone()
    k = torch.randn(6, 2, 8)
    ga.graph_write_kv(cache, buffers.slot_mapping[:6], k, k)
    changed = (cache != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    real_blocks = {int(s) // 4 for s in meta.slot_mapping[:3]}
    assert set(changed) == real_blocks | {buffers.null_block}


def test_decode_buffers_reject_what_a_graph_cannot_serve() -> None:
    buffers = ga.DecodeMetadataBuffers(8, 4, 4, null_block=50, device="cpu")
    prefill = build_attention_metadata([0], [3], [[0]], 4)
    with pytest.raises(ValueError, match="not a uniform-decode batch"):
        buffers.fill(prefill, 4)
    decode = build_attention_metadata([2, 2], [1, 1], [[0], [1]], 4)
    with pytest.raises(ValueError, match="cannot pad 2"):
        buffers.fill(decode, 9)
    with pytest.raises(ValueError, match="do not add up"):
        buffers.views(8, (3, 4))


def test_capturable_attention_counts_backend_layers_and_patches_nothing() -> None:
    from runner.models.standard import StandardAttention

    class Probe(torch.nn.Module):  # a layer with its own attention: not counted
        pass

    layer = StandardAttention.__new__(StandardAttention)
    torch.nn.Module.__init__(layer)
    model = torch.nn.Sequential(Probe(), layer, torch.nn.Sequential(layer))
    before = dict(vars(eager_attention))
    with ga.capturable_attention(model) as routed:  # graph metadata routes the layers: nothing is patched
        assert routed == 1 and dict(vars(eager_attention)) == before
    with ga.capturable_attention(torch.nn.Sequential(Probe())) as routed:
        assert routed == 0


# ---- the manager end to end on CPU (eager replay double) -------------------------------------------------
def make_runner(executor: str = "greenlet", **overrides):
    """A small runner on the machine's device, in float32 with the torch experts unless ``overrides`` say
    otherwise: replays are compared with eager steps in float32 (``step_numerics``), and the torch experts
    compute float32 exactly on a GPU too (``grouped_mm``, auto's pick there, rounds operands to bf16)."""
    from runner.worker.model_runner import ModelRunner

    # the thresholds alone by default (one graph per size); tests of the cost model's plan pass "measured"
    cfg: dict[str, Any] = dict(dtype="float32", experts_backend="torch", enable_dbo=True, dbo_decode_token_threshold=4,
               max_num_seqs=16, max_model_len=64, max_num_batched_tokens=64, block_size=4, num_kv_blocks=16 * 16,
               dbo_cost_model="off")
    cfg.update(overrides)
    runner = ModelRunner(RunnerConfig(**cfg))
    if executor != "greenlet" and runner.wrapper is not None:
        runner.wrapper.close()
        runner.wrapper = UBatchWrapper(runner.model, UBatchConfig(2, executor=executor), runner.device)
    return runner


class DecodeBatches:
    """Requests with random context already in the KV cache; builds decode steps the way the runner does."""

    def __init__(self, runner, num_reqs: int = 12, seed: int = 0) -> None:
        self.runner, bs = runner, runner.block_size
        self.num_reqs = num_reqs
        per = runner.max_model_len // bs
        assert num_reqs * per <= runner.num_kv_blocks, f"{num_reqs} requests of {per} blocks do not fit the cache"
        self.blocks = [list(range(i * per, (i + 1) * per)) for i in range(num_reqs)]
        g = torch.Generator().manual_seed(seed)
        self.ctx = torch.randint(3, runner.max_model_len // 2, (num_reqs,), generator=g).tolist()
        for i, c in enumerate(self.ctx):
            meta = build_attention_metadata([0], [c], [self.blocks[i]], bs, runner.device)
            with set_forward_context(attn_metadata=meta):
                runner.model(input_ids=torch.randint(0, 500, (c,), generator=g).to(runner.device),
                             positions=meta.positions)

    def step(self, n: int, graph_runner=None, ubatch: bool | None = None, split_point=None):
        """(padded tokens, hidden[:n]) — exactly the integration lines proposed for ModelRunner._forward."""
        r = self.runner
        vote = r.cfg.enable_dbo and n >= r.cfg.dbo_decode_token_threshold if ubatch is None else ubatch
        decision = local_decision(n, vote, 2)
        padded = decision.num_tokens_padded if graph_runner is None else \
            graph_runner.padded_num_tokens(n, True, decision)
        meta = build_attention_metadata(self.ctx[:n], [1] * n, self.blocks[:n], r.block_size, r.device,
                                        num_padded_tokens=padded)
        r.input_ids[:padded].zero_()
        r.input_ids[:n].copy_(torch.arange(7, 7 + n))
        r.positions[:padded].copy_(meta.positions)
        r.real_token_mask[:n].fill_(True)  # captured graphs read this buffer: refill it for every step
        r.real_token_mask[n:padded].fill_(False)
        mask = r.real_token_mask[:padded]
        slices = None
        if decision.should_ubatch:
            _, slices = maybe_create_ubatch_slices(True, np.ones(n, dtype=np.int64), padded, n, 2, split_point)
        model = r.wrapper if r.wrapper is not None else r.model
        with set_forward_context(attn_metadata=meta, ubatch_slices=slices, real_token_mask=mask):
            hidden = NotImplemented if graph_runner is None else \
                graph_runner.try_replay(meta, slices, r.input_ids[:padded], r.positions[:padded])
            if hidden is NotImplemented:
                hidden = model(input_ids=r.input_ids[:padded], positions=r.positions[:padded])
        return padded, hidden[:n].clone()


@pytest.fixture(scope="module")
def qwen_runner():
    runner = make_runner()
    yield runner, DecodeBatches(runner)
    runner.close()


def test_replay_plumbing_matches_eager_with_and_without_dbo(qwen_runner, caplog) -> None:
    runner, batches = qwen_runner
    gr = manager.make_graph_runner(runner, sizes=[1, 2, 4, 8, 12], backend=EagerReplayBackend(), num_warmups=1,
                                   progress=False)
    calls = {"graph": 0}
    assert isinstance(gr.buffers, ga.DecodeMetadataBuffers)
    backend = gr.buffers.backend
    original = backend.attend

    def counting(q, k_cache, v_cache, meta, scale, options=None):  # the layers' attention on graph metadata
        calls["graph"] += isinstance(meta, ga.GraphDecodeMetadata)
        return original(q, k_cache, v_cache, meta, scale, options)

    shadow_method(backend, "attend", counting)
    try:
        with caplog.at_level(logging.INFO, logger="ubatch.cudagraph"):
            report = gr.capture()
    finally:
        del backend.attend
    assert "captured 6 CUDA graphs (decode sizes [1, 2, 3], DBO sizes [4, 8, 12])" in caplog.text
    assert report.keys == sorted(gr.graphs) and calls["graph"] > 0
    assert len(gr.warmed_threads) == 1  # greenlet executor: every ubatch launches from one worker thread
    for n, padded in [(1, 1), (3, 3), (4, 4), (5, 8), (8, 8), (9, 12), (12, 12)]:
        _, ref = batches.step(n)
        got_padded, out = batches.step(n, gr)
        assert got_padded == padded
        assert_steps_close(out, ref, f"{n} tokens")
    assert gr.stats == {Why.REPLAY: 7}
    # 8 decode tokens that DP did not agree to ubatch: size 8 only has a DBO graph -> eager (vLLM downgrade)
    _, ref = batches.step(8, ubatch=False)
    padded, out = batches.step(8, gr, ubatch=False)
    assert padded == 8 and gr.stats[Why.DBO_ONLY] == 1
    assert_bit_equal(out, ref, "the eager fallback")  # both eager, same shapes
    # a balanced split that cuts elsewhere than the captured graph runs eager -- ubatched at (3, 5) -- and its
    # output is the eager step's (and, the split changing no result, the (4, 4) graph's)
    _, replayed = batches.step(8, gr)
    _, ref = batches.step(8, split_point=[3])
    steps = runner.wrapper.num_ubatched_steps
    _, out = batches.step(8, gr, split_point=[3])
    assert gr.stats[Why.SPLIT_MISMATCH] == 1 and runner.wrapper.num_ubatched_steps == steps + 1
    assert_bit_equal(out, ref, "the eager fallback at (3, 5)")
    assert_steps_close(out, replayed, "(3, 5) eager vs the (4, 4) graph")
    gr.clear()
    assert not gr.graphs


class CountingReplays:
    """Wraps a graph backend (the CUDA one or the eager stand-in) and records every graph it replays, so a
    test can tell which captured graph served a step, not only that the output matched."""

    def __init__(self, inner: GraphBackend) -> None:
        self.inner = inner
        self.replayed: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def replay(self, graph: Any) -> None:
        self.replayed.append(graph)
        self.inner.replay(graph)


def moe_link(runner) -> EmulatedLink | None:
    """The emulated link the runner's MoE layers share (``None`` without ``--emulate-link``)."""
    links = {id(m.runtime): m.runtime.link() for m in runner.model.modules() if isinstance(m, FusedMoE)}
    assert len(links) == 1, "the model's MoE layers must share one runtime"
    return next(iter(links.values()))


REPLAY_SIZES = (1, 3, 4, 6, 8, 13, 16)  # up to the largest capture size; 13 pads into the 16 graph


def check_replay_equals_eager(runner, batches: DecodeBatches, gr, dbo: bool, link: str | None,
                              sizes: Sequence[int] = REPLAY_SIZES, tol: float | None = None) -> None:
    """Each size's replay equals its eager step, and is a replay of the graph it should be: exactly one graph
    replayed per step, of the padded size, ubatched exactly when DBO is on and the step reaches the DBO
    threshold. With a link, every eager reference step really went over it. Replay and eager differ in
    shapes (padding, the graph metadata's width), so "equals" is within ``tol``, by default the float32 step
    tolerance (``step_numerics``; a 16-bit runner is refused there)."""
    assert any(k.ubatched for k in gr.graphs) is dbo
    assert batches.num_reqs >= max(sizes), "DecodeBatches needs one request per decode token"
    counter = CountingReplays(gr.backend)
    gr.backend = counter
    key_of = {id(entry.graph): key for key, entry in gr.graphs.items()}
    emulated = moe_link(runner)
    assert (emulated is not None) is (link is not None)
    threshold = runner.cfg.dbo_decode_token_threshold
    for n in sizes:
        transfers = emulated.num_transfers if emulated is not None else 0
        _, ref = batches.step(n)
        assert emulated is None or emulated.num_transfers > transfers, f"{n} tokens: the link carried nothing"
        replays = len(counter.replayed)
        padded, out = batches.step(n, gr)
        assert len(counter.replayed) == replays + 1, f"{n} tokens: no graph replayed"
        key = key_of[id(counter.replayed[-1])]
        assert key.num_tokens == padded >= n and key.ubatched is (dbo and n >= threshold), (n, key)
        assert_steps_close(out, ref, f"{n} tokens", tol)
    assert gr.stats[Why.REPLAY] == len(sizes), dict(gr.stats)


def check_both_kinds_replay(runner, batches: DecodeBatches, gr, sizes: Sequence[int] = REPLAY_SIZES,
                            tol: float = 1e-5) -> None:
    """With the measured cost model's plan, a step at a size that may ubatch replays the plain graph when it runs
    without DBO and the DBO graph when it runs with it; both equal the eager step."""
    threshold = runner.cfg.dbo_decode_token_threshold
    counter = CountingReplays(gr.backend)
    gr.backend = counter
    key_of = {id(entry.graph): key for key, entry in gr.graphs.items()}
    for n in [n for n in sizes if n >= threshold]:
        for ubatch in (False, True):
            _, ref = batches.step(n, ubatch=ubatch)
            replays = len(counter.replayed)
            padded, out = batches.step(n, gr, ubatch=ubatch)
            assert len(counter.replayed) == replays + 1, f"{n} tokens, ubatch={ubatch}: ran eager"
            key = key_of[id(counter.replayed[-1])]
            assert (key.num_tokens, key.ubatched) == (padded, ubatch), (n, ubatch, key)
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol, msg=prefixed(f"{n} tokens, {ubatch}"))
    assert set(gr.stats) == {Why.REPLAY}, dict(gr.stats)


def test_the_measured_cost_models_plan_replays_both_kinds_on_the_eager_stand_in() -> None:
    """tests/test_cudagraph_cuda.py's ``test_both_kinds_replay`` on CPU."""
    runner = make_runner(dbo_cost_model="measured")
    try:
        batches = DecodeBatches(runner, num_reqs=max(REPLAY_SIZES))
        gr = manager.make_graph_runner(runner, backend=EagerReplayBackend(), num_warmups=0, progress=False)
        gr.capture()
        check_both_kinds_replay(runner, batches, gr)
        gr.clear()
    finally:
        runner.close()


@pytest.mark.parametrize("link", [None, "latency_us=20,gbps=100"], ids=["none", "emulated"])
@pytest.mark.parametrize("dbo", [True, False], ids=["dbo", "no-dbo"])
def test_replay_equals_eager_on_the_eager_stand_in(link: str | None, dbo: bool) -> None:
    """tests/test_cudagraph_cuda.py's ``test_replay_equals_eager`` on CPU: same sizes, same capture plan
    (the default ladder up to max_num_seqs=16), the eager stand-in for the graphs."""
    runner = make_runner(emulate_link=link, enable_dbo=dbo)
    try:
        batches = DecodeBatches(runner, num_reqs=max(REPLAY_SIZES))
        gr = manager.make_graph_runner(runner, backend=EagerReplayBackend(), num_warmups=0, progress=False)
        gr.capture()
        check_replay_equals_eager(runner, batches, gr, dbo, link)
        gr.clear()
    finally:
        runner.close()


def test_mixed_batches_never_replay_and_a_dbo_decode_step_replays(qwen_runner) -> None:
    runner, batches = qwen_runner
    gr = manager.make_graph_runner(runner, sizes=[4, 8], backend=EagerReplayBackend(), num_warmups=0,
                                   progress=False)
    gr.capture()
    mixed = build_attention_metadata([0, 5], [3, 1], batches.blocks[:2], runner.block_size, num_padded_tokens=4)
    assert gr.try_replay(mixed, None, runner.input_ids[:4], runner.positions[:4]) is NotImplemented
    assert gr.stats[Why.MIXED] == 1
    _, ref = batches.step(8)
    _, out = batches.step(8, gr)
    assert gr.stats[Why.REPLAY] == 1
    assert_steps_close(out, ref, "8 tokens")


def test_a_failed_capture_names_the_graph_and_leaves_nothing_behind(qwen_runner) -> None:
    runner, _ = qwen_runner

    class FailSecondSize(EagerReplayBackend):
        calls = 0

        def capture(self, fn, pool, stream):
            FailSecondSize.calls += 1
            if FailSecondSize.calls == 6:  # the second size's forward (each size's 4 heads are captured after it)
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().capture(fn, pool, stream)

    gr = manager.make_graph_runner(runner, sizes=[1, 8], backend=FailSecondSize(), num_warmups=0, progress=False)
    with pytest.raises(RuntimeError, match=r"graph for 3 failed: operation not permitted.*--enforce-eager"):
        gr.capture()
    assert not gr.graphs
    gr.backend = EagerReplayBackend()
    gr.capture()
    with pytest.raises(RuntimeError, match="already captured"):
        gr.capture()


def test_threads_executor_warms_every_ubatch_thread_and_replays_mla() -> None:
    runner = make_runner("threads", model="tiny-deepseek-v3")
    try:
        batches = DecodeBatches(runner, num_reqs=8)
        gr = manager.make_graph_runner(runner, sizes=[2, 8], backend=EagerReplayBackend(), num_warmups=0,
                                       progress=False)
        gr.capture()
        assert len(gr.warmed_threads) == 2
        for n in (2, 6, 8):
            _, ref = batches.step(n)
            _, out = batches.step(n, gr)
            assert_steps_close(out, ref, f"{n} tokens")
        assert gr.stats == {Why.REPLAY: 3}
    finally:
        runner.close()


def test_eager_dbo_handoffs_are_countable(qwen_runner, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter the CUDA test uses to prove a replay does zero handoffs does see eager ones."""
    runner, batches = qwen_runner
    count = {"yields": 0}
    original = UBatchContext.yield_

    def counting(self):
        count["yields"] += 1
        return original(self)

    monkeypatch.setattr(UBatchContext, "yield_", counting)
    steps = runner.wrapper.num_ubatched_steps
    batches.step(8)
    assert count["yields"] > 0 and runner.wrapper.num_ubatched_steps == steps + 1


def test_null_block_is_reserved_past_the_scheduler_range(qwen_runner) -> None:
    runner, _ = qwen_runner
    gr = manager.make_graph_runner(runner, sizes=[4], backend=EagerReplayBackend(), num_warmups=0, progress=False)
    assert isinstance(gr.buffers, ga.DecodeMetadataBuffers)
    assert gr.buffers.null_block == runner.num_kv_blocks  # the block the runner allocates past the scheduler's
    assert all(m.kv_cache.shape[0] == runner.num_kv_blocks + 1
               for m in runner.model.modules() if isinstance(getattr(m, "kv_cache", None), torch.Tensor))


# ---- runner integration entry point --------------------------------------------------------------------
def test_maybe_make_graph_runner_is_eager_on_cpu_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    forget_logged()
    fake = SimpleNamespace(cfg=RunnerConfig(), device=torch.device("cpu"), rank=0)
    with caplog.at_level(logging.INFO, logger="ubatch.cudagraph"):
        assert manager.maybe_make_graph_runner(fake) is None
        assert manager.maybe_make_graph_runner(fake) is None
        assert manager.maybe_make_graph_runner(SimpleNamespace(cfg=RunnerConfig(enforce_eager=True),
                                                               device=torch.device("cpu"), rank=0)) is None
    assert [r.getMessage() for r in caplog.records] == ["CUDA graphs need a GPU: running eager"]


def test_maybe_make_graph_runner_refuses_uncapturable_backends(caplog: pytest.LogCaptureFixture) -> None:
    forget_logged()
    fake = SimpleNamespace(cfg=RunnerConfig(experts_backend="torch"), device=torch.device("cuda", 0),
                           experts_backend="torch")  # the model runner's resolved backend
    with caplog.at_level(logging.WARNING, logger="ubatch.cudagraph"):
        assert manager.maybe_make_graph_runner(fake) is None
    assert "CUDA graphs disabled: experts backend torch" in caplog.text and "nonzero" in caplog.text


def test_bench_exits_with_a_clear_message_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_cudagraph.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr
