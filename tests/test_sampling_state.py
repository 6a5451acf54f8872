"""The sampler reads the engine's steps as arrays, with the requests' settings in a persistent per-slot table.

- Through the scheduler (synchronous and overlap loop, chunked prefill, preemption, slots reused by other
  requests, request ids reused with other settings), every step's sampling metadata, tokens and logprobs from
  the table (``Sampler.prepare`` + ``sample_step``) equal those of a second sampler given the same rows as
  ``ScheduledChunk`` objects, whose settings are read from each chunk's ``SamplingParams`` every step; the
  table is written exactly once per request per admission (its first chunk).
- The table-driven metadata equals the per-row builder it replaced (``tests/reference_sampling_metadata.py``)
  on random batches mixing every option, from a table a row per batch row and from a per-slot table in which
  the rows sit in shuffled slots among rows of other requests.
- A step built by hand from chunks (no slots, prompt lengths implied) samples as the rows given by hand.
- The real engine (``LLM`` on the tiny Qwen3-MoE) generates with every option on without ever building the
  per-request chunk objects.
- On a GPU (``test_cuda_*``), a step's sampling makes no host sync before its one read-back and samples the
  CPU's tokens.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest
import torch

from fake_runner import FakeRunner, run_wave
from reference_sampling_metadata import reference_sampling_metadata
from runner.core.scheduler import Scheduler
from runner.core.scheduler_output import RequestSnapshot, ScheduledChunk, SchedulerOutput
from runner.sampling_params import SamplingParams
from runner.worker.sampler import Sampler, SamplerOutput, StepRows, request_seed
from runner.worker.sampling_metadata import RowSpec, SamplingMetadata, build_sampling_metadata, settings_of_rows
from runner.worker.sampling_settings import SamplingSettings

V = 64
EOS = 7


def assert_same_metadata(a: SamplingMetadata, b: SamplingMetadata) -> None:
    for name, x in vars(a).items():
        y = getattr(b, name)
        if isinstance(x, tuple):
            assert isinstance(y, tuple) and len(x) == len(y), name
            pairs = list(zip(x, y, strict=True))
        else:
            pairs = [(x, y)]
        for u, w in pairs:
            if isinstance(u, torch.Tensor):
                assert isinstance(w, torch.Tensor) and u.dtype == w.dtype and u.tolist() == w.tolist(), name
            else:
                assert u == w, name


class TwinRunner(FakeRunner):
    """The FakeRunner (its sampler reads each step's arrays and the per-slot table) next to a twin sampler given
    the same rows as chunk objects: every step's metadata and results must be equal."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.twin = Sampler(self.vocab_size, "cpu", self.eos_token_ids)
        self.num_compared = self.num_first_chunks = self.max_slot = 0
        self.num_writes = 0
        real_sample_step, real_set = self.sampler.sample_step, self.sampler.settings.set
        self._sched: SchedulerOutput | None = None

        def sample_step(logits: torch.Tensor, step: StepRows) -> SamplerOutput:
            assert self._sched is not None
            chunks = self._sched.chunks
            picks = step.picks.tolist() if step.picks is not None else list(range(len(chunks)))
            picked = [chunks[i] for i in picks]
            assert_same_metadata(build_sampling_metadata(step.settings, step.rows, step.slots, step.output_index,
                                                         "cpu"), self.twin.metadata(picked))
            want = self.twin.sample(logits.clone(), picked)
            got = real_sample_step(logits, step)
            assert got == want
            self.num_compared += len(picks)
            return got

        def write(*args: Any, **kwargs: Any) -> None:
            self.num_writes += 1
            real_set(*args, **kwargs)

        self.sampler.sample_step = sample_step  # type: ignore[method-assign]
        self.sampler.settings.set = write  # type: ignore[method-assign]

    def step(self, sched: SchedulerOutput) -> Any:
        self._sched = sched
        if sched.num_reqs:
            self.num_first_chunks += int(np.count_nonzero(sched.num_computed == 0))
            self.max_slot = max(self.max_slot, int(sched.slots.max()))
            self.twin.record_inputs(sched.chunks)
        return super().step(sched)


def random_params(rng: random.Random) -> SamplingParams:
    """Every option, each on for some requests; strong enough to change tokens."""
    kw: dict[str, Any] = dict(max_tokens=rng.randint(2, 12), temperature=rng.choice([0.0, 0.0, 0.7, 1.0, 1.4]))
    if kw["temperature"]:
        kw.update(rng.choice([{}, dict(top_k=5), dict(top_p=0.8), dict(top_k=9, top_p=0.7), dict(min_p=0.1),
                              dict(top_k=V + 3)]))
        kw["seed"] = rng.choice([None, rng.randrange(-2**70, 2**70)])
    kw.update(rng.choice([{}, dict(repetition_penalty=1.6), dict(frequency_penalty=1.2, presence_penalty=-0.5)]))
    if rng.random() < 0.3:
        kw.update(min_tokens=min(3, kw["max_tokens"]), stop_token_ids=[rng.randrange(V)])
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randrange(V): rng.uniform(-5, 8) for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 2, V + 1])
    return SamplingParams(**kw)


