"""Prefix caching through the public ``LLM`` API: outputs identical with caching on and off (greedy, seeded
sampling, prompt logprobs, penalties, stop strings, ``n > 1``, a request aborted by its stop string while it
shares blocks), also with chunked prefill, a pool small enough to evict and preempt, DBO, DP=2 over rank
processes and the DeepSeek (MLA) tiny model; and caching really happened: ``num_cached_tokens``, the counters,
fewer tokens scheduled, and ``reset_prefix_cache``."""
from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

from runner.core.scheduler import Scheduler
from runner.core.scheduler_output import SchedulerOutput
from runner.engine.inproc_client import InprocClient
from runner.entrypoints.llm import LLM
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams
from tiny_checkpoint import TinyCheckpoint

BLOCK = 4
PREFIX = "Dual batch overlap hides the expert all-to-all behind the other micro-batch's compute. "
TEXTS = [PREFIX + "The quick brown fox", PREFIX + "Hello world! How are", PREFIX + "One, two, three:",
         PREFIX + "Caf\u00e9 cr\u00e8me", PREFIX + "The quick brown fox", PREFIX + "the lazy dog jumps"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12),
          SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
          SamplingParams(temperature=0.8, seed=5, max_tokens=16, stop=["e", "o"], ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=10, logprobs=2, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.4, ignore_eos=True)]
WHOLE_PROMPT = {2, 5}  # prompt logprobs, a penalty: these compute their whole prompt
ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=BLOCK, max_num_seqs=8, dist_timeout_s=60.0)
DBO: dict[str, Any] = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4,
                           dbo_cost_model="off")


def _lp(entries: Any) -> Any:
    """Log-probability entries as token ids and ranks (the values are float32, computed in other batches)."""
    return None if entries is None else [None if e is None else sorted((t, lp.rank) for t, lp in e.items())
                                         for e in entries]


def outputs_of(outs: list[RequestOutput]) -> list[Any]:
    return [(o.prompt_token_ids, _lp(o.prompt_logprobs),
             [(c.token_ids, c.text, c.finish_reason, c.stop_reason, _lp(c.logprobs)) for c in o.outputs])
            for o in outs]


class TokenCount:
    """The tokens an in-process engine's scheduler hands the model runner, summed over its steps."""

    def __init__(self, llm: LLM) -> None:
        client = llm.engine_client
        assert isinstance(client, InprocClient)
        self.sched: Scheduler = client.core.scheduler
        schedule = self.sched.schedule
        self.tokens = 0

        def counted() -> SchedulerOutput:
            out = schedule()
            self.tokens += out.num_tokens
            return out

        self.sched.schedule = counted  # type: ignore[method-assign]

    def take(self) -> int:
        tokens, self.tokens = self.tokens, 0
        return tokens


