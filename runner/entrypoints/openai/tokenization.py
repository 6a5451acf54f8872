"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's routes and shapes), over the server's tokenizer.

``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` or a conversation ``{"messages": [...],
"add_generation_prompt": true, "add_special_tokens": false, "chat_template_kwargs": {...}}`` (rendered by the
chat template the server applies to ``/v1/chat/completions``, so the ids are those a chat request would run);
``"return_token_strs": true`` adds each token's string. It answers ``{"count", "max_model_len", "tokens",
"token_strs"}``. ``/detokenize`` takes ``{"tokens": [int, ...]}`` and answers ``{"prompt": str}``. Both take the
optional ``model`` of the other routes; errors are the server's 400s naming the field.
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from runner.entrypoints.openai.errors import bad_request, parse_request
from runner.entrypoints.openai.limits import read_body
from runner.entrypoints.openai.protocol import ChatMessageParam, _Strict
from runner.entrypoints.openai.serving_engine import OpenAIServing


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: only with --trust-request-chat-template (chat_render.py)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class OpenAIServingTokenization(OpenAIServing):
    """The two routes' work, with the bounds of the generation routes: the body limits, a prompt or rendered
    conversation no longer than ``max_model_len`` could hold (400 before tokenizing), at most ``max_model_len``
    token ids to detokenize, a request's own chat template only with ``--trust-request-chat-template``, and
    tokenizing in the tokenizer thread, which a client disconnect stops waiting for."""

    def _checked_tokenizer(self, model: str) -> Any:
        tokenizer = self.tokenizer()
        if tokenizer is None:
            raise bad_request(f"{self.models.described(model)} is served without a tokenizer", "model")
        return tokenizer

    async def tokenize_route(self, raw: Request) -> JSONResponse:
        body = await read_body(raw.receive, self.limits.max_request_bytes, self.limits)
        request: TokenizeChatRequest | TokenizeCompletionRequest = parse_request(body, TokenizeChatRequest) \
            if _has_messages(body) else parse_request(body, TokenizeCompletionRequest)
        model = self.models.resolve(request.model)
        tokenizer = self._checked_tokenizer(model)
        if isinstance(request, TokenizeChatRequest):
            if request.continue_final_message and request.add_generation_prompt:
                raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                                  "continue_final_message")
            kwargs = {**(request.chat_template_kwargs or {}), "add_generation_prompt": request.add_generation_prompt,
                      "continue_final_message": request.continue_final_message}
            prompt = await self.chat_prompt(raw, model, [m.template_dict() for m in request.messages], kwargs,
                                            request.chat_template, request.add_special_tokens)
            ids = prompt.token_ids
        else:
            ids = await self.until_disconnect(raw, self.off_loop(self.tokenize, request.prompt, "prompt",
                                                                 request.add_special_tokens))
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len,
                                             tokens=list(ids), token_strs=strs).model_dump())

    async def detokenize_route(self, raw: Request) -> JSONResponse:
        body = await read_body(raw.receive, self.limits.max_request_bytes, self.limits)
        request = parse_request(body, DetokenizeRequest)
        model = self.models.resolve(request.model)
        tokenizer = self._checked_tokenizer(model)
        vocab, limit = self.engine.vocab_size, self.engine.max_model_len
        if len(request.tokens) > limit:
            raise bad_request(f"tokens has {len(request.tokens)} token ids, more than this model's maximum context "
                              f"length of {limit}", "tokens")
        bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens has token id {bad}, outside the model's vocabulary [0, {vocab})", "tokens")
        text = await self.until_disconnect(raw, self.off_loop(tokenizer.decode, request.tokens))
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


def _has_messages(body: bytes) -> bool:
    """Whether the body is the conversation form (a malformed body is left to ``parse_request`` to name)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "messages" in data


def add_tokenization_routes(app: FastAPI) -> None:
    """The two routes, over ``app.state.tokenization`` (``build_app``'s)."""
    serving: OpenAIServingTokenization = app.state.tokenization

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> JSONResponse:
        return await serving.tokenize_route(raw)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> JSONResponse:
        return await serving.detokenize_route(raw)
