"""The engine core's plain tokens (``runner.core.requests.EngineCoreOutputs``): a running request's new token
without anything else travels in two arrays, not as a struct. These tests check that the arrays and the structs
together say exactly what one struct per output said: every request's tokens, in order, against the request
generated alone; the first output and the finish as structs; nothing after an abort; the same bytes decoded
on the client; each client its own requests; and the front's RequestOutputs unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from fake_runner import FakeRunner, reference_generate
from runner.config import RunnerConfig
from runner.core.engine_core import EngineCore
from runner.core.engine_core_proc import CoreLoop
from runner.core.logprob_rows import LogprobRows, LogprobTokens, StepLogprobs, TokenLogprobs
from runner.core.messages import ENCODER, OUTPUT_DECODER, CoreStats, Outputs
from runner.core.requests import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from runner.core.runner_output import ModelRunnerOutput
from runner.core.scheduler_output import SchedulerOutput
from runner.engine.output_processor import OutputProcessor
from runner.outputs import Logprob, RequestOutput
from runner.sampling_params import RequestOutputKind, SamplingParams
from runner.worker.sampler import request_seed
from tiny_checkpoint import build_tokenizer

VOCAB = 64
PROMPTS = [[3, 4, 5], [6], [7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19, 20]]


class LogprobsRunner(FakeRunner):
    """The fake runner with a log-probability entry for each sampled token of a request that asks for them
    (a stand-in value: the engine core only passes them on)."""

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        output = super().step(sched)
        if output is None:
            return None
        entries: list[TokenLogprobs | None] = [
            None if token is None or snap.sampling.logprobs is None else TokenLogprobs(token, -1.0, 1, [], [])
            for token, snap in zip(output.sampled_token_ids, sched.requests, strict=True)]
        return ModelRunnerOutput(output.sampled_token_ids, StepLogprobs.of_entries(entries) if any(entries) else None)


def run_core(params: list[SamplingParams], *, overlap: bool, abort_at: tuple[int, int] | None = None
             ) -> list[EngineCoreOutputs]:
    """Every step's outputs of one wave over the fake runner; ``abort_at`` = (step, request id): abort it
    after that step."""
    cfg = RunnerConfig(max_num_seqs=8, max_num_batched_tokens=64, disable_overlap_schedule=not overlap)
    core = EngineCore(cfg, LogprobsRunner(VOCAB))
    steps: list[EngineCoreOutputs] = []
    try:
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            core.add_request(EngineCoreRequest(i, prompt, p, default_seed=100 + i))
        for k in range(200):
            step = core.step()
            steps.append(step.outputs)
            if abort_at is not None and k == abort_at[0]:
                core.abort_requests([abort_at[1]])
            if not step.running:
                return steps
        raise AssertionError("the wave did not end in 200 steps")
    finally:
        core.close()


def tokens_by_request(steps: list[EngineCoreOutputs]) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for outputs in steps:
        for out in outputs:  # the plain tokens first, then the structs: the order the front reads them
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_plain_tokens_and_structs_add_up_to_each_request_generated_alone(overlap: bool) -> None:
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=None if i % 3 else 7, max_tokens=3 + 2 * i,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    steps = run_core(params, overlap=overlap)
    got = tokens_by_request(steps)
    for i, p in enumerate(params):
        want, _ = reference_generate(PROMPTS[i], p, VOCAB, request_seed(p, 100 + i))
        assert got[i] == want, f"request {i}"
    first: dict[int, EngineCoreOutput] = {}
    finals: dict[int, EngineCoreOutput] = {}
    plain_seen: set[int] = set()
    for outputs in steps:
        plain = outputs.request_ids.tolist()
        assert not set(plain) & set(finals), "a plain token after its request finished"
        assert not set(plain) - set(first), "a plain token before its request's first output"
        plain_seen.update(plain)
        for out in outputs.outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = out
            if out.finished:
                finals[out.request_id] = out
    assert sorted(first) == sorted(finals) == list(range(len(PROMPTS)))
    assert all(out.num_cached_tokens == 0 for out in first.values())  # the first output carries it
    assert all(out.finish_reason == "length" and len(out.new_token_ids) == 1 for out in finals.values())
    assert plain_seen == set(range(len(PROMPTS)))  # every request decoded through the arrays
    steady = [o for o in steps if o.outputs == [] and o.num_new_tokens == len(PROMPTS)]
    assert steady, "no step where every running request's token came as a plain token alone"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_rows_with_logprobs_travel_as_arrays_beside_the_plain_tokens(overlap: bool) -> None:
    """A running request with log-probabilities gets its steady tokens in a step's ``LogprobTokens`` (its
    rows as arrays, no struct), the others stay plain; its first output and its finish are structs with its
    rows; every request's tokens equal its run alone, and each row is for the token it came with."""
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2 if i in (1, 4) else None)
              for i in range(len(PROMPTS))]
    steps = run_core(params, overlap=overlap)
    array_rows: dict[int, int] = {}
    for outputs in steps:
        assert not {1, 4} & set(outputs.request_ids.tolist())
        for block in outputs.logprob_tokens:
            assert set(block.ids().tolist()) <= {1, 4}
            for rid in block.ids().tolist():
                array_rows[rid] = array_rows.get(rid, 0) + 1
        for out in outputs.outputs:
            if out.request_id in (1, 4) and out.new_token_ids:
                assert out.new_logprobs is not None and out.new_logprobs.ids().tolist() == out.new_token_ids
            else:
                assert out.new_logprobs is None
    assert array_rows == {1: 4, 4: 4}  # six tokens: the first and the last in structs
    steady = [o for o in steps if o.outputs == [] and o.num_new_tokens == len(PROMPTS)]
    assert steady and all(sorted(o.logprob_tokens[0].ids().tolist()) == [1, 4] for o in steady)
    got = tokens_by_request(steps)  # the sequence view: a struct per array token, its row with it
    for i, p in enumerate(params):
        assert got[i] == reference_generate(PROMPTS[i], p, VOCAB, request_seed(p, 100 + i))[0], f"request {i}"
    for outputs in steps:
        for out in outputs:
            assert (out.new_logprobs is not None and bool(out.new_token_ids)) == (out.request_id in (1, 4)
                                                                                 and bool(out.new_token_ids))
            if out.new_logprobs is not None:
                assert out.new_logprobs.ids().tolist() == out.new_token_ids


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_an_aborted_request_gets_no_plain_token_after_its_abort(overlap: bool) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    steps = run_core(params, overlap=overlap, abort_at=(4, 2))
    after = [rid for outputs in steps[5:] for rid in outputs.request_ids.tolist()]
    assert 2 not in after
    assert all(out.request_id != 2 for outputs in steps[5:] for out in outputs.outputs)
    assert 0 < len(tokens_by_request(steps)[2]) < 12
    assert all(len(t) == 12 for rid, t in tokens_by_request(steps).items() if rid != 2)


