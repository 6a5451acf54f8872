"""The scheduler's decode run (``runner/core/decode_run.py``): steady decodes held as arrays. Every request's
tokens and finish equal the request generated alone, through every way a row leaves the run (EOS, length, stop
token ids, aborts, preemption under a small KV pool, a budget smaller than the run, invalid samples), in the
synchronous and the overlap loop; the run really carries the decodes; and a request read from
outside while in the run shows the same state the per-request path would."""
from __future__ import annotations

import random

import pytest

from fake_runner import FakeRunner, forward_step, reference_generate, run_wave
from runner.core.runner_output import ModelRunnerOutput
from runner.core.scheduler import FINISHED, Request, Scheduler
from runner.core.scheduler_output import SchedulerOutput
from runner.core.slots import placeholder
from runner.sampling_params import SamplingParams
from runner.worker.sampler import request_seed
from test_scheduler import make_sched, sampled_by

VOCAB = 64


class RunWatcher(FakeRunner):
    """The fake runner, noting the largest decode run seen at launch and aborting requests at given steps."""

    def __init__(self, sched_box: list[Scheduler], aborts: dict[int, int], *, num_kv_blocks: int, eos: int) -> None:
        super().__init__(vocab_size=VOCAB, block_size=4, num_kv_blocks=num_kv_blocks, eos_token_ids=[eos])
        self.box, self.aborts, self.most_rows = sched_box, aborts, 0

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        scheduler = self.box[0]
        self.most_rows = max(self.most_rows, scheduler.num_decode_run_rows)
        rid = self.aborts.get(self.num_steps)
        if rid is not None:
            scheduler.abort_request(rid, "aborted by the test", reason="abort")
        return super().step(sched)


def workload(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        params = SamplingParams(temperature=0.0 if kind else 0.8, seed=None if kind else i,
                                max_tokens=rng.randrange(1, 24), ignore_eos=kind == 1,
                                stop_token_ids=[rng.randrange(VOCAB)] if kind == 3 else None)
        out.append(([rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))], params))
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize(("seqs", "budget", "blocks"), [(12, 64, 256), (12, 5, 256), (10, 40, 24)],
                         ids=["roomy", "budget-below-run", "small-kv-pool"])
def test_every_request_equals_its_reference(overlap: bool, seqs: int, budget: int, blocks: int) -> None:
    eos = 7
    runner_box: list[Scheduler] = []
    runner = RunWatcher(runner_box, {9: 5}, num_kv_blocks=blocks, eos=eos)
    sched = make_sched(runner, max_num_seqs=seqs, max_num_batched_tokens=budget)
    runner_box.append(sched)
    reqs: list[Request] = []
    for i, (prompt, params) in enumerate(workload(3, 30)):
        reqs.append(sched.add_request(prompt, params, request_seed(params, i), req_id=i))
    run_wave(sched, runner, overlap)
    assert runner.most_rows >= 3, "the decode run never carried the steady decodes"
    for i, (req, (prompt, params)) in enumerate(zip(reqs, workload(3, 30), strict=True)):
        assert req.status == FINISHED
        if req.finish_reason == "abort":
            assert i == 5
            want, _ = reference_generate(prompt, params, VOCAB, request_seed(params, i), eos=[eos])
            assert req.output_token_ids == want[:len(req.output_token_ids)]
            continue
        want, reason = reference_generate(prompt, params, VOCAB, request_seed(params, i), eos=[eos])
        assert (req.output_token_ids, req.finish_reason) == (want, reason), f"request {i}"
    assert sched.num_decode_run_rows == 0 and sched.num_free_blocks == blocks


