"""Prefix caching in the scheduler: the block hash chain, the block pool (reference counts, the LRU of evictable
cached blocks, eviction order, reset) and the scheduler over a stand-in runner whose "KV cache" holds token ids,
so a block shared or found in the cache with the wrong content changes the tokens (``tests/fake_runner.py``)."""
from __future__ import annotations

import hashlib
import random
import subprocess
import sys

import pytest

from fake_runner import FakeRunner, reference_generate, run_wave
from runner.core.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens
from runner.core.kv_blocks import BlockPool, OutOfKVBlocksError
from runner.core.scheduler import Scheduler
from runner.sampling_params import SamplingParams
from runner.worker.sampler import request_seed

VOCAB = 64
H = [hashlib.sha256(bytes([i])).digest() for i in range(8)]  # stand-in block hashes for the pool tests


# ---------------------------------------------------------------------------------------------- hash chain
def test_block_hash_is_sha256_of_parent_tokens_and_extra_keys() -> None:
    tokens = [1, 2, 3, 300]
    want = hashlib.sha256(ROOT_HASH + b"".join(t.to_bytes(8, "little") for t in [*tokens, 0])).digest()
    assert hash_block_tokens(ROOT_HASH, tokens) == want
    assert hash_block_tokens(ROOT_HASH, tokens, (5,)) != want  # extra keys are part of the content
    assert hash_block_tokens(H[0], tokens) != want  # so is the parent
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 301]) != want
    with pytest.raises(ValueError, match="32 bytes"):
        hash_block_tokens(b"short", tokens)


def test_block_hash_is_the_same_in_another_process() -> None:
    """No Python ``hash()`` and no random seed: a fresh interpreter (another hash seed) gets the same digest."""
    code = ("from runner.core.block_hash import ROOT_HASH, hash_block_tokens; "
            "print(hash_block_tokens(ROOT_HASH, [7, 8, 9]).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PYTHONPATH": sys.path[0]})
    assert out.stdout.strip() == hash_block_tokens(ROOT_HASH, [7, 8, 9]).hex()


def test_extend_block_hashes_continues_the_chain() -> None:
    tokens = list(range(12))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens[:8], 4)
    a = hash_block_tokens(ROOT_HASH, tokens[:4])
    b = hash_block_tokens(a, tokens[4:8])
    assert hashes == [a, b]
    extend_block_hashes(hashes, tokens[8:], 4)  # the next block, chained on the last
    assert hashes == [a, b, hash_block_tokens(b, tokens[8:])]
    with pytest.raises(ValueError, match="10 tokens are not a whole number of blocks of 4"):
        extend_block_hashes(hashes, tokens[:10], 4)
    with pytest.raises(ValueError, match="block 0 holds a placeholder token"):
        extend_block_hashes([], [1, 2, -3, 4], 4)


# ---------------------------------------------------------------------------------------------- block pool
def test_pool_allocates_lowest_first_and_refuses_double_free() -> None:
    a = BlockPool(5)
    b1 = a.allocate(2)
    b2 = a.allocate(3)
    assert b1 == [0, 1] and sorted(b1 + b2) == list(range(5)) and a.num_free_blocks == 0
    with pytest.raises(OutOfKVBlocksError, match="requested 1, free 0 of 5"):
        a.allocate(1)
    a.free(b1)
    assert a.num_free_blocks == 2 and a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(ValueError, match="not allocated"):
        a.free([b1[0]])
    with pytest.raises(ValueError, match="block 7 is not allocated"):
        a.free([7])
    a.free(b2)
    assert a.num_free_blocks == 5


def test_pool_shares_by_reference_count_and_keeps_freed_cached_blocks() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert pool.register(blocks[0], H[0]) and pool.register(blocks[1], H[1])
    assert not pool.register(blocks[0], H[2])  # one hash per block
    assert pool.cached_prefix([H[0], H[1], H[2]]) == blocks
    assert pool.cached_prefix([H[1]]) == [blocks[1]] and pool.cached_prefix([H[3], H[0]]) == []
    pool.touch(blocks)  # a second request shares them
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 2  # still held by the second
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2  # free, content kept
    assert pool.num_evictable(blocks) == 2
    pool.touch(blocks[:1])  # found again: taken out of the evictable pool
    assert pool.num_free_blocks == 3 and pool.num_evictable(blocks) == 1
    with pytest.raises(ValueError, match="holds no cached prefix"):
        pool.touch([3])
    with pytest.raises(ValueError, match="not allocated"):
        pool.register(3, H[5])


