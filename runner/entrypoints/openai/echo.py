"""Completions with ``echo`` or ``prompt_logprobs`` (vLLM's ``request_output_to_completion_response``): what
lm-evaluation-harness sends to score a text's log-likelihood (``echo=True, logprobs=1, max_tokens=0``).

- ``echo``: each choice's text is the prompt then the completion; with ``logprobs``, its ``logprobs`` cover the
  prompt's tokens too (the first has ``null`` log-probability and alternatives, as in vLLM and OpenAI's legacy
  API), from the engine's prompt log-probabilities. ``max_tokens: 0`` answers the prompt alone (one token is
  generated and dropped; ``usage`` counts none).
- ``prompt_logprobs: N``: each choice carries vLLM's ``prompt_logprobs`` list: ``null``, then per prompt token
  ``{token_id: {"logprob", "rank", "decoded_token"}}`` with the N most likely tokens.

Answered whole (``stream`` is refused with these): the engine computes the prompt's log-probabilities during the
prefill, and a client scoring prompts reads one response.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, Response

from runner.entrypoints.openai.engine_streams import EngineStreams
from runner.entrypoints.openai.errors import bad_request
from runner.entrypoints.openai.logprobs import completion_logprobs
from runner.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
)
from runner.entrypoints.openai.serving_engine import Choices, OpenAIServing
from runner.outputs import Logprob, PromptLogprobs
from runner.sampling_params import SamplingParams


def wants_prompt(request: CompletionRequest) -> bool:
    return request.echo or request.prompt_logprobs is not None


def check_echo_request(request: CompletionRequest) -> CompletionRequest:
    """400 for what this path does not answer; ``max_tokens: 0`` with echo becomes 1 (the token is dropped)."""
    if request.stream:
        raise bad_request("echo and prompt_logprobs are answered without stream; send stream: false", "stream")
    if request.max_tokens == 0:
        if not request.echo:
            raise bad_request("max_tokens must be an integer >= 1, got 0 (0 is allowed with echo: the prompt "
                              "alone)", "max_tokens")
        return request.model_copy(update={"max_tokens": 1})
    return request


def with_prompt_logprobs(params: SamplingParams, request: CompletionRequest) -> SamplingParams:
    """The engine computes the prompt's logprobs: as many alternatives as ``prompt_logprobs``, or, for an echo
    with ``logprobs``, as ``logprobs`` (vLLM's rule)."""
    n = request.prompt_logprobs
    if request.echo and request.logprobs is not None:
        n = max(n or 0, request.logprobs)
    if n is None:
        return params
    params = params.clone()
    params.prompt_logprobs = n
    return params


def _prompt_part(prompt_ids: list[int], steps: PromptLogprobs, num_top: int,
                 text: Callable[[int, Logprob], str]) -> CompletionLogProbs:
    out = CompletionLogProbs()
    offset = 0
    for token_id, step in zip(prompt_ids, steps, strict=True):  # the caller checked one step per prompt token
        if step is None:  # the first prompt token: nothing before it to predict it
            token = text(token_id, Logprob(0.0, None, None))
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(token)
            continue
        part = completion_logprobs([token_id], [step], num_top, text, initial_offset=offset)
        out.tokens += part.tokens
        out.token_logprobs += part.token_logprobs
        out.top_logprobs += part.top_logprobs
        out.text_offset += part.text_offset
        offset += len(part.tokens[0])
    return out


def _json_prompt_logprobs(steps: PromptLogprobs, num_top: int) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: the prompt token and the ``num_top`` most likely at each position."""
    return [None if step is None else {t: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                       for t, lp in step.items() if lp.rank is None or lp.rank <= num_top
                                       or t == next(iter(step))} for step in steps]


async def echo_response(serving: OpenAIServing, streams: EngineStreams, choices: Choices, request: CompletionRequest,
                        request_id: str, model: str, text: Callable[[int, Logprob], str],
                        echo_only: bool) -> Response:
    """Read every output, then answer as the module docstring says (``echo_only``: the request had max_tokens 0)."""
    prompt_steps: dict[int, PromptLogprobs] = {}
    try:
        while (item := await serving.next_output(streams)) is not None:
            p, output = item
            choices.saw(p, output)
            if output.prompt_logprobs is not None:
                prompt_steps[p] = output.prompt_logprobs
            for out in output.outputs:
                choices.states[choices.index(p, out)].add(out)
        if streams.disconnected:
            return bad_request("Client disconnected").response()
        serving.end_unfinished(streams, choices)
    except BaseException as exc:
        raise serving.failure(exc) from exc
    finally:
        await streams.close()
    out_choices = []
    for i, s in enumerate(choices.states):
        prompt = choices.prompts[i // choices.n]
        steps = prompt_steps.get(i // choices.n)
        token_ids, body = (list(prompt.token_ids), "") if echo_only else (s.token_ids, s.text)
        logprobs = None
        if request.logprobs is not None:
            generated = CompletionLogProbs() if echo_only else None
            if request.echo:
                if steps is None or len(steps) != len(prompt.token_ids):
                    raise serving.failure(RuntimeError("the engine returned no prompt log-probabilities"))
                logprobs = _prompt_part(list(prompt.token_ids), steps, request.logprobs, text)
                offset = sum(len(t) for t in logprobs.tokens)
            else:
                logprobs, offset = CompletionLogProbs(), 0
            if generated is None:
                generated = completion_logprobs(s.token_ids, s.logprobs, request.logprobs, text,
                                                initial_offset=offset)
            logprobs.tokens += generated.tokens
            logprobs.token_logprobs += generated.token_logprobs
            logprobs.top_logprobs += generated.top_logprobs
            logprobs.text_offset += generated.text_offset
        prompt_text = prompt.text if prompt.text is not None else text_of(serving, prompt.token_ids)
        out_choices.append(CompletionResponseChoice(
            index=i, text=(prompt_text if request.echo else "") + ("" if echo_only else body),
            logprobs=logprobs, finish_reason="length" if echo_only else s.finish_reason,
            stop_reason=None if echo_only else s.stop_reason,
            prompt_logprobs=_json_prompt_logprobs(steps, request.prompt_logprobs)
            if request.prompt_logprobs is not None and steps is not None else None,
            **choices.token_ids(i, [] if echo_only else token_ids, request.return_token_ids, first=True)))
    usage = choices.usage()
    if echo_only:
        usage = UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=0, total_tokens=usage.prompt_tokens,
                          prompt_tokens_details=usage.prompt_tokens_details)
    return JSONResponse(CompletionResponse(id=request_id, model=model, usage=usage, choices=out_choices)
                        .model_dump(mode="json"))


def text_of(serving: OpenAIServing, token_ids: list[int]) -> str:
    """A token-id prompt's text, for echo: the tokenizer's decoding (a model without one echoes nothing)."""
    tokenizer = serving.tokenizer()
    return tokenizer.decode(token_ids) if tokenizer is not None else ""
