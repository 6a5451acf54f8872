"""Request and response bodies of the OpenAI API as vLLM serves them (``vllm/entrypoints/openai/protocol.py``,
split in newer vLLM into ``completion/protocol.py``, ``chat_completion/protocol.py`` and ``engine/protocol.py``;
OpenAI's reference: https://platform.openai.com/docs/api-reference/completions and ``/chat``).

Requests are validated strictly (``n: true`` or ``temperature: "0.5"`` is a 400 naming the field, not a silent
coercion); value ranges are left to :class:`~runner.sampling_params.SamplingParams`, whose errors name the
field too. Sampling fields a request leaves unset are None here and take the checkpoint's defaults
(``generation_config.json``), then vLLM's (``sampling.build_sampling_params``). Fields of the OpenAI or
vLLM API that this server does not implement are refused when a request sets them to anything but their
neutral value (``UNSUPPORTED``); fields no one defines are ignored with a warning, as vLLM does.
"""
from __future__ import annotations

import os
import time
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from runner.sampling_params import INT64_MAX, INT64_MIN

# OpenAI's range for chat top_logprobs, and vLLM's default --max-logprobs for completions' logprobs.
MAX_LOGPROBS = 20
# vLLM's VLLM_MAX_COMPLETION_PROMPTS default: the most prompts one completion request may list.
MAX_COMPLETION_PROMPTS = 1024


def max_logprobs(info: ValidationInfo) -> int:
    """The most ``logprobs`` / ``top_logprobs`` a request may ask for: the server's ``--max-logprobs``, passed as
    the validation context (``errors.parse_request``), else vLLM's default."""
    context = info.context
    return int(context["max_logprobs"]) if isinstance(context, dict) and "max_logprobs" in context \
        else MAX_LOGPROBS


def random_id(prefix: str) -> str:
    """A request id as vLLM makes them (``cmpl-<uuid hex>``, ``chatcmpl-<uuid hex>``): unique per request. The
    bits of ``uuid.uuid4().hex`` (random, with its version and variant bits set), without the ``UUID`` object,
    which cost more than the rest of the id's use."""
    value = int.from_bytes(os.urandom(16), "big")
    value = (value & ~(0xC000 << 48) | 0x8000 << 48) & ~(0xF000 << 64) | 4 << 76
    return f"{prefix}-{value:032x}"


class _Strict(BaseModel):
    """Requests: no type coercion (a bool is not an int, a string is not a number); unknown fields kept in
    ``model_extra`` so the server can name them in a warning."""

    model_config = ConfigDict(strict=True, extra="allow")


class _Body(BaseModel):
    """Responses."""


