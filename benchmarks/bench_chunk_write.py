"""The server's CPU per streamed body chunk: a chunk framed and written to uvicorn's transport past its ``send``
(``transport_writer``, private internals: the fast path the server does not take, kept here so that the decision
can be measured again) against uvicorn's own ``send`` of an ``http.response.body`` message run up to its first
wait (``chunk_writer``, the server's way), side by side, on asyncio's event loop and on uvloop's (the API
server's: ``api_server.run_loop``).

A uvicorn server (httptools, as ``serve`` runs it) in this process holds ``--streams`` streamed responses open
to a client process that reads them all as they come, and writes ``--steps`` times one chunk to every stream
(an SSE completion event of one token, 191 bytes), then lets the event loop turn: as the engine client's output
reader answers a step. The server has the first core this process may use, the client the last. The figure is
this thread's CPU time over the steps, divided by the chunks: the framing, the checks, the socket writes (the
kernel's loopback path included) and the loop's turn, for each way and loop, in turn ``--repeats`` times;
medians. It is split into user-space and kernel time (``getrusage(RUSAGE_THREAD)``), which is where the two
loops differ. Writes ``benchmarks/results/chunk_write.csv``. Usage:
``python benchmarks/bench_chunk_write.py [--streams 64] [--steps 300]``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import statistics
import sys
from collections.abc import Awaitable
from pathlib import Path

import uvicorn
import uvloop
from starlette.types import Receive, Scope, Send

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, write_csv  # noqa: E402
from runner.entrypoints.openai.chunk_writer import ChunkWrite, chunk_writer  # noqa: E402

EVENT = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion","created":1700000000,'
         b'"model":"m","choices":[{"index":0,"text":" token","logprobs":null,"finish_reason":null}]}\n\n')
WAYS = ("uvicorn send", "transport write")
LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}
CORES = sorted(os.sched_getaffinity(0))  # the server on the first, the client on the last (where there are two)
# The client: N streams' GETs, then every stream read to its connection's end (the server closes them).
READER = """
import os, selectors, socket, sys
os.sched_setaffinity(0, {int(sys.argv[3])})
sel = selectors.DefaultSelector()
for _ in range(int(sys.argv[2])):
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    s.sendall(b"GET / HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
    sel.register(s, selectors.EVENT_READ)
open_ = int(sys.argv[2])
while open_:
    for key, _ in sel.select():
        if not key.fileobj.recv(1 << 20):
            sel.unregister(key.fileobj)
            key.fileobj.close()
            open_ -= 1
"""


def transport_writer(send: Send) -> ChunkWrite:
    """Frame a chunk and write it to the connection's transport as uvicorn's httptools ``send`` does, whenever that
    ``send`` would do nothing else (the socket is not full, the client is there, the response is chunked and not
    complete); otherwise hand it to ``send``."""
    through_send = chunk_writer(send)
    cycle = send.__self__  # type: ignore[attr-defined]  # uvicorn's httptools RequestResponseCycle
    write, flow = cycle.transport.write, cycle.flow

    def write_chunk(body: bytes) -> Awaitable[None] | None:
        if flow.write_paused or cycle.disconnected or not cycle.chunked_encoding or cycle.response_complete \
                or not body:
            return through_send(body)
        write(b"%x\r\n%b\r\n" % (len(body), body))
        return None

    return write_chunk


def thread_cpu() -> tuple[float, float]:
    """This thread's user-space and kernel CPU seconds so far."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime, usage.ru_stime


async def serve_once(way: str, streams: int, steps: int) -> tuple[float, float]:
    """``steps`` chunks to each of ``streams`` streams, written the ``way`` way; this thread's user-space and
    kernel CPU µs per chunk."""
    writers: list[ChunkWrite] = []
    all_open, written = asyncio.Event(), asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        writers.append(transport_writer(send) if way == "transport write" else chunk_writer(send))
        if len(writers) == streams:
            all_open.set()
        await written.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning",
                                           access_log=False, limit_concurrency=None))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    reader = await asyncio.create_subprocess_exec(sys.executable, "-c", READER, str(sock.getsockname()[1]),
                                                  str(streams), str(CORES[-1]))
    await asyncio.wait_for(all_open.wait(), 60)
    user, kernel = thread_cpu()
    for _ in range(steps):
        for write in writers:
            if (rest := write(EVENT)) is not None:
                await rest
        await asyncio.sleep(0)
    user_end, kernel_end = thread_cpu()
    per_chunk = 1e6 / (steps * streams)
    written.set()
    await asyncio.wait_for(reader.wait(), 120)
    server.should_exit = True
    await serving
    sock.close()
    return (user_end - user) * per_chunk, (kernel_end - kernel) * per_chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(RESULTS_DIR / "chunk_write.csv"))
    args = ap.parse_args()
    os.sched_setaffinity(0, {CORES[0]})
    cases = [(loop, way) for loop in LOOPS for way in WAYS]
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {case: [] for case in cases}
    for repeat in range(args.repeats):
        for loop, way in cases if repeat % 2 == 0 else cases[::-1]:
            figures[loop, way].append(LOOPS[loop](serve_once(way, args.streams, args.steps)))
        print(f"repeat {repeat}: " + ", ".join(f"{way} on {loop} {sum(figures[loop, way][-1]):.2f} us"
                                                for loop, way in cases), flush=True)
    rows = [{"loop": loop, "way": way, "streams": args.streams, "steps": args.steps, "repeats": args.repeats,
             "bytes_per_chunk": len(EVENT),
             "cpu_us_per_chunk_median": round(statistics.median(u + k for u, k in values), 3),
             "cpu_us_per_chunk_min": round(min(u + k for u, k in values), 3),
             "user_us_per_chunk_median": round(statistics.median(u for u, _ in values), 3),
             "kernel_us_per_chunk_median": round(statistics.median(k for _, k in values), 3)}
            for (loop, way), values in figures.items()]
    base = next(row["cpu_us_per_chunk_median"] for row in rows if (row["loop"], row["way"]) == ("asyncio", WAYS[0]))
    for row in rows:
        print(f"{row['way']} on {row['loop']}: {row['cpu_us_per_chunk_median']:.2f} us CPU per chunk "
              f"({row['cpu_us_per_chunk_median'] / base:.2f}x of uvicorn's send on asyncio): "
              f"{row['user_us_per_chunk_median']:.2f} us user space, {row['kernel_us_per_chunk_median']:.2f} us kernel")
    write_csv(rows, args.out)


if __name__ == "__main__":
    main()
