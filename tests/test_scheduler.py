"""Scheduler: token budget, chunked prefill, decode-first order, KV blocks (no leaks, preemption), stops, errors."""
from __future__ import annotations

import random
from typing import Any

import pytest

from fake_runner import FakeRunner, reference_generate
from runner.core.scheduler import Scheduler
from runner.core.scheduler_output import ScheduledChunk, SchedulerOutput
from runner.sampling_params import SamplingParams
from runner.worker.sampler import request_seed

VOCAB = 64


def make_sched(runner: FakeRunner, max_num_seqs: int = 8, max_num_batched_tokens: int = 32) -> Scheduler:
    return Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     block_size=runner.block_size, num_kv_blocks=runner.num_kv_blocks,
                     max_model_len=runner.max_model_len, vocab_size=runner.vocab_size,
                     eos_token_ids=runner.eos_token_ids)


def sampled_by(runner: FakeRunner, out: SchedulerOutput) -> list[int | None]:
    """What ``runner`` sampled for ``out`` (a step with chunks always has an output)."""
    result = runner.step(out)
    assert result is not None
    return result.sampled_token_ids


def run(sched: Scheduler, runner: FakeRunner, arrivals: dict[int, list] | None = None) -> None:
    """Step to completion; ``arrivals[step]`` = [(prompt, params, req_id)] added before that step."""
    step = 0
    while True:
        for prompt, params, rid in (arrivals or {}).get(step, []):
            sched.add_request(prompt, params, request_seed(params, rid), req_id=rid)
        out = sched.schedule()
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(out.chunks) <= sched.max_num_seqs
        assert sched.allocator.num_free_blocks + sum(len(r.block_ids) for r in sched.running) \
            == sched.allocator.num_blocks
        sampled = runner.step(out)
        if sampled is None:
            if arrivals and any(s > step for s in arrivals):
                step += 1
                continue
            break
        sched.update(out, sampled.sampled_token_ids)
        step += 1


def test_chunked_prefill_positions_and_blocks() -> None:
    runner = FakeRunner(block_size=4)
    sched = make_sched(runner, max_num_batched_tokens=6)
    prompt = list(range(1, 15))  # 14 tokens -> chunks of 6, 6, 2
    sched.add_request(prompt, SamplingParams(max_tokens=2))
    seen = []
    for _ in range(3):
        out = sched.schedule()
        (c,) = out.chunks
        seen.append((c.num_computed_tokens, c.token_ids, len(c.block_ids), c.sample))
        sched.update(out, sampled_by(runner, out))
    assert seen == [(0, prompt[:6], 2, False), (6, prompt[6:12], 3, False), (12, prompt[12:], 4, True)]
    out = sched.schedule()  # now a decode of the sampled token at position 14, still inside block 4
    (c,) = out.chunks
    assert (c.num_computed_tokens, len(c.block_ids), out.is_uniform_decode) == (14, 4, True)
    sched.update(out, sampled_by(runner, out))
    assert not sched.has_unfinished_requests() and sched.num_free_blocks == runner.num_kv_blocks


def test_decodes_first_then_continuing_prefill_then_new() -> None:
    runner = FakeRunner()
    sched = make_sched(runner, max_num_batched_tokens=8)
    sched.add_request([1, 2], SamplingParams(max_tokens=5), req_id=0)
    sched.add_request(list(range(1, 13)), SamplingParams(max_tokens=5), req_id=1)  # 12 tokens: chunked
    out = sched.schedule()
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [(0, 2), (1, 6)]
    sched.update(out, sampled_by(runner, out))
    sched.add_request([3, 4, 5], SamplingParams(max_tokens=5), req_id=2)
    out = sched.schedule()
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [(0, 1), (1, 6), (2, 1)]
    assert out.has_prefill and not out.is_uniform_decode and out.num_tokens == 8
    assert out.num_scheduled_tokens == [1, 6, 1]


def test_token_budget_max_num_seqs_and_outputs_match_reference() -> None:
    rng = random.Random(0)
    runner = FakeRunner(block_size=4, num_kv_blocks=256)
    sched = make_sched(runner, max_num_seqs=3, max_num_batched_tokens=10)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 25))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(1, 6), temperature=rng.choice([0.0, 0.9]), top_p=0.9)
              for _ in prompts]
    run(sched, runner, {0: [(p, s, i) for i, (p, s) in enumerate(zip(prompts, params, strict=True))]})
    for i, (p, s) in enumerate(zip(prompts, params, strict=True)):
        req = sched.requests[i]
        assert (req.output_token_ids, req.finish_reason) == reference_generate(p, s, VOCAB, i)
    assert max(len(s.chunks) for s in runner.steps) == 3
    assert max(s.num_tokens for s in runner.steps) == 10


def test_no_leaked_blocks_with_arrivals_and_preemption() -> None:
    rng = random.Random(1)
    runner = FakeRunner(block_size=4, num_kv_blocks=12)  # 48 token slots: forces preemption by recompute
    sched = make_sched(runner, max_num_seqs=6, max_num_batched_tokens=16)
    arrivals: dict[int, list] = {}
    reqs = []
    for i in range(30):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True)
        arrivals.setdefault(rng.randrange(40), []).append((prompt, params, i))
        reqs.append((prompt, params))
    run(sched, runner, arrivals)
    assert sched.num_preemptions > 0
    assert sched.num_free_blocks == 12 and not sched.running and not sched.waiting
    for i, (p, s) in enumerate(reqs):
        assert sched.requests[i].output_token_ids == reference_generate(p, s, VOCAB, i)[0], f"request {i}"


