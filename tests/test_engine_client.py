"""The server's engine client over real engine-core processes (one per DP rank, ZeroMQ between them).

What must hold: tokens equal the offline ``LLM`` on the same prompts (DP=1, and DP=2 with EP and DBO), with
requests arriving while others run and in bursts separated by idle gaps (several waves); an aborted request's
KV blocks come back; a killed rank fails the requests in flight with an error naming it; an idle engine's
processes use (almost) no CPU.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from proc_sockets import cpu_seconds
from runner import LLM
from runner.config import make_config
from runner.engine.async_llm import MPEngineClient
from runner.engine.protocol import EngineDeadError, RequestError
from runner.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow
TIMEOUT_S = 120


def engine_config(dp: int, **kw: Any) -> Any:
    return make_config(model="tiny-qwen3-moe", data_parallel_size=dp, enable_expert_parallel=dp > 1,
                       enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4,
                       dbo_cost_model="off", device="cpu", max_num_seqs=8, dist_timeout_s=30.0, **kw)


def workload(n: int = 24, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams], list[float]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(2, 20))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 10), ignore_eos=True) if i % 3 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randint(1, 10), ignore_eos=True)
              for i in range(n)]
    # three bursts 0.8 s apart (the engine goes idle between them: new waves), staggered inside each burst
    delays = [(i * 3 // n) * 0.8 + rng.random() * 0.2 for i in range(n)]
    return prompts, params, delays


def offline(prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    llm = LLM(model="tiny-qwen3-moe", device="cpu", max_num_seqs=8)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()


async def collect(client: MPEngineClient, rid: str, prompt: list[int], params: SamplingParams,
                  delay: float = 0.0) -> list[int]:
    await asyncio.sleep(delay)
    tokens: list[int] = []
    async for out in client.generate(rid, None, prompt, params):
        tokens += out.outputs[0].token_ids
    return tokens


@pytest.mark.parametrize("dp", [1, 2], ids=["dp1", "dp2-ep-dbo"])
def test_streamed_tokens_equal_offline_over_waves_and_idle_uses_no_cpu(dp: int) -> None:
    prompts, params, delays = workload()
    delta = [SamplingParams(**{**p.__dict__, "output_kind": RequestOutputKind.DELTA}) for p in params]

    async def run() -> tuple[list[list[int]], float, Any]:
        client = MPEngineClient(engine_config(dp))
        await client.start()
        try:
            got = await asyncio.wait_for(asyncio.gather(
                *[collect(client, f"r{i}", p, sp, d)
                  for i, (p, sp, d) in enumerate(zip(prompts, delta, delays, strict=True))]),
                TIMEOUT_S)
            await asyncio.sleep(1.5)  # let the last wave end everywhere
            pids = client.pids
            before = cpu_seconds(pids)
            await asyncio.sleep(3.0)
            idle_cpu = cpu_seconds(pids) - before
            return got, idle_cpu, client.stats()
        finally:
            await client.shutdown(10)

    got, idle_cpu, stats = asyncio.run(run())
    assert got == offline(prompts, params)
    assert stats.num_ubatched_steps > 0  # DBO really ran in the server's steps
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert idle_cpu < 0.3 * dp  # heartbeats only: a busy loop would burn ~3 s per rank


def test_abort_frees_kv_and_bad_requests_are_refused_before_any_rank() -> None:
    async def run() -> None:
        client = MPEngineClient(engine_config(1))
        await client.start()
        try:
            with pytest.raises(RequestError, match=r"token id 9999 at position \d+ is outside the vocabulary"):
                async for _ in client.generate("bad", None, [1, 9999], SamplingParams(max_tokens=2)):
                    pass
            with pytest.raises(RequestError, match=r"max_tokens \(5000\).*exceeds max_model_len") as e:
                async for _ in client.generate("long", None, [1, 2], SamplingParams(max_tokens=5000)):
                    pass
            assert e.value.field == "max_tokens"
            stream = client.generate("a", None, [1, 2, 3], SamplingParams(
                temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
            await stream.__anext__()
            await stream.__anext__()
            assert client.stats().kv_cache_usage > 0 or client.stats().num_running >= 0
            assert isinstance(stream, AsyncGenerator)
            await stream.aclose()  # the client went away: the request is aborted at the next step
            for _ in range(200):
                s = client.stats()
                if s.num_running == 0 and s.kv_cache_usage == 0.0 and client._ranks[0].outstanding == 0:
                    break
                await asyncio.sleep(0.05)
            s = client.stats()
            assert (s.num_running, s.kv_cache_usage, client._ranks[0].outstanding) == (0, 0.0, 0)
            assert client.num_unfinished_requests == 0
        finally:
            await client.shutdown(10)

    asyncio.run(run())


def test_a_killed_rank_fails_requests_in_flight_naming_it() -> None:
    async def run() -> tuple[str, float]:
        client = MPEngineClient(engine_config(2))
        await client.start()
        try:
            stream = client.generate("a", None, [1, 2, 3], SamplingParams(
                temperature=0.0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
            await stream.__anext__()
            os.kill(client.pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError) as e:
                async for _ in stream:
                    pass
            return str(e.value), time.monotonic() - t0
        finally:
            await client.close()

    message, seconds = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert "rank 1 exited with signal SIGKILL" in message
    assert seconds < 10


def test_rank_threads_follow_omp_num_threads_else_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.engine.mp_client import rank_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert rank_threads(1) == 3 and rank_threads(2) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert rank_threads(1) == 8 and rank_threads(2) == 4 and rank_threads(16) == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(ValueError, match=f"OMP_NUM_THREADS='{bad}'"):
            rank_threads(1)
