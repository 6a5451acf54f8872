"""What the completion and chat handlers share (vLLM's ``OpenAIServing``): reading the body, the model check,
tokenization, the checks a prompt must pass before any engine sees it, starting the engine requests, the
accumulated choices, and the mapping of engine failures to HTTP statuses.

Order of checks, so that nothing reaches the engine unless the whole request is valid: body and fields (400),
``n`` times the prompts within ``--max-n`` (400), model (404), prompts (tokenized here, in one tokenizer thread
off the event loop, so a long prompt or chat template delays no other request's stream nor ``/health``; one
thread, as vLLM does, because a tokenizer is not safe to use from several at once; a request's own chat template
renders in a child process, ``chat_render``), token ids in the vocabulary and prompt + max_tokens within
``max_model_len`` (400), sampling values (400), then admission (503 draining / 500 dead) and the engine. A client
that disconnects while its prompt is rendered or tokenized ends its request there (``until_disconnect``).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from runner.engine.protocol import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    EngineShuttingDownError,
    RequestError,
)
from runner.entrypoints.openai.chat_render import refuse_untrusted, render_in_child, request_template_field
from runner.entrypoints.openai.chunk_templates import ChunkTemplate, SlotKind
from runner.entrypoints.openai.engine_streams import EngineStreams
from runner.entrypoints.openai.errors import OpenAIError, bad_request, parse_request, redact
from runner.entrypoints.openai.lifecycle import ServerLifecycle
from runner.entrypoints.openai.limits import ClientLeft, read_body
from runner.entrypoints.openai.prompt_bounds import (
    LARGE_TEXT_CHARS,
    check_prompt_chars,
    max_prompt_chars,
    release_memory_after,
)
from runner.entrypoints.openai.protocol import PromptTokenUsageInfo, UsageInfo
from runner.entrypoints.openai.server_limits import DEFAULT_LIMITS, ServerLimits
from runner.entrypoints.openai.serving_models import ServingModels
from runner.entrypoints.openai.sse import DONE, EventStreamResponse, sse_event
from runner.outputs import CompletionOutput, Logprob, RequestOutput
from runner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)
_R = TypeVar("_R")
# When a client refused for a full waiting queue may try again (seconds): about the time a few steps free slots.
RETRY_AFTER_S = 1


@dataclass
class EnginePrompt:
    text: str | None
    token_ids: list[int]


@dataclass
class ChoiceState:
    """One choice as received so far (outputs are deltas: DELTA when streaming, one FINAL_ONLY output otherwise)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_text_len: int = 0  # completions' logprobs: the length of the tokens' texts streamed so far

    def add(self, out: CompletionOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


class Choices:
    """The choices of one response: sample k of prompt p is choice ``p * n + k`` (vLLM's order).
    ``cached_tokens_details``: ``usage`` says how many prompt tokens the prefix cache served
    (``--enable-prompt-tokens-details``), from what the engine reported for each prompt (:meth:`saw`)."""

    def __init__(self, prompts: list[EnginePrompt], n: int, *, cached_tokens_details: bool = False) -> None:
        self.prompts = prompts
        self.n = n
        self.states = [ChoiceState() for _ in range(len(prompts) * n)]
        self.cached_tokens_details = cached_tokens_details
        self.cached_tokens: list[int | None] = [None] * len(prompts)

    def saw(self, prompt: int, output: RequestOutput) -> None:
        """Note what an output of prompt ``prompt``'s engine request says about its prompt: its cached tokens,
        once the engine has scheduled it. With ``n`` > 1 each sample reports its own (a later one may find the
        blocks an earlier one computed); the prompt's are the fewest, the tokens no sample had to compute."""
        cached, known = output.num_cached_tokens, self.cached_tokens[prompt]
        if cached is not None:
            self.cached_tokens[prompt] = cached if known is None else min(known, cached)

    def index(self, prompt: int, out: CompletionOutput) -> int:
        if not 0 <= out.index < self.n:
            raise RuntimeError(f"the engine returned sample {out.index} for a request with n={self.n}")
        return prompt * self.n + out.index

    def token_ids(self, i: int, token_ids: list[int], asked: bool | None, *, first: bool) -> dict[str, Any]:
        """vLLM's ``return_token_ids`` fields of choice ``i``: its (new) token ids, and the prompt's ids with the
        choice's first piece; nothing unless asked."""
        if not asked:
            return {}
        fields: dict[str, Any] = {"token_ids": list(token_ids)}
        if first:
            fields["prompt_token_ids"] = list(self.prompts[i // self.n].token_ids)
        return fields

    def unfinished(self) -> list[int]:
        return [i for i, s in enumerate(self.states) if s.finish_reason is None]

    def usage(self) -> UsageInfo:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(len(s.token_ids) for s in self.states)
        details = PromptTokenUsageInfo(cached_tokens=sum(c or 0 for c in self.cached_tokens)) \
            if self.cached_tokens_details else None
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=details)


async def _disconnected(raw: Request) -> None:
    """Returns once the client of ``raw`` (whose body was read) has disconnected."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    """``enable_prompt_tokens_details``: responses' ``usage`` carries ``prompt_tokens_details.cached_tokens``
    (vLLM's ``--enable-prompt-tokens-details``)."""

    def __init__(self, engine: EngineClient, models: ServingModels, lifecycle: ServerLifecycle,
                 log_requests: bool = False, *, limits: ServerLimits = DEFAULT_LIMITS,
                 tokenizer_thread: ThreadPoolExecutor | None = None,
                 enable_prompt_tokens_details: bool = False) -> None:
        self.engine = engine
        self.models = models
        self.lifecycle = lifecycle
        self.log_requests = log_requests
        self.limits = limits
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.tokenizer_thread = tokenizer_thread or ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._max_prompt_chars: int | None = None
        self._chunk_templates: dict[tuple[str, ...], ChunkTemplate] = {}

    # ---- input ------------------------------------------------------------------------------------------
    async def read(self, raw: Request, model: type[_M]) -> _M:
        body = await read_body(raw.receive, self.limits.max_request_bytes, self.limits)
        return parse_request(body, model, {"max_logprobs": self.limits.max_logprobs})

    def check_n(self, n: int, num_prompts: int) -> None:
        """``n`` samples of each of ``num_prompts`` prompts: at most ``--max-n`` sequences per request."""
        limit = self.limits.max_n
        if n * num_prompts > limit:
            what = f"n={n}" if num_prompts == 1 else f"n={n} samples of each of {num_prompts} prompts"
            raise bad_request(f"{what} asks for {n * num_prompts} sequences, more than this server's limit of "
                              f"{limit} per request (--max-n)", "n")

    def max_prompt_chars(self) -> int:
        if self._max_prompt_chars is None:
            self._max_prompt_chars = max_prompt_chars(self.tokenizer(), self.engine.max_model_len)
        return self._max_prompt_chars

    def tokenize(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids (in the tokenizer thread); a text too long to fit is refused before tokenizing."""
        check_prompt_chars(text, self.max_prompt_chars(), param)
        ids = self.tokenizer()(text, add_special_tokens=add_special_tokens)["input_ids"]
        release_memory_after(text)
        return ids

    async def off_loop(self, fn: Callable[..., _R], *args: Any) -> _R:
        """``fn(*args)`` in the tokenizer thread (tokenization, chat templates)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    async def until_disconnect(self, raw: Request, work: Awaitable[_R]) -> _R:
        """``work``'s result, unless the client disconnects first: then ``work`` is cancelled (a render's child
        is killed; a tokenization already in the thread runs out, bounded by the prompt's length) and
        ``ClientLeft`` raised."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pending in (task, watch):
                if not pending.done():
                    pending.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
        if not task.cancelled() and task.exception() is None:
            return task.result()
        if watch.done() and not watch.cancelled():
            raise ClientLeft()
        return task.result()  # raises the work's error

    async def tokenized(self, raw: Request, text: str, work: Awaitable[_R]) -> _R:
        """``work`` (the tokenization of ``text``), which a client disconnect stops waiting for when the text is
        long enough for that to matter."""
        if len(text) < LARGE_TEXT_CHARS:
            return await work
        return await self.until_disconnect(raw, work)

    async def chat_prompt(self, raw: Request, model: str, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                          top_level_template: str | None, add_special_tokens: bool) -> EnginePrompt:
        """The chat template applied to ``messages`` (``kwargs``: the template's variables and
        ``add_generation_prompt`` / ``continue_final_message``), tokenized: the checkpoint's template renders in
        the tokenizer thread with the tokenization, a request's own (``chat_template``, or inside
        ``chat_template_kwargs``) in a child process, with ``--trust-request-chat-template`` only."""
        tokenizer = self.tokenizer()
        field = request_template_field(top_level_template, kwargs)
        if field is not None and not self.limits.trust_request_chat_template:
            raise refuse_untrusted(field)
        if field is None:
            if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
                raise bad_request(f"{self.models.described(model)} has no chat template, so it cannot serve chat "
                                  "completions: use /v1/completions", "model")
            return await self.until_disconnect(raw, self.off_loop(
                self._render_and_tokenize, tokenizer, messages, kwargs, add_special_tokens,
                self.models.described(model)))
        if top_level_template is not None:
            kwargs = {**kwargs, "chat_template": top_level_template}
        text = await self.until_disconnect(raw, render_in_child(
            tokenizer, messages, kwargs, field=field, timeout_s=self.limits.chat_template_timeout_s,
            max_chars=self.max_prompt_chars()))
        ids = await self.until_disconnect(raw, self.off_loop(self.tokenize, text, "messages", add_special_tokens))
        return EnginePrompt(text, ids)

    def _render_and_tokenize(self, tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                             add_special_tokens: bool, described: str) -> EnginePrompt:
        """In the tokenizer thread: the checkpoint's chat template, then the tokenization of its text."""
        try:
            text = tokenizer.apply_chat_template(messages, **kwargs, tokenize=False)
        except Exception as exc:  # noqa: BLE001  (a template that raises on these messages (jinja's raise_exception, a bad key))
            raise bad_request(f"The chat template of {described[0].lower()}{described[1:]} failed on these "
                              f"messages: {exc}", "messages") from None
        return EnginePrompt(text, self.tokenize(text, "messages", add_special_tokens))

    def tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def shutdown(self) -> None:
        """Stop the tokenizer thread (what it runs now finishes; nothing queued starts)."""
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def choices(self, prompts: list[EnginePrompt], n: int) -> Choices:
        """A response's choices, ``n`` per prompt."""
        return Choices(prompts, n, cached_tokens_details=self.enable_prompt_tokens_details)

    def check_prompt(self, prompt: EnginePrompt, param: str) -> EnginePrompt:
        if not prompt.token_ids:
            raise bad_request(f"{param} is empty after tokenization", param)
        vocab, ids = self.engine.vocab_size, prompt.token_ids
        if min(ids) < 0 or max(ids) >= vocab:  # in C; the first bad id named below
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise bad_request(f"{param} has token id {bad}, outside the model's vocabulary [0, {vocab})", param)
        return prompt

    def chunk_template(self, key: tuple[str, ...], render: Callable[..., str],
                       kinds: dict[str, SlotKind]) -> ChunkTemplate:
        """The template of one kind of stream chunk (``key``: its kind and what else fixes it, such as the model
        name), rendered through its model the first time only."""
        template = self._chunk_templates.get(key)
        if template is None:
            template = self._chunk_templates[key] = ChunkTemplate.render(render, kinds)
        return template

    # ---- the engine ------------------------------------------------------------------------------------------
    async def start(self, raw: Request, request_ids: list[str], prompts: list[EnginePrompt],
                    params: list[SamplingParams]) -> EngineStreams:
        """Submit one engine request per prompt and wait for each one's first output (so an engine refusal is
        answered with its status); the returned streams must be closed."""
        self.lifecycle.check_admission()
        if self.log_requests:
            for rid, prompt, sp in zip(request_ids, prompts, params, strict=True):
                logger.info("Request %s: %d prompt tokens, %s", rid, len(prompt.token_ids), sp)
        streams = self.lifecycle.open_streams(request_ids, raw.receive)
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                streams.open(prompt.text, prompt.token_ids, sp)
            await streams.prime()
        except BaseException as exc:  # the engine refused one: leave (and abort) the ones it took
            await streams.close()
            raise self.failure(exc) from exc
        return streams

    async def next_output(self, streams: EngineStreams) -> tuple[int, RequestOutput] | None:
        """The next output; None at the end. Raises EngineDeadError when the server gave up on a dead engine,
        and an OpenAIError for a request the engine could not run."""
        item = await streams.next()
        if item is None and streams.stop_reason == "dead":
            raise EngineDeadError(self.lifecycle.dead_reason or "the engine died")
        if item is not None and item[1].error is not None:
            raise OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                              f"The engine could not run request {item[1].request_id}: {redact(item[1].error)}")
        return item

    async def next_outputs(self, streams: EngineStreams) -> list[tuple[int, RequestOutput]] | None:
        """:meth:`next_output` for every output ready now (``EngineStreams.next_batch``)."""
        batch = await streams.next_batch()
        if batch is None and streams.stop_reason == "dead":
            raise EngineDeadError(self.lifecycle.dead_reason or "the engine died")
        if batch is not None and batch[0][1].error is not None:
            raise OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                              f"The engine could not run request {batch[0][1].request_id}: "
                              f"{redact(batch[0][1].error)}")
        return batch

    async def respond(self, stream: bool, streams: EngineStreams, choices: Choices,
                      events: Callable[[], AsyncGenerator[str, None]], body: Callable[[], BaseModel]) -> Response:
        """The response: ``events()`` as a server-sent-event stream, or every output read into ``choices`` and
        answered as ``body()``. The engine requests end with it either way (``streams`` closed)."""
        if stream:
            return EventStreamResponse(events(), lambda exc: sse_event(self.failure(exc).body().model_dump()),
                                       streams.close, streams.set_direct_write)
        try:
            while (item := await self.next_output(streams)) is not None:
                p, output = item
                choices.saw(p, output)
                for out in output.outputs:
                    choices.states[choices.index(p, out)].add(out)
            if streams.disconnected:  # no one will read it
                return bad_request("Client disconnected").response()
            self.end_unfinished(streams, choices)
            return JSONResponse(body().model_dump(mode="json"))
        except BaseException as exc:
            raise self.failure(exc) from exc
        finally:
            await streams.close()

    async def output_texts(self, streams: EngineStreams, choices: Choices,
                           event: Callable[[int, CompletionOutput], str], *, head: str = "",
                           aborted: Callable[[int], str], usage: Callable[[], str] | None
                           ) -> AsyncGenerator[str, None]:
        """A stream's text for every batch of outputs ready (one write each), ``event`` giving the text of one
        sample's output of prompt p. The engine's output reader writes the running outputs itself
        (``EngineStreams.set_direct_format``) and this yields only what reaches the handler. ``head``
        goes out with the first batch, and the batch that finishes the last engine request with the end (unless
        the client left): ``aborted(i)`` for each choice the engine did not finish (``end_unfinished``),
        ``usage()`` when the request asked for it, and ``[DONE]``. A stream's end is one write."""
        def events_of(p: int, output: RequestOutput) -> str:
            choices.saw(p, output)
            outs = output.outputs
            return event(p, outs[0]) if len(outs) == 1 else "".join([event(p, out) for out in outs])

        streams.set_direct_format(events_of)
        held = head
        while (batch := await self.next_outputs(streams)) is not None:
            text = held + "".join([events_of(p, output) for p, output in batch])
            held = ""
            if streams.all_finished:  # nothing follows: it goes out with the end
                held = text
                break
            if text:
                yield text
        if not streams.disconnected:
            ends = [aborted(i) for i in self.end_unfinished(streams, choices)]
            yield "".join([held, *ends, usage() if usage is not None else "", DONE])

    def end_unfinished(self, streams: EngineStreams, choices: Choices) -> list[int]:
        """Choices the engine did not finish (the server aborted them, or the engine ended their request
        without a finish reason) end with finish_reason "abort"; returns their indices."""
        left = choices.unfinished()
        if left and not streams.aborted_by_server:
            logger.error("The engine ended request(s) %s without finishing choice(s) %s; reporting them aborted",
                         ", ".join(streams.request_ids), left)
        for i in left:
            choices.states[i].finish_reason = "abort"
        return left

    def failure(self, exc: BaseException) -> OpenAIError:
        """The HTTP error for an exception raised while serving a request."""
        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, EngineDeadError):
            self.lifecycle.engine_died(str(exc))
            return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"The engine is dead: {redact(str(exc))}")
        if isinstance(exc, RequestError):  # the engine's own checks (the server's ran first)
            return bad_request(str(exc), exc.field)
        if isinstance(exc, EngineOverloadedError):
            return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), retry_after_s=RETRY_AFTER_S)
        if isinstance(exc, EngineShuttingDownError):
            return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
        if isinstance(exc, Exception):
            logger.error("Request failed", exc_info=exc)
            message = f"Internal error: {type(exc).__name__}: {redact(str(exc))} (details in the server's log)"
            return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, message)
        raise exc  # CancelledError, KeyboardInterrupt: not ours to answer
