"""``python -m runner serve`` end to end: real server processes on loopback, real engine-core rank processes,
the official ``openai`` client and plain HTTP, a transformers-written checkpoint with a tokenizer and a chat
template (``tests/tiny_checkpoint.py``).

What must hold (issue 26): greedy completions and chat equal the offline ``LLM`` token for token, DP=1 and DP=2
with EP and DBO, and so do completions with random sampling settings; streamed chunks join to the non-streamed
response and ``usage`` counts are right; 64 concurrent streams (mixed lengths, ``n=2``, seeded sampling) give what
each gives alone; clients that disconnect leave the others alone and the server returns to idle (no request
running, KV cache empty); errors never reach a rank; an idle server uses almost no CPU; SIGTERM under load exits 0
within the shutdown timeout with no process left; a killed rank fails the requests in flight with a 500 naming it
and the server exits non-zero within ``--dist-timeout-s`` + 10 s.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam

from openai_extra import extra_fields
from proc_sockets import cpu_seconds, descendants
from runner import LLM, SamplingParams
from runner.entrypoints.benchserve.server_proc import ServerProcess, scrape
from server_set import started_servers
from tiny_checkpoint import TinyCheckpoint

pytestmark = pytest.mark.slow
ENGINE = "--device cpu --max-num-seqs 16 --dist-timeout-s 30 --dbo-decode-token-threshold 2 " \
         "--dbo-prefill-token-threshold 4 --dbo-cost-model off"
DP2 = "-dp 2 --enable-expert-parallel --enable-dbo"
PROMPTS = ["The quick brown fox", "Hello world! How are", "Caf\u00e9 cr\u00e8me and"]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello! How are you today?"}]
RANK_PIDS = re.compile(r"rank (\d+) pid (\d+)")


def rank_pids(server: ServerProcess) -> dict[int, int]:
    return {int(r): int(p) for r, p in RANK_PIDS.findall(server.log_tail(200))}


@pytest.fixture(scope="module")
def servers(tiny_chat_checkpoint: TinyCheckpoint) -> Iterator[dict[str, ServerProcess]]:
    with started_servers(str(tiny_chat_checkpoint.path), ENGINE, (("dp1", ""), ("dp2", DP2))) as started:
        yield started


@pytest.fixture(scope="module")
def offline(tiny_chat_checkpoint: TinyCheckpoint) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_chat_checkpoint.path), device="cpu", max_num_seqs=16)
    yield llm
    llm.close()


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("dp", ["dp1", "dp2"])
def test_completions_and_chat_equal_offline_and_streams_join(servers: dict[str, ServerProcess], offline: LLM,
                                                             tiny_chat_checkpoint: TinyCheckpoint,
                                                             dp: str) -> None:
    srv, c, model = servers[dp], client(servers[dp]), str(tiny_chat_checkpoint.path)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    want = offline.generate(PROMPTS, greedy, use_tqdm=False)
    extra = {"return_token_ids": True}
    full = c.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0, extra_body=extra)
    got = [extra_fields(ch)["token_ids"] for ch in sorted(full.choices, key=lambda ch: ch.index)]
    assert got == [list(o.outputs[0].token_ids) for o in want]
    assert [ch.text for ch in sorted(full.choices, key=lambda ch: ch.index)] == [o.outputs[0].text for o in want]
    assert full.usage is not None
    assert full.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    assert full.usage.completion_tokens == sum(len(t) for t in got)
    # streamed: the chunks of each choice join to the full response, and the usage chunk counts the same
    texts: list[str] = ["", "", ""]
    ids: list[list[int]] = [[], [], []]
    usage: CompletionUsage | None = None
    for chunk in c.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body=extra):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            ids[ch.index] += extra_fields(ch).get("token_ids") or []
    assert ids == got and texts == [ch.text for ch in sorted(full.choices, key=lambda ch: ch.index)]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    # chat: the checkpoint's template, the same tokens as LLM.chat
    want_chat = offline.chat(MESSAGES, greedy, use_tqdm=False)[0]
    chat = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                     extra_body=extra)
    assert extra_fields(chat.choices[0])["token_ids"] == list(want_chat.outputs[0].token_ids)
    assert chat.choices[0].message.content == want_chat.outputs[0].text
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(want_chat.prompt_token_ids)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0, stream=True) if ch.choices)
    assert streamed == chat.choices[0].message.content
    if dp == "dp2":
        steps = scrape(srv.base_url, ("ubatch:dbo_ubatched_steps_total",))
        assert steps["ubatch:dbo_ubatched_steps_total"] > 0  # DBO really ran in the server's steps


def _random_completion(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any], SamplingParams]:
    """A completion request with random settings (OpenAI's fields, and vLLM's extra ones), every sampling setting
    given (the server fills what a request leaves out from the checkpoint's generation_config, as vLLM does), and
    the offline SamplingParams with the same settings."""
    body: dict[str, Any] = {"prompt": rng.choice(PROMPTS) + " " * rng.randint(0, 2), "max_tokens": rng.randint(1, 16),
                            "seed": rng.randrange(100), "temperature": rng.choice([0.0, 0.7, 1.2]), "top_p": 1.0}
    extra: dict[str, Any] = {"return_token_ids": True, "top_k": 0}
    drawing = body["temperature"] > 0
    choices: list[tuple[dict[str, Any], bool, str, list[Any]]] = [
        (body, drawing, "top_p", [0.5, 0.9]), (body, drawing, "n", [2]), (body, True, "presence_penalty", [0.5, -0.5]),
        (body, True, "frequency_penalty", [0.5, 1.0]), (body, True, "stop", [["e"], ["o"], [" the"]]),
        (body, True, "logprobs", [0, 2]), (extra, drawing, "top_k", [1, 5, 50]), (extra, drawing, "min_p", [0.1]),
        (extra, True, "repetition_penalty", [1.3]), (extra, True, "ignore_eos", [True]),
        (extra, True, "min_tokens", [min(3, body["max_tokens"])])]
    for fields, on, field, values in choices:
        if on and rng.random() < 0.3:
            fields[field] = rng.choice(values)
    params = SamplingParams(
        temperature=body["temperature"], top_p=body["top_p"], top_k=extra["top_k"], min_p=extra.get("min_p", 0.0),
        seed=body["seed"], max_tokens=body["max_tokens"], presence_penalty=body.get("presence_penalty", 0.0),
        frequency_penalty=body.get("frequency_penalty", 0.0), repetition_penalty=extra.get("repetition_penalty", 1.0),
        stop=body.get("stop"), logprobs=body.get("logprobs"), n=body.get("n", 1),
        ignore_eos=extra.get("ignore_eos", False), min_tokens=extra.get("min_tokens", 0))
    return body, extra, params


@pytest.mark.parametrize("dp", ["dp1", "dp2"])
def test_random_completion_settings_equal_offline(servers: dict[str, ServerProcess], offline: LLM,
                                                  tiny_chat_checkpoint: TinyCheckpoint, dp: str) -> None:
    """40 completion requests, each with random settings (temperature, top-k/top-p/min-p, the three penalties,
    stop strings, logprobs, ``n``, ``ignore_eos``, ``min_tokens``, a seed), streamed or not: each choice's token
    ids, text and finish reason equal ``LLM.generate``'s with the same settings."""
    c, model, rng = client(servers[dp]), str(tiny_chat_checkpoint.path), random.Random(17)
    for i in range(40):
        body, extra, params = _random_completion(rng)
        want = sorted((o.index, list(o.token_ids), o.text, o.finish_reason)
                      for o in offline.generate([body["prompt"]], params, use_tqdm=False)[0].outputs)
        if i % 2:
            joined: dict[int, tuple[list[int], str, str | None]] = {}
            for chunk in c.completions.create(model=model, stream=True, extra_body=extra, **body):
                for ch in chunk.choices:
                    ids, text, finish = joined.get(ch.index, ([], "", None))
                    joined[ch.index] = (ids + (extra_fields(ch).get("token_ids") or []), text + ch.text,
                                        ch.finish_reason or finish)
            got = sorted((index, *choice) for index, choice in joined.items())
        else:
            full = c.completions.create(model=model, extra_body=extra, **body)
            got = sorted((ch.index, extra_fields(ch)["token_ids"], ch.text, ch.finish_reason) for ch in full.choices)
        assert got == want, (body, extra)


def _mixed_requests(n: int = 64) -> list[dict[str, Any]]:
    rng = random.Random(3)
    reqs = []
    for i in range(n):
        body: dict[str, Any] = {"prompt": rng.choice(PROMPTS) + " " * rng.randint(0, 3),
                                "max_tokens": rng.randint(1, 24), "ignore_eos": True}
        kind = i % 4
        if kind == 0:
            body.update(n=2, temperature=1.0, seed=1000 + i)
        elif kind == 1:
            body.update(temperature=0.9, top_p=0.9, seed=i)
        else:
            body.update(temperature=0.0)
        reqs.append(body)
    return reqs


async def _stream_tokens(c: openai.AsyncOpenAI, model: str, body: dict[str, Any]) -> list[list[int]]:
    body = dict(body)
    prompt, max_tokens = body.pop("prompt"), body.pop("max_tokens")
    fields = {k: body.pop(k) for k in ("n", "temperature", "top_p", "seed") if k in body}
    out: list[list[int]] = [[] for _ in range(fields.get("n", 1))]
    stream = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                        extra_body={**body, "return_token_ids": True}, **fields)
    async for chunk in stream:
        for ch in chunk.choices:
            out[ch.index] += extra_fields(ch).get("token_ids") or []
    return out


