"""A stream's chunks written by the engine's output reader itself (``EngineStreams.set_direct_format`` /
``set_direct_write`` over ``chunk_writer``): a write that need not wait happens at once without waking the handler;
one that waits for the client is finished by the handler before anything after it; the last output, errors and
a disconnect still go to the handler; over a real server with a client that reads slowly (flow control), the
streamed text equals the whole response's; and a stream's end (a chat stream's start too) is one body message."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable
from typing import Any

import pytest
from starlette.types import Send

from fake_engine_client import FakeEngineClient
from openai_harness import MODEL, ServerThread
from runner.engine.protocol import EngineDeadError
from runner.entrypoints.openai import chunk_writer, sse
from runner.entrypoints.openai.chunk_writer import ChunkWrite
from runner.entrypoints.openai.engine_streams import EngineStreams
from runner.entrypoints.openai.send_now import send_now
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams
from test_engine_streams import SinkEngine, output, texts


# ---- send_now ---------------------------------------------------------------------------------------------------
def test_send_now_finishes_a_send_that_need_not_wait_at_once() -> None:
    written: list[str] = []

    async def send(message: str) -> None:
        written.append(message)

    async def main() -> None:
        assert send_now(send("a")) is None
        assert written == ["a"]  # before any task switch

    asyncio.run(main())


def test_send_now_hands_a_waiting_send_to_the_awaiting_task() -> None:
    async def main() -> None:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        written: list[str] = []

        async def send(message: str) -> None:
            await ready  # the client's socket is full
            written.append(message)

        rest = send_now(send("a"))
        assert rest is not None and written == []
        waiter = asyncio.ensure_future(rest)
        await asyncio.sleep(0)
        assert not waiter.done()
        ready.set_result(None)
        await asyncio.wait_for(waiter, 5)
        assert written == ["a"]

    asyncio.run(main())


def test_send_now_passes_a_cancellation_into_the_waiting_send_and_raises_what_it_raises() -> None:
    async def main() -> None:
        seen: list[str] = []

        async def send() -> None:
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        async def broken() -> None:
            raise OSError("connection reset")

        rest = send_now(send())
        assert rest is not None
        waiter = asyncio.ensure_future(rest)
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert seen == ["cancelled"]
        with pytest.raises(OSError, match="connection reset"):
            send_now(broken())

    asyncio.run(main())


# ---- EngineStreams ----------------------------------------------------------------------------------------------
class Client:
    """The response's side of a direct stream: what was written, and a switch that makes writes wait."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.full: asyncio.Future[None] | None = None  # while set, a write waits for it

    def format(self, i: int, out: RequestOutput) -> str:
        return f"{i}:{out.outputs[0].text};"

    def write(self, text: str) -> Awaitable[None] | None:
        return send_now(self._send(text))

    async def _send(self, text: str) -> None:
        if self.full is not None:
            await self.full
        self.written.append(text)


def direct(engine: SinkEngine, client: Client) -> EngineStreams:
    streams = EngineStreams(engine, ["r-0"], receive=None)
    streams.open(None, [1, 2], SamplingParams(max_tokens=8))
    streams.set_direct_format(client.format)
    streams.set_direct_write(client.write)
    return streams


async def waiting() -> tuple[SinkEngine, Client, EngineStreams, asyncio.Future[Any]]:
    """A direct stream whose handler waits in ``next_batch`` (its future)."""
    engine, client = SinkEngine(), Client()
    streams = direct(engine, client)
    reader = asyncio.ensure_future(streams.next_batch())
    await asyncio.sleep(0)
    return engine, client, streams, reader


def test_outputs_are_written_while_the_handler_waits_and_the_last_one_wakes_it() -> None:
    async def main() -> None:
        engine, client = SinkEngine(), Client()
        streams = direct(engine, client)
        sink = engine.sinks["r-0"]
        sink.put(output("r-0", "a"))  # before the handler waits: queued for it
        assert texts(await streams.next_batch()) == [(0, "a")]
        reader = asyncio.ensure_future(streams.next_batch())
        await asyncio.sleep(0)
        sink.put(output("r-0", "b"))
        sink.put(output("r-0", "c"))
        assert client.written == ["0:b;", "0:c;"]  # written at once, by the caller of put
        await asyncio.sleep(0)
        assert not reader.done()  # and the handler was not woken for them
        sink.put(output("r-0", "d", finished=True))
        sink.end()
        assert texts(await asyncio.wait_for(reader, 5)) == [(0, "d")]
        assert streams.finished == [True] and client.written == ["0:b;", "0:c;"]
        assert await streams.next_batch() is None
        await streams.close()

    asyncio.run(main())


