"""Overlap loop (runner/core/overlap_loop.py): same tokens as the synchronous loop, placeholders resolved from the
future-token map, speculative steps after a stop token discarded without freeing in-flight KV blocks, one-step
look-ahead, no leaks under stress; and ``--trace-file`` in the engine."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from devices import device_args
from fake_runner import FakeRunner, forward_step, reference_generate, run_steps
from future_token_map import FutureTokenMap
from runner.config import RunnerConfig
from runner.core.overlap_loop import (
    ForwardExecutor,
    InlineLauncher,
    LoopStats,
    StepLauncher,
    StepTimeoutError,
    make_step_launcher,
)
from runner.core.runner_output import ModelRunnerOutput
from runner.core.scheduler import Request, Scheduler
from runner.core.scheduler_output import SchedulerOutput
from runner.core.slots import SlotPool, placeholder
from runner.entrypoints.cli import build_parser, job_from_args
from runner.entrypoints.llm import LLM
from runner.sampling_params import SamplingParams
from runner.worker.sampler import request_seed

VOCAB = 64
ROOT = Path(__file__).resolve().parents[1]
Arrivals = dict[int, list[tuple[list[int], SamplingParams, int]]]


def make_sched(runner: FakeRunner, max_num_seqs: int = 8, max_num_batched_tokens: int = 32) -> Scheduler:
    return Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     block_size=runner.block_size, num_kv_blocks=runner.num_kv_blocks,
                     max_model_len=runner.max_model_len, vocab_size=runner.vocab_size,
                     eos_token_ids=runner.eos_token_ids)


class InFlightGuard:
    """Wraps a scheduler so that every block or slot it hands out is checked against the steps still in flight
    (scheduled, results not yet applied): reusing one of theirs is exactly the bug the loop must not have."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.unprocessed: dict[int, SchedulerOutput] = {}
        self.violations: list[str] = []
        schedule, update = sched.schedule, sched.update
        allocate, alloc_slot = sched.allocator.allocate, sched.slots.alloc

        def guarded_schedule() -> SchedulerOutput:
            out = schedule()
            if out.chunks:
                self.unprocessed[out.step_id] = out
            return out

        def guarded_update(sched: SchedulerOutput, sampled: Sequence[int | None]) -> list[Request]:
            self.unprocessed.pop(sched.step_id, None)
            return update(sched, sampled)

        def guarded_allocate(n: int) -> list[int]:
            blocks = allocate(n)
            busy = {b for o in self.unprocessed.values() for c in o.chunks for b in c.block_ids}
            if busy & set(blocks):
                self.violations.append(f"blocks {sorted(busy & set(blocks))} reused while a step using them runs")
            return blocks

        def guarded_alloc_slot() -> int:
            slot = alloc_slot()
            if any(c.slot == slot for o in self.unprocessed.values() for c in o.chunks):
                self.violations.append(f"slot {slot} reused while a step using it runs")
            return slot

        sched.schedule, sched.update = guarded_schedule, guarded_update  # type: ignore[method-assign]
        sched.allocator.allocate, sched.slots.alloc = guarded_allocate, guarded_alloc_slot  # type: ignore[method-assign]


def drive(runner: Any, arrivals: Arrivals, overlap: bool, guard: bool = False, inline: bool = False,
          **sched_kw: Any) -> tuple[Scheduler, LoopStats, InFlightGuard | None]:
    """Run the loop to completion, adding ``arrivals[k]`` right before the k-th step is scheduled; with
    ``overlap``, steps launch on a forward thread, or in this thread when ``inline``."""
    sched = make_sched(runner, **sched_kw)
    g = InFlightGuard(sched) if guard else None
    added = []

    def before_launch(k: int) -> None:
        for prompt, params, rid in arrivals.get(k, []):
            sched.add_request(prompt, params, request_seed(params, 1000 + rid), req_id=rid)
            added.append(rid)

    executor: StepLauncher | None = None
    if overlap:
        executor = InlineLauncher() if inline else ForwardExecutor()
    try:
        stats = run_steps(sched, runner, executor=executor, before_launch=before_launch)
    finally:
        if executor is not None:
            executor.close()
    assert len(added) == sum(map(len, arrivals.values())), "the run ended before every arrival"
    return sched, stats, g


