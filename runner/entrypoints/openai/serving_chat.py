"""``POST /v1/chat/completions`` (vLLM's ``OpenAIServingChat``): the prompt is the checkpoint's chat template
applied to ``messages`` (rendered, then tokenized without adding special tokens, as
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` does). Streamed as vLLM
streams it: first a ``{"role": "assistant", "content": ""}`` delta per choice, then content deltas, the finish
reason on the last one, a usage chunk when ``stream_options.include_usage``, then ``[DONE]``."""
from __future__ import annotations

import functools
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from runner.entrypoints.openai.chunk_templates import SlotKind
from runner.entrypoints.openai.engine_streams import EngineStreams
from runner.entrypoints.openai.logprobs import chat_logprobs, token_bytes_fn, token_text_fn
from runner.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    random_id,
)
from runner.entrypoints.openai.sampling import build_sampling_params, resolve_max_tokens
from runner.entrypoints.openai.serving_engine import (
    Choices,
    EnginePrompt,
    OpenAIServing,
)
from runner.entrypoints.openai.sse import TextChunks, chunk_event
from runner.outputs import CompletionOutput, Logprob

ROLE = "assistant"
# The fields of the stream chunks built from templates (``chunk_templates.py``): each choice's first chunk (the
# role), a token's text, and the last one.
ROLE_FIELDS: dict[str, SlotKind] = {"id": "str", "created": "int", "index": "int"}
TEXT_FIELDS: dict[str, SlotKind] = {**ROLE_FIELDS, "text": "str"}
LAST_FIELDS: dict[str, SlotKind] = {**TEXT_FIELDS, "finish_reason": "str", "stop_reason": "json"}


class OpenAIServingChat(OpenAIServing):
    _token_bytes: Callable[[int, str], list[int]] | None = None  # logprobs' bytes (``token_bytes_fn``), made once

    async def create_chat_completion(self, raw: Request) -> Response:
        request = await self.read(raw, ChatCompletionRequest)
        self.check_n(request.n, 1)
        model = self.models.resolve(request.model)
        prompt = self.check_prompt(await self._render(raw, request, model), "messages")
        defaults = self.engine.default_sampling_params()
        max_tokens = resolve_max_tokens(request, len(prompt.token_ids), self.engine.max_model_len, defaults,
                                        "messages")
        params = build_sampling_params(request, max_tokens, defaults, self.engine.vocab_size)
        request_id = random_id("chatcmpl")
        streams = await self.start(raw, [request_id], [prompt], [params])
        choices = self.choices([prompt], request.n)
        text = token_text_fn(self.tokenizer())

        def body() -> ChatCompletionResponse:
            return ChatCompletionResponse(id=request_id, model=model, usage=choices.usage(), choices=[
                ChatCompletionResponseChoice(index=i, message=ChatMessage(role=ROLE, content=s.text),
                                             logprobs=self._logprobs(request, text, s.token_ids, s.logprobs),
                                             finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                             **choices.token_ids(i, s.token_ids, request.return_token_ids, first=True))
                for i, s in enumerate(choices.states)])

        return await self.respond(request.stream, streams, choices,
                                  lambda: self._events(streams, choices, request, request_id, model, text), body)

    async def _render(self, raw: Request, request: ChatCompletionRequest, model: str) -> EnginePrompt:
        kwargs = {**(request.chat_template_kwargs or {}), "add_generation_prompt": request.add_generation_prompt}
        return await self.chat_prompt(raw, model, [m.template_dict() for m in request.messages], kwargs,
                                      request.chat_template, request.add_special_tokens)

    def _logprobs(self, request: ChatCompletionRequest, text: Callable[[int, Logprob], str], token_ids: list[int],
                  steps: list[dict[int, Logprob]]) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        if self._token_bytes is None:
            self._token_bytes = token_bytes_fn(self.tokenizer())
        return chat_logprobs(token_ids, steps, request.top_logprobs or 0, text, self._token_bytes)

    async def _events(self, streams: EngineStreams, choices: Choices, request: ChatCompletionRequest,
                      request_id: str, model: str, text: Callable[[int, Logprob], str]) -> AsyncGenerator[str, None]:
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
            return chunk_event(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                            choices=[choice]), include_usage)

        def render(id: str, created: int, index: int, role: str | None = None, text: str = "",
                   **choice: Any) -> str:  # a chunk template's model path
            return chunk_event(ChatCompletionStreamResponse(id=id, created=created, model=model, choices=[
                ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(role=role, content=text),
                                                   **choice)]), include_usage)

        key = ("chat", model, str(include_usage))
        first_chunk = self.chunk_template((*key, "role"), functools.partial(render, role=ROLE), ROLE_FIELDS).bind(
            id=request_id, created=created)
        head = "".join([first_chunk.fill(index=i) for i in range(len(choices.states))])
        plain = TextChunks(self.chunk_template((*key, "text"), render, TEXT_FIELDS).bind(id=request_id,
                                                                                          created=created))
        last = self.chunk_template((*key, "last"), render, LAST_FIELDS).bind(id=request_id, created=created)
        plain_only = not request.logprobs and not request.return_token_ids

        def event(p: int, out: CompletionOutput) -> str:
            i = choices.index(p, out)
            state = choices.states[i]
            first = not state.token_ids
            state.add(out)
            if plain_only and out.finish_reason is not None:
                return last.fill(index=i, text=out.text, finish_reason=out.finish_reason, stop_reason=out.stop_reason)
            if plain_only:
                return plain.event(i, out.text) if out.text or out.token_ids else ""
            if not (out.text or out.token_ids or out.finish_reason is not None):
                return ""
            return chunk(ChatCompletionResponseStreamChoice(
                index=i, delta=DeltaMessage(content=out.text),
                logprobs=self._logprobs(request, text, out.token_ids, out.logprobs or []),
                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                **choices.token_ids(i, out.token_ids, request.return_token_ids, first=first)))

        def aborted(i: int) -> str:
            return chunk(ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=""),
                                                            finish_reason="abort"))

        def usage() -> str:
            return chunk_event(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                            usage=choices.usage()), include_usage)

        async for events in self.output_texts(streams, choices, event, head=head, aborted=aborted,
                                              usage=usage if include_usage else None):
            yield events
