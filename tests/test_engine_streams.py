"""How outputs reach a request's handler (``EngineStreams`` over ``EngineClient.stream``): what one engine step
hands over is read as one batch, failures and error outputs come after the outputs before them, a disconnect
wakes a waiting reader, closing ends the engine streams; and a stream's body chunks skip the middleware chain."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fake_engine_client import FakeEngineClient
from openai_harness import MODEL, ServerThread
from runner.engine.protocol import CloseStream, EngineDeadError, OutputSink
from runner.entrypoints.openai.engine_streams import EngineStreams
from runner.outputs import CompletionOutput, RequestOutput
from runner.sampling_params import SamplingParams


class SinkEngine(FakeEngineClient):
    """Hands each stream's sink to the test, which plays the engine's output reader."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks: dict[str, OutputSink] = {}
        self.closed: list[str] = []

    def stream(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
               sink: OutputSink) -> CloseStream:
        self.sinks[request_id] = sink

        async def close() -> None:
            self.closed.append(request_id)

        return close


def output(request_id: str, text: str, finished: bool = False, error: str | None = None) -> RequestOutput:
    sample = CompletionOutput(0, text, [1], finish_reason="stop" if finished else None)
    return RequestOutput(request_id, None, [1], [sample], finished, error=error)


def texts(batch: list[tuple[int, RequestOutput]] | None) -> list[tuple[int, str]] | None:
    return None if batch is None else [(i, o.outputs[0].text) for i, o in batch]


def opened(engine: SinkEngine, n: int = 2) -> EngineStreams:
    streams = EngineStreams(engine, [f"r-{i}" for i in range(n)], receive=None)
    for _ in range(n):
        streams.open(None, [1, 2], SamplingParams(max_tokens=4))
    return streams


def test_a_step_is_one_batch_in_arrival_order_and_ends_when_every_stream_ended() -> None:
    async def main() -> None:
        engine = SinkEngine()
        streams = opened(engine)
        a, b = engine.sinks["r-0"], engine.sinks["r-1"]
        reader = asyncio.ensure_future(streams.next_batch())
        await asyncio.sleep(0)
        assert not reader.done()  # nothing yet: the reader waits
        a.put(output("r-0", "x"))
        b.put(output("r-1", "y"))
        a.put(output("r-0", "z", finished=True))
        a.end()
        assert texts(await reader) == [(0, "x"), (1, "y"), (0, "z")]
        assert streams.finished == [True, False]
        b.put(output("r-1", "w", finished=True))
        b.end()
        assert texts(await streams.next_batch()) == [(1, "w")]
        assert await streams.next_batch() is None
        await streams.close()
        assert engine.closed == ["r-0", "r-1"] and engine.aborted == []  # both finished: nothing to abort

    asyncio.run(main())


def test_failure_and_error_output_come_after_the_outputs_before_them() -> None:
    async def main() -> None:
        engine = SinkEngine()
        streams = opened(engine)
        a, b = engine.sinks["r-0"], engine.sinks["r-1"]
        a.put(output("r-0", "x"))
        b.put(output("r-1", "bad", finished=True, error="no room"))
        a.put(output("r-0", "y"))
        a.fail(EngineDeadError("rank 1 died"))
        assert texts(await streams.next_batch()) == [(0, "x")]
        error_batch = await streams.next_batch()
        assert error_batch is not None and len(error_batch) == 1 and error_batch[0][1].error == "no room"
        assert texts(await streams.next_batch()) == [(0, "y")]
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            await streams.next_batch()
        await streams.close()
        assert engine.closed == ["r-0", "r-1"]

    asyncio.run(main())


def test_disconnect_wakes_the_reader_and_close_aborts_what_did_not_finish() -> None:
    async def main() -> None:
        engine = SinkEngine()
        messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        streams = EngineStreams(engine, ["r-0"], receive=messages.get)
        streams.open(None, [1, 2], SamplingParams(max_tokens=4))
        engine.running["r-0"] = None  # type: ignore[assignment]  # the double aborts only requests it runs
        reader = asyncio.ensure_future(streams.next_batch())
        await asyncio.sleep(0)
        await messages.put({"type": "http.disconnect"})
        assert await asyncio.wait_for(reader, 5) is None and streams.disconnected
        await streams.close()
        assert engine.closed == ["r-0"]

    asyncio.run(main())


def test_prime_raises_a_refusal_handed_to_the_sink() -> None:
    async def main() -> None:
        engine = SinkEngine()
        streams = opened(engine)
        engine.sinks["r-0"].put(output("r-0", "x"))
        engine.sinks["r-1"].fail(EngineDeadError("rank 0 died"))
        with pytest.raises(EngineDeadError, match="rank 0 died"):
            await streams.prime()
        await streams.close()

    asyncio.run(main())


class CountBodies:
    """A pure ASGI middleware inside the app that counts the body messages its ``send`` sees."""

    def __init__(self, app: ASGIApp, seen: list[Message]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counting(message: Message) -> None:
            self.seen.append(message)
            await send(message)

        await self.app(scope, receive, counting)


def test_stream_body_chunks_skip_the_middlewares() -> None:
    """The response start and the body's end (the last chunk and ``[DONE]``, one message) go through the
    middlewares; the other events go straight to the server's ``send``, and the client still reads every one."""
    seen: list[Message] = []
    server = ServerThread()
    server.app.add_middleware(CountBodies, seen=seen)
    with server as running, running.http() as http:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 6, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) != ""
    assert [m["type"] for m in seen] == ["http.response.start", "http.response.body"]
    end = seen[1]["body"].decode()
    assert not seen[1]["more_body"] and end.endswith("data: [DONE]\n\n")
    assert end.count("data: ") == 2 and json.loads(end.split("\n\n")[0][len("data: "):])["choices"][0][
        "finish_reason"] == "length"
