"""A test double of ``runner.engine.protocol.EngineClient`` for the OpenAI server's tests.

Deterministic: sample ``s`` of a request generates, at position ``k``, the letter
``LETTERS[(sum(prompt_ids) + 7 k + 3 s + 11 seed) % 26]`` (one byte-level token each), so a test can work out
every expected text from the prompt alone (``expected_text``). It follows the EngineClient contract the way
the real client must: DELTA outputs per step (each sample in its own RequestOutput, so the server sees subsets
of samples), one FINAL_ONLY output, stop strings held back until they are complete and cut out (vLLM's output
processor), ``stop_token_ids``, ``max_tokens``; ``abort`` ends a request with finish_reason "abort" (FINAL_ONLY:
with the text so far); leaving its iterator aborts it; overload and shutdown raise before anything is queued;
``kill`` makes it dead (iterators raise ``EngineDeadError``, ``dead_event`` is set). It reports to a
``MetricsSink`` as the real client does, and records what reached it (``submitted``, ``aborted``).

The tokenizer is a real transformers ``PreTrainedTokenizerFast`` built with ``tokenizers``: byte-level, no
merges (one token per byte), ChatML special tokens and a ChatML chat template.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from runner.engine.protocol import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    EngineShuttingDownError,
    EngineStats,
    MetricsSink,
    RankStats,
    RequestError,
)
from runner.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from runner.sampling_params import RequestOutputKind, SamplingParams

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@functools.lru_cache(maxsize=2)
def make_tokenizer(chat_template: bool = True) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for s in SPECIAL_TOKENS:
        vocab[s] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    if chat_template:
        tok.chat_template = CHATML_TEMPLATE
    return tok


def letter(prompt_ids: list[int], sample: int, seed: int | None, k: int) -> str:
    return LETTERS[(sum(prompt_ids) + 7 * k + 3 * sample + 11 * (seed or 0)) % 26]


def expected_text(prompt_ids: list[int], sample: int, seed: int | None, num_tokens: int) -> str:
    return "".join(letter(prompt_ids, sample, seed, k) for k in range(num_tokens))


def expected_logprob(k: int, rank: int) -> float:
    """The log-probability the double gives the token of ``rank`` at position ``k``."""
    return -0.25 * rank - 0.01 * (k % 7)


def sampled_rank(k: int) -> int:
    """The sampled token is not always the most likely one: rank 1, 2, 3, 1, 2, 3, ..."""
    return 1 + k % 3


@dataclass
class _Sample:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # full text, stop string cut out once found
    sent: int = 0  # characters of text already sent (DELTA)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    rank: int
    arrival: float
    samples: list[_Sample]
    aborted: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None


class FakeEngineClient(EngineClient):
    def __init__(self, *, max_model_len: int = 256, token_delay_s: float = 0.0, defaults: dict[str, Any] | None = None,
                 metrics: MetricsSink | None = None, max_running: int | None = None, chat_template: bool = True,
                 with_tokenizer: bool = True, num_ranks: int = 2) -> None:
        self._max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.defaults = dict(defaults or {})
        self.metrics = metrics
        self.max_running = max_running
        self.tokenizer = make_tokenizer(chat_template) if with_tokenizer else None
        self.num_ranks = num_ranks
        self.submitted: list[tuple[str, str | None, list[int], SamplingParams]] = []
        self.aborted: list[str] = []  # requests ended by abort() or by leaving their iterator, unfinished
        self.finished: list[str] = []
        self.running: dict[str, _Request] = {}
        self.shutting_down = False
        self.request_error: RequestError | None = None  # raised by every generate, as the engine's own checks do
        self._dead: str | None = None
        self._dead_event: asyncio.Event | None = None
        self._steps = 0
        self._next_rank = 0

    # ---- EngineClient ------------------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return len(make_tokenizer())

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def default_sampling_params(self) -> dict[str, Any]:
        return dict(self.defaults)

    @property
    def dead_error(self) -> str | None:
        return self._dead

    @property
    def dead_event(self) -> asyncio.Event:
        """Set when the engine dies (create it on the server's event loop before ``kill``)."""
        if self._dead_event is None:
            self._dead_event = asyncio.Event()
        return self._dead_event

    def stats(self) -> EngineStats:
        ranks = [RankStats() for _ in range(self.num_ranks)]
        for req in self.running.values():
            r = ranks[req.rank]
            r.num_running += 1
            r.kv_cache_usage += (len(req.prompt_ids) + max(len(s.token_ids) for s in req.samples)) / 1000.0
        for r in ranks:
            r.num_steps = self._steps
            r.num_ubatched_steps = self._steps // 2
            r.comm_s = 0.004 * self._steps
            r.comm_exposed_s = 0.001 * self._steps
        return EngineStats(ranks=ranks)

    async def reset_prefix_cache(self) -> bool:
        """The double caches nothing; like a rank whose requests hold cached blocks, it refuses while one runs."""
        return not self.running

    async def abort(self, request_id: str) -> None:
        req = self.running.get(request_id)
        if req is not None and not req.aborted:
            req.aborted = True
            self.aborted.append(request_id)

    def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        return self._generate(request_id, prompt, list(prompt_token_ids), params)

    # ---- test controls -----------------------------------------------------------------------------------------
    def kill(self, reason: str) -> None:
        """The engine dies (call on the server's event loop): running and new requests raise EngineDeadError."""
        self._dead = reason
        self.dead_event.set()

    # ---- the generation ----------------------------------------------------------------------------------------
    async def _generate(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.shutting_down:
            raise EngineShuttingDownError("the engine is shutting down")
        if self.request_error is not None:
            raise self.request_error
        if self.max_running is not None and len(self.running) >= self.max_running:
            raise EngineOverloadedError(f"{len(self.running)} requests are running, the limit is {self.max_running}")
        if params.output_kind not in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
            raise ValueError(f"the double serves DELTA and FINAL_ONLY, not {params.output_kind}")
        self.submitted.append((request_id, prompt, prompt_ids, params))
        req = _Request(request_id, prompt_ids, params, self._next_rank, time.time(),
                       [_Sample(i) for i in range(params.n)])
        self._next_rank = (self._next_rank + 1) % self.num_ranks
        self.running[request_id] = req
        if self.metrics is not None:
            self.metrics.on_prompt_tokens(len(prompt_ids))
        done = False
        try:
            k = 0
            while True:
                await asyncio.sleep(self.token_delay_s)
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                live = [s for s in req.samples if s.finish_reason is None]
                if req.aborted:
                    for s in live:
                        s.finish_reason = "abort"
                    yield self._output(req, live, final=True)
                    done = True
                    return
                self._steps += 1
                for s in live:
                    self._step(req, s, k)
                self._report_tokens(req, len(live))
                k += 1
                final = all(s.finish_reason is not None for s in req.samples)
                if params.output_kind == RequestOutputKind.DELTA:
                    for s in live:  # one output per sample: the server must place each by its index
                        yield self._output(req, [s], final=final and s is live[-1])
                elif final:
                    yield self._output(req, req.samples, final=True)
                if final:
                    done = True
                    return
        finally:
            self.running.pop(request_id, None)
            if done and not req.aborted:
                self.finished.append(request_id)
            elif not done and not req.aborted:  # the server left the iterator: that aborts the request
                req.aborted = True
                self.aborted.append(request_id)

    def _step(self, req: _Request, s: _Sample, k: int) -> None:
        params = req.params
        # SamplingParams made ``stop`` and ``stop_token_ids`` lists; the server resolved ``max_tokens``
        assert isinstance(params.stop, list) and params.stop_token_ids is not None and params.max_tokens is not None
        ch = letter(req.prompt_ids, s.index, params.seed, k)
        token = self.vocab_id(ch)
        s.token_ids.append(token)
        s.text += ch
        if params.logprobs is not None:
            s.logprobs.append(self._logprobs(token, k, params.logprobs))
        if token in (params.stop_token_ids or ()):
            s.finish_reason, s.stop_reason = "stop", token
        for stop in [params.stop] if isinstance(params.stop, str) else params.stop or []:
            at = s.text.find(stop)
            if at >= 0:
                s.text = s.text[:at + len(stop)] if params.include_stop_str_in_output else s.text[:at]
                s.finish_reason, s.stop_reason = "stop", stop
                break
        limit = params.max_tokens if params.max_tokens is not None else self._max_model_len - len(req.prompt_ids)
        if s.finish_reason is None and len(s.token_ids) >= limit:
            s.finish_reason = "length"

    def _logprobs(self, token: int, k: int, num_top: int) -> dict[int, Logprob]:
        rank = sampled_rank(k)
        step = {token: Logprob(expected_logprob(k, rank), rank, self.tokenizer.decode([token]) if self.tokenizer
                               else None)}
        others = [self.vocab_id(c) for c in LETTERS if self.vocab_id(c) != token]
        ranks = [r for r in range(1, num_top + 1) if r != rank]
        for r, t in zip(ranks, others[k % 5:], strict=False):  # one letter per rank; the letters may run out
            step[t] = Logprob(expected_logprob(k, r), r, None)  # decoded by the server's tokenizer
        return step

    def _output(self, req: _Request, samples: list[_Sample], final: bool) -> RequestOutput:
        delta = req.params.output_kind == RequestOutputKind.DELTA
        outs = []
        for s in samples:
            if delta:
                hold = 0 if s.finish_reason is not None else req.params.output_text_buffer_length
                upto = max(s.sent, len(s.text) - hold)
                text, s.sent = s.text[s.sent:upto], upto
                # this step's token; an aborted sample made none
                ids, lps = ([], []) if s.finish_reason == "abort" else (s.token_ids[-1:], s.logprobs[-1:])
            else:
                text, ids, lps = s.text, list(s.token_ids), list(s.logprobs)
            outs.append(CompletionOutput(index=s.index, text=text, token_ids=ids,
                                         logprobs=lps if req.params.logprobs is not None else None,
                                         finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        now = time.time()
        output = RequestOutput(req.request_id, None, req.prompt_ids, outs, final,
                               metrics=RequestMetrics(req.arrival, req.first_token_time, req.last_token_time,
                                                      now if final else None))
        if final and self.metrics is not None:
            full = [CompletionOutput(s.index, s.text, list(s.token_ids), finish_reason=s.finish_reason,
                                     stop_reason=s.stop_reason) for s in req.samples]
            self.metrics.on_request_finished(
                RequestOutput(req.request_id, None, req.prompt_ids, full, True, metrics=output.metrics),
                len(req.prompt_ids), sum(len(s.token_ids) for s in req.samples))
        return output

    def _report_tokens(self, req: _Request, num_new: int) -> None:
        now = time.time()
        ttft = None
        gaps: list[float] = []
        if req.first_token_time is None:
            req.first_token_time = now
            ttft = now - req.arrival
        else:
            gaps = [now - (req.last_token_time or now)] * num_new
        req.last_token_time = now
        if self.metrics is not None:
            self.metrics.on_tokens(num_new, ttft, gaps)
            self.metrics.on_engine_stats(self.stats())

    @staticmethod
    def vocab_id(ch: str) -> int:
        return make_tokenizer().convert_tokens_to_ids(ch)
