"""The API server's CPU per request, without the engine's per-token work: streamed completions that end after one token
(``--max-tokens``: more, one per step), served by the real app (``api_server.build_app``, wrapped in ``RawSend`` as
``serve_app`` runs it) and driven in-process over ASGI, so what is measured is the per-request path: route, body
read and pydantic parse, sampling parameters, ``OpenAIServing.start`` (request log, ``EngineStreams``), the engine
client's ``_submit`` (checks, ``RequestTracker.add``, the msgpack ``AddRequest``), the one output, the close path
and the Prometheus metrics.

Engines (``--engine``):

- ``mp`` (default): the server's own ``MPEngineClient`` with a loopback rank in place of the engine-core
  process: it steps on every event-loop turn while requests run, each running request getting one token per
  step, all of a step's outputs in one ``Outputs`` message, through the client's output path (the engine
  client's and the handlers' per-token work: detokenizer, stream chunks, direct writes).
- ``fake``: an ``EngineClient`` stand-in that finishes each request with one ``RequestOutput`` itself (the
  server's part alone, no engine client).

``--n N``: N choices per request (sampled at temperature 1 with a seed, as ``n`` > 1 needs), each getting a
token per step. No uvicorn: its HTTP parsing and socket writes are not in the figure. ``--log-requests`` sets the
request log (on: an INFO line per request to a handler writing to /dev/null, as the server's stderr handler; off: the
logger is not called). Reports the process CPU microseconds per request, the median of ``--repeats``, and the
driver's own cost (the same requests answered by a bare ASGI app), to CSV. Compare checkouts with
``PYTHONPATH=<checkout> python benchmarks/bench_request_path.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, write_csv
from runner.config import RunnerConfig
from runner.core.messages import CoreInfo, CoreStats, Outputs
from runner.core.requests import EngineCoreOutput
from runner.engine.async_llm import MPEngineClient
from runner.engine.mp_client import _Rank
from runner.engine.protocol import CloseStream, EngineClient, EngineStats, OutputSink
from runner.entrypoints.openai.api_server import build_app
from runner.entrypoints.openai.metrics import ServerMetrics
from runner.entrypoints.openai.sse import RawSend
from runner.outputs import CompletionOutput, RequestMetrics, RequestOutput
from runner.sampling_params import SamplingParams
from tiny_checkpoint import build_tokenizer

MODEL = "bench-model"
PROMPT_LEN, MAX_MODEL_LEN = 16, 256
TOKEN = 70  # the one generated token (--engine fake)
TOKENS = [70, 71, 72, 73, 74, 75, 76, 77]  # the tokens a loopback rank generates, in turn


class _Request(msgspec.Struct):
    request_id: int


class _Add(msgspec.Struct, tag="add"):
    request: _Request


class _AddMany(msgspec.Struct, tag="add_many"):
    requests: list[_Request]


class _Abort(msgspec.Struct, tag="abort"):
    request_ids: list[int]


_RANK_DECODER = msgspec.msgpack.Decoder(_Add | _AddMany | _Abort)


class LoopbackRank:
    """In place of a rank's input socket: a step on every event-loop turn while requests run, each running
    request getting one token per step (a step's outputs in one ``Outputs`` message through the client's output
    path), until it has ``tokens``."""

    def __init__(self, client: MPEngineClient, tokens: int) -> None:
        self.client = client
        self.tokens = tokens
        self.running: dict[int, int] = {}  # request id -> tokens generated
        self.stepping = False

    def send(self, data: bytes) -> None:
        msg = _RANK_DECODER.decode(data)
        if isinstance(msg, _Abort):
            return
        if not self.stepping:
            self.stepping = True
            asyncio.get_running_loop().call_soon(self._step)
        for request in [msg.request] if isinstance(msg, _Add) else msg.requests:
            self.running[request.request_id] = 0

    def _step(self) -> None:
        outputs, running, last = [], self.running, self.tokens - 1
        for i, done in list(running.items()):
            finished = done == last
            outputs.append(EngineCoreOutput(i, [TOKENS[done % len(TOKENS)]], num_prompt_tokens=PROMPT_LEN,
                                            finish_reason="length" if finished else None))
            if finished:
                del running[i]
            else:
                running[i] = done + 1
        self.client._on_outputs(Outputs(0, outputs, CoreStats()))
        self.stepping = bool(running)
        if self.stepping:
            asyncio.get_running_loop().call_soon(self._step)


def mp_engine(tokenizer: Any, metrics: ServerMetrics, tokens: int) -> MPEngineClient:
    """The server's engine client over one loopback rank (its start-up, which spawns the ranks, left out)."""
    client = MPEngineClient(RunnerConfig(), tokenizer=tokenizer, metrics=metrics)
    info = CoreInfo(rank=0, max_model_len=MAX_MODEL_LEN, vocab_size=len(tokenizer), num_kv_blocks=1024,
                    block_size=16, eos_token_ids=[], dtype="float32", experts_backend="torch")
    client._ranks.append(_Rank(LoopbackRank(client, tokens), info))
    client._accepting = True
    return client