def test_pool_duplicate_content_stays_unhashed() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.register(a, H[0])
    assert not pool.register(b, H[0])  # same content computed twice: the second copy is a plain block
    pool.free([a, b])
    assert pool.num_cached_blocks == 1 and pool.cached_prefix([H[0]]) == [a]
    assert pool.allocate(2) == [b, 2]  # plain free blocks first: the cached one is kept


def test_pool_evicts_least_recently_freed_first_and_only_when_needed() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2), pool.allocate(2)
    for b, h in zip(first + second, H[:4], strict=True):
        pool.register(b, h)
    pool.free(reversed(first))  # freed tail first: first[1] is the oldest
    pool.free(reversed(second))
    assert pool.num_evictions == 0
    assert pool.allocate(1) == [first[1]]  # evicted: its hash is gone
    assert pool.num_evictions == 1
    assert pool.cached_prefix([H[0], H[1]]) == [first[0]]
    pool.touch([first[0]])  # used again: now the most recently used
    pool.free([first[0]])
    assert pool.allocate(2) == [second[1], second[0]]
    assert pool.num_cached_blocks == 1 and pool.cached_prefix([H[0]]) == [first[0]]


def test_pool_reset_drops_hashes_only_when_no_block_is_held() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.register(blocks[0], H[0])
    assert not pool.reset() and pool.num_cached_blocks == 1  # a block is held: nothing changes
    pool.free(blocks)
    assert pool.reset()
    assert pool.num_cached_blocks == 0 and pool.cached_prefix([H[0]]) == [] and pool.num_free_blocks == 3
    assert pool.allocate(3) == [0, 1, 2]


# ---------------------------------------------------------------------------------------------- scheduler
def make_sched(runner: FakeRunner, caching: bool = True, max_num_seqs: int = 8,
               max_num_batched_tokens: int = 32) -> Scheduler:
    return Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     block_size=runner.block_size, num_kv_blocks=runner.num_kv_blocks,
                     max_model_len=runner.max_model_len, vocab_size=runner.vocab_size,
                     eos_token_ids=runner.eos_token_ids, enable_prefix_caching=caching)


def step(sched: Scheduler, runner: FakeRunner) -> None:
    out = sched.schedule()
    result = runner.step(out)
    assert result is not None
    sched.update(out, result.sampled_token_ids)


def finish(sched: Scheduler, runner: FakeRunner) -> None:
    while sched.has_unfinished_requests():
        step(sched, runner)


def test_repeated_prompt_reuses_full_blocks_and_computes_the_last_token() -> None:
    runner = FakeRunner(block_size=4)
    sched = make_sched(runner)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks
    params = SamplingParams(max_tokens=3)
    first = sched.add_request(prompt, params, req_id=0)
    finish(sched, runner)
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits, first.num_cached_tokens) == (10, 0, 0)
    second = sched.add_request(prompt, params, req_id=1)
    out = sched.schedule()
    assert out.num_computed.tolist() == [8] and out.token_ids.tolist() == prompt[8:]  # 2 blocks from the cache
    result = runner.step(out)
    assert result is not None
    sched.update(out, result.sampled_token_ids)
    finish(sched, runner)
    assert second.output_token_ids == first.output_token_ids == reference_generate(prompt, params, VOCAB, 0)[0]
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits, second.num_cached_tokens) == (20, 8, 8)
    # 12 tokens = 3 full blocks, but the last token is always computed: 2 blocks again
    third = sched.add_request(prompt + [first.output_token_ids[0], 9], params, req_id=2)
    out = sched.schedule()
    assert out.num_computed.tolist() == [8] and third.num_cached_tokens == 8
    result = runner.step(out)
    assert result is not None
    sched.update(out, result.sampled_token_ids)
    # a prompt of exactly one block: nothing to reuse (its last token is computed)
    sched.add_request(prompt[:4], params, req_id=3)
    finish(sched, runner)
    assert sched.requests[3].num_cached_tokens == 0
    assert sched.num_free_blocks == runner.num_kv_blocks


