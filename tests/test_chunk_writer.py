"""``chunk_writer``: under uvicorn's httptools protocol a body chunk goes out byte for byte as an awaited ``send``
writes it, without waiting; after the client left a chunk is dropped as uvicorn drops it; any other ``send`` gets
the chunk as an ASGI message."""
from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from starlette.types import Message, Receive, Scope, Send

from runner.entrypoints.openai import chunk_writer

BODIES = [b"a", b"data: {\"text\":\"\xc3\xa9\"}\n\n", bytes(range(256)) * 3]


def run_server(app: Callable[[Scope, Receive, Send], Awaitable[None]],
               client: Callable[[int], Awaitable[Any]]) -> Any:
    """Serve ``app`` with uvicorn's httptools protocol on a free port of 127.0.0.1 while ``client(port)`` runs."""
    async def main() -> Any:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            return await asyncio.wait_for(client(sock.getsockname()[1]), 30)
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 30)
            sock.close()
    return asyncio.run(main())


async def response_body(port: int, path: str) -> bytes:
    """The raw body (chunk framing included) of a GET of ``path``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
    data = await reader.read()
    writer.close()
    return data.split(b"\r\n\r\n", 1)[1]


def test_chunks_are_written_as_an_awaited_send_writes_them_at_once() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/writer":
            write = chunk_writer.chunk_writer(send)
            assert all(write(body) is None for body in BODIES)
        else:
            for body in BODIES:
                await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def client(port: int) -> tuple[bytes, bytes]:
        return await response_body(port, "/writer"), await response_body(port, "/send")

    written, sent = run_server(app, client)
    assert written == sent == b"".join(b"%x\r\n%b\r\n" % (len(b), b) for b in BODIES) + b"0\r\n\r\n"


def test_after_the_client_left_a_chunk_goes_to_uvicorn_which_drops_it() -> None:
    left = asyncio.Event()
    results: list[object] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        write = chunk_writer.chunk_writer(send)
        assert write(b"first") is None
        while (await receive())["type"] != "http.disconnect":
            pass
        results.append(write(b"after the client left"))  # uvicorn's send returns at once: nothing to wait for
        left.set()

    async def client(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"first\r\n")).endswith(b"5\r\nfirst\r\n")
        writer.close()
        await left.wait()

    run_server(app, client)
    assert results == [None]


def test_any_other_send_gets_each_chunk_as_a_body_message() -> None:
    messages: list[Message] = []

    async def send(message: Message) -> None:
        messages.append(message)

    write = chunk_writer.chunk_writer(send)
    assert [write(body) for body in BODIES] == [None] * len(BODIES)
    assert messages == [{"type": "http.response.body", "body": b, "more_body": True} for b in BODIES]