def test_bad_prompts_are_errors_and_others_complete() -> None:
    runner = FakeRunner(max_model_len=16)
    sched = make_sched(runner)
    # prompts of any type: rejecting the bad ones is the test
    bad: dict[int, tuple[Any, str]] = {
        0: ([], "prompt is empty"), 1: ([1, 64, 2], "token id 64 at position 1 is outside the vocabulary [0, 64)"),
        2: ([-1], "token id -1 at position 0"), 3: (list(range(16)), "prompt has 16 tokens but max_model_len is 16"),
        4: ([1, "a"], "position 1 is 'a'"), 5: ("hello", "must be a list of token ids")}
    for rid, (prompt, _) in bad.items():
        req = sched.add_request(prompt, SamplingParams(max_tokens=3), req_id=rid)
        assert req.is_finished and req.finish_reason == "error"
    good = sched.add_request(list(range(15)), SamplingParams(max_tokens=3), req_id=9)  # 15 + 1 == max_model_len
    run(sched, runner)
    for rid, (_, msg) in bad.items():
        error = sched.requests[rid].error
        assert error is not None and msg in error
    assert good.finish_reason == "length" and len(good.output_token_ids) == 1  # capped by max_model_len
    assert sched.num_free_blocks == runner.num_kv_blocks


def test_request_larger_than_cache_is_rejected_up_front() -> None:
    runner = FakeRunner(block_size=4, num_kv_blocks=3)
    sched = make_sched(runner)
    req = sched.add_request([1] * 10, SamplingParams(max_tokens=8))
    assert req.finish_reason == "error" and req.error is not None and "--num-kv-blocks" in req.error
    ok = sched.add_request([1] * 10, SamplingParams(max_tokens=3))  # 12 tokens: 11 KV positions, 3 blocks
    run(sched, runner)
    assert ok.finish_reason == "length" and len(ok.output_token_ids) == 3


def test_stop_conditions() -> None:
    prompt = [5, 6, 7]
    ref, _ = reference_generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), VOCAB, 0)
    k = next(i for i in range(1, 8) if ref[i] not in ref[:i])  # first position whose token is new
    cases = {
        "eos": (SamplingParams(temperature=0.0, max_tokens=8), [ref[k]], k + 1, "stop"),
        "ignore_eos": (SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), [ref[k]], 8, "length"),
        "stop_token": (SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[ref[k]]), [], k + 1, "stop"),
        "max_tokens": (SamplingParams(temperature=0.0, max_tokens=2), [], 2, "length"),
    }
    for name, (params, eos, n, reason) in cases.items():
        runner = FakeRunner(eos_token_ids=eos)
        sched = make_sched(runner)
        req = sched.add_request(prompt, params)
        run(sched, runner)
        assert (req.output_token_ids, req.finish_reason) == (ref[:n], reason), name
    runner = FakeRunner(max_model_len=6)
    sched = make_sched(runner)
    req = sched.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8))
    run(sched, runner)
    assert (req.output_token_ids, req.finish_reason) == (ref[:3], "length")


def test_update_rejects_mismatched_results() -> None:
    runner = FakeRunner()
    sched = make_sched(runner)
    sched.add_request([1, 2])
    out = sched.schedule()
    with pytest.raises(ValueError, match="returned 0 results for 1 chunks"):
        sched.update(out, [])
    with pytest.raises(RuntimeError, match="sampled 1.5"):  # not a token id at all: a model runner bug
        sched.update(out, [1.5])  # type: ignore[list-item]  # a float where a token id belongs: the bug tested


def test_a_token_outside_the_vocabulary_ends_only_its_request() -> None:
    """A sampled id outside the vocabulary (the sampler's INVALID_TOKEN for non-finite logits) ends that request
    with an error; the other request of the step keeps its token and goes on."""
    runner = FakeRunner()
    sched = make_sched(runner)
    bad, good = sched.add_request([1, 2]), sched.add_request([3, 4])
    out = sched.schedule()
    done = sched.update(out, [-1, 7])
    assert done == [bad]
    assert (bad.finish_reason, bad.output_token_ids) == ("error", [])
    assert "not finite" in (bad.error or "")
    assert good.finish_reason is None and good.output_token_ids == [7]
    assert [r.req_id for r in sched.running] == [good.req_id]


def test_scheduler_output_properties() -> None:
    sp = SamplingParams()
    dec = ScheduledChunk(0, [1], 5, [0, 1], True, sp, 0)
    pre = ScheduledChunk(1, [1, 2, 3], 0, [2], True, sp, 0)
    first = ScheduledChunk(2, [1], 0, [3], True, sp, 0)  # a one-token prompt is a prefill
    assert SchedulerOutput([dec, dec]).is_uniform_decode
    assert not SchedulerOutput([]).is_uniform_decode and not SchedulerOutput([]).has_prefill
    assert SchedulerOutput([dec, pre]).has_prefill and SchedulerOutput([dec, pre]).num_tokens == 4
    assert not SchedulerOutput([first]).is_uniform_decode
