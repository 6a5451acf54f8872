"""``python -m runner serve --api-server-count 2``: two API-server processes on one port in front of the same
ranks (real processes on loopback, the official ``openai`` client, the checkpoint of ``test_serve_e2e``).

What must hold (issue 36): greedy completions, chat and streams equal the offline ``LLM`` (DP=2 with EP and
DBO: both front ends' requests share the ranks' waves); requests land on both API servers and ``/metrics`` on
either counts the requests of both; a profile window's timelines go to the API server that stopped it; SIGTERM
drains both and exits 0 with no process left; a killed rank fails the requests in flight on every front end with
a 500 naming it, and the server exits non-zero.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

import test_serve_e2e as e2e
from proc_sockets import descendants
from runner import LLM
from runner.entrypoints.benchserve.server_proc import METRIC_LINE, ServerProcess
from test_faults import assert_nothing_left
from tiny_checkpoint import TinyCheckpoint

pytestmark = pytest.mark.slow
TWO = "--api-server-count 2"
READY = "with 2 API server processes"
API_SERVER_PIDS = re.compile(r"API server (\d+) pid (\d+)")


@contextlib.contextmanager
def two_front_ends(model: str, extra: str) -> Iterator[ServerProcess]:
    """A server with two API servers, returned once both serve (the parent logs it); always stopped."""
    srv = ServerProcess(model, f"{e2e.ENGINE} {TWO} {extra}", startup_timeout_s=300, name="two-api-servers")
    srv.start()
    try:
        deadline = time.monotonic() + 120
        while READY not in srv.log_tail(400) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert READY in srv.log_tail(400), srv.log_tail()
        assert sorted(int(i) for i, _ in API_SERVER_PIDS.findall(srv.log_tail(400))) == [0, 1]
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    profiles = tmp_path_factory.mktemp("profiles")
    with two_front_ends(str(tiny_chat_checkpoint.path), f"{e2e.DP2} --profile-dir {profiles}") as srv:
        yield srv
        code = srv.stop()
    assert code == 0, srv.log_tail()


@pytest.fixture(scope="module")
def offline(tiny_chat_checkpoint: TinyCheckpoint) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_chat_checkpoint.path), device="cpu", max_num_seqs=16)
    yield llm
    llm.close()


def metric_series(base_url: str, name: str) -> dict[str, float]:
    """Each label set of ``name`` -> its value, from one ``/metrics`` answer (a fresh connection)."""
    with httpx.Client(timeout=30) as h:
        text = h.get(f"{base_url}/metrics").text
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line.strip())
        if m and m.group(1) == name:
            found[m.group(2) or ""] = float(m.group(3))
    return found


def per_api_server(base_url: str) -> dict[str, float]:
    series = metric_series(base_url, "ubatch:api_server_requests_total")
    return {re.search(r'api_server="(\d+)"', labels).group(1): v for labels, v in series.items()}  # type: ignore[union-attr]


def test_completions_chat_and_streams_equal_offline(server: ServerProcess, offline: LLM,
                                                    tiny_chat_checkpoint: TinyCheckpoint) -> None:
    # test_serve_e2e's checks (token ids, texts, usage, streams joining, chat), against the two front ends
    e2e.test_completions_and_chat_equal_offline_and_streams_join({"dp2": server}, offline, tiny_chat_checkpoint,
                                                                 "dp2")


def test_requests_land_on_both_and_metrics_count_both(server: ServerProcess,
                                                      tiny_chat_checkpoint: TinyCheckpoint) -> None:
    model = str(tiny_chat_checkpoint.path)
    before_success = sum(metric_series(server.base_url, "ubatch:request_success_total").values())
    before = per_api_server(server.base_url)

    async def one(i: int) -> str:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as c:  # a connection of its own: either front end may take it
            out = await c.completions.create(model=model, prompt=e2e.PROMPTS[i % 3], max_tokens=8, temperature=0)
            return out.choices[0].text

    async def batch() -> list[str]:
        return await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(12)]), 120)

    sent, after = 0, before
    for _ in range(5):  # the kernel picks the front end of each connection: until both took some (bounded)
        texts = asyncio.run(batch())
        sent += len(texts)
        assert texts[0::3] == [texts[0]] * 4  # greedy: the same prompt gives the same text on either front end
        after = per_api_server(server.base_url)
        if all(after.get(k, 0.0) > before.get(k, 0.0) for k in ("0", "1")):
            break
    assert all(after.get(k, 0.0) > before.get(k, 0.0) for k in ("0", "1")), (before, after)
    assert sum(after.values()) - sum(before.values()) == sent
    # every answer of /metrics (from whichever front end takes the connection) counts the requests of both, and
    # the engine's figures (every rank reports to every API server; all at the end of a wave) agree: idle
    totals = {sum(metric_series(server.base_url, "ubatch:request_success_total").values()) for _ in range(8)}
    assert totals == {before_success + sent}
    engine = ("ubatch:num_requests_running", "ubatch:kv_cache_usage_perc", "ubatch:engine_steps_total")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        seen = {tuple(sum(metric_series(server.base_url, name).values()) for name in engine) for _ in range(8)}
        if len(seen) == 1 and next(iter(seen))[:2] == (0.0, 0.0):
            break
        time.sleep(0.5)
    assert len(seen) == 1 and next(iter(seen))[:2] == (0.0, 0.0) and next(iter(seen))[2] > 0, seen


def test_a_profile_window_comes_back_to_the_api_server_that_stopped_it(server: ServerProcess,
                                                                       tiny_chat_checkpoint: TinyCheckpoint) -> None:
    # one connection, so one API server; the ranks must send their timelines to that one's client
    with httpx.Client(base_url=server.base_url, timeout=120) as h:
        assert h.post("/start_profile").status_code == 200
        done = h.post("/v1/completions", json={"model": str(tiny_chat_checkpoint.path), "prompt": e2e.PROMPTS[0],
                                               "max_tokens": 8, "temperature": 0})
        assert done.status_code == 200
        stop = h.post("/stop_profile")
    assert stop.status_code == 200, stop.text
    body = stop.json()
    assert body["path"] is not None and os.path.isfile(body["path"]) and len(body["ranks"]) == 2, body


def test_sigterm_drains_both_and_exits_0_with_no_process_left(tiny_chat_checkpoint: TinyCheckpoint) -> None:
    model = str(tiny_chat_checkpoint.path)
    # 10 ms a step on the emulated device: 480 tokens outlast the 3 s drain, so the server is still draining (not
    # gone) when the refused requests below arrive, however fast the host is
    with two_front_ends(model, "--shutdown-timeout 3 --emulate-device step_us=10000") as srv:
        assert srv.proc is not None
        children = descendants(srv.proc.pid)  # the rank and both API servers
        assert len(children) >= 3
        results: list[str] = []
        streaming: list[int] = []

        async def one(i: int) -> None:
            async with (
                httpx.AsyncClient(timeout=120) as h,
                h.stream("POST", f"{srv.base_url}/v1/completions", json={
                        "model": model, "prompt": e2e.PROMPTS[i % 3], "max_tokens": 480, "temperature": 0,
                        "ignore_eos": True, "stream": True}) as resp,
            ):
                last = ""
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        if not last:
                            streaming.append(i)
                        last = line
                results.append(last)

        async def run() -> list[int]:
            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            deadline = time.monotonic() + 60
            while len(streaming) < 8 and time.monotonic() < deadline:  # every stream has its first tokens
                await asyncio.sleep(0.02)
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            refused = []
            for _ in range(4):  # new connections, to either front end: both refuse new work while draining
                async with httpx.AsyncClient(timeout=30) as h:
                    refused.append((await h.post(f"{srv.base_url}/v1/completions",
                                                 json={"model": model, "prompt": "hi"})).status_code)
            await asyncio.gather(*tasks)
            await asyncio.to_thread(srv.proc.wait, 60)
            return refused

        refused = asyncio.run(run())
        assert refused == [503] * 4
        assert srv.proc.returncode == 0, srv.log_tail()
        assert len(results) == 8 and all('"finish_reason":"abort"' in r or '"finish_reason":"length"' in r
                                         for r in results)
        assert_nothing_left(children, "after the server exited")


def test_a_killed_rank_fails_requests_on_both_front_ends_with_500_naming_it(tiny_chat_checkpoint: TinyCheckpoint
                                                                           ) -> None:
    model = str(tiny_chat_checkpoint.path)
    with two_front_ends(model, "--dist-timeout-s 10") as srv:
        assert srv.proc is not None
        children = descendants(srv.proc.pid)
        rank0 = e2e.rank_pids(srv)[0]
        streams = []
        for i in range(6):  # each on a connection of its own
            c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
            stream = c.completions.create(model=model, prompt=e2e.PROMPTS[i % 3], max_tokens=480, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))
            streams.append(stream)
        os.kill(rank0, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(openai.APIError, match="rank 0 exited with signal SIGKILL"):
                for _ in stream:
                    pass
        srv.proc.wait(30)
        assert srv.proc.returncode not in (0, None)
        log = srv.log_tail(200)
        assert "error: rank 0 exited with signal SIGKILL" in log
        # each API server failed its own requests in flight, naming the rank
        failed = [int(n) for n in re.findall(r"The engine is dead \(rank 0 exited with signal SIGKILL[^)]*\): "
                                             r"failing (\d+) running request", log)]
        assert len(failed) == 2 and sum(failed) == len(streams), failed
        assert_nothing_left(children, "after the server exited")



def test_a_killed_api_server_takes_the_server_down_naming_it(tiny_chat_checkpoint: TinyCheckpoint) -> None:
    model = str(tiny_chat_checkpoint.path)
    with two_front_ends(model, "") as srv:
        assert srv.proc is not None
        children = descendants(srv.proc.pid)
        pids = {int(i): int(p) for i, p in API_SERVER_PIDS.findall(srv.log_tail(400))}
        os.kill(pids[1], signal.SIGKILL)
        srv.proc.wait(60)
        assert srv.proc.returncode == 1
        assert f"error: API server 1 (pid {pids[1]}) exited with signal SIGKILL" in srv.log_tail(50)
        assert_nothing_left(children, "after the server exited")