def cached_prefix_len(prompt_len: int) -> int:
    """The tokens a prompt whose every full block is cached starts from: its last token is always computed."""
    return (prompt_len - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("settings", [
    pytest.param({}, id="default"),
    pytest.param(dict(max_num_batched_tokens=8), id="chunked-prefill"),
    pytest.param(dict(max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=40), id="small-pool"),
    pytest.param(DBO, id="dbo"),
])
def test_outputs_equal_caching_off_and_the_second_call_reuses_the_prefix(
        tiny_chat_checkpoint: TinyCheckpoint, settings: dict[str, Any]) -> None:
    path = str(tiny_chat_checkpoint.path)
    results = {}
    for caching in (False, True):
        llm = LLM(model=path, enable_prefix_caching=caching, **{**ENGINE, **settings})
        count = TokenCount(llm)
        try:
            runs = []
            for _ in range(2):
                outs = llm.generate(TEXTS, PARAMS, use_tqdm=False)
                stats = llm.last_stats
                assert stats is not None
                runs.append((outputs_of(outs), [o.num_cached_tokens for o in outs], count.take(),
                             stats.prefix_cache_hits, stats.prefix_cache_queries, stats.num_preemptions,
                             count.sched.allocator.num_evictions))
            results[caching] = runs
        finally:
            llm.close()
    off, on = results[False], results[True]
    assert on[0][0] == off[0][0] and on[1][0] == off[0][0] and off[1][0] == off[0][0]
    assert off[0][1] == off[1][1] == [0] * len(TEXTS) and off[1][3] == off[1][4] == 0
    prompt_lens = [len(p[0]) for p in off[0][0]]
    second = on[1]
    assert second[3] > 0 and second[2] < off[1][2]  # hits, and fewer tokens computed than without the cache
    for i, cached in enumerate(second[1]):
        if i in WHOLE_PROMPT:
            assert cached == 0
        elif "num_gpu_blocks_override" not in settings:  # the whole prompt's full blocks stayed cached
            assert cached == cached_prefix_len(prompt_lens[i]), f"request {i}"
    if "num_gpu_blocks_override" in settings:
        assert off[0][5] > 0 and on[0][5] > 0 and on[1][6] > 0  # the small pool preempts and evicts
    else:  # no preemption: each request computes its tokens once, less what it found in the cache
        assert second[2] == off[1][2] - second[3]
        assert second[4] == sum(prompt_lens[i] * PARAMS[i].n for i in range(len(TEXTS)) if i not in WHOLE_PROMPT)


def test_reset_prefix_cache_and_repeats_within_one_call(tiny_chat_checkpoint: TinyCheckpoint) -> None:
    llm = LLM(model=str(tiny_chat_checkpoint.path), **ENGINE)
    count = TokenCount(llm)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        first = llm.generate(TEXTS[:2], params, use_tqdm=False)
        assert [o.num_cached_tokens for o in first] == [0, 0]
        count.take()
        again = llm.generate(TEXTS[:2], params, use_tqdm=False)
        assert [o.num_cached_tokens for o in again] == [cached_prefix_len(len(o.prompt_token_ids)) for o in first]
        assert outputs_of(again) == outputs_of(first)
        stats = llm.last_stats
        assert stats is not None and f"prefix cache: {stats.prefix_cache_hits}/" in stats.summary()
        assert llm.reset_prefix_cache() is True
        after = llm.generate(TEXTS[:2], params, use_tqdm=False)
        assert [o.num_cached_tokens for o in after] == [0, 0] and outputs_of(after) == outputs_of(first)
        stats = llm.last_stats
        assert stats is not None and stats.prefix_cache_hits == 0 and "prefix cache" not in stats.summary()
    finally:
        llm.close()


def test_caching_is_on_by_default_and_off_when_asked(tiny_chat_checkpoint: TinyCheckpoint) -> None:
    for caching in (True, False):
        kwargs: dict[str, Any] = {} if caching else dict(enable_prefix_caching=False)  # the default: on
        llm = LLM(model=str(tiny_chat_checkpoint.path), **ENGINE, **kwargs)
        try:
            client = llm.engine_client
            assert isinstance(client, InprocClient) and client.core.scheduler.enable_prefix_caching is caching
            params = SamplingParams(temperature=0.0, max_tokens=2)
            llm.generate([TEXTS[0]], params, use_tqdm=False)
            (o,) = llm.generate([TEXTS[0]], params, use_tqdm=False)
            assert o.num_cached_tokens == (cached_prefix_len(len(o.prompt_token_ids)) if caching else 0)
        finally:
            llm.close()


def test_dp2_rank_processes_cache_per_rank_and_reset_every_rank(tiny_chat_checkpoint: TinyCheckpoint) -> None:
    """Two DP ranks in processes of their own (the sync multi-process client): each rank has its cache; the
    counters come back with the ranks' stats; reset_prefix_cache asks every rank."""
    llm = LLM(model=str(tiny_chat_checkpoint.path), data_parallel_size=2, **ENGINE)
    try:
        first = llm.generate(TEXTS, PARAMS, use_tqdm=False)
        second = llm.generate(TEXTS, PARAMS, use_tqdm=False)
        stats = llm.last_stats
        assert stats is not None and stats.prefix_cache_hits > 0
        assert outputs_of(second) == outputs_of(first)
        assert any(o.num_cached_tokens for o in second)
        assert llm.reset_prefix_cache() is True
        third = llm.generate(TEXTS, PARAMS, use_tqdm=False)
        assert outputs_of(third) == outputs_of(first) and [o.num_cached_tokens for o in third] == [0] * len(TEXTS)
    finally:
        llm.close()


def test_deepseek_mla_cache_equal_with_caching_on_and_off(tmp_path: Path) -> None:
    prefix = [(7 * j + 3) % 509 for j in range(13)]
    prompts = [prefix + [(11 * i + j) % 509 for j in range(n)] for i, n in enumerate([3, 6, 1, 5])]
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=5, ignore_eos=True)] * 2
    results = {}
    for caching in (False, True):
        llm = LLM(model="tiny-deepseek-v3", cache_dir=str(tmp_path / "cache"), enable_prefix_caching=caching,
                  max_num_batched_tokens=16, **ENGINE)
        try:
            runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
            results[caching] = ([[c.token_ids for o in outs for c in o.outputs] for outs in runs],
                                [[o.num_cached_tokens for o in outs] for outs in runs])
        finally:
            llm.close()
    (off, _), (on, cached) = results[False], results[True]
    assert on[0] == off[0] and on[1] == off[0] and off[1] == off[0]
    assert cached[1] == [cached_prefix_len(len(p)) for p in prompts]


