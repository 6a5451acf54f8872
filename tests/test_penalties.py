"""Penalty counts kept per request slot on the forward side equal counts rebuilt from scratch: across chunked
prefill, decodes, preemption with recompute, slot reuse, and the overlap loop (whose inputs are placeholders
until the forward side resolves them)."""
from __future__ import annotations

import random
from collections import Counter
from functools import partial

import torch

from fake_runner import FakeRunner, reference_generate
from runner.core.scheduler import Scheduler
from runner.core.scheduler_output import ScheduledChunk
from runner.sampling_params import SamplingParams
from runner.worker.penalties import PenaltyState
from test_overlap_loop import drive

V = 64
SEED_BASE = 1000  # test_overlap_loop.drive seeds request r with SEED_BASE + r
PEN = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)


def chunk(req: int, slot: int, tokens: list[int], start: int, prompt_len: int,
          params: SamplingParams = PEN) -> ScheduledChunk:
    return ScheduledChunk(req, tokens, start, [], True, params, seed=0, slot=slot, prompt_len=prompt_len)


def assert_state(state: PenaltyState, slot: int, prompt: list[int], outputs: list[int]) -> None:
    assert state.counts is not None and state.seen is not None
    want = Counter(outputs)
    got = {t: int(c) for t, c in enumerate(state.counts[slot].tolist()) if c}
    assert got == dict(want), f"slot {slot} output counts"
    assert set(torch.nonzero(state.seen[slot]).flatten().tolist()) == set(prompt) | set(outputs), f"slot {slot}"


def test_counts_follow_chunked_prefill_decode_recompute_and_slot_reuse() -> None:
    state = PenaltyState(V, "cpu")
    assert state.counts is None  # nothing allocated before a request with penalties
    state.record_inputs([chunk(0, 0, [1, 2, 3], 0, 5, SamplingParams())])
    assert state.counts is None  # ...and none for requests without
    prompt, outs = [5, 6, 7, 5, 8], [9, 9, 5, 2]
    state.record_inputs([chunk(0, 3, prompt[:3], 0, 5)])  # chunked prefill: 3 tokens, then 2
    state.record_inputs([chunk(0, 3, prompt[3:], 3, 5)])
    assert_state(state, 3, prompt, [])
    for i, tok in enumerate(outs):  # each output is the input of the next step
        state.record_inputs([chunk(0, 3, [tok], 5 + i, 5)])
        assert_state(state, 3, prompt, outs[:i + 1])
    # preempted, readmitted in slot 1: one recompute chunk of prompt + outputs, cut by the token budget
    history = prompt + outs
    state.record_inputs([chunk(0, 1, history[:4], 0, 5), chunk(1, 3, [40, 41], 0, 1)])  # slot 3 reused
    state.record_inputs([chunk(0, 1, history[4:], 4, 5)])
    assert_state(state, 1, prompt, outs)
    assert_state(state, 3, [40], [41])  # the new owner of slot 3 starts from nothing
    assert state.num_slots >= 4


def test_counts_grow_with_the_highest_slot() -> None:
    state = PenaltyState(V, "cpu")
    state.record_inputs([chunk(0, 2, [1, 2], 0, 1)])
    state.record_inputs([chunk(1, 20, [3, 4, 4], 0, 1)])  # past the first allocation: grows, keeps slot 2
    assert state.num_slots > 20
    assert_state(state, 2, [1], [2])
    assert_state(state, 20, [3], [4, 4])


def test_a_slot_without_a_slot_id_is_an_error() -> None:
    state = PenaltyState(V, "cpu")
    try:
        state.record_inputs([chunk(7, -1, [1], 0, 1)])
    except ValueError as exc:
        assert "request 7 uses penalties but its chunk has no slot (slot=-1)" in str(exc)
    else:
        raise AssertionError("no error")


def workload(seed: int, n: int) -> list[tuple[int, list[int], SamplingParams, int]]:
    """(arrival step, prompt, params, request id): strong penalties (they change tokens), some seeded random,
    some greedy, some with min_tokens; prompts up to 30 tokens (chunked at 16)."""
    rng = random.Random(seed)
    out = []
    for rid in range(n):
        kind = rng.choice([partial(SamplingParams, repetition_penalty=1.8),
                           partial(SamplingParams, frequency_penalty=1.5),
                           partial(SamplingParams, presence_penalty=2.0),
                           partial(SamplingParams, repetition_penalty=0.6, presence_penalty=-1.0),
                           partial(SamplingParams)])
        params = kind(max_tokens=rng.randint(3, 14), temperature=rng.choice([0.0, 0.9]),
                      min_tokens=rng.choice([0, 3]))
        prompt = [rng.randrange(V // 4) for _ in range(rng.randint(1, 30))]  # small alphabet: repeats
        out.append((rng.randrange(20), prompt, params, rid))
    return out


def run(requests: list, overlap: bool, num_kv_blocks: int) -> tuple[Scheduler, int]:
    """The requests through the scheduler and the step loop (test_overlap_loop's driver: its in-flight guard
    checks that no block or slot is reused while a step using it runs); the highest slot any chunk used."""
    runner = FakeRunner(vocab_size=V, block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=64,
                        eos_token_ids=[7])
    keep_busy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # runs past the last arrival
    arrivals: dict[int, list] = {0: [([1, 2], keep_busy, 10_000)]}
    for step, prompt, params, rid in requests:
        arrivals.setdefault(step, []).append((prompt, params, rid))
    sched, stats, guard = drive(runner, arrivals, overlap, guard=True, max_num_seqs=5, max_num_batched_tokens=16)
    assert guard is not None and guard.violations == []
    assert not overlap or stats.num_placeholders_resolved > 50
    return sched, max(c.slot for s in runner.steps for c in s.chunks)


def test_penalised_generation_equals_from_scratch_reference_through_the_scheduler() -> None:
    """Every request's tokens equal a reference that rebuilds its counts from its history before every token,
    with the synchronous loop and the overlap loop, with a cache small enough to preempt (recompute) requests."""
    requests = workload(seed=3, n=24)
    expected = {rid: reference_generate(prompt, params, V, SEED_BASE + rid, {7}, 64)
                for _, prompt, params, rid in requests}
    plain = {rid: reference_generate(prompt, SamplingParams(temperature=params.temperature,
                                                            max_tokens=params.max_tokens,
                                                            min_tokens=params.min_tokens), V, SEED_BASE + rid,
                                 {7}, 64)
             for _, prompt, params, rid in requests if params.uses_penalties}
    assert sum(plain[r] != expected[r] for r in plain) >= len(plain) // 2  # the penalties change the tokens
    for overlap in (False, True):
        for blocks in (200, 20):  # 20 blocks of 4 for up to 6 requests of up to 44 tokens: preemption
            sched, max_slot = run(requests, overlap, blocks)
            got = {rid: (r.output_token_ids, r.finish_reason) for rid, r in sched.requests.items() if rid != 10_000}
            assert got == expected, f"overlap={overlap}, blocks={blocks}"
            assert max_slot + 1 < len(requests)  # fewer slots than requests: slots were reused
            if blocks == 20:
                assert sched.num_preemptions > 0