class _TokenIds(_Body):
    """vLLM's ``return_token_ids`` fields of a choice: sent only when asked for (absent otherwise, as in vLLM)."""

    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_token_ids(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("token_ids", "prompt_token_ids", "prompt_logprobs"):
            if data.get(key) is None:
                data.pop(key, None)
        return data

    model_config = ConfigDict(extra="forbid")


# ---- requests -------------------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool | None = False


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError(f"stop must be a string or a list of strings, got {value!r}")


class _SamplingFields(_Strict):
    """The sampling fields both APIs share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's bound: torch.long's range
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: each choice also carries its token ids (and, once, the prompt's), e.g. to check them token for token
    return_token_ids: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        return _check_stop(value)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return value


# Fields of the OpenAI or vLLM API that this server does not implement, with the values that mean "not used".
_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "priority": (None, 0),
    "kv_transfer_params": (None,),
}


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of either (one choice per
    prompt and sample, in order)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    add_special_tokens: bool = True
    echo: bool = False  # the prompt first in each choice's text (and logprobs); with max_tokens 0, the prompt alone
    prompt_logprobs: int | None = None  # vLLM's: each choice also carries the prompt's log-probabilities

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **{k: v for k, v in _UNSUPPORTED_COMMON.items() if k != "prompt_logprobs"}, "suffix": (None, ""),
        "best_of": (None, 1)}

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs_range(cls, value: int | None, info: ValidationInfo) -> int | None:
        limit = max_logprobs(info)
        if value is not None and not 0 <= value <= limit:
            raise ValueError(f"{info.field_name} must be an integer in [0, {limit}], got {value}")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        def is_ids(v: Any) -> bool:
            if not isinstance(v, list):
                return False
            if set(map(type, v)) <= {int}:  # what JSON gives, checked in C (a long prompt's ids, per request)
                return True
            return all(isinstance(t, int) and not isinstance(t, bool) for t in v)

        non_empty_list = isinstance(value, list) and len(value) > 0
        single = isinstance(value, str) or (non_empty_list and is_ids(value))
        shape_ok = single or (non_empty_list and (
            all(isinstance(p, str) for p in value) or all(is_ids(p) for p in value)))
        if not shape_ok:
            raise ValueError("prompt must be a non-empty string, a list of token ids, or a non-empty list of "
                             f"strings or of token-id lists; got {_short(value)}")
        prompts = [value] if single else value
        if len(prompts) > MAX_COMPLETION_PROMPTS:  # vLLM's message and bound
            raise ValueError(f"prompt list length {len(prompts)} exceeds the maximum allowed count of "
                             f"{MAX_COMPLETION_PROMPTS}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if not isinstance(p, str) and min(p) < 0:
                raise ValueError(f"prompt {i} has a negative token id {min(p)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _null_max_tokens(cls, data: Any) -> Any:
        # vLLM: an explicit null max_tokens means the default (16), as when it is left out.
        if isinstance(data, dict) and "max_tokens" in data and data["max_tokens"] is None:
            data = {**data, "max_tokens": cls.model_fields["max_tokens"].default}
        return data

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessageParam(_Strict):
    """One message of a conversation. Fields besides ``role`` and ``content`` (``name``, ``tool_call_id``, ...)
    are passed to the chat template as they are."""

    role: str
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for j, part in enumerate(value):
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content part {j} has type {part.type!r}: only text parts "
                                     "({'type': 'text', 'text': ...}) are supported")
        return value

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it; text parts are joined by newlines (vLLM's rule)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text or "" for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: the prompt is the checkpoint's chat template applied to ``messages``."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: only with --trust-request-chat-template (chat_render.py)

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_UNSUPPORTED_COMMON, "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
        "function_call": (None, "none", "auto"), "echo": (None, False), "continue_final_message": (None, False),
        "documents": (None,)}

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None:
            limit = max_logprobs(info)
            if not 0 <= value <= limit:
                raise ValueError(f"top_logprobs must be an integer in [0, {limit}], got {value}")
            if value > 0 and not info.data.get("logprobs"):
                raise ValueError("top_logprobs needs logprobs set to true")
        return value


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---- responses ------------------------------------------------------------------------------------------
class PromptTokenUsageInfo(_Body):
    """vLLM's and OpenAI's ``usage.prompt_tokens_details``: the prompt tokens served from the prefix cache."""

    cached_tokens: int


class UsageInfo(_Body):
    """``prompt_tokens_details`` only with ``--enable-prompt-tokens-details`` (absent otherwise)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_details(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class ErrorInfo(_Body):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Body):
    error: ErrorInfo


class CompletionLogProbs(_Body):
    """Completions' logprobs: per generated token its text, its offset in the choice's text, its
    log-probability, and the most likely alternatives (with the sampled token)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(_TokenIds):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id; None for EOS or length
    # vLLM's: per prompt token (None for the first) {token id: {logprob, rank, decoded_token}}; sent when asked
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionResponse(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo


class CompletionResponseStreamChoice(_TokenIds):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ChatCompletionLogProb(_Body):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(_Body):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(_Body):
    role: str
    content: str | None = None


class ChatCompletionResponseChoice(_TokenIds):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo


class DeltaMessage(_Body):
    """What a chat stream chunk adds; only the fields it sets are sent (``{"content": "..."}``)."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(_TokenIds):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Body):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ubatch"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
