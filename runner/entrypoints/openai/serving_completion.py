"""``POST /v1/completions`` (vLLM's ``OpenAIServingCompletion``): one engine request per prompt, ``n`` samples each;
choice ``p * n + k`` is sample k of prompt p. Streamed as server-sent events (one chunk per new piece of a choice,
a usage chunk when ``stream_options.include_usage``, then ``[DONE]``), or answered once with ``usage``."""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from runner.entrypoints.openai.chunk_templates import SlotKind
from runner.entrypoints.openai.echo import check_echo_request, echo_response, wants_prompt, with_prompt_logprobs
from runner.entrypoints.openai.engine_streams import EngineStreams
from runner.entrypoints.openai.errors import bad_request
from runner.entrypoints.openai.logprobs import completion_logprobs, token_text_fn
from runner.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
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

# The fields of the stream chunks built from templates (``chunk_templates.py``): a token's text, and the last one.
TEXT_FIELDS: dict[str, SlotKind] = {"id": "str", "created": "int", "index": "int", "text": "str"}
LAST_FIELDS: dict[str, SlotKind] = {**TEXT_FIELDS, "finish_reason": "str", "stop_reason": "json"}


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, raw: Request) -> Response:
        request = await self.read(raw, CompletionRequest)
        echo_only = request.echo and request.max_tokens == 0
        if wants_prompt(request):  # echo / prompt_logprobs: echo.py answers
            request = check_echo_request(request)
        raw_prompts = request.prompts()
        self.check_n(request.n, len(raw_prompts))
        model = self.models.resolve(request.model)
        names = ["prompt"] if len(raw_prompts) == 1 else [f"prompt[{i}]" for i in range(len(raw_prompts))]
        prompts = [await self.tokenized(raw, p, self.off_loop(self._prompt, p, name, request, model))
                   if isinstance(p, str)
                   else self._prompt(p, name, request, model) for p, name in zip(raw_prompts, names, strict=True)]
        defaults = self.engine.default_sampling_params()
        params = [build_sampling_params(request, resolve_max_tokens(request, len(p.token_ids),
                                                                    self.engine.max_model_len, defaults, name),
                                        defaults, self.engine.vocab_size)
                  for p, name in zip(prompts, names, strict=True)]
        params = [with_prompt_logprobs(p, request) for p in params]
        request_id = random_id("cmpl")
        streams = await self.start(raw, [f"{request_id}-{i}" for i in range(len(prompts))], prompts, params)
        choices = self.choices(prompts, request.n)
        text = token_text_fn(self.tokenizer())
        if wants_prompt(request):
            return await echo_response(self, streams, choices, request, request_id, model, text, echo_only)

        def body() -> CompletionResponse:
            return CompletionResponse(id=request_id, model=model, usage=choices.usage(), choices=[
                CompletionResponseChoice(
                    index=i, text=s.text, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                    logprobs=completion_logprobs(s.token_ids, s.logprobs, request.logprobs, text)
                    if request.logprobs is not None else None,
                    **choices.token_ids(i, s.token_ids, request.return_token_ids, first=True))
                for i, s in enumerate(choices.states)])

        return await self.respond(request.stream, streams, choices,
                                  lambda: self._events(streams, choices, request, request_id, model, text), body)

    def _prompt(self, prompt: str | list[int], param: str, request: CompletionRequest, model: str) -> EnginePrompt:
        if isinstance(prompt, str):
            tokenizer = self.tokenizer()
            if tokenizer is None:
                raise bad_request(f"The model `{model}` is served without a tokenizer: send the prompt as token ids",
                                  param)
            engine_prompt = EnginePrompt(prompt, self.tokenize(prompt, param, request.add_special_tokens))
        else:
            engine_prompt = EnginePrompt(None, list(prompt))
        return self.check_prompt(engine_prompt, param)

    async def _events(self, streams: EngineStreams, choices: Choices, request: CompletionRequest, request_id: str,
                      model: str, text: Callable[[int, Logprob], str]) -> AsyncGenerator[str, None]:
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def chunk(choice: CompletionResponseStreamChoice) -> str:
            return chunk_event(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice]),
                               include_usage)

        def render(id: str, created: int, **choice: Any) -> str:  # a chunk template's model path
            return chunk_event(CompletionStreamResponse(id=id, created=created, model=model, choices=[
                CompletionResponseStreamChoice(**choice)]), include_usage)

        key = ("completion", model, str(include_usage))
        plain = TextChunks(self.chunk_template((*key, "text"), render, TEXT_FIELDS).bind(id=request_id,
                                                                                          created=created))
        last = self.chunk_template((*key, "last"), render, LAST_FIELDS).bind(id=request_id, created=created)
        plain_only = request.logprobs is None and not request.return_token_ids

        def event(p: int, out: CompletionOutput) -> str:
            i = choices.index(p, out)
            state = choices.states[i]
            if plain_only:
                state.add(out)
                if out.finish_reason is not None:
                    return last.fill(index=i, text=out.text, finish_reason=out.finish_reason,
                                     stop_reason=out.stop_reason)
                return plain.event(i, out.text) if out.text or out.token_ids else ""
            logprobs = None
            if request.logprobs is not None:
                # offsets count the tokens' texts, as in the full response (the text itself may lag behind while a
                # stop string could still complete)
                logprobs = completion_logprobs(out.token_ids, out.logprobs or [], request.logprobs, text,
                                               initial_offset=state.token_text_len)
                state.token_text_len += sum(len(t) for t in logprobs.tokens)
            first = not state.token_ids
            state.add(out)
            if not (out.text or out.token_ids or out.finish_reason is not None):
                return ""
            return chunk(CompletionResponseStreamChoice(
                index=i, text=out.text, logprobs=logprobs, finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                **choices.token_ids(i, out.token_ids, request.return_token_ids, first=first)))

        def aborted(i: int) -> str:
            return chunk(CompletionResponseStreamChoice(index=i, text="", finish_reason="abort"))

        def usage() -> str:
            return chunk_event(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                        usage=choices.usage()), include_usage)

        async for events in self.output_texts(streams, choices, event, aborted=aborted,
                                              usage=usage if include_usage else None):
            yield events
