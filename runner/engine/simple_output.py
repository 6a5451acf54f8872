"""Per-request state of the server's engine client: the request's queue, its ``n`` engine requests, and the
``RequestOutput`` s built from their outputs.

``n > 1``: one engine request per sample; a seeded request's sample ``i`` uses ``seed + i`` (vLLM's parallel
sampling), so each sample is reproducible on its own.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from runner.core.requests import EngineCoreOutput, EngineCoreRequest
from runner.engine.protocol import MetricsSink
from runner.outputs import CompletionOutput, RequestMetrics, RequestOutput
from runner.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Sample:
    index: int
    engine_id: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_tokens: int = 0  # DELTA: how much of it was already handed out
    sent_text: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    samples: list[_Sample]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class RequestTracker:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self._by_engine_id: dict[int, tuple[_Request, _Sample]] = {}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> Iterable[str]:
        return list(self._requests)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            queue: asyncio.Queue, new_engine_id: Callable[[], int]) -> list[EngineCoreRequest]:
        now = time.time()
        samples, children = [], []
        for i in range(params.n):
            child = params.clone()
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + i
            eid = new_engine_id()
            samples.append(_Sample(i, eid))
            children.append(EngineCoreRequest(eid, prompt_token_ids, child, arrival_time=now))
        req = _Request(request_id, prompt, prompt_token_ids, params, queue, samples, now)
        self._requests[request_id] = req
        for s in samples:
            self._by_engine_id[s.engine_id] = (req, s)
        return children

    def abort(self, request_id: str, reason: str) -> list[int]:
        """Finish the request's unfinished samples with ``reason``; returns their engine ids."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        running = [s for s in req.samples if s.finish_reason is None]
        for s in running:
            s.finish_reason = reason
        self._emit(req, running)
        return [s.engine_id for s in running]

    def fail_all(self, exc: BaseException) -> None:
        for req in list(self._requests.values()):
            req.queue.put_nowait(exc)
            self._forget(req)

    def process(self, outputs: list[EngineCoreOutput], metrics: MetricsSink | None) -> list[int]:
        now = time.time()
        touched: dict[str, tuple[_Request, list[_Sample]]] = {}
        for out in outputs:
            entry = self._by_engine_id.get(out.request_id)
            if entry is None:
                continue
            req, sample = entry
            if out.new_token_ids:
                itl = [] if sample.last_token_time is None else [now - sample.last_token_time]
                ttft = now - req.arrival_time if sample.first_token_time is None else None
                if sample.first_token_time is None:
                    sample.first_token_time = now
                sample.last_token_time = now
                sample.token_ids.extend(out.new_token_ids)
                if metrics is not None:
                    metrics.on_tokens(len(out.new_token_ids), ttft, itl)
            if out.finished:
                sample.finish_reason, sample.stop_reason, sample.error = out.finish_reason, out.stop_reason, out.error
            touched.setdefault(req.request_id, (req, []))[1].append(sample)
        for req, samples in touched.values():
            self._emit(req, samples)
            if req.finished and metrics is not None:
                metrics.on_request_finished(self._final(req), len(req.prompt_token_ids),
                                            sum(len(s.token_ids) for s in req.samples))
        return []

    # ------------------------------------------------------------------ assembly
    def _decode(self, ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def _emit(self, req: _Request, samples: list[_Sample]) -> None:
        kind = req.params.output_kind
        for s in samples:
            s.text = self._decode(s.token_ids, req.params)
        if req.finished:
            req.queue.put_nowait(self._final(req) if kind != RequestOutputKind.DELTA else self._delta(req, samples))
            self._forget(req)
        elif kind == RequestOutputKind.DELTA:
            req.queue.put_nowait(self._delta(req, samples))
        elif kind == RequestOutputKind.CUMULATIVE:
            req.queue.put_nowait(self._final(req))

    def _delta(self, req: _Request, samples: list[_Sample]) -> RequestOutput:
        outs = []
        for s in samples:
            text = s.text
            if s.finish_reason is None and text.endswith("\ufffd"):  # a multi-byte character not complete yet
                text = text[:-1]
            outs.append(CompletionOutput(s.index, text[s.sent_text:], s.token_ids[s.sent_tokens:],
                                         finish_reason=s.finish_reason, stop_reason=s.stop_reason))
            s.sent_text, s.sent_tokens = len(text), len(s.token_ids)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             self._metrics(req), self._error(req))

    def _final(self, req: _Request) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.text, list(s.token_ids), finish_reason=s.finish_reason,
                                 stop_reason=s.stop_reason) for s in req.samples]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             self._metrics(req), self._error(req))

    @staticmethod
    def _metrics(req: _Request) -> RequestMetrics:
        firsts = [s.first_token_time for s in req.samples if s.first_token_time is not None]
        lasts = [s.last_token_time for s in req.samples if s.last_token_time is not None]
        return RequestMetrics(req.arrival_time, min(firsts, default=None), max(lasts, default=None),
                              time.time() if req.finished else None)

    @staticmethod
    def _error(req: _Request) -> str | None:
        return next((s.error for s in req.samples if s.error), None)

    def _forget(self, req: _Request) -> None:
        self._requests.pop(req.request_id, None)
        for s in req.samples:
            self._by_engine_id.pop(s.engine_id, None)
