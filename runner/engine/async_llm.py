"""The server's engine client (vLLM V1's ``AsyncLLM`` over ``DPAsyncMPClient``): the ``EngineClient`` the OpenAI
server is written against, over :class:`~runner.engine.async_client.AsyncMPClient`.

- **Several clients.** With ``--api-server-count N`` each API-server process has a client of its own
  (``client_index`` c of N, over :class:`~runner.engine.mp_client.EngineSockets` made by the parent, which starts
  and supervises the ranks: ``runner/entrypoints/api_servers.py``). Client c numbers its engine requests c,
  c + N, c + 2N, ... so that no two clients' ids meet on a rank; every rank reports its load (all clients'
  requests) to every client, which its choice of rank and ``--max-queued-requests`` count too.
- **Requests.** Each request is checked by ``runner.core.prompt_checks`` (the checks every front end runs), split
  into ``n`` engine requests (one per sample), and each goes to a rank (``MPClient``'s rank choice).
- **Outputs.** The reader task turns each step's outputs into ``RequestOutput`` s in one pass (detokenization,
  stop strings, ``n``: the output processor) and hands each to its request's sink (:meth:`stream`: the request
  handler's buffer, no task in between; :meth:`generate`: a queue); a stop string found here aborts the engine
  request. Leaving :meth:`generate` early or closing a :meth:`stream` aborts the request.
- **Failure.** A rank that dies or stops answering heartbeats is named by the launcher; every request in flight
  then fails with :class:`EngineDeadError` carrying that name, and ``dead_error`` tells the server to answer 503
  on /health and exit non-zero.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from runner.config import RunnerConfig
from runner.core.messages import CoreStats
from runner.core.prompt_checks import max_tokens_problem, prompt_token_problem
from runner.core.requests import EngineCoreOutputs, default_seed
from runner.engine.async_client import AsyncMPClient
from runner.engine.generation_config import GenerationConfig
from runner.engine.mp_client import EngineSockets
from runner.engine.protocol import (
    CloseStream,
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    EngineShuttingDownError,
    EngineStats,
    MetricsSink,
    OutputSink,
    RankStats,
    RequestError,
)
from runner.engine.simple_output import RequestTracker
from runner.engine.tokenizer import Tokenizer
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams

logger = logging.getLogger("ubatch.engine")


class _QueueSink:
    """:meth:`MPEngineClient.generate`'s sink: the outputs on a queue its iterator reads."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, output: RequestOutput) -> None:
        self.queue.put_nowait(output)

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)

    def end(self) -> None:
        pass  # the finished output ends the iterator