def test_64_concurrent_streams_equal_one_at_a_time(servers: dict[str, ServerProcess],
                                                   tiny_chat_checkpoint: TinyCheckpoint) -> None:
    srv, model = servers["dp2"], str(tiny_chat_checkpoint.path)
    reqs = _mixed_requests()

    async def run() -> tuple[list[Any], list[Any]]:
        async with openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as c:
            together = await asyncio.gather(*[_stream_tokens(c, model, r) for r in reqs])
            alone = [await _stream_tokens(c, model, r) for r in reqs]
        return together, alone

    together, alone = asyncio.run(run())
    assert together == alone
    assert [len(t) for sample in together for t in sample] == \
        [r["max_tokens"] for r in reqs for _ in range(r.get("n", 1))]  # ignore_eos: every sample ran to the end
    assert any(a != b for (a, b) in (s for s in together if len(s) == 2) if len(a) > 2)  # n=2: different samples


def test_disconnects_leave_the_others_alone_and_the_server_idle(servers: dict[str, ServerProcess],
                                                                tiny_chat_checkpoint: TinyCheckpoint
                                                                ) -> None:
    srv, model = servers["dp2"], str(tiny_chat_checkpoint.path)
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def stream(i: int, drop_after: int | None) -> int:
        chunks = 0
        async with (
            httpx.AsyncClient(timeout=120) as h,
            h.stream("POST", f"{srv.base_url}/v1/completions",
                     json={**body, "max_tokens": 400 if drop_after else 40}) as resp,
        ):
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if drop_after is not None and chunks >= drop_after:
                        return chunks  # leaving the block closes the connection mid-stream
        return chunks

    async def run() -> list[int]:
        return await asyncio.gather(*[stream(i, 3 if i % 2 else None) for i in range(8)])

    chunks = asyncio.run(run())
    assert [c for i, c in enumerate(chunks) if i % 2 == 0] == [40] * 4  # the others finished whole
    names = ("ubatch:num_requests_running", "ubatch:kv_cache_usage_perc", "ubatch:num_requests_waiting")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = scrape(srv.base_url, names)
        if all(m.get(n, 0.0) == 0.0 for n in names):
            break
        time.sleep(0.2)
    assert all(m.get(n, 0.0) == 0.0 for n in names), m