def workload(seed: int, n: int, max_step: int, eos_prob: bool = True) -> Arrivals:
    """Long requests that keep the loop busy for max_step+ steps (one every 40 steps: each lasts at least 45, one
    token per step up to max_model_len 48), plus ``n`` arrivals at random steps: prompts up to 40 tokens
    (chunked at 16), greedy or seeded random, some with stop tokens."""
    rng = random.Random(seed)
    arrivals: Arrivals = {}
    for k, step in enumerate(range(0, max_step, 40)):
        rid = n + k if k else 0  # ids 1..n are the random arrivals'
        arrivals[step] = [([1, 2, 3], SamplingParams(max_tokens=max_step + 20, ignore_eos=True), rid)]
    for rid in range(1, n + 1):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]), top_p=0.9,
                                ignore_eos=not eos_prob or rng.random() < 0.3,
                                stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.3 else None)
        arrivals.setdefault(rng.randrange(max_step), []).append((prompt, params, rid))
    return arrivals


def expected(arrivals: Arrivals, runner: FakeRunner) -> dict[int, tuple[list[int], str]]:
    return {rid: reference_generate(p, s, VOCAB, 1000 + rid, runner.eos_token_ids, runner.max_model_len)
            for items in arrivals.values() for p, s, rid in items}


def sampled(runner: FakeRunner, fmap: FutureTokenMap, out: SchedulerOutput) -> list[int | None]:
    """What the forward side of ``out``'s step sampled (a step with chunks always has an output)."""
    result = forward_step(runner, fmap, out)
    assert result is not None
    return result.sampled_token_ids


def outputs(sched: Scheduler) -> dict[int, tuple[list[int], str | None]]:
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in sched.requests.items()}


def assert_clean(sched: Scheduler) -> None:
    assert not sched.has_unfinished_requests() and sched.num_inflight_steps == 0
    assert sched.allocator.num_free_blocks == sched.allocator.num_blocks, "KV blocks leaked"
    assert sched.slots.num_free == sched.slots.capacity, "future-map slots leaked"
    assert all(r.num_pending == 0 and not r.inflight and min(r.output_token_ids, default=0) >= 0
               for r in sched.requests.values())


# ---------------------------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("inline", [False, True], ids=["forward-thread", "inline"])
@pytest.mark.parametrize("num_kv_blocks", [256, 24])  # 24 blocks of 4: preemption (the loop syncs first)
def test_overlap_on_equals_off_with_arrivals_chunking_stops_and_preemption(num_kv_blocks: int, inline: bool) -> None:
    arrivals = workload(seed=num_kv_blocks, n=60, max_step=120)
    runs = {}
    for overlap in (False, True):
        runner = FakeRunner(vocab_size=VOCAB, block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=48,
                            eos_token_ids=[7, 11])
        sched, stats, guard = drive(runner, arrivals, overlap, guard=True, inline=inline, max_num_seqs=6,
                                    max_num_batched_tokens=16)
        assert_clean(sched)
        assert guard is not None and guard.violations == []
        runs[overlap] = (outputs(sched), stats, sched.num_preemptions)
        assert outputs(sched) == expected(arrivals, runner)
    (off, off_stats, _), (on, on_stats, preempted) = runs[False], runs[True]
    assert on == off
    assert off_stats.num_overlapped_steps == 0 and off_stats.num_placeholders_resolved == 0
    assert on_stats.num_overlapped_steps > 0.8 * on_stats.num_steps  # overlap really happened...
    assert on_stats.num_placeholders_resolved > 100  # ...and decode inputs came from the future-token map
    if num_kv_blocks == 24:
        assert preempted > 0 and on_stats.sync_reasons["preemption"] > 0