def test_outputs_as_a_sequence_list_plain_tokens_first() -> None:
    struct = EngineCoreOutput(9, [4], finish_reason="stop", num_prompt_tokens=2)
    outs = EngineCoreOutputs([struct], np.array([5, 6]), np.array([50, 60]))
    assert len(outs) == 3 and outs.num_new_tokens == 3
    assert [(o.request_id, o.new_token_ids) for o in outs] == [(5, [50]), (6, [60]), (9, [4])]
    assert outs[1].new_token_ids == [60] and outs[-1] is struct and outs[2] is struct
    assert [o.request_id for o in outs[1:]] == [6, 9]
    with pytest.raises(IndexError, match="output 3 of 3"):
        outs[3]
    with pytest.raises(ValueError, match="2 request ids for 1 plain tokens"):
        EngineCoreOutputs((), np.array([1, 2]), np.array([3]))


def test_a_client_decodes_the_arrays_the_rank_encoded() -> None:
    struct = EngineCoreOutput(3, [7], finish_reason="length", num_prompt_tokens=4)
    ids, tokens = np.array([2**40, 0, 11], dtype=np.int64), np.array([1, 63, 2**31], dtype=np.int64)
    msg = OUTPUT_DECODER.decode(ENCODER.encode(Outputs.of(1, EngineCoreOutputs([struct], ids, tokens),
                                                          CoreStats(num_running=3))))
    assert isinstance(msg, Outputs) and msg.rank == 1 and msg.stats.num_running == 3
    got = msg.engine_core_outputs()
    assert got.request_ids.tolist() == ids.tolist() and got.token_ids.tolist() == tokens.tolist()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in got.outputs] == [(3, [7], "length")]
    many = len(ENCODER.encode(Outputs.of(0, EngineCoreOutputs((), np.arange(1000), np.arange(1000)), CoreStats())))
    none = len(ENCODER.encode(Outputs(0, [], CoreStats())))
    assert (many - none) / 1000 <= 16.1  # two int64 a token


