"""The server engine client's requests: each one's queue, over the engine client's :class:`OutputProcessor`
(``output_processor.py``: detokenization, stop strings, ``n > 1``, output kinds, log-probabilities).

The processor turns the ranks' outputs into ``RequestOutput`` s; this puts each on its request's queue (the
request handler's ``generate`` loop reads it), reports tokens and finished requests to the metrics sink, and
hands back the engine requests the processor stopped (a stop string), which the client aborts in their
ranks. ``n > 1``: one engine request per sample; a seeded request's sample ``i`` uses ``seed + i`` (vLLM's
parallel sampling), so each sample is reproducible on its own.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Iterable

from runner.core.requests import EngineCoreOutput, EngineCoreRequest
from runner.engine.generation_config import GenerationConfig
from runner.engine.output_processor import OutputProcessor
from runner.engine.protocol import MetricsSink
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams


class RequestTracker:
    """``max_tokens`` must be resolved by the caller (the client knows ``max_model_len`` only once the ranks
    are up); ``generation_config`` adds the checkpoint's EOS ids to every request."""

    def __init__(self, tokenizer: Any, generation_config: GenerationConfig | None = None) -> None:
        self.processor = OutputProcessor(tokenizer, None, generation_config)
        self._queues: dict[str, asyncio.Queue] = {}
        self._arrival: dict[str, float] = {}
        self._generated: dict[str, int] = {}  # request id -> tokens so far, over its samples
        self._last_token: dict[int, float] = {}  # engine request id -> when its last token came

    @property
    def num_requests(self) -> int:
        return len(self._queues)

    def has(self, request_id: str) -> bool:
        return request_id in self._queues

    def request_ids(self) -> Iterable[str]:
        return list(self._queues)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            queue: asyncio.Queue, new_engine_id: Callable[[], int]) -> list[EngineCoreRequest]:
        now = time.time()
        children = self.processor.add_request(request_id, prompt, prompt_token_ids, params, now,
                                              engine_request_ids=[new_engine_id() for _ in range(params.n)])
        self._queues[request_id] = queue
        self._arrival[request_id] = now
        self._generated[request_id] = 0
        return children

    def abort(self, request_id: str, reason: str, metrics: MetricsSink | None) -> list[int]:
        """Finish the request's unfinished samples with ``reason`` (its queue gets that final output, and
        ``metrics`` counts it finished with that reason); returns their engine ids."""
        outputs, engine_ids = self.processor.abort_requests([request_id], reason=reason)
        self._deliver(outputs, metrics)
        for eid in engine_ids:
            self._last_token.pop(eid, None)
        return engine_ids

    def fail_all(self, exc: BaseException) -> None:
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(exc)
            _, engine_ids = self.processor.abort_requests([request_id])
            for eid in engine_ids:
                self._last_token.pop(eid, None)
            self._forget(request_id)

    def process(self, outputs: list[EngineCoreOutput], metrics: MetricsSink | None) -> list[int]:
        """Hand the ranks' outputs to their requests; returns the engine requests to abort (stopped here)."""
        now = time.time()
        for out in outputs:
            if not out.new_token_ids:
                continue
            state = self.processor.request_states.get(out.request_id)
            if state is None:
                continue
            last = self._last_token.get(out.request_id)
            self._last_token[out.request_id] = now
            self._generated[state.request_id] += len(out.new_token_ids)
            if metrics is not None:
                ttft = now - self._arrival[state.request_id] if last is None else None
                metrics.on_tokens(len(out.new_token_ids), ttft, [] if last is None else [now - last])
        request_outputs, to_abort = self.processor.process_outputs(outputs, now)
        for out in outputs:
            if out.finished or out.request_id in to_abort:
                self._last_token.pop(out.request_id, None)
        self._deliver(request_outputs, metrics)
        return to_abort

    def _deliver(self, outputs: list[RequestOutput], metrics: MetricsSink | None) -> None:
        for ro in outputs:
            queue = self._queues.get(ro.request_id)
            if queue is None:
                continue
            queue.put_nowait(ro)
            if ro.finished:
                if metrics is not None:
                    metrics.on_request_finished(ro, len(ro.prompt_token_ids), self._generated[ro.request_id])
                self._forget(ro.request_id)

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._arrival.pop(request_id, None)
        self._generated.pop(request_id, None)