def test_engine_generate_overlap_on_equals_off() -> None:
    prompts = [[(3 * i + j) % VOCAB for j in range(1 + (7 * i) % 30)] for i in range(24)]
    params = [SamplingParams(max_tokens=1 + i % 9, temperature=0.7 * (i % 2), seed=i if i % 4 == 1 else None)
              for i in range(24)]
    results = {}
    for disable in (False, True):
        runner = FakeRunner(vocab_size=VOCAB, num_kv_blocks=128, eos_token_ids=[5])
        llm = LLM(RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, disable_overlap_schedule=disable),
                  runner=runner)
        results[disable] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                            for o in llm.generate(prompts, params)]
        st = llm.last_loop_stats
        assert st is not None and st.overlap is not disable and (st.num_overlapped_steps > 0) is not disable
        # The forward side's wait for sampled ids is counted, inside its busy time (both loops).
        assert 0 < st.read_wait_s <= st.forward_busy_s
        llm.close()
    assert results[False] == results[True]


# ---------------------------------------------------------------------------------------------- placeholders
class GatedRunner(FakeRunner):
    """Step k waits until the CPU has launched step k+1 (or timed out), so every decode input really is
    a placeholder resolved after its producer finished. Records what each step received."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.launched = threading.Semaphore(0)
        self.received: list[SchedulerOutput] = []
        self.sampled: list[list[int | None]] = []
        self.active = 0

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        self.active += 1
        assert self.active == 1, "two steps ran at once"
        if sched.chunks:
            self.launched.acquire(timeout=2)
        self.received.append(sched)
        out = super().step(sched)
        self.sampled.append(out.sampled_token_ids if out is not None else [])
        self.active -= 1
        return out


def test_placeholder_is_resolved_after_its_producer_finished() -> None:
    runner = GatedRunner(vocab_size=VOCAB, num_kv_blocks=64)
    sched = make_sched(runner)
    scheduled: list[SchedulerOutput] = []
    schedule = sched.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        scheduled.append(out)
        if len(scheduled) > 1:
            runner.launched.release()  # step k (running) may finish once step k+1 is scheduled
        return out

    sched.schedule = spy  # type: ignore[method-assign]
    a = sched.add_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), req_id=0)
    b = sched.add_request([4], SamplingParams(max_tokens=3, temperature=1.0), request_seed(
        SamplingParams(temperature=1.0), 9), req_id=1)
    executor = ForwardExecutor()
    stats = run_steps(sched, runner, executor=executor)
    executor.close()
    # Every decode the CPU scheduled named its input by the request's slot; the runner got the real token,
    # the one the previous step had sampled for that request.
    by_step = {o.step_id: o for o in scheduled}
    checked = 0
    for k, got in enumerate(runner.received):
        sent = by_step[got.step_id]
        for c_sent, c_got in zip(sent.chunks, got.chunks, strict=True):
            assert min(c_got.token_ids) >= 0
            if c_sent.is_decode:
                req = sched.requests[c_sent.req_id]
                assert c_sent.token_ids == [placeholder(c_sent.slot)]
                position = c_sent.num_computed_tokens - len(req.prompt_token_ids)  # which output it feeds
                assert c_got.token_ids == [req.output_token_ids[position]]
                prev_tokens = {c.req_id: t for c, t in zip(runner.received[k - 1].chunks, runner.sampled[k - 1],
                                                           strict=True)}
                assert c_got.token_ids == [prev_tokens[c_sent.req_id]]  # produced by the step just before
                checked += 1
    assert checked == 4 + 2 and stats.num_placeholders_resolved == checked
    assert a.output_token_ids == reference_generate([1, 2, 3], a.sampling, VOCAB, 0)[0]
    assert b.output_token_ids == reference_generate([4], b.sampling, VOCAB, 9)[0]
    assert_clean(sched)


def test_future_map_rejects_stale_or_foreign_reads() -> None:
    fmap = FutureTokenMap(4)
    fmap.store([7], [2], [42])
    assert fmap.resolve_one(7, placeholder(2)) == 42 and fmap.resolve_one(7, 5) == 5
    with pytest.raises(RuntimeError, match="holds nothing"):  # consumed: a second read has no fresh store
        fmap.resolve_one(7, placeholder(2))
    fmap.store([8], [2], [3])
    with pytest.raises(RuntimeError, match="a token of request 8"):  # a slot never names two requests
        fmap.resolve_one(7, placeholder(2))
    pool = SlotPool(2)
    assert [pool.alloc(), pool.alloc()] == [0, 1]
    with pytest.raises(RuntimeError, match="slots are in use"):
        pool.alloc()
    pool.free(0)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(0)


# ---------------------------------------------------------------------------------------------- scheduler rules
def test_stop_token_in_flight_discards_next_step_and_defers_freeing() -> None:
    runner = FakeRunner(vocab_size=VOCAB, block_size=4, num_kv_blocks=16)
    ref, _ = reference_generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8), VOCAB, 0)
    runner.eos_token_ids = {ref[1]}  # the second output is a stop token
    sched = make_sched(runner)
    sched.eos_token_ids = frozenset(runner.eos_token_ids)
    req = sched.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8))
    s1 = sched.schedule()  # prefill, samples output 0
    s2 = sched.schedule()  # decode of a placeholder, samples output 1 (the stop token)
    s3 = sched.schedule()  # speculative: output 1 is not known yet
    assert s2.chunks[0].token_ids == [placeholder(req.slot)] and len(s3.chunks) == 1
    assert req.output_token_ids == [placeholder(req.slot)] * 3 and req.num_pending == 3
    free_before, slot = sched.num_free_blocks, req.slot
    fmap = FutureTokenMap(sched.slots.capacity)
    r1, r2, r3 = (sampled(runner, fmap, s) for s in (s1, s2, s3))  # forward side runs ahead
    sched.update(s1, r1)
    assert sched.update(s2, r2) == [req] and req.finish_reason == "stop"
    assert req.output_token_ids == ref[:2]  # the speculative placeholder is dropped at once
    assert sched.num_free_blocks == free_before and req.block_ids and req.slot == slot  # s3 still uses them
    assert not sched.schedule().chunks
    sched.update(s3, r3)  # s3's token for the finished request is discarded, blocks freed
    assert req.output_token_ids == ref[:2] and sched.num_free_blocks == sched.allocator.num_blocks
    assert sched.slots.num_free == sched.slots.capacity


def test_known_last_token_is_not_over_scheduled() -> None:
    runner = FakeRunner(vocab_size=VOCAB, max_model_len=6)
    sched = make_sched(runner)
    a = sched.add_request([1, 2], SamplingParams(max_tokens=2, ignore_eos=True), req_id=0)
    b = sched.add_request([1, 2, 3, 4], SamplingParams(max_tokens=9, ignore_eos=True), req_id=1)  # 6 = max_model_len
    s1, s2 = sched.schedule(), sched.schedule()
    assert [c.req_id for c in s2.chunks] == [0, 1]  # both decode on placeholders
    assert not sched.schedule().chunks  # both last tokens are in flight: nothing more to schedule
    fmap = FutureTokenMap(sched.slots.capacity)
    for s in [s1, s2]:
        sched.update(s, sampled(runner, fmap, s))
    assert len(a.output_token_ids) == 2 and len(b.output_token_ids) == 2
    assert (a.finish_reason, b.finish_reason) == ("length", "length")
    assert_clean(sched)


def _check_lookahead(flag: bool) -> None:
    """One run of the lookahead test below, with or without serialised consecutive prefills."""
    runner = FakeRunner(vocab_size=VOCAB, num_kv_blocks=128)
    sched = make_sched(runner, max_num_seqs=4, max_num_batched_tokens=8)
    updated: list[int] = []
    update = sched.update

    def recording_update(sched: SchedulerOutput, sampled: Sequence[int | None]) -> list[Request]:
        updated.append(sched.step_id)
        return update(sched, sampled)

    sched.update = recording_update  # type: ignore[method-assign]
    step = runner.step
    violations: list[str] = []
    launched: list[int] = []

    def checked_step(sched: SchedulerOutput) -> ModelRunnerOutput | None:  # runs on the executor thread
        if sched.chunks:
            launched.append(sched.step_id)
            if len(launched) >= 3 and launched[-3] not in updated:
                violations.append(f"step {sched.step_id} launched before step {launched[-3]} was processed")
        prev = runner.steps[-1] if runner.steps else None
        if flag and prev is not None and prev.has_prefill and sched.has_prefill and prev.step_id not in updated:
            violations.append(f"prefill step {sched.step_id} overlapped prefill step {prev.step_id}")
        return step(sched)

    runner.step = checked_step  # type: ignore[method-assign]
    for i in range(12):
        sched.add_request([i + 1] * (3 + i), SamplingParams(max_tokens=4, ignore_eos=True), req_id=i)
    executor = ForwardExecutor()
    stats = run_steps(sched, runner, executor=executor, consecutive_prefill_overlap=not flag)
    executor.close()
    assert violations == []
    assert (stats.sync_reasons["consecutive_prefill"] > 0) is flag
    assert_clean(sched)


def test_lookahead_is_one_step_and_consecutive_prefills_can_be_serialised() -> None:
    """Before step k is launched, step k-2's results are applied; with the flag, also step k-1's when both
    are prefill steps (their first tokens are out before the next prefill runs)."""
    for flag in (False, True):
        _check_lookahead(flag)


def test_stress_thousands_of_short_requests_no_lost_tokens_no_leaks() -> None:
    rng = random.Random(7)
    runner = FakeRunner(vocab_size=VOCAB, block_size=4, num_kv_blocks=40, max_model_len=32, eos_token_ids=[3])
    arrivals: Arrivals = {0: [([1], SamplingParams(max_tokens=31, ignore_eos=True), 0)]}
    n = 2500
    for rid in range(1, n + 1):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        params = SamplingParams(max_tokens=rng.randint(1, 4), ignore_eos=rng.random() < 0.5)
        arrivals.setdefault(rng.randrange(25), []).append((prompt, params, rid))
    sched, stats, guard = drive(runner, arrivals, overlap=True, guard=True, max_num_seqs=16,
                                max_num_batched_tokens=32)
    assert guard is not None and guard.violations == []
    assert_clean(sched)
    want = expected(arrivals, runner)
    got = outputs(sched)
    assert got == want  # nothing lost, duplicated or reordered, every finish reason right
    assert sum(len(t) for t, _ in got.values()) == sum(len(t) for t, _ in want.values())
    assert stats.num_overlapped_steps > stats.num_steps // 2 and stats.num_placeholders_resolved > 1000


# ---------------------------------------------------------------------------------------------- plumbing
def test_executor_thread_sets_torch_threads_and_reports_errors() -> None:
    ex = ForwardExecutor(num_threads=1)
    assert ex.submit(torch.get_num_threads).result() == 1
    assert ex.submit(lambda: threading.current_thread().name).result() == "ubatch-forward"
    with pytest.raises(ZeroDivisionError):
        ex.submit(lambda: 1 / 0).result()
    assert ex.submit(lambda: 5).result() == 5  # the thread survives a failed step
    ex.close()
    with pytest.raises(RuntimeError, match="closed"):
        ex.submit(lambda: 0)


def test_steps_launch_inline_where_they_queue_on_a_device_and_on_a_thread_where_the_cpu_computes_them() -> None:
    for device, emulated in ((torch.device("cpu"), True), (torch.device("cuda", 1), False)):
        assert isinstance(make_step_launcher(device, emulated_device=emulated), InlineLauncher)
    for cpu_device in (torch.device("cpu"), None):  # the CPU's forward, a stand-in that names no device
        launcher = make_step_launcher(cpu_device)
        assert isinstance(launcher, ForwardExecutor) and launcher.thread_id != threading.get_ident()
        launcher.close()
    inline = InlineLauncher(torch.device("cpu"))
    assert inline.thread_id is None
    assert inline.submit(threading.get_ident).result() == threading.get_ident()  # in the caller's thread
    with pytest.raises(ZeroDivisionError):
        inline.submit(lambda: 1 / 0).result()
    assert inline.submit(lambda: 5).result() == 5 and inline.busy_s > 0


def test_a_step_that_never_ends_is_a_timeout_naming_the_executor_not_a_hang() -> None:
    release = threading.Event()

    class StuckRunner(FakeRunner):
        def step(self, out: SchedulerOutput) -> Any:
            release.wait(30)  # a forward that neither returns nor raises (until the test lets it go)
            return super().step(out)

    runner = StuckRunner()
    sched = make_sched(runner)
    sched.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    ex = ForwardExecutor(num_threads=1)
    try:
        with pytest.raises(StepTimeoutError, match=r"waited 0.2 s for a step of 1 chunks on the forward executor "
                                                   r"thread 'ubatch-forward'.*--dist-timeout-s"):
            run_steps(sched, runner, executor=ex, step_timeout_s=0.2)
    finally:
        release.set()
        ex.close()


def test_flags_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "--disable-consecutive-prefill-overlap", "--disable-overlap-schedule"])
    cfg = job_from_args(args, args.subparser).cfg
    assert cfg.disable_consecutive_prefill_overlap and cfg.disable_overlap_schedule
    assert not RunnerConfig().disable_consecutive_prefill_overlap and not RunnerConfig().disable_overlap_schedule


def test_generate_trace_file_writes_chrome_trace_and_prints_metrics(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"  # its directory must exist (a missing one is refused: test_cli.py)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "generate", "--model", "tiny-qwen3-moe", "--enable-dbo",
         "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "4",
         "--emulate-link", "latency_us=100,gbps=1", "--trace-file", str(out), "--max-tokens", "3",
         "--num-prompts", "2", *device_args(1)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} >= {"compute", "comm"} and {e["pid"] for e in spans} == {0}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert f"trace written to {out}" in proc.stdout
    assert "DBO overlap, rank 0" in proc.stdout and "comm hidden" in proc.stdout, proc.stdout


def _step_windows(spans: list[Any]) -> list[tuple[float, float]]:
    """Each step's run on the forward side, from its DP vote to the end of its sampling (a vote with no
    sampling after it, the wave's last, is no step)."""
    marks = sorted((s.start, s.name, s.end) for s in spans if s.track == "step" and s.name in ("dp_vote", "sample"))
    windows, start = [], None
    for t, name, end in marks:
        if name == "dp_vote":
            start = t
        elif start is not None:
            windows.append((start, end))
            start = None
    return windows