class TwoClients:
    """What ``CoreLoop._send_outputs`` reads of its rank: two clients; ``sent[c]`` keeps client ``c``'s messages."""

    def __init__(self, client_of: dict[int, int]) -> None:
        self.rank = 0
        self.client_of = dict(client_of)
        self.sent: list[list[Outputs]] = [[], []]
        self.outs = [self.Socket(self.sent[0]), self.Socket(self.sent[1])]
        self._last_stats = [0.0, 0.0]

    class Socket:
        def __init__(self, sent: list[Outputs]) -> None:
            self.sent = sent

        def send(self, data: bytes) -> None:
            msg = OUTPUT_DECODER.decode(data)
            assert isinstance(msg, Outputs)
            self.sent.append(msg)

    def _stats(self) -> CoreStats:
        return CoreStats()


def test_each_client_gets_its_own_requests_plain_tokens() -> None:
    rank = TwoClients({10: 0, 11: 1, 12: 0, 13: 1, 20: 1, 21: 0, 22: 1})
    rows = LogprobRows.of_entries([TokenLogprobs(t, -0.5 * t, t, [t, 0], [-0.1, -0.2]) for t in (5, 6, 7, 8)])
    block = LogprobTokens.of(np.array([20, 21, 22, 98]), np.array([2, 1, 2, 2]), rows)
    outs = EngineCoreOutputs([EngineCoreOutput(13, [9], finish_reason="stop")], np.array([10, 11, 12, 99]),
                             np.array([1, 2, 3, 4]), [block])
    CoreLoop._send_outputs(rank, outs)  # type: ignore[arg-type]  # the fields it reads
    (zero,), (one,) = rank.sent
    assert zero.engine_core_outputs().request_ids.tolist() == [10, 12]
    assert zero.engine_core_outputs().token_ids.tolist() == [1, 3] and zero.outputs == []
    assert one.engine_core_outputs().request_ids.tolist() == [11]
    assert [o.request_id for o in one.outputs] == [13] and 13 not in rank.client_of  # finished: routed, dropped
    # the rows with log-probabilities: each client its own, each with its row
    assert [(b.ids().tolist(), b.counts().tolist(), list(b.rows)) for b in zero.logprob_tokens] == \
        [([21], [1], [rows[1]])]
    assert [(b.ids().tolist(), b.counts().tolist(), list(b.rows)) for b in one.logprob_tokens] == \
        [([20, 22], [2, 2], [rows[0], rows[2]])]