def test_server_engine_client_reports_cached_tokens_and_resets_every_rank() -> None:
    """The server's engine client over two rank processes: ``num_cached_tokens`` on the outputs, the per-rank
    counters in its stats, and ``await reset_prefix_cache()``: False while a request holds blocks, True after."""
    import asyncio

    from runner.config import make_config
    from runner.engine.async_llm import MPEngineClient
    from runner.sampling_params import RequestOutputKind

    prompt = [(5 * j + 1) % 500 for j in range(23)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def final(client: MPEngineClient, rid: str, p: SamplingParams = params) -> RequestOutput:
        last = None
        async for out in client.generate(rid, None, prompt, p):
            last = out
        assert last is not None and last.finished
        return last

    async def run() -> None:
        client = MPEngineClient(make_config(model="tiny-qwen3-moe", data_parallel_size=2, device="cpu",
                                            block_size=BLOCK, max_num_seqs=4, dist_timeout_s=30.0))
        await client.start()
        try:
            first = await asyncio.wait_for(final(client, "a"), 120)
            second = await asyncio.wait_for(final(client, "b"), 120)
            assert (first.num_cached_tokens, second.num_cached_tokens) == (0, cached_prefix_len(len(prompt)))
            assert second.outputs[0].token_ids == first.outputs[0].token_ids
            ranks = client.stats().ranks
            assert [r.prefix_cache_hits for r in ranks] == [cached_prefix_len(len(prompt)), 0]  # both on rank 0
            assert [r.prefix_cache_queries for r in ranks] == [2 * len(prompt), 0]
            stream = client.generate("long", None, prompt, SamplingParams(
                temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
            assert isinstance(stream, AsyncGenerator)  # leaving it (aclose) aborts the request
            await asyncio.wait_for(stream.__anext__(), 120)
            assert await client.reset_prefix_cache(timeout_s=60) is False  # rank 0's request holds blocks
            await stream.aclose()
            for _ in range(200):  # the abort frees the request's blocks at the rank's next step
                if await client.reset_prefix_cache(timeout_s=60):
                    break
                await asyncio.sleep(0.05)
            third = await asyncio.wait_for(final(client, "c"), 120)
            assert third.num_cached_tokens == 0 and third.outputs[0].token_ids == first.outputs[0].token_ids
        finally:
            await client.shutdown(10)

    asyncio.run(run())


def test_cli_bench_empties_the_cache_before_each_timed_run(tmp_path: Path) -> None:
    """``bench`` runs the same prompts after a warm-up and again per repeat: each run computes them alike."""
    from runner.config import make_config
    from runner.entrypoints.cli import Job, run_job

    cfg = make_config(model="tiny-qwen3-moe", cache_dir=str(tmp_path / "cache"), device="cpu", block_size=BLOCK,
                      max_num_seqs=4, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4)
    prompts = [[(3 * i + j) % 500 for j in range(10)] for i in range(2)]
    result = run_job(Job("bench", cfg, prompts, SamplingParams(max_tokens=3, ignore_eos=True), True, repeats=2))
    assert result is not None
    repeats = [r for run in result["runs"] for r in run["repeats"]]
    assert len(repeats) == 4
    assert [(r["prefix_cache_queries"], r["prefix_cache_hits"]) for r in repeats] == [(20, 0)] * 4
