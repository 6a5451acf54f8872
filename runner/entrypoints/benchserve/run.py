"""One benchmark run against one server: send the workload on its schedule, time every request, and read the
server's step counters (and, optionally, a profile window of a few seconds) around it. The requests share one
``aiohttp`` session (vLLM's benchmark client), its connections kept alive between requests."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx

from runner.entrypoints.benchserve.http_client import RequestResult, request_timeout, send_completion
from runner.entrypoints.benchserve.metrics import BenchmarkMetrics, compute_metrics
from runner.entrypoints.benchserve.server_proc import scrape
from runner.entrypoints.benchserve.workload import BenchRequest

STEP_METRICS = ("ubatch:engine_steps_total", "ubatch:dbo_ubatched_steps_total")
TOKEN_METRICS = ("ubatch:prompt_tokens_total", "ubatch:generation_tokens_total")
PREFIX_CACHE_METRICS = ("ubatch:prefix_cache_queries_total", "ubatch:prefix_cache_hits_total")
COUNTERS = STEP_METRICS + TOKEN_METRICS + PREFIX_CACHE_METRICS


@dataclass
class ProfileWindow:
    """Record the server's timeline from ``delay_s`` after the first request for ``duration_s``."""

    delay_s: float
    duration_s: float


@dataclass
class RunResult:
    metrics: BenchmarkMetrics
    results: list[RequestResult]
    profile: dict[str, Any] | None = None  # the server's /stop_profile answer, with the steps it covered
    duration_s: float = 0.0


async def _profile(client: aiohttp.ClientSession, base_url: str, window: ProfileWindow,
                   headers: dict[str, str]) -> dict[str, Any] | None:
    await asyncio.sleep(window.delay_s)
    before = await asyncio.to_thread(scrape, base_url, STEP_METRICS)
    async with client.post(f"{base_url}/start_profile", headers=headers, timeout=request_timeout(60)) as resp:
        resp.raise_for_status()
    await asyncio.sleep(window.duration_s)
    async with client.post(f"{base_url}/stop_profile", headers=headers, timeout=request_timeout(120)) as resp:
        resp.raise_for_status()
        answer = await resp.json()
    after = await asyncio.to_thread(scrape, base_url, STEP_METRICS)
    answer["steps"] = after.get(STEP_METRICS[0], 0.0) - before.get(STEP_METRICS[0], 0.0)
    return answer


async def run_once(base_url: str, model: str, requests: Sequence[BenchRequest], offsets: Sequence[float], *,
                   max_concurrency: int | None = None, api_key: str | None = None,
                   profile: ProfileWindow | None = None, ignore_eos: bool = False) -> RunResult:
    """Send ``requests[i]`` at ``offsets[i]`` seconds (at most ``max_concurrency`` in flight)."""
    url = f"{base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    before = await asyncio.to_thread(scrape, base_url, COUNTERS)
    connector = aiohttp.TCPConnector(limit=max_concurrency or len(requests) or 1)
    async with aiohttp.ClientSession(connector=connector, trust_env=True) as client:  # proxies as httpx read them
        start, cpu_start = time.perf_counter(), time.process_time()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                return await send_completion(client, url, model, req, api_key, ignore_eos=ignore_eos)
            async with limit:
                return await send_completion(client, url, model, req, api_key, ignore_eos=ignore_eos)

        profiler = asyncio.create_task(_profile(client, base_url, profile, headers)) if profile else None
        results = list(await asyncio.gather(*[one(r, t) for r, t in zip(requests, offsets, strict=True)]))
        duration = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        profiled = await profiler if profiler is not None else None
    after = await asyncio.to_thread(scrape, base_url, COUNTERS)
    metrics = compute_metrics(results, duration)
    metrics.client_cpu_share = cpu / duration if duration > 0 else None
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS}
    metrics.engine_steps, metrics.ubatched_steps = delta[STEP_METRICS[0]], delta[STEP_METRICS[1]]
    metrics.server_prompt_tokens, metrics.server_generation_tokens = delta[TOKEN_METRICS[0]], delta[TOKEN_METRICS[1]]
    metrics.prefix_cache_queries, metrics.prefix_cache_hits = (delta[PREFIX_CACHE_METRICS[0]],
                                                               delta[PREFIX_CACHE_METRICS[1]])
    return RunResult(metrics, results, profiled, duration)


def reset_prefix_cache(base_url: str, api_key: str | None = None, timeout_s: float = 60.0) -> None:
    """``POST /reset_prefix_cache``: the server's next requests find nothing cached. Raises with the server's
    answer when it refuses (requests still hold cached blocks)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.post(f"{base_url}/reset_prefix_cache", headers=headers, timeout=timeout_s)
    if resp.status_code != 200:
        raise RuntimeError(f"POST {base_url}/reset_prefix_cache answered {resp.status_code}: {resp.text[:300]}")