def test_generated_tokens_are_cached_when_the_request_ends() -> None:
    runner = FakeRunner(block_size=4)
    sched = make_sched(runner)
    prompt = [3, 1, 4, 1, 5, 9]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = sched.add_request(prompt, params, req_id=0)
    finish(sched, runner)
    history = prompt + first.output_token_ids  # 14 tokens; the KV of 13 was computed: 3 full blocks
    follow_up = sched.add_request(history + [2], SamplingParams(max_tokens=2), req_id=1)
    finish(sched, runner)
    assert follow_up.num_cached_tokens == 12
    assert follow_up.output_token_ids == reference_generate(history + [2], SamplingParams(max_tokens=2), VOCAB, 0)[0]


def test_prompt_logprobs_and_penalties_compute_the_whole_prompt() -> None:
    runner = FakeRunner(block_size=4)
    sched = make_sched(runner)
    prompt = list(range(1, 14))
    sched.add_request(prompt, SamplingParams(max_tokens=1), req_id=0)
    finish(sched, runner)
    for rid, params in ((1, SamplingParams(max_tokens=1, prompt_logprobs=0)),
                        (2, SamplingParams(max_tokens=1, repetition_penalty=1.5))):
        req = sched.add_request(prompt, params, req_id=rid)
        out = sched.schedule()
        assert out.num_computed.tolist() == [0] and req.num_cached_tokens == 0
        result = runner.step(out)
        assert result is not None
        sched.update(out, result.sampled_token_ids)
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (13, 0)  # neither looked the cache up


def test_requests_admitted_in_one_step_do_not_read_blocks_that_step_fills() -> None:
    runner = FakeRunner(block_size=4)
    sched = make_sched(runner, max_num_batched_tokens=64)
    prompt = list(range(1, 14))
    sched.add_request(prompt, SamplingParams(max_tokens=2), req_id=0)
    sched.add_request(prompt, SamplingParams(max_tokens=2), req_id=1)
    out = sched.schedule()
    assert out.num_computed.tolist() == [0, 0]
    result = runner.step(out)
    assert result is not None
    sched.update(out, result.sampled_token_ids)
    sched.add_request(prompt, SamplingParams(max_tokens=2), req_id=2)  # the next step finds them
    out = sched.schedule()
    assert out.num_computed.tolist()[-1] == 12


def test_chunked_prefill_registers_each_filled_block_for_later_requests() -> None:
    runner = FakeRunner(block_size=4)
    sched = make_sched(runner, max_num_batched_tokens=6)
    prompt = list(range(1, 30))
    sched.add_request(prompt, SamplingParams(max_tokens=1), req_id=0)
    step(sched, runner)  # positions 0..5: block 0 full
    step(sched, runner)  # 6..11: blocks 1, 2
    late = sched.add_request(prompt, SamplingParams(max_tokens=1), req_id=1)
    step(sched, runner)  # 12..17 (the whole budget): blocks 3, 4
    step(sched, runner)  # 18..23: block 5
    out = sched.schedule()  # 24..28, and the budget left admits the late request from the 6 full blocks
    assert out.num_computed.tolist() == [24, 24] and late.num_cached_tokens == 24
    result = runner.step(out)
    assert result is not None
    sched.update(out, result.sampled_token_ids)
    finish(sched, runner)
    assert late.output_token_ids == sched.requests[0].output_token_ids


def test_abort_of_a_sharing_request_leaves_the_other_intact() -> None:
    runner = FakeRunner(block_size=4)
    sched = make_sched(runner)
    prompt = list(range(1, 18))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    sched.add_request(prompt, params, req_id=0)
    step(sched, runner)
    sharer = sched.add_request(prompt, params, req_id=1)
    step(sched, runner)
    assert sharer.num_cached_tokens == 16 and sharer.block_ids[:4] == sched.requests[0].block_ids[:4]
    sched.abort_request(0, reason="abort")
    finish(sched, runner)
    assert sharer.output_token_ids == reference_generate(prompt, params, VOCAB, 0)[0]
    assert sched.num_free_blocks == runner.num_kv_blocks


def test_reset_prefix_cache_refused_while_blocks_are_held() -> None:
    runner = FakeRunner(block_size=4)
    sched = make_sched(runner)
    prompt = list(range(1, 10))
    sched.add_request(prompt, SamplingParams(max_tokens=4), req_id=0)
    step(sched, runner)
    assert not sched.reset_prefix_cache()
    finish(sched, runner)
    assert sched.allocator.num_cached_blocks > 0 and sched.reset_prefix_cache()
    again = sched.add_request(prompt, SamplingParams(max_tokens=4), req_id=1)
    finish(sched, runner)
    assert again.num_cached_tokens == 0 and sched.allocator.num_cached_blocks > 0


