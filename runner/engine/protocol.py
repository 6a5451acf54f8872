"""What a front end needs from the engine while requests arrive and stream (vLLM's ``EngineClient`` protocol).

The OpenAI server (``runner/entrypoints/openai/``) is written against :class:`EngineClient` only: the
multi-process client (one engine-core process per DP rank, ``runner/engine/async_llm.py``) implements it,
and so can a test double. Everything here is asyncio-friendly: no call blocks the event loop on a forward step.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more requests: a rank died or stopped responding (the message names it)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``--max-queued-requests``); the front end answers 503."""


class RequestError(ValueError):
    """A request the engine cannot run (prompt ids outside the vocabulary, prompt + max_tokens over
    max_model_len, ...); ``field`` names the request field at fault, for an HTTP 400 naming it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class EngineShuttingDownError(RuntimeError):
    """The server is draining after SIGTERM/SIGINT and takes no new requests; the front end answers 503."""


@dataclass
class RankStats:
    """One DP rank's engine core, as of its latest report."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # share of KV blocks held, [0, 1]
    num_steps: int = 0  # steps with work on some rank (dummy steps included)
    num_ubatched_steps: int = 0  # steps run as two DBO ubatches
    comm_s: float = 0.0  # all-to-all time on the (emulated) link
    comm_exposed_s: float = 0.0  # of which a ubatch waited for it (not hidden behind compute)
    # the measured DBO cost model per bucket ("decode 256-511 tok replayed"): (DBO on, DBO's speed-up)
    dbo_buckets: dict[str, tuple[bool, float]] = field(default_factory=dict)
    # vLLM's vllm:prefix_cache_queries / vllm:prefix_cache_hits: prompt tokens of admitted requests looked up in
    # this rank's prefix cache, and found there (cumulative)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class EngineStats:
    """All ranks' latest reports. ``comm_hidden_fraction`` is the share of all-to-all time hidden behind compute
    (None until some all-to-all time was measured)."""

    ranks: list[RankStats] = field(default_factory=list)

    @property
    def num_running(self) -> int:
        return sum(r.num_running for r in self.ranks)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.ranks)

    @property
    def kv_cache_usage(self) -> float:
        return max((r.kv_cache_usage for r in self.ranks), default=0.0)

    @property
    def num_steps(self) -> int:
        return max((r.num_steps for r in self.ranks), default=0)  # ranks step together

    @property
    def num_ubatched_steps(self) -> int:
        return max((r.num_ubatched_steps for r in self.ranks), default=0)

    @property
    def comm_hidden_fraction(self) -> float | None:
        comm = sum(r.comm_s for r in self.ranks)
        if comm <= 0:
            return None
        return max(0.0, 1.0 - sum(r.comm_exposed_s for r in self.ranks) / comm)


class MetricsSink(Protocol):
    """Where the engine client reports what it sees (the server's Prometheus metrics implement it)."""

    def on_request_finished(self, output: RequestOutput, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """A finished request; ``output`` holds every sample with its finish_reason."""
        ...

    def on_tokens(self, num_new_tokens: int, ttft_s: float | None, itl_s: list[float]) -> None:
        """New tokens of one request: ``ttft_s`` when the first one arrived, ``itl_s`` the gaps between this
        output and the previous one (one per token after the first of the request)."""
        ...

    def on_prompt_tokens(self, num_tokens: int) -> None:
        ...

    def on_engine_stats(self, stats: EngineStats) -> None:
        ...


class OutputSink(Protocol):
    """Where :meth:`EngineClient.stream` hands one request's outputs, on the event loop, as they come: the
    engine calls these directly (no task, no queue between them), so a front end serving many streams wakes
    each of its readers once per engine step, whatever the number of layers in between."""

    def put(self, output: RequestOutput) -> None:
        """The next output (the last one has ``finished`` set)."""
        ...

    def fail(self, exc: BaseException) -> None:
        """The request failed (the engine died, it refused the request): nothing follows."""
        ...

    def end(self) -> None:
        """No more outputs (after the finished one, or the request was left)."""
        ...


# Ends a stream opened with EngineClient.stream: leaves it, and aborts the request if the engine has not
# finished it.
CloseStream = Callable[[], Awaitable[None]]


class EngineClient(ABC):
    """The engine as the front end sees it: submit, stream, abort, ask about its health and load."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Prompt + generated tokens a request may hold."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        ...

    @abstractmethod
    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (transformers), or None when the model ships none."""

    @abstractmethod
    def default_sampling_params(self) -> dict[str, Any]:
        """Sampling defaults from the checkpoint's ``generation_config.json`` (empty with
        ``--generation-config vllm``): fields a request leaves unset take these values."""

    @abstractmethod
    def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (``params.output_kind``: DELTA for streaming, FINAL_ONLY for one
        output). Raises :class:`EngineOverloadedError`, :class:`EngineShuttingDownError` before anything is
        queued, and :class:`EngineDeadError` if the engine dies while the request runs. Leaving the iterator
        early (a client that disconnected) aborts the request and frees its KV blocks at the next step."""

    def stream(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
               sink: OutputSink) -> CloseStream:
        """:meth:`generate`, with each output handed to ``sink`` instead of yielded; returns the coroutine
        function that ends the stream. This one reads :meth:`generate` from a task of its own (a refusal then
        reaches ``sink.fail``); an engine that produces outputs on the event loop overrides it to call ``sink``
        directly, without that task switch per output, and may raise its refusals here."""
        iterator = self.generate(request_id, prompt, prompt_token_ids, params)
        task = asyncio.create_task(_pump(iterator, sink), name=f"pump {request_id}")

        async def close() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        return close

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """End a request: its iterator yields a final output whose unfinished samples have finish_reason
        "abort" (with FINAL_ONLY, the text generated so far) and ends. A no-op for a finished or unknown id
        (the server also calls it for requests whose iterator it left)."""

    @property
    @abstractmethod
    def dead_error(self) -> str | None:
        """Why the engine is dead (names the rank), or None while every rank is alive."""

    @abstractmethod
    def stats(self) -> EngineStats:
        ...

    @abstractmethod
    async def reset_prefix_cache(self) -> bool:
        """Drop every DP rank's cached prefix blocks (vLLM's ``reset_prefix_cache``): True only if every rank did
        (a rank whose running requests hold cached blocks drops nothing and answers False). Raises
        :class:`EngineDeadError` when the engine is dead."""


async def _pump(iterator: AsyncIterator[RequestOutput], sink: OutputSink) -> None:
    """:meth:`EngineClient.stream`'s task: ``iterator`` into ``sink``; leaving it closes the iterator (which
    aborts an unfinished request, per :meth:`EngineClient.generate`)."""
    try:
        async for output in iterator:
            sink.put(output)
        sink.end()
    except Exception as exc:  # noqa: BLE001  (handed to the reader, which answers it (500 for EngineDeadError, 503 ...))
        sink.fail(exc)
    finally:
        if isinstance(iterator, AsyncGenerator):
            await iterator.aclose()