def test_several_prompts_are_written_directly_and_nothing_overtakes_what_waits_for_the_handler() -> None:
    """Two prompts' running outputs are written by the caller of ``put``; once one prompt's last output is queued
    for the handler, the other prompt's next output queues behind it until the handler waits again."""
    async def main() -> None:
        engine, client = SinkEngine(), Client()
        streams = EngineStreams(engine, ["r-0", "r-1"], receive=None)
        for _ in range(2):
            streams.open(None, [1, 2], SamplingParams(max_tokens=8))
        streams.set_direct_format(client.format)
        streams.set_direct_write(client.write)
        first, second = engine.sinks["r-0"], engine.sinks["r-1"]
        reader = asyncio.ensure_future(streams.next_batch())
        await asyncio.sleep(0)
        first.put(output("r-0", "a"))
        second.put(output("r-1", "b"))
        assert client.written == ["0:a;", "1:b;"] and not reader.done()
        first.put(output("r-0", "c", finished=True))
        first.end()
        second.put(output("r-1", "d"))  # after a queued output: behind it, not written
        assert texts(await asyncio.wait_for(reader, 5)) == [(0, "c"), (1, "d")]
        assert client.written == ["0:a;", "1:b;"]
        reader = asyncio.ensure_future(streams.next_batch())
        await asyncio.sleep(0)
        second.put(output("r-1", "e"))  # the handler waits again: written at once
        assert client.written == ["0:a;", "1:b;", "1:e;"] and not reader.done()
        second.put(output("r-1", "f", finished=True))
        second.end()
        assert texts(await asyncio.wait_for(reader, 5)) == [(1, "f")]
        assert streams.finished == [True, True] and await streams.next_batch() is None
        await streams.close()

    asyncio.run(main())


def test_a_write_that_waits_is_finished_by_the_handler_before_the_outputs_after_it() -> None:
    async def main() -> None:
        engine, client, streams, reader = await waiting()
        sink = engine.sinks["r-0"]
        client.full = asyncio.get_running_loop().create_future()
        sink.put(output("r-0", "a"))  # its write waits for the client
        sink.put(output("r-0", "b"))  # queued behind it, for the handler
        await asyncio.sleep(0)
        assert client.written == [] and not reader.done()
        client.full.set_result(None)
        client.full = None
        assert texts(await asyncio.wait_for(reader, 5)) == [(0, "b")]
        assert client.written == ["0:a;"]
        await streams.close()

    asyncio.run(main())


def test_errors_failures_and_format_exceptions_reach_the_handler() -> None:
    async def main() -> None:
        engine, client, streams, reader = await waiting()
        sink = engine.sinks["r-0"]
        sink.put(output("r-0", "bad", finished=True, error="no room"))
        batch = await asyncio.wait_for(reader, 5)
        assert batch is not None and batch[0][1].error == "no room" and client.written == []
        await streams.close()

        engine, client, streams, reader = await waiting()
        engine.sinks["r-0"].fail(EngineDeadError("rank 1 died"))
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            await asyncio.wait_for(reader, 5)
        await streams.close()

        def broken(i: int, out: RequestOutput) -> str:
            raise RuntimeError(f"the engine returned sample {out.outputs[0].index + 3} for a request with n=1")

        engine, client, streams, reader = await waiting()
        streams.set_direct_format(broken)
        engine.sinks["r-0"].put(output("r-0", "a"))
        with pytest.raises(RuntimeError, match="sample 3"):
            await asyncio.wait_for(reader, 5)
        await streams.close()

    asyncio.run(main())


def test_nothing_is_written_after_a_disconnect() -> None:
    async def main() -> None:
        engine, client = SinkEngine(), Client()
        messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        streams = EngineStreams(engine, ["r-0"], receive=messages.get)
        streams.open(None, [1, 2], SamplingParams(max_tokens=8))
        streams.set_direct_format(client.format)
        streams.set_direct_write(client.write)
        reader = asyncio.ensure_future(streams.next_batch())
        await asyncio.sleep(0)
        engine.sinks["r-0"].put(output("r-0", "a"))
        await messages.put({"type": "http.disconnect"})
        assert await asyncio.wait_for(reader, 5) is None and streams.disconnected
        engine.sinks["r-0"].put(output("r-0", "b"))
        assert client.written == ["0:a;"]
        await streams.close()

    asyncio.run(main())