class MPEngineClient(AsyncMPClient, EngineClient):
    """``await MPEngineClient(cfg, ...).start()``; then :meth:`generate` / :meth:`stream` from request handlers;
    ``await shutdown()`` at the end (or :meth:`close` to stop the ranks at once).

    ``sockets``: attach as client ``client_index`` to ranks that another process started over these sockets
    (``--api-server-count``); that process supervises and stops them, and reports their failure here
    (:meth:`engine_failed`)."""

    # tokenizer: a transformers tokenizer (third-party), or None for a model without one
    def __init__(self, cfg: RunnerConfig, *, tokenizer: Tokenizer = None,
                 default_params: dict[str, Any] | None = None, max_queued_requests: int | None = None,
                 metrics: MetricsSink | None = None, on_dead: Callable[[str], None] | None = None,
                 generation_config: GenerationConfig | None = None, sockets: EngineSockets | None = None,
                 client_index: int = 0) -> None:
        super().__init__(cfg, sockets=sockets, client_index=client_index)
        self.tokenizer = tokenizer
        self._default_params = dict(default_params or {})
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.on_dead = on_dead
        self._accepting = False
        self._engine_ids = itertools.count(client_index, self._num_clients)
        self._seeds = itertools.count(client_index, self._num_clients)
        self.tracker = RequestTracker(tokenizer, generation_config)  # the checkpoint's EOS ids on every request

    # ------------------------------------------------------------------ EngineClient
    def get_tokenizer(self) -> Any:  # a transformers tokenizer (third-party)
        return self.tokenizer

    def default_sampling_params(self) -> dict[str, Any]:
        return dict(self._default_params)

    def stats(self) -> EngineStats:
        return EngineStats([_rank_stats(r.stats) for r in self._ranks])

    @property
    def num_unfinished_requests(self) -> int:
        return self.tracker.num_requests

    def _started(self) -> None:
        self._accepting = True

    def engine_failed(self, message: str) -> None:
        """The process supervising the ranks reports one failed (attached clients): every request in flight
        fails with ``message``."""
        self._die(message)

    def _on_dead(self, message: str) -> None:
        self._accepting = False
        logger.error("engine dead: %s", message)
        self.tracker.fail_all(EngineDeadError(message))
        super()._on_dead(message)
        if self.on_dead is not None:
            self.on_dead(message)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, let the ranks finish their wave and leave their loops, then stop them. Attached:
        abort what is left and wait until the ranks ended it; the ranks are left to their owner."""
        self._accepting = False
        for request_id in list(self.tracker.request_ids()):
            self._abort(request_id, "abort")
        if self._dead_error is None:
            await self._drain(timeout_s)
        await self.close()

    async def close(self) -> None:
        self._accepting = False
        await super().close()

    # ------------------------------------------------------------------ requests
    def _check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """The prompt checks every front end runs (``prompt_checks``), and ``max_tokens`` resolved: what is left
        under ``max_model_len`` when unset, a 400 naming the field when over it."""
        info = self.core_info
        problem = prompt_token_problem(prompt_token_ids, info.vocab_size, info.max_model_len)
        if problem is not None:
            raise RequestError("prompt", problem)
        params.check_vocab(info.vocab_size)
        if params.max_tokens is None:
            params = params.clone()
            params.max_tokens = info.max_model_len - len(prompt_token_ids)
        else:
            problem = max_tokens_problem(len(prompt_token_ids), params.max_tokens, info.max_model_len)
            if problem is not None:
                raise RequestError("max_tokens", problem)
        return params

    def _check_accepting(self, n: int) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(self._dead_error)
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down and takes no new requests")
        if self.max_queued_requests is not None:  # requests beyond what the ranks can run at once wait
            capacity = self.cfg.max_num_seqs * len(self._ranks)
            load = sum(r.outstanding + r.others for r in self._ranks)
            waiting = max(0, load - capacity)
            if max(0, load + n - capacity) > self.max_queued_requests:
                raise EngineOverloadedError(f"the waiting queue is full ({waiting} requests waiting, "
                                            f"--max-queued-requests {self.max_queued_requests})")

    def _submit(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                sink: OutputSink) -> None:
        """Check the request, register its sink and queue its engine requests for the ranks."""
        self._check_accepting(params.n)
        prompt_token_ids = list(prompt_token_ids)  # the caller's list stays the caller's
        params = self._check_request(prompt_token_ids, params)
        if self.tracker.has(request_id):
            raise RequestError("request_id", f"request id {request_id!r} is already running")
        children = self.tracker.add(request_id, prompt, prompt_token_ids, params, sink,
                                    lambda: next(self._engine_ids))
        if self.metrics is not None:
            self.metrics.on_prompt_tokens(len(prompt_token_ids))
        for child in children:
            child.default_seed = default_seed(self.cfg.seed, next(self._seeds))
            self._submit_engine_request(child)

    def stream(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
               sink: OutputSink) -> CloseStream:
        """The output reader hands this request's outputs to ``sink`` itself (no task per request); refusals
        raise here."""
        self._submit(request_id, prompt, prompt_token_ids, params, sink)

        async def close() -> None:
            self._abort(request_id, "abort")  # a no-op once the request finished

        return close

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        sink = _QueueSink()
        self._submit(request_id, prompt, prompt_token_ids, params, sink)
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort(request_id, "abort")

    async def abort(self, request_id: str) -> None:
        self._abort(request_id, "abort")

    def _abort(self, request_id: str, reason: str) -> None:
        self._abort_engine_requests(self.tracker.abort(request_id, reason, self.metrics))

    def _process(self, outputs: EngineCoreOutputs) -> None:
        to_abort = self.tracker.process(outputs, self.metrics)
        if to_abort:
            self._abort_engine_requests(to_abort)


def _rank_stats(s: CoreStats) -> RankStats:
    return RankStats(s.num_running, s.num_waiting, s.kv_cache_usage, s.num_steps, s.num_ubatched_steps, s.comm_s,
                     s.comm_exposed_s, {b.bucket: (b.dbo_on, b.speedup) for b in s.dbo_buckets},
                     prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits)
