"""The engine's persistent per-request state: what its vectorised builders must keep from the per-request code.

- ``build_attention_metadata`` (numpy over the batch, rows of a persistent block table) equals the per-request
  builder it replaced (``reference_metadata.py``) on any batch, padding and ``max_blocks`` included; so does
  ``build_paged_metadata``'s decode/prefill grouping;
- in a running engine (random arrivals, chunked prefill, preemptions, aborts; sync and overlap loop) every
  step's block table, slot mapping and positions, built on the forward side from the scheduler's persistent
  table while the scheduler may already be appending blocks for the next step, equal the reference built from
  what the scheduler held when it scheduled the step (snapshots of ``Request.block_ids`` and
  ``num_computed_tokens``, kept apart from the table);
- over random arrivals, aborts, preemptions and steps left in flight, the scheduler's block table rows are
  exactly its requests' block lists, no block has two owners, and every block, slot and table row is back
  when the requests are done.
"""
from __future__ import annotations

import random
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from fake_runner import FakeRunner, run_wave
from reference_metadata import reference_attention_metadata, reference_request_groups
from runner.attention.kv_cache import blocks_needed, build_attention_metadata
from runner.attention.metadata import build_paged_metadata
from runner.attention.torch_backend import TorchAttentionBackend
from runner.core.runner_output import ModelRunnerOutput
from runner.core.scheduler import Scheduler
from runner.core.scheduler_output import SchedulerOutput
from runner.sampling_params import SamplingParams
from runner.worker.sampler import request_seed

SETTINGS = settings(max_examples=120, deadline=None)
FIELDS = ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu", "block_table", "slot_mapping",
          "positions")
SCALARS = ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "causal")
VOCAB = 64


def assert_same_metadata(got: Any, want: Any) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    for name in SCALARS:
        assert getattr(got, name) == getattr(want, name), name


@st.composite
def batches(draw: Any) -> tuple[list[int], list[int], list[list[int]], int, int | None, int | None]:
    """Requests with context 0..40 and 0..20 new tokens, each holding the blocks it needs (sometimes a few
    more, as a hand-built batch may), distinct block ids; sometimes padding, sometimes a fixed width."""
    block = draw(st.sampled_from([1, 4, 16]))
    n = draw(st.integers(0, 12))
    ctx = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    qlen = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    counts = [blocks_needed(c + q, block) + draw(st.integers(0, 2)) for c, q in zip(ctx, qlen, strict=True)]
    ids = iter(draw(st.randoms(use_true_random=False)).sample(range(5000), sum(counts)))
    blocks = [[next(ids) for _ in range(k)] for k in counts]
    pad = draw(st.none() | st.integers(0, 8))
    padded = None if pad is None else sum(qlen) + pad
    widest = max((len(b) for b in blocks), default=0)
    max_blocks = draw(st.none() | st.integers(max(widest, 1), widest + 3))
    return ctx, qlen, blocks, block, padded, max_blocks


@SETTINGS
@given(batches())
def test_metadata_equals_the_per_request_builder(batch: Any) -> None:
    ctx, qlen, blocks, block, padded, max_blocks = batch
    got = build_attention_metadata(ctx, qlen, blocks, block, num_padded_tokens=padded, max_blocks=max_blocks)
    want = reference_attention_metadata(ctx, qlen, blocks, block, num_padded_tokens=padded, max_blocks=max_blocks)
    assert_same_metadata(got, want)


@SETTINGS
@given(batches())
def test_paged_grouping_equals_the_per_request_loop(batch: Any) -> None:
    ctx, qlen, blocks, block, padded, _ = batch
    if any(q > c + q for c, q in zip(ctx, qlen, strict=True)):
        return
    common = build_attention_metadata(ctx, qlen, blocks, block, num_padded_tokens=padded)
    meta = build_paged_metadata(TorchAttentionBackend(), common)
    decodes, longest, prefills = reference_request_groups(common)
    assert meta.prefills == prefills
    if not decodes:
        assert meta.decode is None
        return
    d = meta.decode
    assert d is not None and d.num_reqs == len(decodes) and d.max_seq_len == longest
    assert d.seq_lens.tolist() == [common.seq_lens_cpu[i].item() for i in decodes]
    assert d.block_table.tolist() == [common.block_table[i].tolist() for i in decodes]
    qsl = common.query_start_loc_cpu.tolist()
    if decodes == list(range(len(decodes))):
        assert d.token_index is None
    else:
        assert d.token_index is not None and d.token_index.tolist() == [qsl[i] for i in decodes]