def summary(outputs: list[RequestOutput]) -> list[tuple[str, str, list[int], str | None, bool]]:
    return [(o.request_id, c.text, list(c.token_ids), c.finish_reason, o.finished) for o in outputs
            for c in o.outputs]


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                                  RequestOutputKind.FINAL_ONLY])
def test_the_front_reads_the_arrays_as_it_reads_structs(kind: RequestOutputKind) -> None:
    """Two processors, the same steps: one reads the arrays, the other the same outputs as structs; same
    RequestOutputs and the same requests to abort (request b stops on a stop string found in a plain token)."""
    tokenizer = build_tokenizer()
    hello, world = tokenizer.encode("hello"), tokenizer.encode(" world")
    steps = [EngineCoreOutputs([EngineCoreOutput(0, [hello[0]], num_cached_tokens=0),
                                EngineCoreOutput(1, [hello[0]], num_cached_tokens=0)])]
    for t in [*hello[1:], *world]:
        steps.append(EngineCoreOutputs((), np.array([0, 1]), np.array([t, t])))
    steps.append(EngineCoreOutputs([EngineCoreOutput(0, [hello[0]], finish_reason="length")]))
    results = []
    for as_structs in (False, True):
        processor = OutputProcessor(tokenizer, 64)
        for rid, engine_id, stop in (("a", 0, None), ("b", 1, ["o w"])):
            params = SamplingParams(temperature=0.0, max_tokens=32, output_kind=kind, stop=stop)
            processor.add_request(rid, None, [5, 6], params, engine_request_ids=[engine_id])
        got, aborted = [], []
        for outputs in steps:
            outs, to_abort = processor.process_outputs(list(outputs) if as_structs else outputs, now=1.0)
            got.extend(summary(outs))
            aborted.extend(to_abort)
        results.append((got, aborted))
    assert results[0] == results[1]
    got, aborted = results[0]
    assert aborted == [1]
    b_final = [g for g in got if g[0] == "b" and g[4]]
    assert len(b_final) == 1 and b_final[0][3] == "stop"


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_the_front_reads_logprob_arrays_as_it_reads_structs(kind: RequestOutputKind) -> None:
    """Tokens with log-probabilities in a step's arrays (``LogprobTokens``, two requests asking for 1 and 2
    alternatives in rows 2 wide) give the same RequestOutputs, log-probability dicts, cumulative sums and
    aborts (request b stops on a stop string) as the same outputs read one struct at a time."""
    tokenizer = build_tokenizer()
    hello, world = tokenizer.encode("hello"), tokenizer.encode(" world")

    def rows(tokens: list[int], step: int) -> LogprobRows:
        return LogprobRows.of_entries([TokenLogprobs(t, -0.25 * (step + j + 1), 1 + j, [t, 7], [-0.1 * step, -2.5])
                                       for j, t in enumerate(tokens)])

    steps = [EngineCoreOutputs([EngineCoreOutput(0, [hello[0]], rows([hello[0]], 0).take(slice(0, 1), 1),
                                                 num_cached_tokens=0),
                                EngineCoreOutput(1, [hello[0]], rows([hello[0]], 0), num_cached_tokens=0)])]
    for k, t in enumerate([*hello[1:], *world], start=1):
        steps.append(EngineCoreOutputs((), logprob_tokens=[
            LogprobTokens.of(np.array([0, 1]), np.array([1, 2]), rows([t, t], k))]))
    steps.append(EngineCoreOutputs([EngineCoreOutput(0, [hello[0]], rows([hello[0]], 99).take(slice(0, 1), 1),
                                                     finish_reason="length")]))
    results = []
    for as_structs in (False, True):
        processor = OutputProcessor(tokenizer, 64)
        for rid, engine_id, stop, n in (("a", 0, None, 1), ("b", 1, ["o w"], 2)):
            params = SamplingParams(temperature=0.0, max_tokens=32, output_kind=kind, stop=stop, logprobs=n)
            processor.add_request(rid, None, [5, 6], params, engine_request_ids=[engine_id])
        got: list[tuple[tuple[str, str, list[int], str | None, bool], list[dict[int, Logprob]] | None,
                        float | None]] = []
        aborted: list[int] = []
        for outputs in steps:
            outs, to_abort = processor.process_outputs(list(outputs) if as_structs else outputs, now=1.0)
            got.extend(((o.request_id, c.text, list(c.token_ids), c.finish_reason, o.finished), c.logprobs,
                        c.cumulative_logprob) for o in outs for c in o.outputs)
            aborted.extend(to_abort)
        results.append((got, aborted))
    assert results[0] == results[1]
    got, aborted = results[0]
    assert aborted == [1]
    delta = kind == RequestOutputKind.DELTA

    def positions(rid: str) -> list[dict[int, Logprob]]:  # every token's dict: DELTA's joined, else the last's
        outs = [lps or [] for s, lps, _ in got if s[0] == rid and (delta or s[4])]
        return [p for lps in outs for p in lps]

    a_lps, b_lps = positions("a"), positions("b")
    assert len(a_lps) == len(hello) + len(world) + 1
    assert all(len(position) == 1 for position in a_lps)  # logprobs=1: the sampled token is the top one
    a_cum = [cum for s, _, cum in got if s[0] == "a" and s[4]][0]
    assert a_cum == pytest.approx(sum(lp.logprob for position in a_lps for lp in position.values()))
    assert b_lps and all(set(position) >= {7} for position in b_lps)  # logprobs=2: the second, id 7