# ---- a real server, a slow client ------------------------------------------------------------------------------
def read_http_chunks(sock: socket.socket, deadline_s: float) -> list[str]:
    """The chunks of a chunked HTTP response read from ``sock`` to its end, as the server framed them: uvicorn
    frames each body message it writes as one chunk."""
    data = b""
    deadline = time.monotonic() + deadline_s
    while not data.endswith(b"0\r\n\r\n"):
        assert time.monotonic() < deadline, "the server did not end the stream in time"
        piece = sock.recv(65536)
        assert piece, "the server closed the connection before the end of the stream"
        data += piece
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head
    chunks: list[str] = []
    while True:
        size_line, body = body.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return chunks
        chunks.append(body[:size].decode())
        body = body[size + 2:]


def events_of(chunks: list[str]) -> list[str]:
    """The ``data:`` payloads of server-sent-event text."""
    return [line[len("data: "):] for line in "".join(chunks).split("\n") if line.startswith("data: ")]


def read_chunked_events(sock: socket.socket, deadline_s: float) -> list[str]:
    """The ``data:`` payloads of a chunked server-sent-event response read from ``sock`` to its end."""
    return events_of(read_http_chunks(sock, deadline_s))


def stream_over_socket(port: int, path: str, body: dict[str, Any], pause_s: float = 0.0) -> list[str]:
    """POST ``body`` to ``path`` over a plain socket and read the chunked response (after ``pause_s``)."""
    data = json.dumps(body).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        time.sleep(pause_s)
        return read_http_chunks(sock, 60)


def test_a_client_that_reads_slowly_gets_the_whole_stream_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small socket buffers and a client that reads only after a pause fill the server's transport, so some of the
    direct writes go to uvicorn's ``send``, which waits (flow control): the handler finishes those, and the
    streamed text still equals the whole response's."""
    waited: list[bool] = []  # per chunk written: whether the write waited for the client

    def counting_writer(send: Send) -> ChunkWrite:
        write = chunk_writer.chunk_writer(send)

        def counted(body: bytes) -> Awaitable[None] | None:
            rest = write(body)
            waited.append(rest is not None)
            return rest
        return counted

    monkeypatch.setattr(sse, "chunk_writer", counting_writer)
    max_tokens = 2000
    server = ServerThread(FakeEngineClient(max_model_len=4096))
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
    with server as running:
        with running.http() as http:
            whole = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": max_tokens})
            assert whole.status_code == 200
            expected = whole.json()["choices"][0]["text"]
        body = {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "stream": True}
        # the server writes into full buffers during the pause
        events = events_of(stream_over_socket(running.port, "/v1/completions", body, pause_s=1.0))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected and len(expected) == max_tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(waited) >= 1, "no direct write waited for the client: the test did not fill the buffers"
    assert len(waited) - sum(waited) >= 1, "no direct write finished at once"


def test_a_stream_ends_in_one_write_and_a_chat_stream_starts_with_its_first_tokens() -> None:
    """The last tokens, the usage chunk and ``[DONE]`` are one body message (one HTTP chunk, written with the
    body's end); a chat stream's role chunk goes out with its first tokens. The text equals the whole response's."""
    server = ServerThread(FakeEngineClient(max_model_len=4096))
    with server as running:
        with running.http() as http:
            whole = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12}).json()
        for path, body in [
                ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 12}),
                ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                                          "max_tokens": 12})]:
            chunks = stream_over_socket(running.port, path, {**body, "stream": True,
                                                             "stream_options": {"include_usage": True}})
            last = events_of(chunks[-1:])
            assert last[-1] == "[DONE]" and len(last) == 3, last
            assert json.loads(last[0])["choices"][0]["finish_reason"] == "length"
            assert json.loads(last[1])["usage"]["completion_tokens"] == 12
            assert all("[DONE]" not in c for c in chunks[:-1])
            if path == "/v1/chat/completions":
                first = [json.loads(e) for e in events_of(chunks[:1])]
                assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                assert len(first) >= 2 and first[1]["choices"][0]["delta"]["content"]
                text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                               for e in events_of(chunks)[:-2])
                assert text == whole["choices"][0]["message"]["content"]
