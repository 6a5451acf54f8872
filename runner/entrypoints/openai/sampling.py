"""From a request body to :class:`SamplingParams`, checked against the model before the engine sees it.

Precedence, as vLLM's ``to_sampling_params``: the request's value, else the checkpoint's default
(``EngineClient.default_sampling_params()``, from ``generation_config.json``), else vLLM's default. The
checkpoint's ``stop_token_ids`` are added to the request's. A bad value is a 400 naming the field as the request
spelled it (chat's ``top_logprobs`` and ``max_completion_tokens``, not SamplingParams' ``logprobs`` and
``max_tokens``).
"""
from __future__ import annotations

from typing import Any, cast

from runner.entrypoints.openai.errors import bad_request
from runner.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from runner.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
)

# The fields that fall back to the checkpoint's defaults, with vLLM's defaults (``_DEFAULT_SAMPLING_PARAMS``).
DEFAULTED_FIELDS: dict[str, float | int] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}


def max_tokens_field(request: CompletionRequest | ChatCompletionRequest) -> str:
    """The name under which the request set its output length."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def requested_max_tokens(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def resolve_max_tokens(request: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int,
                       defaults: dict[str, Any], prompt_field: str) -> int:
    """How many tokens this prompt may generate. A prompt that fills the context, or a prompt plus the
    requested length over ``max_model_len``, is a 400 naming both numbers. Left unset (chat), the length is what
    the context leaves, capped by the checkpoint's ``max_tokens`` default if it has one."""
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
                          f"{prompt_len} tokens, which leaves no room to generate. Shorten the prompt.", prompt_field)
    field = max_tokens_field(request)
    requested = requested_max_tokens(request)
    if requested is None:
        room = max_model_len - prompt_len
        default = defaults.get("max_tokens")
        return min(room, default) if default is not None else room
    if requested < 1:
        raise bad_request(f"{field} must be an integer >= 1, got {requested}", field)
    if prompt_len + requested > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
                          f"completion). Reduce the length of the prompt or of the completion ({field}).", field)
    return requested


def build_sampling_params(request: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                          defaults: dict[str, Any], vocab_size: int) -> SamplingParams:
    """SamplingParams for one prompt of ``request``; DELTA outputs when streaming, one final output otherwise."""
    values = {name: value if (value := getattr(request, name)) is not None else defaults.get(name, default)
              for name, default in DEFAULTED_FIELDS.items()}
    stop_token_ids = list(request.stop_token_ids or [])
    stop_token_ids += [t for t in defaults.get("stop_token_ids") or () if t not in stop_token_ids]
    if isinstance(request, ChatCompletionRequest):
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        renamed = {"logprobs": "top_logprobs", "max_tokens": max_tokens_field(request)}
    else:
        logprobs = request.logprobs
        renamed = {}
    try:
        params = SamplingParams(
            n=request.n, **values, seed=request.seed, stop=request.stop, stop_token_ids=stop_token_ids,
            ignore_eos=request.ignore_eos, max_tokens=max_tokens, min_tokens=request.min_tokens, logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            # JSON's string keys: SamplingParams parses them to token ids and names a bad one
            logit_bias=cast("dict[int, float] | None", request.logit_bias),
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY)
        params.check_vocab(vocab_size)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), renamed.get(exc.field, exc.field)) from None
    return params
