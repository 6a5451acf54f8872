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
from runner.entrypoints.openai.protocol import ChatMessageParam, _Strict


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


def _tokenizer(app: FastAPI, model: str) -> Any:
    tokenizer = app.state.engine_client.get_tokenizer()
    if tokenizer is None:
        raise bad_request(f"The model `{model}` is served without a tokenizer", "model")
    return tokenizer


def _chat_ids(tokenizer: Any, request: TokenizeChatRequest, model: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request(f"The model `{model}` has no chat template: tokenize a prompt instead", "messages")
    if request.continue_final_message and request.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    try:
        text = tokenizer.apply_chat_template([m.template_dict() for m in request.messages],
                                             **(request.chat_template_kwargs or {}), tokenize=False,
                                             add_generation_prompt=request.add_generation_prompt,
                                             continue_final_message=request.continue_final_message)
    except Exception as exc:  # noqa: BLE001  (a template that raises on these messages)
        raise bad_request(f"The chat template of `{model}` failed on these messages: {exc}", "messages") from None
    return list(tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"])


def _has_messages(body: bytes) -> bool:
    """Whether the body is the conversation form (a malformed body is left to ``parse_request`` to name)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and "messages" in data


def add_tokenization_routes(app: FastAPI) -> None:
    """The two routes, over ``app.state.engine_client`` and ``app.state.models`` (``build_app``'s)."""

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> JSONResponse:
        body = await raw.body()
        chat: TokenizeChatRequest | TokenizeCompletionRequest = parse_request(body, TokenizeChatRequest) \
            if _has_messages(body) else parse_request(body, TokenizeCompletionRequest)
        model = app.state.models.resolve(chat.model)
        tokenizer = _tokenizer(app, model)
        if isinstance(chat, TokenizeChatRequest):
            ids = _chat_ids(tokenizer, chat, model)
        else:
            ids = list(tokenizer(chat.prompt, add_special_tokens=chat.add_special_tokens)["input_ids"])
        strs = tokenizer.convert_ids_to_tokens(ids) if chat.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=app.state.engine_client.max_model_len,
                                             tokens=ids, token_strs=strs).model_dump())

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> JSONResponse:
        request = parse_request(await raw.body(), DetokenizeRequest)
        model = app.state.models.resolve(request.model)
        tokenizer = _tokenizer(app, model)
        vocab = app.state.engine_client.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens has token id {bad}, outside the model's vocabulary [0, {vocab})", "tokens")
        return JSONResponse(DetokenizeResponse(prompt=tokenizer.decode(request.tokens)).model_dump())