# ---------------------------------------------------------------------------------------------- in the engine
class CheckingRunner(FakeRunner):
    """The FakeRunner (its outputs depend on the block tables it is given) that also builds each step's
    metadata the engine's way, on the forward side, and compares it with the reference built from what the
    scheduler held when it scheduled the step."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.expected: dict[int, tuple[list[int], list[int], list[list[int]]]] = {}
        self.num_checked = 0

    def watch(self, sched: Scheduler) -> None:
        schedule = sched.schedule

        def snapshot() -> SchedulerOutput:
            before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
            out = schedule()
            reqs = [sched.requests[rid] for rid in out.req_ids.tolist()]
            ctx = [before.get(r.req_id, 0) for r in reqs]
            if reqs:
                self.expected[out.step_id] = (ctx, [r.num_computed_tokens - c for r, c in zip(reqs, ctx, strict=True)],
                                              [list(r.block_ids) for r in reqs])
            return out

        sched.schedule = snapshot  # type: ignore[method-assign]

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        if sched.num_reqs:
            ctx, qlen, blocks = self.expected.pop(sched.step_id)
            assert sched.num_computed.tolist() == ctx and sched.query_lens.tolist() == qlen
            got = build_attention_metadata(sched.num_computed, sched.query_lens, sched.blocks, self.block_size,
                                           num_padded_tokens=sched.num_tokens + 3)
            assert_same_metadata(got, reference_attention_metadata(ctx, qlen, blocks, self.block_size,
                                                                   num_padded_tokens=sched.num_tokens + 3))
            assert [c.block_ids for c in sched.chunks] == blocks
            self.num_checked += 1
        return super().step(sched)


def assert_table_matches(sched: Scheduler) -> None:
    """Every admitted request's table row is its block list; every other row is empty and zero. A block held by
    several requests is a cached prefix block of each (no holder writes it any more)."""
    table = sched.block_table
    owned: dict[int, list[int]] = {}
    rows = set()
    for r in sched.requests.values():
        for b in r.block_ids:
            owned.setdefault(b, []).append(r.req_id)
    for b, holders in owned.items():
        if len(holders) > 1:
            for rid in holders:
                r = sched.requests[rid]
                assert r.block_ids.index(b) < r.num_cached_blocks, f"block {b} held by {holders}, not cached in {rid}"
    for r in sched.requests.values():
        if r.slot >= 0:
            rows.add(r.slot)
            assert table.row(r.slot) == r.block_ids
        else:
            assert not r.block_ids
    for row in set(range(table.table.shape[0])) - rows:
        assert table.num_blocks[row] == 0 and not table.table[row].any()
    assert sched.allocator.num_free_blocks + len(owned) == sched.allocator.num_blocks


def engine_run(seed: int, overlap: bool, num_kv_blocks: int) -> tuple[dict[int, Any], Scheduler, CheckingRunner]:
    """One wave: a long request keeps the loop busy while 40 others arrive at random steps and some are
    aborted between steps."""
    rng = random.Random(seed)
    runner = CheckingRunner(vocab_size=VOCAB, block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=80,
                            eos_token_ids=[7])
    # No prefix caching: the checker's context lengths start every admission at 0, and each block has one owner.
    sched = Scheduler(max_num_seqs=6, max_num_batched_tokens=16, block_size=4, num_kv_blocks=num_kv_blocks,
                      max_model_len=80, vocab_size=VOCAB, eos_token_ids=[7], enable_prefix_caching=False)
    runner.watch(sched)
    arrivals: dict[int, list[tuple[list[int], SamplingParams, int]]] = {
        0: [([1, 2, 3], SamplingParams(max_tokens=70, ignore_eos=True, temperature=0.0), 0)]}
    for rid in range(1, 41):
        params = SamplingParams(max_tokens=rng.randint(1, 14), temperature=rng.choice([0.0, 0.8]), seed=rid)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        arrivals.setdefault(rng.randrange(50), []).append((prompt, params, rid))
    aborts = {rng.randrange(60): rng.randrange(1, 41) for _ in range(8)}
    added: list[int] = []

    def before_launch(k: int) -> None:
        for prompt, params, rid in arrivals.get(k, []):
            sched.add_request(prompt, params, request_seed(params, rid), req_id=rid)
            added.append(rid)
        if k in aborts:
            sched.abort_request(aborts[k], reason="abort")
        assert_table_matches(sched)

    run_wave(sched, runner, overlap, before_launch)
    assert len(added) == 41, "the wave ended before every arrival"
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in sched.requests.items()}, sched, runner


def test_engine_block_tables_equal_the_reference_with_preemption_and_aborts() -> None:
    for num_kv_blocks in (200, 24):  # 24 blocks of 4: preemption
        runs = {}
        for overlap in (False, True):
            outputs, sched, runner = engine_run(5, overlap, num_kv_blocks)
            assert runner.num_checked > 40 and not runner.expected
            assert_table_matches(sched)
            assert not sched.has_unfinished_requests() and sched.num_inflight_steps == 0
            assert sched.allocator.num_free_blocks == sched.allocator.num_blocks
            assert sched.slots.num_free == sched.slots.capacity
            assert not sched.block_table.table.any() and not sched.block_table.num_blocks.any()
            runs[overlap] = (outputs, sched.num_preemptions)
        # An abort lands at a step, and the overlap loop's results lag a step: only untouched requests compare.
        aborted = {rid for rid, o in runs[False][0].items() if o[1] == "abort"} | {
            rid for rid, o in runs[True][0].items() if o[1] == "abort"}
        assert aborted and {k: v for k, v in runs[False][0].items() if k not in aborted} == {
            k: v for k, v in runs[True][0].items() if k not in aborted}
        if num_kv_blocks == 24:
            assert runs[False][1] > 0  # preemptions happened


# ---------------------------------------------------------------------------------------------- property
@settings(max_examples=150, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(6, 30))
def test_scheduler_state_stays_consistent_and_frees_everything(rng: random.Random, num_kv_blocks: int) -> None:
    """80 random operations (arrivals, aborts, steps), with at most one step left in flight (``launch``
    schedules the next step before the previous one's results are applied, as the overlap loop does)."""
    ops = rng.choices(["add", "step", "launch", "abort"], weights=[3, 5, 2, 1], k=80)
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=12, block_size=4, num_kv_blocks=num_kv_blocks,
                      max_model_len=40, vocab_size=VOCAB, eos_token_ids=[0])
    inflight: list[SchedulerOutput] = []
    next_id = 0

    def tokens_for(out: SchedulerOutput, x: int) -> list[int | None]:
        return [(x * 7 + 13 * i) % VOCAB if s else None for i, s in enumerate(out.sample.tolist())]

    for op in ops:
        x = rng.randrange(10**6)
        if op == "add":
            sched.add_request([1 + (x + j) % (VOCAB - 1) for j in range(1 + x % 20)],
                              SamplingParams(max_tokens=1 + x % 9, ignore_eos=x % 3 == 0), req_id=next_id)
            next_id += 1
        elif op == "abort" and next_id:
            sched.abort_request(x % next_id, reason="abort")
        elif op == "launch" and not inflight:
            out = sched.schedule()
            if out.num_reqs:
                inflight.append(out)
        elif op == "step":
            if inflight and sched.wants_sync:
                prev = inflight.pop()
                sched.update(prev, tokens_for(prev, x))
            out = sched.schedule()
            if inflight:
                prev = inflight.pop()
                sched.update(prev, tokens_for(prev, x))
            if out.num_reqs:
                sched.update(out, tokens_for(out, x + 1))
        for req in sched.take_finished():
            sched.forget(req.req_id)
        assert_table_matches(sched)
    while inflight or sched.has_unfinished_requests():
        if inflight:
            prev = inflight.pop()
            sched.update(prev, tokens_for(prev, 1))
        out = sched.schedule()
        if out.num_reqs:
            sched.update(out, tokens_for(out, 2))
        assert_table_matches(sched)
    assert sched.allocator.num_free_blocks == sched.allocator.num_blocks
    assert sched.slots.num_free == sched.slots.capacity
    assert not sched.block_table.table.any() and not sched.block_table.num_blocks.any()
    event(f"preempted: {sched.num_preemptions > 0}")
