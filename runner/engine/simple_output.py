"""The server engine client's requests: each one's sink, over the engine client's :class:`OutputProcessor`
(``output_processor.py``: detokenization, stop strings, ``n > 1``, output kinds, log-probabilities).

The processor turns each step's outputs into ``RequestOutput`` s in one pass; this hands each to its request's
sink (``protocol.OutputSink``: the request handler's buffer, woken at most once per step), reports tokens and
finished requests to the metrics sink, and
hands back the engine requests the processor stopped (a stop string), which the client aborts in their
ranks. ``n > 1``: one engine request per sample; a seeded request's sample ``i`` uses ``seed + i`` (vLLM's
parallel sampling), so each sample is reproducible on its own.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

from runner.core.requests import EngineCoreOutputs, EngineCoreRequest
from runner.engine.generation_config import GenerationConfig
from runner.engine.output_processor import OutputProcessor
from runner.engine.protocol import MetricsSink, OutputSink
from runner.engine.tokenizer import Tokenizer
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams


class RequestTracker:
    """``max_tokens`` must be resolved by the caller (the client knows ``max_model_len`` only once the ranks
    are up); ``generation_config`` adds the checkpoint's EOS ids to every request."""

    def __init__(self, tokenizer: Tokenizer, generation_config: GenerationConfig | None = None) -> None:
        self.processor = OutputProcessor(tokenizer, None, generation_config)
        self._sinks: dict[str, OutputSink] = {}
        self._arrival: dict[str, float] = {}
        self._generated: dict[str, int] = {}  # request id -> tokens so far, over its samples
        self._last_token: dict[int, float] = {}  # engine request id -> when its last token came

    @property
    def num_requests(self) -> int:
        return len(self._sinks)

    def has(self, request_id: str) -> bool:
        return request_id in self._sinks

    def request_ids(self) -> Iterable[str]:
        return list(self._sinks)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            sink: OutputSink, new_engine_id: Callable[[], int]) -> list[EngineCoreRequest]:
        now = time.time()
        children = self.processor.add_request(request_id, prompt, prompt_token_ids, params, now,
                                              engine_request_ids=[new_engine_id() for _ in range(params.n)])
        self._sinks[request_id] = sink
        self._arrival[request_id] = now
        self._generated[request_id] = 0
        return children

    def abort(self, request_id: str, reason: str, metrics: MetricsSink | None) -> list[int]:
        """Finish the request's unfinished samples with ``reason`` (its sink gets that final output, and
        ``metrics`` counts it finished with that reason); returns their engine ids."""
        outputs, engine_ids = self.processor.abort_requests([request_id], reason=reason)
        self._deliver(outputs, metrics)
        for eid in engine_ids:
            self._last_token.pop(eid, None)
        return engine_ids

    def fail_all(self, exc: BaseException) -> None:
        for request_id, sink in list(self._sinks.items()):
            sink.fail(exc)
            _, engine_ids = self.processor.abort_requests([request_id])
            for eid in engine_ids:
                self._last_token.pop(eid, None)
            self._forget(request_id)

    def process(self, outputs: EngineCoreOutputs, metrics: MetricsSink | None) -> list[int]:
        """Hand the ranks' outputs to their requests; returns the engine requests to abort (stopped here).
        The step's tokens and gaps go to ``metrics`` in one report (a request's first token in one of its own,
        with its time to first token)."""
        now = time.time()
        states, last_token, generated = self.processor.request_states, self._last_token, self._generated
        num_tokens, gaps = 0, []
        counts = itertools.chain(zip(outputs.array_request_ids(), itertools.repeat(1)),
                                 ((out.request_id, len(out.new_token_ids)) for out in outputs.outputs))
        for engine_id, num_new in counts:
            if not num_new:
                continue
            state = states.get(engine_id)
            if state is None:
                continue
            last = last_token.get(engine_id)
            last_token[engine_id] = now
            generated[state.request_id] += num_new
            num_tokens += num_new
            if last is not None:
                gaps.append(now - last)
            elif metrics is not None:
                metrics.on_tokens(0, now - self._arrival[state.request_id], [])
        if metrics is not None and num_tokens:
            metrics.on_tokens(num_tokens, None, gaps)
        request_outputs, to_abort = self.processor.process_outputs(outputs, now)
        for out in outputs.outputs:  # an array token never finishes a request
            if out.finish_reason is not None:
                last_token.pop(out.request_id, None)
        for engine_id in to_abort:
            last_token.pop(engine_id, None)
        self._deliver(request_outputs, metrics)
        return to_abort

    def _deliver(self, outputs: list[RequestOutput], metrics: MetricsSink | None) -> None:
        for ro in outputs:
            sink = self._sinks.get(ro.request_id)
            if sink is None:
                continue
            sink.put(ro)
            if ro.finished:
                sink.end()
                if metrics is not None:
                    metrics.on_request_finished(ro, len(ro.prompt_token_ids), self._generated[ro.request_id])
                self._forget(ro.request_id)

    def _forget(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._arrival.pop(request_id, None)
        self._generated.pop(request_id, None)