def test_caching_off_never_looks_up_or_registers() -> None:
    runner = FakeRunner(block_size=4)
    sched = make_sched(runner, caching=False)
    for rid in range(2):
        sched.add_request(list(range(1, 14)), SamplingParams(max_tokens=2), req_id=rid)
        finish(sched, runner)
    assert sched.requests[1].num_cached_tokens == 0 and sched.allocator.num_cached_blocks == 0
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (0, 0)


def shared_prefix_workload(seed: int, n: int) -> list[tuple[int, list[int], SamplingParams, int]]:
    """(arrival step, prompt, params, id): a long request first that keeps the loop busy for 60 steps, then ``n``
    prompts built from a few common prefixes (some block-aligned, some not) plus a random tail, greedy or seeded
    random, some with stop tokens, arriving over the first 50 steps; a few repeat an earlier prompt whole."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(k)] for k in (8, 13, 21)]
    work = [(0, [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True), 0)]
    for rid in range(1, n + 1):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))]
        if rng.random() < 0.2:
            prompt = list(rng.choice(work[1:] or work)[1])
        params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]), top_p=0.9,
                                ignore_eos=rng.random() < 0.5,
                                stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.3 else None)
        work.append((rng.randrange(50), prompt, params, rid))
    return work


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("num_kv_blocks", [256, 28])  # 28 blocks of 4: evictions and preemptions
def test_outputs_equal_the_reference_with_shared_prefixes(overlap: bool, num_kv_blocks: int) -> None:
    work = shared_prefix_workload(seed=num_kv_blocks, n=50)
    results = {}
    for caching in (False, True):
        runner = FakeRunner(vocab_size=VOCAB, block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=128,
                            eos_token_ids=[7, 11])
        sched = make_sched(runner, caching, max_num_seqs=6, max_num_batched_tokens=16)

        def before_launch(k: int, sched: Scheduler = sched) -> None:
            for at, prompt, params, rid in work:
                if at == k:
                    sched.add_request(prompt, params, request_seed(params, 1000 + rid), req_id=rid)

        run_wave(sched, runner, overlap, before_launch)
        assert len(sched.requests) == len(work), "the run ended before every arrival"
        assert not sched.has_unfinished_requests() and sched.num_free_blocks == num_kv_blocks
        results[caching] = ({rid: (r.output_token_ids, r.finish_reason) for rid, r in sched.requests.items()},
                            sched.prefix_cache_hits, sum(s.num_tokens for s in runner.steps), sched.num_preemptions)
    (off, off_hits, off_tokens, _), (on, on_hits, on_tokens, preemptions) = results[False], results[True]
    want = {rid: reference_generate(p, s, VOCAB, 1000 + rid, {7, 11}, 128) for _, p, s, rid in work}
    assert off == want and on == want
    assert off_hits == 0 and on_hits > 100 and on_tokens < off_tokens
    if num_kv_blocks == 28:
        assert preemptions > 0


def test_preempted_request_finds_the_head_of_its_blocks_again() -> None:
    """Two requests outgrow 7 blocks: the later one is preempted (its full blocks cached, freed tail first), the
    other's growth evicts two of them, and re-admitted it starts from the one block left, its head."""
    runner = FakeRunner(block_size=4, num_kv_blocks=7)
    sched = make_sched(runner, max_num_seqs=4)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    a = sched.add_request(list(range(1, 10)), params, req_id=0)
    b = sched.add_request(list(range(20, 28)), params, req_id=1)
    chunks = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        chunks += [c for c in zip(out.req_ids.tolist(), out.num_computed.tolist(), out.query_lens.tolist(),
                                  strict=True) if c[0] == 1]
        result = runner.step(out)
        assert result is not None
        sched.update(out, result.sampled_token_ids)
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    assert (1, 4, 9) in chunks  # 8 prompt + 4 outputs known: positions 4..12 computed again, block 0 reused
    assert b.num_cached_tokens == 0  # counted at its first scheduling only
    assert a.output_token_ids == reference_generate(list(range(1, 10)), params, VOCAB, 0)[0]
    assert b.output_token_ids == reference_generate(list(range(20, 28)), params, VOCAB, 0)[0]
