"""Requests that end early: a client that disconnects (streamed or waiting for a full response) ends its engine
request; the drain after a stop signal (503 for new requests, running ones finish or end with "abort"); an engine
that dies (500 naming the rank, the server stops with status 1). In one process, with the server in a thread;
``test_openai_signals.py`` sends real signals to a server process."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from fake_engine_client import FakeEngineClient, expected_text, make_tokenizer
from openai_harness import MODEL, ServerThread, sse_events

# 200 steps of token_delay_s: far past any wait here
LONG: completion_create_params.CompletionCreateParamsBase = {"model": MODEL, "prompt": "long", "max_tokens": 200}
CHAT: chat_create_params.CompletionCreateParamsBase = {
    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}


def wait_until(cond: Callable[[], object], what: str, timeout_s: float = 20.0) -> None:
    """Poll until ``cond()`` is truthy; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


class Background:
    """An HTTP call on a thread of its own; ``result()`` waits for it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as exc:  # noqa: BLE001
                self.error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout_s: float = 30.0) -> Any:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the request did not end within {timeout_s} s"
        if self.error is not None:
            raise self.error
        return self.value


@pytest.mark.parametrize("path, body", [("/v1/completions", LONG), ("/v1/chat/completions", CHAT)])
def test_disconnect_mid_stream_aborts_the_engine_request(path: str, body: dict) -> None:
    engine = FakeEngineClient(token_delay_s=0.02)
    with ServerThread(engine) as srv:
        with (
            httpx.Client(base_url=srv.url, timeout=30) as http,
            http.stream("POST", path, json={**body, "stream": True}) as response,
        ):
            lines = response.iter_lines()
            got = [line for _, line in zip(range(6), lines, strict=False)]  # the first 6 lines
            assert any(line.startswith("data: ") for line in got)
        # the client closed the connection: the server must end the engine request, not run it to 200 tokens;
        # the handler leaves the in-flight count after the abort, when its task next runs
        lifecycle = srv.app.state.lifecycle
        wait_until(lambda: engine.aborted and not engine.running and lifecycle.num_in_flight == 0,
                   "the engine request to be aborted and its handler to end")
        assert engine.aborted == [engine.submitted[0][0]] and engine.finished == []
        # the server still serves
        assert srv.client().completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text


def test_disconnect_while_waiting_for_a_full_response_aborts() -> None:
    engine = FakeEngineClient(token_delay_s=0.02)
    with ServerThread(engine) as srv:
        # a client that gives up: its read times out and it closes the connection
        with (
            pytest.raises(httpx.ReadTimeout),
            httpx.Client(base_url=srv.url, timeout=httpx.Timeout(30, read=0.5)) as http,
        ):
            http.post("/v1/completions", json=LONG)
        wait_until(lambda: engine.aborted and not engine.running, "the engine request to be aborted")
        assert engine.aborted == [engine.submitted[0][0]] and engine.finished == []


def test_drain_refuses_new_requests_and_lets_running_ones_finish() -> None:
    engine = FakeEngineClient(token_delay_s=0.02)
    with ServerThread(engine, shutdown_timeout_s=60) as srv:
        prompt_ids = make_tokenizer()("long")["input_ids"]
        # 100 tokens at 20 ms: the requests outlive the checks below by seconds
        streamed: completion_create_params.CompletionCreateParamsStreaming = {**LONG, "max_tokens": 100, "stream": True}
        chat: chat_create_params.CompletionCreateParamsNonStreaming = {**CHAT, "max_tokens": 100}
        stream = Background(lambda: list(srv.client().completions.create(**streamed)))
        full = Background(lambda: srv.client().chat.completions.create(**chat))
        wait_until(lambda: len(engine.running) == 2, "both requests to run")
        srv.call_soon(srv.app.state.lifecycle.begin_drain, "SIGTERM")
        wait_until(lambda: srv.app.state.lifecycle.draining, "the drain to start")
        with srv.http() as http:
            for method, path, body in (("POST", "/v1/completions", LONG), ("POST", "/v1/chat/completions", CHAT),
                                       ("GET", "/v1/models", None)):
                r = http.request(method, path, json=body)
                assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
            assert http.get("/health").status_code == 503
            assert http.get("/metrics").status_code == 200
        chunks = stream.result()
        assert "".join(c.choices[0].text for c in chunks) == expected_text(prompt_ids, 0, None, 100)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert full.result().choices[0].finish_reason == "length"
        assert srv.wait_stopped() == 0
    assert engine.aborted == [] and len(engine.finished) == 2 and len(engine.submitted) == 2


def test_shutdown_timeout_aborts_what_is_still_running() -> None:
    engine = FakeEngineClient(token_delay_s=0.02)
    with ServerThread(engine, shutdown_timeout_s=0.3) as srv, srv.http() as http:
        stream = Background(lambda: sse_events(http.post("/v1/completions", json={**LONG, "stream": True, "n": 2,
                                                                                    "stream_options": {
                                                                                        "include_usage": True}})))
        full = Background(lambda: srv.client().chat.completions.create(**CHAT))
        wait_until(lambda: len(engine.running) == 2, "both requests to run")
        srv.call_soon(srv.app.state.lifecycle.begin_drain, "SIGTERM")
        assert srv.wait_stopped() == 0
        events = stream.result()
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] > 0
    finish = {}
    for e in events[:-2]:
        (c,) = e["choices"]
        assert c["index"] not in finish
        if c["finish_reason"] is not None:
            finish[c["index"]] = c["finish_reason"]
    assert finish == {0: "abort", 1: "abort"}
    r = full.result()  # the full response: the text generated so far, ended by the abort
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "abort" and 0 < len(text) < 200 and r.usage.completion_tokens == len(text)
    assert text == expected_text(make_tokenizer().apply_chat_template(
        CHAT["messages"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"], 0, None, len(text))
    assert sorted(engine.aborted) == sorted(rid for rid, *_ in engine.submitted) and engine.running == {}


def test_a_second_signal_aborts_at_once() -> None:
    engine = FakeEngineClient(token_delay_s=0.02)
    with ServerThread(engine, shutdown_timeout_s=3600) as srv:
        full = Background(lambda: srv.client().completions.create(**LONG))
        wait_until(lambda: len(engine.running) == 1, "the request to run")
        srv.call_soon(srv.app.state.lifecycle.begin_drain, "SIGTERM")
        srv.call_soon(srv.app.state.lifecycle.begin_drain, "SIGINT")
        assert srv.wait_stopped() == 0
        assert full.result().choices[0].finish_reason == "abort"


def test_engine_death_fails_running_requests_and_stops_the_server() -> None:
    engine = FakeEngineClient(token_delay_s=0.02)
    with ServerThread(engine) as srv, srv.http() as http:
        stream = Background(lambda: sse_events(http.post("/v1/completions", json={**LONG, "stream": True})))
        full = Background(lambda: srv.client().completions.create(**LONG))
        # a few tokens each: the stream's first chunk (and its 200) is out, so its failure is an SSE error event
        wait_until(lambda: len(engine.running) == 2 and all(
            len(s.token_ids) >= 3 for r in list(engine.running.values()) for s in r.samples), "both requests to run")

        async def kill() -> None:
            engine.kill("DP rank 1 (pid 4242) exited with status -9")

        srv.on_loop(kill)
        assert srv.wait_stopped() == 1
        events = stream.result()
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == 500 and "DP rank 1" in err["message"]
    import openai

    with pytest.raises(openai.InternalServerError) as info:
        full.result()
    body = info.value.body
    assert isinstance(body, dict)
    assert info.value.status_code == 500 and "DP rank 1" in body["message"]


def test_health_turns_503_when_the_engine_is_dead_and_the_server_stops() -> None:
    engine = FakeEngineClient()
    with ServerThread(engine, with_dead_event=False) as srv:  # the server learns it from dead_error alone
        with srv.http() as http:
            assert http.get("/health").status_code == 200
            engine._dead = "DP rank 0 stopped responding for 30 s"
            r = http.get("/health")
            assert r.status_code == 503 and "DP rank 0" in r.json()["error"]["message"]
        assert srv.wait_stopped() == 1