def test_a_request_read_in_the_run_shows_the_per_request_state() -> None:
    """Overlap order (schedule N+1 before N's results): while in the run, the request's outputs end in one
    placeholder per step in flight, its counts agree, and after the update the placeholder is its token."""
    runner = FakeRunner(vocab_size=VOCAB, block_size=4, num_kv_blocks=32)
    sched = make_sched(runner)
    req = sched.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    want, _ = reference_generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), VOCAB,
                                 0)
    def forward(out: SchedulerOutput) -> list[int | None]:  # placeholders resolved, as the model runner does
        result = forward_step(runner, runner.future_map, out)
        assert result is not None
        return result.sampled_token_ids

    s1 = sched.schedule()  # prefill, samples output 0
    sched.update(s1, forward(s1))
    s2 = sched.schedule()  # a decode by the per-request path: the request joins the run after it
    assert req.run is not None and sched.num_decode_run_rows == 1
    s3 = sched.schedule()  # the run's: output 1 is still in flight
    assert s3.token_ids.tolist() == [placeholder(req.slot)]
    assert req.output_token_ids == [want[0], placeholder(req.slot), placeholder(req.slot)]
    assert (req.num_pending, req.inflight, req.num_computed_tokens, req.num_tokens) == (2, 2, 5, 6)
    t2, t3 = forward(s2), forward(s3)
    sched.update(s2, t2)
    assert req.output_token_ids == [want[0], want[1], placeholder(req.slot)] and req.num_pending == 1
    sched.update(s3, t3)
    assert req.output_token_ids == want[:3] and (req.num_pending, req.inflight) == (0, 0)
    s4 = sched.schedule()
    assert s4.token_ids.tolist() == [want[2]]  # no step in flight: the real token, from the run's arrays
    sched.abort_request(req.req_id, "stop here", reason="abort")  # leaves the run, its step's token discarded
    assert req.run is None and req.output_token_ids == want[:3] and sched.num_decode_run_rows == 0
    assert sched.update(s4, forward(s4)) == [] and sched.last_discarded == [req.req_id]
    assert sched.num_free_blocks == runner.num_kv_blocks


def test_an_invalid_sample_in_the_run_ends_that_request_only() -> None:
    runner = FakeRunner(vocab_size=VOCAB, block_size=4, num_kv_blocks=32)
    sched = make_sched(runner)
    a = sched.add_request([1, 2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    b = sched.add_request([3, 4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, sampled_by(runner, out))
    assert sched.num_decode_run_rows == 2
    out = sched.schedule()
    tokens = sampled_by(runner, out)
    bad = out.req_ids.tolist().index(a.req_id)
    tokens[bad] = -1  # the sampler's INVALID_TOKEN
    assert sched.update(out, tokens) == [a]
    assert a.finish_reason == "error" and b.status != FINISHED and len(b.output_token_ids) == 4


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_stop_token_ids_stop_a_request_inside_the_run(overlap: bool) -> None:
    """A request with stop_token_ids (as every request of a checkpoint whose generation config adds EOS ids)
    decodes in the run and stops there on one of them, with vLLM's stop_reason."""
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want, _ = reference_generate([5, 6, 7], plain, VOCAB, 0)
    stop_token = want[6]
    first = want.index(stop_token)
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token, VOCAB - 1])
    runner_box: list[Scheduler] = []
    runner = RunWatcher(runner_box, {}, num_kv_blocks=64, eos=VOCAB - 2)
    sched = make_sched(runner)
    runner_box.append(sched)
    req = sched.add_request([5, 6, 7], params, 0, req_id=0)
    other = sched.add_request([8, 9], plain, 1, req_id=1)
    run_wave(sched, runner, overlap)
    assert runner.most_rows == 2  # both decoded in the run
    assert (req.output_token_ids, req.finish_reason, req.stop_reason) == (want[:first + 1], "stop", stop_token)
    assert other.output_token_ids == reference_generate([8, 9], plain, VOCAB, 1)[0]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_long_generations_pass_through_the_history_flush(overlap: bool) -> None:
    """More tokens in the run than its history holds (HISTORY_STEPS): they move to the request's list on the way
    and the outputs still equal the reference, also for a request aborted after the flush."""
    from runner.core.decode_run import HISTORY_STEPS

    plain = SamplingParams(temperature=0.0, max_tokens=2 * HISTORY_STEPS + 9, ignore_eos=True)
    runner_box: list[Scheduler] = []
    runner = RunWatcher(runner_box, {HISTORY_STEPS + 20: 1}, num_kv_blocks=128, eos=VOCAB - 2)
    sched = make_sched(runner)
    runner_box.append(sched)
    reqs = [sched.add_request([3 + i, 4, 5], plain, i, req_id=i) for i in range(3)]
    run_wave(sched, runner, overlap)
    for i, req in enumerate(reqs):
        want, _ = reference_generate([3 + i, 4, 5], plain, VOCAB, i)
        if i == 1:
            assert req.finish_reason == "abort" and HISTORY_STEPS < len(req.output_token_ids) < len(want)
            assert req.output_token_ids == want[:len(req.output_token_ids)]
        else:
            assert (req.output_token_ids, req.finish_reason) == (want, "length")
