"""From engine-core outputs (token ids per step) to vLLM's ``RequestOutput`` (vLLM's
``vllm/v1/engine/output_processor.py``), for the offline ``LLM`` and the OpenAI server alike.

The caller registers each request with :meth:`OutputProcessor.add_request`, which returns the engine-core
requests to send (one, or ``n`` children; their integer ids are the caller's, unique across every DP rank it
drives), then feeds every rank's :class:`~runner.core.requests.EngineCoreOutput` s to
:meth:`~OutputProcessor.process_outputs`, which detokenizes (``detokenizer.py``), finds stop strings, gathers
log-probabilities (``logprobs.py``) and returns ``(request_outputs, engine_request_ids_to_abort)``. A stop
string is found here, not in the engine core, so the core does not know the request is done: its id comes
back in the abort list, and the caller must abort it there.

``SamplingParams.output_kind`` says what each ``RequestOutput`` carries: FINAL_ONLY (the offline ``LLM``) one
output when the request finishes; CUMULATIVE everything so far; DELTA (streaming) only the text, token ids and
log-probabilities new since the previous output. Text near the end is held back while a stop string could
still complete there (``detokenizer.py``).

Pure Python, no blocking, no global state: a server can call it from an asyncio task.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runner.core.logprob_rows import LogprobTokens
from runner.core.requests import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from runner.engine.byte_level import byte_level_table
from runner.engine.detokenizer import IncrementalDetokenizer
from runner.engine.generation_config import GenerationConfig
from runner.engine.logprobs import LogprobsState, PromptLogprobsState, TokenTexts
from runner.engine.parallel_sampling import ParentRequest, child_default_seed, child_params
from runner.engine.tokenizer import Tokenizer
from runner.outputs import CompletionOutput, RequestMetrics, RequestOutput
from runner.sampling_params import RequestOutputKind, SamplingParams


@dataclass(eq=False)
class RequestState:
    """One engine request (one sample) as the client sees it."""

    engine_request_id: int
    request_id: str  # the client's id (the parent's, for a child)
    index: int  # which of the parent's n samples
    parent: ParentRequest | None
    prompt: str | None
    prompt_token_ids: Any  # a list of ids; a bad prompt stays as given, and the engine core refuses it
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsState
    metrics: RequestMetrics  # shared by the children of one request
    prompt_logprobs: PromptLogprobsState  # shared by the children; child 0 computes them
    error: str | None = None
    num_cached_tokens: int | None = None  # as the engine core reported it (None: not scheduled yet)
    delta: bool = field(init=False)  # output_kind is DELTA (looked up once: it is read per token)
    final_only: bool = field(init=False)  # output_kind is FINAL_ONLY
    wants_logprobs: bool = field(init=False)  # the request asked for sample log-probabilities
    plain: bool = field(init=False)  # one DELTA sample, no log-probabilities of either kind: the common case
    quiet: bool = field(init=False)  # FINAL_ONLY without sample log-probabilities: nothing to do until it ends
    output_prompt_ids: list[int] = field(init=False)  # RequestOutput.prompt_token_ids ([] for a bad prompt)

    def __post_init__(self) -> None:
        self.delta = self.output_kind == RequestOutputKind.DELTA
        self.final_only = self.output_kind == RequestOutputKind.FINAL_ONLY
        self.wants_logprobs = self.logprobs.logprobs is not None
        self.plain = self.delta and self.parent is None and not self.wants_logprobs \
            and self.prompt_logprobs.prompt_logprobs is None
        self.quiet = self.final_only and not self.wants_logprobs
        self.output_prompt_ids = self.prompt_token_ids if isinstance(self.prompt_token_ids, list) else []

    def completion(self, new_token_ids: list[int], finish_reason: str | None,
                   stop_reason: int | str | None) -> CompletionOutput:
        finished = finish_reason is not None
        delta = self.delta
        text = self.detokenizer.get_next_output_text(finished, delta)
        logprobs = self.logprobs.logprobs
        if delta:
            token_ids = list(new_token_ids)
            if logprobs is not None:
                logprobs = logprobs[len(logprobs) - len(new_token_ids):]
        else:
            token_ids = list(self.detokenizer.token_ids)
            if logprobs is not None:
                logprobs = list(logprobs)
        # positional, in the dataclass's field order (keywords cost a third of a microsecond more per token):
        # index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason
        return CompletionOutput(self.index, text, token_ids, self.logprobs.cumulative_logprob, logprobs,
                                finish_reason, stop_reason if finished else None)


class OutputProcessor:
    """Per-request state of every request in flight. ``tokenizer`` None: token ids only (``text`` stays "").
    ``max_model_len`` resolves ``max_tokens=None`` (None: the caller resolves it before ``add_request``);
    ``generation_config`` adds the checkpoint's EOS ids."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int | None,
                 generation_config: GenerationConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.generation_config = generation_config or GenerationConfig()
        self.request_states: dict[int, RequestState] = {}  # by engine request id
        # single tokens' texts per decoding options (skip_special_tokens, spaces_between_special_tokens)
        self._token_texts: dict[tuple[bool, bool], dict[int, str]] = {}
        # the texts of log-probabilities' tokens: decoded alone with special tokens kept
        self._logprob_texts = TokenTexts(tokenizer, self._token_texts.setdefault((False, True), {}))
        self._byte_table = None if tokenizer is None else byte_level_table(tokenizer)  # byte-level: tokens' bytes
        self._children: dict[str, list[int]] = {}  # client request id -> its live engine request ids

    # ------------------------------------------------------------------ requests
    # prompt_token_ids: as the caller gave them (a bad prompt stays as given, and the engine core refuses it)
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: Any, params: SamplingParams,
                    arrival_time: float | None = None, *, engine_request_ids: Sequence[int],
                    default_seed: int = 0) -> list[EngineCoreRequest]:
        """Register a request and return its engine-core requests (``params.n`` of them, with the ids given in
        ``engine_request_ids``). ``default_seed`` seeds a random request without ``seed`` (child k: see
        ``parallel_sampling.py``). Raises ValueError for a request that cannot be served at all (a duplicate
        id, stop strings without a tokenizer)."""
        if request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(engine_request_ids)
        if len(ids) != params.n:
            raise ValueError(f"request {request_id!r} has n={params.n} samples but {len(ids)} engine request ids")
        taken = [i for i in ids if i in self.request_states]
        if taken or len(set(ids)) != len(ids):
            raise ValueError(f"engine request id {taken[0] if taken else ids} is already in use")
        arrival = time.time() if arrival_time is None else arrival_time
        base = self.generation_config.apply(params)
        if base.max_tokens is None:
            if self.max_model_len is None:
                raise ValueError(f"request {request_id!r}: max_tokens=None needs the engine's max_model_len")
            base = base.clone() if base is params else base
            base.max_tokens = max(1, self.max_model_len - (len(prompt_token_ids)
                                                           if isinstance(prompt_token_ids, list) else 0))
        parent = ParentRequest(request_id, base, ids) if base.n > 1 else None
        metrics = RequestMetrics(arrival_time=arrival)
        prompt_len = len(prompt_token_ids) if isinstance(prompt_token_ids, list) else 0
        prompt_logprobs = PromptLogprobsState(self._logprob_texts, base.prompt_logprobs, prompt_len)
        states, requests = [], []
        for index, engine_id in enumerate(ids):
            child = child_params(base, index) if parent is not None else base
            if index > 0 and child.prompt_logprobs is not None:  # one sample's prefill computes them for all
                child = child.clone()
                child.prompt_logprobs = None
            states.append(RequestState(
                engine_id, request_id, index, parent, prompt, prompt_token_ids, base.output_kind,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child, self._token_texts.setdefault(
                    (child.skip_special_tokens, child.spaces_between_special_tokens), {}), self._byte_table),
                LogprobsState(self._logprob_texts, child.logprobs), metrics, prompt_logprobs))
            requests.append(EngineCoreRequest(engine_id, prompt_token_ids, child,
                                              default_seed=child_default_seed(default_seed, index),
                                              arrival_time=arrival))
        for state in states:
            self.request_states[state.engine_request_id] = state
        self._children[request_id] = ids
        return requests

    def abort_requests(self, request_ids: Iterable[str], now: float | None = None,
                       reason: str = "abort") -> tuple[list[RequestOutput], list[int]]:
        """Finish these client requests now (a client went away, the server drains): returns their final
        outputs (``finish_reason`` ``reason`` for every sample still running; a streaming consumer waits for
        them) and their engine request ids still running, which the caller must abort in the engine cores.
        Unknown or finished ids are ignored."""
        now = time.time() if now is None else now
        outputs: list[RequestOutput] = []
        engine_ids: list[int] = []
        for rid in request_ids:
            for eid in list(self._children.get(rid, ())):
                state = self.request_states.get(eid)
                if state is None:
                    continue
                engine_ids.append(eid)
                result = self._request_output(state, [], reason, None, now)
                if result is not None:
                    outputs.append(result)
                self._finish(state)
        return outputs, engine_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def unfinished_engine_request_ids(self) -> list[int]:
        return list(self.request_states)

    # ------------------------------------------------------------------ outputs
    def process_outputs(self, outputs: EngineCoreOutputs | Iterable[EngineCoreOutput],
                        now: float | None = None) -> tuple[list[RequestOutput], list[int]]:
        """Turn one batch of engine-core outputs (from any DP rank, any order) into RequestOutputs; returns
        them and the engine request ids that stopped here (a stop string, or bad log-probabilities) and must
        be aborted in the engine core. Outputs of unknown (aborted, finished) requests are ignored. An engine
        core's :class:`EngineCoreOutputs` are read as they came: its array tokens (plain, then with
        log-probabilities), then its structs."""
        now = time.time() if now is None else now
        request_outputs: list[RequestOutput] = []
        to_abort: list[int] = []
        structs: Iterable[EngineCoreOutput] = outputs
        if isinstance(outputs, EngineCoreOutputs):
            self._process_plain_tokens(outputs, now, request_outputs, to_abort)
            for block in outputs.logprob_tokens:
                self._process_logprob_tokens(block, now, request_outputs, to_abort)
            structs = outputs.outputs
        states = self.request_states
        for out in structs:
            state = states.get(out.request_id)
            if state is None:
                continue
            new_ids = out.new_token_ids  # read here, never kept: the detokenizer and the output copy it
            if out.num_cached_tokens is not None:
                state.num_cached_tokens = out.num_cached_tokens
            stop_reason: int | str | None
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if new_ids:
                metrics = state.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
                stop_string = state.detokenizer.update(new_ids, finish_reason == "stop")
                if stop_string is not None:
                    finish_reason, stop_reason = "stop", stop_string
            if finish_reason is None and state.quiet and not out.new_prompt_logprobs:
                continue  # the offline LLM's running requests: _request_output would return None, nothing else
            if finish_reason is None and state.plain and not out.new_prompt_logprobs:
                request_outputs.append(self._plain_output(state, new_ids))
                continue
            self._emit(state, out, finish_reason, stop_reason, now, request_outputs, to_abort)
        return request_outputs, to_abort

    def _process_plain_tokens(self, outputs: EngineCoreOutputs, now: float, request_outputs: list[RequestOutput],
                              to_abort: list[int]) -> None:
        """:meth:`process_outputs` for the plain tokens (one new token of a running request each, nothing
        else): the same steps, read from the arrays."""
        states = self.request_states
        for engine_id, token in zip(outputs.request_ids.tolist(), outputs.token_ids.tolist(), strict=True):
            state = states.get(engine_id)
            if state is None:
                continue
            new_ids = [token]
            stop_string = _arrive(state, new_ids, now)
            if stop_string is None:
                if state.quiet:
                    continue
                if state.plain:
                    request_outputs.append(self._plain_output(state, new_ids))
                    continue
            self._emit(state, EngineCoreOutput(engine_id, new_ids), None if stop_string is None else "stop",
                       stop_string, now, request_outputs, to_abort)

    def _process_logprob_tokens(self, block: LogprobTokens, now: float, request_outputs: list[RequestOutput],
                                to_abort: list[int]) -> None:
        """:meth:`process_outputs` for one step's tokens with log-probabilities (one new token of a running
        request each, with its row): the arrays read as lists once, then a row per request."""
        states = self.request_states
        rows = block.rows.lists()
        for engine_id, token, logprob, rank, top_ids, top_lps in zip(block.ids().tolist(), *rows, strict=True):
            state = states.get(engine_id)
            if state is None:
                continue
            new_ids = [token]
            stop_string = _arrive(state, new_ids, now)
            if state.wants_logprobs:  # as _emit: rows a request did not ask for are not kept
                state.logprobs.add(token, logprob, rank, top_ids, top_lps)
            self._finish_output(state, new_ids, None, None, False, None if stop_string is None else "stop",
                                stop_string, now, request_outputs, to_abort)

    @staticmethod
    def _plain_output(state: RequestState, new_ids: list[int]) -> RequestOutput:
        """What :meth:`_request_output` builds for a running plain request, inline (most outputs): its new text
        and ids; no error (that finishes a request), no log-probabilities."""
        return RequestOutput(
            state.request_id, state.prompt, state.output_prompt_ids,
            [CompletionOutput(state.index, state.detokenizer.get_next_output_text(False, True),
                              list(new_ids), None, None, None, None)],
            False, state.metrics, None, None, state.num_cached_tokens)

    def _emit(self, state: RequestState, out: EngineCoreOutput, finish_reason: str | None,
              stop_reason: int | str | None, now: float, request_outputs: list[RequestOutput],
              to_abort: list[int]) -> None:
        """The rest of :meth:`process_outputs` for one output once its text is updated (``finish_reason`` and
        ``stop_reason`` include a stop string found here): log-probabilities, the RequestOutput, the finish."""
        new_ids = out.new_token_ids
        problem = None  # the two updates return None at once where nothing was asked nor sent: skipped
        if state.wants_logprobs:
            problem = state.logprobs.update(new_ids, out.new_logprobs)
        if problem is None and out.new_prompt_logprobs:
            problem = state.prompt_logprobs.update(out.prompt_logprobs_start, out.new_prompt_logprobs)
        self._finish_output(state, new_ids, problem, out.error, out.finished, finish_reason, stop_reason, now,
                            request_outputs, to_abort)

    def _finish_output(self, state: RequestState, new_ids: list[int], problem: str | None, error: str | None,
                       finished_in_core: bool, finish_reason: str | None, stop_reason: int | str | None, now: float,
                       request_outputs: list[RequestOutput], to_abort: list[int]) -> None:
        """The RequestOutput of one output whose text and log-probabilities are in: ``problem`` (the engine's
        log-probabilities do not fit) finishes the request with an error; a finish here that the engine core did
        not report (``finished_in_core``: a stop string, a problem) adds the request to ``to_abort``."""
        if problem is not None:
            finish_reason, stop_reason, error = "error", None, f"request {state.request_id!r}: {problem}"
        if finish_reason is not None and error is not None:
            state.error = error
            if state.parent is not None and state.parent.error is None:
                state.parent.error = error
        result = self._request_output(state, new_ids, finish_reason, stop_reason, now)
        if result is not None:
            request_outputs.append(result)
        if finish_reason is not None:
            self._finish(state)
            if not finished_in_core:  # stopped here: the engine core still runs it
                to_abort.append(state.engine_request_id)

    def _request_output(self, state: RequestState, new_ids: list[int], finish_reason: str | None,
                        stop_reason: int | str | None, now: float) -> RequestOutput | None:
        finished = finish_reason is not None
        if state.final_only and not finished:
            return None
        completion = state.completion(new_ids, finish_reason, stop_reason)
        if state.parent is None:
            outputs = [completion]
        else:
            outputs, finished = state.parent.get_outputs(state.engine_request_id, completion)
            if not outputs:
                return None
        if finished:
            state.metrics.finished_time = now
        error = state.error if state.parent is None else state.parent.error
        # positional, in the field order: request_id, prompt, prompt_token_ids, outputs, finished, metrics,
        # error, prompt_logprobs, num_cached_tokens
        return RequestOutput(state.request_id, state.prompt, state.output_prompt_ids, outputs, finished,
                             state.metrics, error, state.prompt_logprobs.prompt_logprobs, state.num_cached_tokens)

    def _finish(self, state: RequestState) -> None:
        self.request_states.pop(state.engine_request_id, None)
        if state.parent is not None and state.parent.running:
            return
        self._children.pop(state.request_id, None)


def _arrive(state: RequestState, new_ids: list[int], now: float) -> str | None:
    """A running request's array token arrives: its metrics' timestamps, then its text; returns the stop string
    that text completed, or None."""
    metrics = state.metrics
    if metrics.first_token_time is None:
        metrics.first_token_time = now
    metrics.last_token_time = now
    return state.detokenizer.update(new_ids, False)
