"""One streamed completion request, timed as ``vllm bench serve`` times it: TTFT is the first content chunk's
arrival, every later chunk adds an inter-token gap, and the token counts are the server's own ``usage``. It is
sent with ``aiohttp`` and its stream read line by line, as vLLM's benchmark does: it costs the client less CPU per
streamed token than an ``httpx`` stream (docs/benchmarks.md), so the client is not what limits a fast server."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from runner.entrypoints.benchserve.workload import BenchRequest


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0  # the server's usage.completion_tokens
    chunks: int = 0  # content chunks received (one per token with this engine)
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    error: str = ""
    start_time: float = 0.0  # time.perf_counter() when it was sent
    text: str = ""  # the streamed text


def completion_body(model: str, req: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    """The streamed, greedy completion request for ``req``: ``max_tokens`` its output length, EOS ignored only
    when asked (vLLM's ``--ignore-eos``)."""
    return {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}


def request_timeout(timeout_s: float) -> aiohttp.ClientTimeout:
    """No limit on a whole stream, but ``timeout_s`` on getting a connection and on each wait for more bytes."""
    return aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)


async def send_completion(client: aiohttp.ClientSession, url: str, model: str, req: BenchRequest,
                          api_key: str | None = None, timeout_s: float = 600.0,
                          ignore_eos: bool = False) -> RequestResult:
    """POST ``req`` to ``url`` (``.../v1/completions``) with ``stream`` and ``include_usage``; never raises."""
    body = completion_body(model, req, ignore_eos)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = last = time.perf_counter()
    result = RequestResult(ok=False, start_time=start)
    try:
        async with client.post(url, json=body, headers=headers, timeout=request_timeout(timeout_s)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:300]}"
                return result
            async for raw in resp.content:  # one SSE line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                result.text += chunk["choices"][0].get("text") or ""
                if result.chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                result.chunks += 1
        result.latency_s = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "the stream ended without a usage chunk or any token"
    except TimeoutError as exc:  # aiohttp's connect and read timeouts, whose text may be empty
        result.error = f"{type(exc).__name__}: {exc or 'no answer'} (limit {timeout_s:g} s per wait)"
    except Exception as exc:  # noqa: BLE001 - one failed request is counted and named, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    return result