def test_bad_requests_reach_no_rank_and_an_idle_server_uses_no_cpu(servers: dict[str, ServerProcess],
                                                                    tiny_chat_checkpoint: TinyCheckpoint
                                                                    ) -> None:
    srv, model = servers["dp2"], str(tiny_chat_checkpoint.path)
    time.sleep(1.0)  # let a wave still ending finish
    before = scrape(srv.base_url, ("ubatch:engine_steps_total",))
    url = f"{srv.base_url}/v1/completions"
    cases = [
        (httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"}), 400, None),
        (httpx.post(url, json={"model": model, "prompt": "hi", "temperature": -1.0}), 400, "temperature"),
        (httpx.post(url, json={"model": "nope", "prompt": "hi"}), 404, "model"),
        (httpx.post(url, json={"model": model, "prompt": "hi", "max_tokens": 100000}), 400, "max_tokens"),
        (httpx.post(url, json={"model": model, "prompt": [[1, 10 ** 6]]}), 400, "prompt"),
    ]
    for resp, status, param in cases:
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert err["code"] == status and err["message"]
        if param is not None:
            assert err["param"] is not None and param in err["param"], err
    after = scrape(srv.base_url, ("ubatch:engine_steps_total",))
    assert after == before  # no step ran for any of them
    assert srv.proc is not None  # started by the fixture
    pids = [srv.proc.pid, *descendants(srv.proc.pid)]
    used = cpu_seconds(pids)
    time.sleep(5.0)
    assert cpu_seconds(pids) - used < 0.5  # heartbeats and the HTTP loop only


@contextlib.contextmanager
def dp2_server(model: str, extra: str) -> Iterator[tuple[ServerProcess, dict[int, int]]]:
    """A DP=2 server of its own (a test that stops or breaks it), with its ranks' pids from its log."""
    srv = ServerProcess(model, f"{ENGINE} {DP2} {extra}", startup_timeout_s=300, name="dp2-own")
    srv.start()
    try:
        ranks = rank_pids(srv)
        assert sorted(ranks) == [0, 1]
        yield srv, ranks
    finally:
        srv.stop()


def test_sigterm_under_load_drains_and_exits_0(tiny_chat_checkpoint: TinyCheckpoint) -> None:
    model = str(tiny_chat_checkpoint.path)
    with dp2_server(model, "--shutdown-timeout 3") as (srv, ranks):
        proc = srv.proc
        assert proc is not None  # started by dp2_server
        results: list[str] = []

        async def one(i: int) -> None:
            async with (
                httpx.AsyncClient(timeout=120) as h,
                h.stream("POST", f"{srv.base_url}/v1/completions", json={
                        "model": model, "prompt": PROMPTS[i % 3], "max_tokens": 480, "temperature": 0,
                        "ignore_eos": True, "stream": True}) as resp,
            ):
                last = ""
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        last = line
                results.append(last)

        async def run() -> tuple[int, float]:
            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            await asyncio.sleep(2.0)
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(timeout=30) as h:
                refused = (await h.post(f"{srv.base_url}/v1/completions",
                                        json={"model": model, "prompt": "hi"})).status_code
            await asyncio.gather(*tasks)
            await asyncio.to_thread(proc.wait, 60)
            return refused, time.monotonic() - t0

        refused, seconds = asyncio.run(run())
        assert refused == 503
        assert proc.returncode == 0
        assert seconds < 3 + 15  # the shutdown timeout, plus stopping the ranks
        assert len(results) == 8 and all('"finish_reason":"abort"' in r or '"finish_reason":"length"' in r
                                         for r in results)
        assert all(not os.path.exists(f"/proc/{pid}") for pid in ranks.values())


def test_a_killed_rank_fails_requests_with_500_naming_it(tiny_chat_checkpoint: TinyCheckpoint) -> None:
    model = str(tiny_chat_checkpoint.path)
    with dp2_server(model, "--dist-timeout-s 10") as (srv, ranks):
        proc = srv.proc
        assert proc is not None  # started by dp2_server
        c = client(srv)
        stream = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=480, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match="rank 1 exited with signal SIGKILL"):
            for _ in stream:
                pass
        try:  # until it has exited, the server refuses new work
            resp = httpx.post(f"{srv.base_url}/v1/completions", json={"model": model, "prompt": "hi"}, timeout=30)
            assert resp.status_code in (500, 503), resp.text
        except httpx.TransportError:
            pass  # it already exited, as it must
        proc.wait(10 + 10)
        assert proc.returncode not in (0, None) and time.monotonic() - t0 < 10 + 10
        assert "rank 1 exited with signal SIGKILL" in srv.log_tail(50)
        assert all(not os.path.exists(f"/proc/{pid}") for pid in ranks.values())