class CountingSink:
    """Records what the server's metrics would see (``protocol.MetricsSink``) and each request's outputs."""

    def __init__(self) -> None:
        self.tokens = 0
        self.finished: dict[str, int] = {}
        self.outputs: list[RequestOutput] = []

    def on_tokens(self, num_new_tokens: int, ttft_s: float | None, itl_s: list[float]) -> None:
        self.tokens += num_new_tokens

    def on_request_finished(self, output: RequestOutput, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.finished[output.request_id] = num_generation_tokens

    def on_prompt_tokens(self, num_tokens: int) -> None:
        pass

    def on_engine_stats(self, stats: object) -> None:
        pass

    def put(self, output: RequestOutput) -> None:
        self.outputs.append(output)

    def fail(self, exc: BaseException) -> None:
        raise AssertionError(f"no request should fail: {exc}")

    def end(self) -> None:
        pass


def test_the_servers_token_counts_include_tokens_with_logprobs() -> None:
    """The server's request tracker counts every array token, plain or with log-probabilities, for the
    generation-token metrics and each finished request's count."""
    from runner.engine.simple_output import RequestTracker

    tracker, sink = RequestTracker(build_tokenizer()), CountingSink()
    ids = iter(range(100))
    for rid, lp in (("plain", None), ("with-lp", 1)):
        tracker.add(rid, None, [5, 6], SamplingParams(temperature=0.0, max_tokens=4, logprobs=lp), sink,
                    lambda: next(ids))
    rows = [LogprobRows.of_entries([TokenLogprobs(t, -0.5, 1, [t], [-0.5])]) for t in (7, 8, 9, 10)]
    steps = [EngineCoreOutputs([EngineCoreOutput(0, [7], num_cached_tokens=0),
                                EngineCoreOutput(1, [7], rows[0], num_cached_tokens=0)])]
    steps += [EngineCoreOutputs((), np.array([0]), np.array([t]),
                                [LogprobTokens.of(np.array([1]), np.array([1]), rows[k])]) for k, t in ((1, 8), (2, 9))]
    steps.append(EngineCoreOutputs([EngineCoreOutput(0, [10], finish_reason="length"),
                                    EngineCoreOutput(1, [10], rows[3], finish_reason="length")]))
    for outputs in steps:
        assert tracker.process(outputs, sink) == []
    assert sink.tokens == 8 and sink.finished == {"plain": 4, "with-lp": 4}
    final = [o for o in sink.outputs if o.request_id == "with-lp" and o.finished]
    assert len(final) == 1