class OneTokenEngine(EngineClient):
    """An ``EngineClient`` whose requests finish with one token, handed to the sink on the next loop turn."""

    def __init__(self, tokenizer: Any, metrics: ServerMetrics) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics

    @property
    def max_model_len(self) -> int:
        return MAX_MODEL_LEN

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def default_sampling_params(self) -> dict[str, Any]:
        return {}

    def _output(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
        now = time.time()
        return RequestOutput(request_id, prompt, prompt_token_ids, [CompletionOutput(0, "a", [TOKEN],
                                                                                     finish_reason="length")],
                             True, RequestMetrics(now, now, now, now))

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        yield self._output(request_id, prompt, prompt_token_ids)

    def stream(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
               sink: OutputSink) -> CloseStream:
        def finish() -> None:
            output = self._output(request_id, prompt, prompt_token_ids)
            sink.put(output)
            sink.end()
            self.metrics.on_tokens(1, 0.0, [])
            self.metrics.on_request_finished(output, len(prompt_token_ids), 1)

        self.metrics.on_prompt_tokens(len(prompt_token_ids))
        asyncio.get_running_loop().call_soon(finish)

        async def close() -> None:
            pass

        return close

    async def abort(self, request_id: str) -> None:
        pass

    @property
    def dead_error(self) -> str | None:
        return None

    def stats(self) -> EngineStats:
        return EngineStats()

    async def reset_prefix_cache(self) -> bool:
        return True  # it caches nothing


async def bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The driver's floor: reads the body and answers one event, as the served requests' shape."""
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def request(app: Any, scope: dict[str, Any], body: bytes) -> tuple[int, bytes]:
    """One request through ``app`` as uvicorn calls it: the body in one message, then ``receive`` waits
    until the response is complete and says ``http.disconnect``."""
    loop = asyncio.get_running_loop()
    state = {"status": 0, "body_sent": False}
    chunks: list[bytes] = []
    complete = loop.create_future()

    async def receive() -> dict[str, Any]:
        if not state["body_sent"]:
            state["body_sent"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        if not complete.done():
            await asyncio.shield(complete)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            state["status"] = message["status"]
        else:
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False) and not complete.done():
                complete.set_result(None)

    await app(dict(scope), receive, send)
    return state["status"], b"".join(chunks)


def http_scope(body: bytes) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
            "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}


async def serve_requests(app: Any, body: bytes, num_requests: int, concurrency: int) -> float:
    """CPU seconds of ``num_requests`` requests, ``concurrency`` at a time; every answer checked."""
    scope = http_scope(body)
    left = iter(range(num_requests))

    async def worker() -> None:
        for _ in left:
            status, answer = await request(app, scope, body)
            if status != 200 or not (answer.endswith(b"data: [DONE]\n\n") or answer.endswith(b"}")):
                raise RuntimeError(f"request failed: {status} {answer[:300]!r}")

    gc.collect()
    start = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.process_time() - start


def build(engine_kind: str, log_requests: bool, tokens: int) -> Any:
    tokenizer = build_tokenizer()
    metrics = ServerMetrics(MODEL, MAX_MODEL_LEN)
    engine: EngineClient = mp_engine(tokenizer, metrics, tokens) if engine_kind == "mp" else OneTokenEngine(tokenizer,
                                                                                                    metrics)
    return RawSend(build_app(engine, [MODEL], log_requests=log_requests, metrics=metrics))


def route_request_log(log_requests: bool) -> None:
    """As ``api_server._log_to_stderr``: the package's INFO lines to a handler, here writing to /dev/null."""
    package = logging.getLogger("runner.entrypoints.openai")
    if log_requests and not package.handlers:
        handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - held for the process's life
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("mp", "fake"), default="mp")
    p.add_argument("--requests", type=int, default=2000, help="requests per run")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--log-requests", choices=("on", "off"), default="off",
                   help="the request log (the server's default before it followed vLLM's: on)")
    p.add_argument("--max-tokens", type=int, default=1, help="tokens per request (mp engine)")
    p.add_argument("--no-stream", action="store_true", help="non-streamed completions")
    p.add_argument("--n", type=int, default=1,
                   help="choices per request (mp engine; above 1, sampled at temperature 1 with a seed, as n > 1 "
                        "needs)")
    p.add_argument("--label", default="current")
    p.add_argument("--out", default=None, help="CSV path (default benchmarks/results/request_path_<label>.csv)")
    args = p.parse_args()
    if args.engine == "fake" and args.max_tokens != 1:
        p.error(f"--max-tokens {args.max_tokens}: the fake engine answers one token; use --engine mp")
    if args.engine == "fake" and args.n != 1:
        p.error(f"--n {args.n}: the fake engine answers one choice; use --engine mp")
    log_requests = args.log_requests == "on"
    route_request_log(log_requests)
    sampling = {"temperature": 0} if args.n == 1 else {"n": args.n, "temperature": 1.0, "seed": 0}
    body = json.dumps({"model": MODEL, "prompt": list(range(3, 3 + PROMPT_LEN)), "max_tokens": args.max_tokens,
                       "stream": not args.no_stream, "ignore_eos": True, **sampling}).encode()

    async def run() -> tuple[list[float], list[float]]:
        app = build(args.engine, log_requests, args.max_tokens)
        # warm-up: templates rendered, code paths taken once, before the objects made so far are frozen
        await serve_requests(app, body, 200, args.concurrency)
        await serve_requests(bare_app, body, 200, args.concurrency)
        gc.collect()
        gc.freeze()  # as the server (``tune_gc``)
        gc.set_threshold(50_000, *gc.get_threshold()[1:])
        served, floor = [], []
        for _ in range(args.repeats):
            served.append(await serve_requests(app, body, args.requests, args.concurrency) / args.requests * 1e6)
            floor.append(await serve_requests(bare_app, body, args.requests, args.concurrency) / args.requests
                         * 1e6)
        return served, floor

    served, floor = asyncio.run(run())
    med, med_floor = statistics.median(served), statistics.median(floor)
    print(f"{args.label}: {med:.1f} us CPU per request of {args.n} x {args.max_tokens} token(s) ({args.engine} engine, "
          f"request log {args.log_requests}, "
          f"{'non-streamed' if args.no_stream else 'streamed'}; median of {args.repeats}: "
          f"{', '.join(f'{s:.1f}' for s in served)}); the driver alone {med_floor:.1f} us")
    write_csv([{"label": args.label, "engine": args.engine, "log_requests": args.log_requests,
                "stream": not args.no_stream, "n": args.n, "max_tokens": args.max_tokens, "requests": args.requests,
                "concurrency": args.concurrency,
                "repeats": args.repeats, "us_per_request": round(med, 2), "driver_us_per_request": round(med_floor, 2),
                "runs_us": " ".join(f"{s:.1f}" for s in served)}],
              args.out or RESULTS_DIR / f"request_path_{args.label.replace(' ', '_')}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