@pytest.mark.parametrize("overlap", [True, False])
def test_trace_shows_next_steps_host_work_inside_the_running_step(tmp_path: Path, overlap: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With the overlap loop, the trace of every decode step holds the scheduling of the step after it; with
    the synchronous loop, none does. So that load cannot decide it, the k-th forward waits (at most 10 s)
    until the CPU thread has scheduled step k + 2, the one after it: a loop that scheduled only after
    processing would make it wait the whole timeout, and the test counts those waits."""
    import time

    from ubatch.trace_metrics import spans_from_chrome

    calls = [0]
    schedule = Scheduler.schedule

    def counted(self: Scheduler) -> SchedulerOutput:
        out = schedule(self)
        calls[0] += 1
        return out

    monkeypatch.setattr(Scheduler, "schedule", counted)
    trace_file = tmp_path / "trace.json"
    llm = LLM(model="tiny-qwen3-moe", cache_dir=str(tmp_path / "cache"), device="cpu", max_num_seqs=32,
              disable_overlap_schedule=not overlap, trace_file=str(trace_file))
    forwards: list[int] = [0]
    timed_out: list[int] = []

    def gate(*_: Any) -> None:
        k, forwards[0] = forwards[0], forwards[0] + 1
        deadline = time.monotonic() + (0 if timed_out else 10)  # after one timeout, no more waiting
        while calls[0] < k + 2 and time.monotonic() < deadline:
            time.sleep(0.0005)
        if calls[0] < k + 2:
            timed_out.append(k)

    if overlap:
        llm.model_runner.model.register_forward_pre_hook(gate)
    try:
        prompts = [[(7 * i + j) % 500 for j in range(8)] for i in range(32)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    assert timed_out == []
    _, spans = spans_from_chrome(json.loads(trace_file.read_text()), 0)
    windows = _step_windows(spans)
    assert len(windows) == 10  # one prefill step, then nine decode steps
    # The k-th schedule() call (0-based) built step k; calls past the tenth found nothing left to schedule.
    schedules = sorted((s.start, s.end) for s in spans if s.track == "scheduler" and s.name == "schedule")
    assert len(schedules) >= 11
    for k in range(1, 10):  # decode step k runs while step k + 1 is scheduled (overlap), or before it (sync)
        nxt = schedules[k + 1]
        if overlap:
            assert windows[k - 1][1] < nxt[0] and nxt[1] < windows[k][1], (k, windows[k - 1:k + 1], nxt)
        else:
            assert windows[k][1] < nxt[0], (k, windows[k], nxt)