def run(seed: int, overlap: bool, num_kv_blocks: int) -> tuple[TwinRunner, Scheduler, int]:
    """A long greedy request keeps the wave going while 50 others arrive at random steps; finished requests are
    forgotten and their ids come back later with other settings."""
    rng = random.Random(seed)
    runner = TwinRunner(vocab_size=V, block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=64,
                        eos_token_ids=[EOS])
    # No prefix caching: the settings writes are counted against chunks at position 0 (a hit starts past it).
    sched = Scheduler(max_num_seqs=5, max_num_batched_tokens=16, block_size=4, num_kv_blocks=num_kv_blocks,
                      max_model_len=64, vocab_size=V, eos_token_ids=[EOS], enable_prefix_caching=False)
    arrivals: dict[int, list[int]] = {}
    for rid in range(1, 51):
        arrivals.setdefault(rng.randrange(60), []).append(rid % 30 + 1)  # ids 1..30: twenty come back
    reused = 0

    def before_launch(k: int) -> None:
        nonlocal reused
        if k == 0:
            sched.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=62, ignore_eos=True), 0,
                              req_id=0)
        for finished in sched.take_finished():
            sched.forget(finished.req_id)
        for rid in arrivals.pop(k, []):
            if rid in sched.requests:  # still running: comes later
                arrivals.setdefault(k + 1, []).append(rid)
                continue
            reused += rid in added
            added.add(rid)
            params = random_params(rng)
            prompt = [rng.randrange(V // 2) for _ in range(rng.randint(1, 24))]
            sched.add_request(prompt, params, request_seed(params, 1000 + rid), req_id=rid)

    added: set[int] = set()
    run_wave(sched, runner, overlap, before_launch)
    assert not arrivals, "the wave ended before every arrival"
    return runner, sched, reused


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("num_kv_blocks", [200, 24], ids=["roomy", "preempting"])
def test_step_arrays_and_slot_table_sample_as_rows_given_by_hand(overlap: bool, num_kv_blocks: int) -> None:
    runner, sched, reused = run(11, overlap, num_kv_blocks)
    assert runner.num_compared > 300 and reused >= 10
    assert runner.num_writes == runner.num_first_chunks  # once per admission, never on later steps
    assert runner.max_slot + 1 < 51 // 3  # each slot held several requests
    if num_kv_blocks == 24 and not overlap:
        assert sched.num_preemptions > 0


@pytest.mark.parametrize("seed", range(6))
def test_table_metadata_equals_the_per_row_builder_it_replaced(seed: int) -> None:
    """Random batches (every option, greedy and random rows, rows below and past ``min_tokens``, seeds of any
    size): the metadata from a table equals the old per-row builder's, tensor for tensor, both from a table a
    row per batch row and from the engine's per-slot table with the rows in shuffled slots among others."""
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    rows = [RowSpec(random_params(rng), seed=rng.randrange(-2**70, 2**70), output_index=rng.randrange(6),
                    slot=slot) for slot in rng.sample(range(100), n)]
    want = reference_sampling_metadata(rows, V, "cpu", [EOS])
    assert_same_metadata(build_sampling_metadata(*settings_of_rows(rows, V, [EOS]), "cpu"), want)
    table = SamplingSettings(V, [EOS])
    table.ensure_rows(100)
    for slot in range(100):  # other requests' rows around the batch's
        table.set(slot, random_params(rng), rng.randrange(2**63), rng.randrange(30), owner=1000 + slot)
    for r in rows:
        table.set(r.slot, r.sampling, r.seed, 0, owner=r.slot)
    slots = np.array([r.slot for r in rows], dtype=np.int64)
    assert_same_metadata(build_sampling_metadata(table, slots, slots, np.array([r.output_index for r in rows]),
                                                 "cpu"), want)


def test_a_slot_written_by_another_request_is_rewritten() -> None:
    """A request whose slot another request wrote (not at position 0: a batch the scheduler would not make,
    but the table must not trust it) rewrites the row before sampling; so does a request id that comes back
    to the same slot with other settings (at position 0, as the scheduler admits it)."""
    sampler = Sampler(V, "cpu")

    def Req(params: SamplingParams) -> RequestSnapshot:
        return RequestSnapshot(params, 5, (1, 2))

    def step(req_id: int, params: SamplingParams, computed: int) -> SchedulerOutput:
        from runner.attention.kv_cache import BlockRows
        return SchedulerOutput.from_arrays(
            req_ids=np.array([req_id]), slots=np.array([3]), num_computed=np.array([computed]),
            query_lens=np.array([1]), sample=np.array([True]), token_ids=np.array([4]),
            blocks=BlockRows.from_lists([[0]]), requests=[Req(params)], finished_req_ids=[], step_id=1)

    logits = torch.zeros(1, V)
    logits[0, 9] = 5.0
    rows = sampler.prepare(step(1, SamplingParams(temperature=0.0, logit_bias={3: 10.0}), 0))
    assert sampler.sample_step(logits.clone(), rows).token_ids == [3]
    rows = sampler.prepare(step(2, SamplingParams(temperature=0.0), 2))  # other request, same slot, mid-way
    assert sampler.sample_step(logits.clone(), rows).token_ids == [9]
    assert sampler.settings.owner[3] == 2 and rows.output_index.tolist() == [1]
    rows = sampler.prepare(step(2, SamplingParams(temperature=0.0, logit_bias={4: 10.0}), 0))  # id 2 again, new
    assert sampler.sample_step(logits.clone(), rows).token_ids == [4]  # settings: its first chunk rewrites


def test_a_step_without_slots_is_an_error_naming_the_request() -> None:
    from runner.attention.kv_cache import BlockRows
    out = SchedulerOutput.from_arrays(
        req_ids=np.array([4]), slots=np.array([-1]), num_computed=np.array([0]), query_lens=np.array([1]),
        sample=np.array([True]), token_ids=np.array([1]), blocks=BlockRows.from_lists([[0]]),
        requests=[RequestSnapshot(SamplingParams())], finished_req_ids=[], step_id=1)
    with pytest.raises(ValueError, match=r"request 4 has no slot \(slot=-1\)"):
        Sampler(V, "cpu").prepare(out)


def test_a_step_built_from_chunks_samples_as_rows_given_by_hand() -> None:
    """Chunks without slots or prompt lengths (tests' and stand-ins' batches) get a table of their own."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3, top_k=4, logprobs=2),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9])]
    chunks = [ScheduledChunk(0, [1, 2, 3], 0, [0], True, params[0], seed=0),
              ScheduledChunk(1, [5], 6, [1, 2], True, params[1], seed=3, prompt_len=4),
              ScheduledChunk(2, [6, 8], 0, [3], False, params[2], seed=0),
              ScheduledChunk(3, [2], 3, [4], True, params[2], seed=0, prompt_len=3)]
    sampler, twin = Sampler(V, "cpu", [EOS]), Sampler(V, "cpu", [EOS])
    rows = sampler.prepare(SchedulerOutput(chunks))
    assert rows.picks is not None and rows.picks.tolist() == [0, 1, 3]
    assert rows.output_index.tolist() == [0, 3, 1]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    logits[2, 9] = logits[2, EOS] = 50.0  # held back: row 3 is below min_tokens
    picked = [chunks[i] for i in (0, 1, 3)]
    assert_same_metadata(build_sampling_metadata(rows.settings, rows.rows, rows.slots, rows.output_index, "cpu"),
                         twin.metadata(picked))
    got = sampler.sample_step(logits.clone(), rows)
    assert got == twin.sample(logits.clone(), picked) and got.token_ids[2] not in (9, EOS)
    assert sampler.settings.num_rows == 0  # the engine's table is untouched


def test_settings_table_grows_and_keeps_rows() -> None:
    table = SamplingSettings(V, [EOS])
    table.ensure_rows(3)
    table.set(2, SamplingParams(temperature=0.5, top_k=3, min_tokens=1, logit_bias={4: 1.0}), seed=9,
              prompt_len=7, owner=11)
    before = {name: getattr(table, name)[2].item() for name in SamplingSettings._ARRAYS}
    table.ensure_rows(200)
    assert table.num_rows >= 200 and len(table.stop_tokens) == len(table.bias) == table.num_rows
    assert {name: getattr(table, name)[2].item() for name in SamplingSettings._ARRAYS} == before
    bias = table.bias[2]
    assert table.stop_tokens[2].tolist() == [EOS] and bias is not None and bias[0].tolist() == [4]
    assert table.owner[150] == -1 and table.flags[150] == 0 and table.temperature[150] == 1.0
    assert table.num_penalty_rows == 0
    table.set(150, SamplingParams(presence_penalty=0.5), seed=1)
    table.set(3, SamplingParams(repetition_penalty=1.2), seed=1)
    assert table.num_penalty_rows == 2
    table.set(150, SamplingParams(), seed=1)  # rewritten by a request without penalties
    assert table.num_penalty_rows == 1


def test_the_engine_never_builds_chunk_objects(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """``LLM`` on the tiny Qwen3-MoE with every sampling option in one batch, the synchronous loop and the
    overlap loop: no step's per-request ``ScheduledChunk`` views are built, and both loops give the same
    tokens."""
    from runner.entrypoints.llm import LLM

    def refuse(self: SchedulerOutput) -> list[ScheduledChunk]:
        raise AssertionError("the engine built a step's chunk objects")

    monkeypatch.setattr(SchedulerOutput, "chunks", property(refuse))
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randint(2, 20))] for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.1, min_p=0.05, max_tokens=6, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=6,
                             ignore_eos=True),
              SamplingParams(temperature=0.7, logit_bias={5: 4.0}, min_tokens=3, max_tokens=6, seed=8)] * 3
    outputs = {}
    for overlap in (False, True):
        llm = LLM(model="tiny-qwen3-moe", device="cpu", cache_dir=str(tmp_path), max_num_seqs=8,
                  max_num_batched_tokens=48, max_model_len=64, disable_overlap_schedule=not overlap, seed=3)
        try:
            outs = llm.generate(prompts, params[:len(prompts)], use_tqdm=False)
        finally:
            llm.close()
        outputs[overlap] = [list(o.outputs[0].token_ids) for o in outs]
        lps = [o.outputs[0].logprobs for o in outs]
        assert all(lp is not None and len(lp) == len(t)
                   for lp, t in zip(lps[2::5], outputs[overlap][2::5], strict=True))
    assert outputs[False] == outputs[True]
    assert all(len(t) >= 3 for t in outputs[False])


@pytest.mark.cuda
def test_cuda_steps_sample_on_the_device_as_on_the_cpu() -> None:
    """On CUDA a step's sampling is tensor work on the device: from reading the step's arrays to the sampled
    tensors nothing syncs (``set_sync_debug_mode("error")``; the metadata and penalty inputs go up through
    pinned memory), the greedy rows' argmax is ``torch.argmax`` on the device, and over a prefill step and
    decode steps mixing every option the tokens equal the CPU sampler's on the same logits (logprobs within
    float32 rounding)."""
    from runner.attention.kv_cache import BlockRows
    from runner.worker.sampler import read_back, sample_on_device

    rng = random.Random(5)
    n = 24
    reqs = [RequestSnapshot(random_params(rng), 100 + i, tuple(rng.randrange(V) for _ in range(rng.randint(1, 6))))
            for i in range(n)]
    greedy = SamplingParams(temperature=0.0)
    reqs[0] = dataclasses.replace(reqs[0], sampling=greedy)  # plain greedy rows in the mix
    reqs[1] = dataclasses.replace(reqs[1], sampling=greedy)
    slots = np.array(rng.sample(range(40), n), dtype=np.int64)
    samplers = {dev: Sampler(V, dev, [EOS]) for dev in ("cpu", "cuda")}
    history = [list(r.prompt_token_ids) for r in reqs]
    g = torch.Generator().manual_seed(1)
    for k in range(6):
        start = np.array([0 if k == 0 else len(h) - 1 for h in history], dtype=np.int64)
        tokens = [h if k == 0 else h[-1:] for h in history]
        sched = SchedulerOutput.from_arrays(
            req_ids=np.arange(n, dtype=np.int64), slots=slots, num_computed=start,
            query_lens=np.array([len(t) for t in tokens], dtype=np.int64), sample=np.ones(n, dtype=bool),
            token_ids=np.array([t for ts in tokens for t in ts], dtype=np.int64),
            blocks=BlockRows.from_lists([[i] for i in range(n)]), requests=reqs, finished_req_ids=[], step_id=k)
        logits = torch.randn(n, V, generator=g) * 3
        results = {}
        for dev, sampler in samplers.items():
            x = logits.to(dev, copy=True)  # the sampler works in place: each device gets its own copy
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                step = sampler.prepare(sched)
                meta = build_sampling_metadata(step.settings, step.rows, step.slots, step.output_index, dev)
                sampled, lp = sample_on_device(x, meta, sampler.penalties)
            finally:
                if dev == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            assert sampled.device.type == dev
            results[dev] = read_back(meta, sampled, lp)
        cpu, gpu = results["cpu"], results["cuda"]
        assert gpu.token_ids == cpu.token_ids
        assert (gpu.logprobs is None) == (cpu.logprobs is None)
        for a, b in zip(gpu.logprobs or [], cpu.logprobs or [], strict=True):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert (a.token_id, a.rank) == (b.token_id, b.rank)
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)
        for h, t in zip(history, cpu.token_ids, strict=True):
            h.append(t)
    assert samplers["cuda"].penalties.counts is not None and samplers["cpu"].penalties.counts is not None
    assert torch.equal(samplers["cuda"].penalties.counts.cpu(), samplers["cpu"].penalties.counts)


@pytest.mark.cuda
def test_cuda_greedy_steps_take_the_argmax_alone_without_a_sync() -> None:
    """A step of greedy rows with no other option builds no metadata (``Sampler.launch_step``): on CUDA it is
    ``torch.max`` and a ``where`` with no host sync, its tokens equal the CPU's (ties, a NaN row, a row of -inf
    included), and its read goes through the event waiter."""
    from runner.attention.kv_cache import BlockRows

    def Req() -> RequestSnapshot:
        return RequestSnapshot(SamplingParams(temperature=0.0), 0, (1, 2))

    n = 16
    sched = SchedulerOutput.from_arrays(
        req_ids=np.arange(n, dtype=np.int64), slots=np.arange(n, dtype=np.int64),
        num_computed=np.zeros(n, dtype=np.int64), query_lens=np.full(n, 2, dtype=np.int64),
        sample=np.ones(n, dtype=bool), token_ids=np.ones(2 * n, dtype=np.int64),
        blocks=BlockRows.from_lists([[i] for i in range(n)]), requests=[Req() for _ in range(n)],
        finished_req_ids=[], step_id=0)
    logits = (torch.randn(n, V, generator=torch.Generator().manual_seed(4)) * 3).round()  # ties
    logits[3, 7] = float("nan")
    logits[4] = float("-inf")
    tokens = {}
    for dev in ("cpu", "cuda"):
        sampler = Sampler(V, dev, [EOS])
        step = sampler.prepare(sched)
        x = logits.to(dev, copy=True)
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            sampled, pending = sampler.launch_step(x, step)
        finally:
            if dev == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        assert sampled.device.type == dev
        tokens[dev] = pending.result(30.0).token_ids
    assert tokens["cuda"] == tokens["cpu"]
    assert tokens["cpu"][3] == tokens["cpu"][4] == -1
